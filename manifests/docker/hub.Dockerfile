# The hub and CLI (`otter`). Build from the repository root:
#   docker build -f manifests/docker/hub.Dockerfile -t otterscale/otter-hub:v0.1.0 .
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
# The same packaging as `make release`: stripped, with SHA256SUMS.
RUN OTTER_RELEASE_DIR=/out scripts/release.sh && cp /out/otterscale-link-*/otter /otter

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/*
COPY --from=build /otter /usr/local/bin/otter
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/otter"]
CMD ["hub", "--data-dir=/var/lib/otter", "--listen=0.0.0.0:8443", "--tunnel-listen=0.0.0.0:8444"]
