#!/usr/bin/env bash
# Builds the release binaries and starts a cluster with bex-cluster:
#
#   scripts/cluster.sh --config configs/local.toml [--out DIR] [--mode loopback|netns]
#                      [--transport rdma|tcp] [--set section.key=value ...]
#
# Everything after the script name goes to `bex-cluster run` (see `bex-cluster run --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -q -p bex-ps-server -p bex-ranker -p bex-trainer -p bex-launcher \
    -p bex-chaos
exec target/release/bex-cluster run "$@"
