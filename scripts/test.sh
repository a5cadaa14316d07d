#!/usr/bin/env bash
# The test command of the README, and what CI runs: formatting, lints (default build and the
# hardware `verbs` feature), every test, and the multi-process checks over network
# namespaces (when root). Fails on the first failure.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never

# Each step says when it started, in minutes since the first, so slow steps show in CI logs.
started=$SECONDS
step() { printf '\n==> [%dm%02ds] %s\n' $(((SECONDS - started) / 60)) $(((SECONDS - started) % 60)) "$*"; }

step "install dependencies"
scripts/install-deps.sh

step "cargo fmt --check"
cargo fmt --all --check

step "cargo clippy (default features)"
cargo clippy --locked --workspace --all-targets -- -D warnings

step "cargo clippy (--features bex-rnic-verbs/verbs)"
cargo clippy --locked --workspace --all-targets --features bex-rnic-verbs/verbs -- -D warnings

step "layering: no client binary links the server; the client library, ranker, bex-chaos, bex-cluster and the Python package link the protocol (bex-ps-proto), not the server's storage (bex-ps-core)"
for p in bex-ranker bex-trainer bex-chaos bex-launcher; do
    if cargo tree --locked -e normal -p "$p" --prefix none | grep -q '^bex-ps-server '; then
        echo "$p depends on bex-ps-server" >&2
        exit 1
    fi
done
for p in bex-client bex-ranker bex-chaos bex-launcher bex-python; do
    if cargo tree --locked -e normal -p "$p" --prefix none | grep -q '^bex-ps-core '; then
        echo "$p depends on bex-ps-core (the server's storage)" >&2
        exit 1
    fi
done

step "cargo doc"
RUSTDOCFLAGS=-Dwarnings cargo doc --locked --workspace --no-deps -q

step "cargo test"
cargo test --locked --workspace

step "divan micro-benchmarks of the hot functions, each run once (cargo bench -p bex-micro measures)"
cargo test --locked -q -p bex-micro --benches

step "cargo test (--features bex-rnic-verbs/verbs)"
cargo test --locked -p bex-rnic-verbs --features verbs

step "the hardware build: nic = \"verbs\" without a device stops ps-server with the cause, exit 2"
cargo test --locked -p bex-ps-server --features bex-transport/verbs --test cluster -- \
    a_server_configured_for_a_missing_rdma_device_exits_2_naming_the_cause

step "alloc-bench --quick (bemalloc against glibc/jemalloc/mimalloc/rpmalloc, Figures 4 and 5)"
cargo build --locked --release -q -p bemalloc-bench
target/release/alloc-bench --quick --out target/alloc-bench

step "bex-perf --quick (transport Figures 8-11 and 13: RDMA on the soft RNIC vs TCP)"
cargo build --locked --release -q -p bex-perf
target/release/bex-perf run --quick --out target/bex-perf

step "ps-bench --quick (one ps-server shard through PsClient, RDMA vs TCP: tables, JSON, figures)"
cargo build --locked --release -q -p bex-ps-server -p bex-ps-bench
target/release/ps-bench --quick --quiet --out target/ps-bench

step "table-scale --quick (a table at 100K and 1M rows against a HashMap and the memory floor: memory per row, inserts, fetch/push latency; exit 1 if a point fails)"
cargo build --locked --release -q -p bex-table-scale
target/release/table-scale run --quick --quiet --out target/table-scale

step "incast study in simulation, quick (paper Table 4: servers before the first pause per window)"
cargo build --locked --release -q -p bex-incast
target/release/bex-incast --quick --out target/incast

step "PS fault matrix in simulation: 10 scenarios x 25 seeds, real shard/RPC/client code on simulated NICs (--seeds 10000 on demand)"
cargo build --locked --release -q -p bex-simcluster
target/release/bex-simcluster --seeds 25 --chunk 25 --quiet --out target/simcluster

step "fuzz smoke: every cargo-fuzz target for 10 s (RoCE packets, transport/RPC frames, RPC reply matching, PS wire and server, config)"
FUZZ_NICE=0 scripts/fuzz.sh --smoke

step "end-to-end: a 2x2 cluster replays inference traffic and trains; asserts on its report"
cargo build --locked --release -q -p bex-ps-server -p bex-ranker -p bex-trainer -p bex-launcher \
    -p bex-experiments -p bex-ps-bench
target/release/bex-cluster doctor --config configs/local.toml
target/release/bex-cluster run --config configs/local.toml --out target/e2e \
    --set ranker.seconds=4.0
target/release/bex-exp check target/e2e/report.json --min-auc 0.75
step "the launcher's test of the real ranker and trainer binaries (skipped by cargo test without BEX_BIN_DIR)"
BEX_BIN_DIR="$PWD/target/release" cargo test --locked -q -p bex-launcher --test cluster \
    real_clients_when_available
step "the Grafana dashboard's queries against what that cluster's servers, rankers and trainers exported"
target/release/bex-exp dashboard deploy/grafana/bex-dashboard.json target/e2e/metrics

step "Python: pip install ./python (PyO3 + maturin), then pytest against clusters bex-cluster holds (bex.torch, the DLRM example's AUC)"
cargo build --locked --release -q -p bex-client --bin bex-rows
target/py/bin/pip install -q ./python
target/py/bin/python -m pytest -q python/tests
step "Python binding overhead, quick: bex.Client.fetch 1000x64 against ps-bench on the same server"
target/py/bin/python python/bench/fetch.py --quick --out target/pybench

if [ "$(id -u)" -eq 0 ]; then
    step "chaos on real processes: kill -9, restart, loss, partition under load; invariants verified"
    cargo build --locked --release -q -p bex-chaos
    target/release/bex-cluster run --config configs/chaos.toml --out target/chaos
else
    echo "SKIPPED: chaos run (needs root for network namespaces)"
fi

step "Kubernetes: every Kustomize tree renders offline and validates (schemas, probes, PVCs, Secret, image)"
KUBERNETES_VALIDATE=target/py/bin/kubernetes-validate scripts/k8s-render.sh target/k8s

if [ "$(id -u)" -eq 0 ] && docker info >/dev/null 2>&1; then
    step "container image: Debian base by debootstrap + docker import, then the Dockerfile's runtime stage around the binaries built above (scripts/docker.sh without --prebuilt compiles them in the image, as users build it)"
    scripts/docker.sh --prebuilt target/release bex:dev
    step "2 x 2 cluster in containers by name: kill + restart, disconnect + reconnect; chaos invariants"
    scripts/compose-chaos.sh bex:dev target/compose
else
    echo "SKIPPED: container image and the Compose cluster (need root and a running Docker Engine)"
fi

if [ "$(id -u)" -eq 0 ]; then
    step "software RNIC across two network namespaces with 1% and 5% iptables loss"
    scripts/netns-loss.sh 0.01 0.05
    step "RoCEv2 on the wire: captured packets' ICRCs (IPv4, IPv6, GSO segments) against the spec"
    scripts/roce-capture.sh target/roce-capture
else
    echo "SKIPPED: netns loss test and RoCE capture (need root)"
fi

step "all checks passed"
