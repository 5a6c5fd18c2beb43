# The agent (`otter-agent`). Build from the repository root:
#   docker build -f manifests/docker/agent.Dockerfile -t otterscale/otter-agent:v0.1.0 .
# The agent manifest's image is set with the hub's --agent-image.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p otter-agent && strip target/release/otter-agent

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/otter-agent /usr/local/bin/otter-agent
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/otter-agent"]
