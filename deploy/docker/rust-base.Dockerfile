# A stand-in for the official rust:<version>-slim-bookworm image, for machines that reach no
# container registry (scripts/docker.sh builds it): Debian from debian:bookworm-slim (itself
# made by debootstrap there) plus this machine's Rust toolchain (bin, lib, libexec: the
# build context) and the certificate authorities it added to its own trust store
# (ca-certificates/, maybe empty: a TLS-inspecting proxy's, so cargo reaches crates.io).
FROM debian:bookworm-slim
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      ca-certificates gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
COPY ca-certificates/ /usr/local/share/ca-certificates/
RUN update-ca-certificates
COPY bin /usr/local/rust/bin/
COPY lib /usr/local/rust/lib/
COPY libexec /usr/local/rust/libexec/
ENV PATH=/usr/local/rust/bin:$PATH CARGO_HOME=/usr/local/cargo
RUN cargo --version && rustc --version
