# The agent (`otter-agent`). Build from the repository root:
#   docker build -f manifests/docker/agent.Dockerfile -t otterscale/otter-agent:v0.1.0 .
# The agent manifest's image is set with the hub's --agent-image.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
# The same packaging as `make release`: stripped, with SHA256SUMS.
RUN OTTER_RELEASE_DIR=/out scripts/release.sh && cp /out/otterscale-link-*/otter-agent /otter-agent

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/*
COPY --from=build /otter-agent /usr/local/bin/otter-agent
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/otter-agent"]
