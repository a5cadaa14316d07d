# bex: ps-server, ranker, trainer, bex-cluster, bex-chaos and bex-exp in one image.
#
#   docker build -t bex .
#   docker run --rm bex ps-server --help
#
# The build stage compiles with the `verbs` feature, so `[transport] nic = "verbs"` works on
# an RDMA host (the runtime stage has libibverbs1 and the userspace drivers); `nic = "soft"`
# (the default) runs anywhere. Base images: the official ones by default; scripts/docker.sh
# builds both bases from Debian's packages when no registry is reachable.
ARG RUST_IMAGE=rust:1.95-slim-bookworm
ARG RUNTIME_IMAGE=debian:bookworm-slim

FROM ${RUST_IMAGE} AS build
LABEL bex.stage=build
# cmake, gcc, make, libclang-dev: the bundled libibverbs shim and its bindgen bindings
# (scripts/install-verbs-deps.sh); no rdma-core headers are needed.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      ca-certificates cmake gcc g++ libc6-dev libclang-dev make pkg-config \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# The crates come from crates.io, as Cargo.lock pins them. Line tables only instead of the
# release profile's limited debug info (for the benchmarks' profiles): backtraces still
# name files and lines, and the build and the image are smaller.
ENV CARGO_PROFILE_RELEASE_DEBUG=line-tables-only
RUN cargo build --release --locked --features bex-transport/verbs \
      -p bex-ps-server -p bex-ranker -p bex-trainer -p bex-launcher -p bex-chaos \
      -p bex-experiments \
 && mkdir -p /out \
 && cp target/release/ps-server target/release/ranker target/release/trainer \
       target/release/bex-cluster target/release/bex-chaos target/release/bex-exp /out/

FROM ${RUNTIME_IMAGE}
# libibverbs1 + ibverbs-providers: nic = "verbs" on RDMA hosts (mlx5, efa, rxe, ...);
# iproute2: bex-cluster's netns mode; curl: probes and the walkthroughs.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      ca-certificates curl ibverbs-providers iproute2 libibverbs1 tini \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/ /usr/local/bin/
COPY configs/ /etc/bex/
RUN useradd --system --uid 10001 --home-dir /var/lib/bex --create-home bex
USER bex
WORKDIR /var/lib/bex
ENV RUST_LOG=info BEX_LOG_FORMAT=json
# tini reaps and forwards SIGTERM, so ps-server drains and checkpoints on `docker stop`.
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["ps-server", "--help"]
