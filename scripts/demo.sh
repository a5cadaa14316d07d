#!/usr/bin/env bash
# The README's first command: builds bex and runs the demo, a local cluster on the software
# RNIC (configs/local.toml: 2 mini-pods x 2 shards = 4 ps-server processes on loopback):
#   1. a ranker replays synthetic inference traffic (open-loop Poisson, fan-out fetches per
#      shard, a small MLP per model) for 10 s;
#   2. two trainers learn the synthetic click task at once (fetch -> forward/backward -> push
#      sparse and dense gradients), reporting held-out AUC and log-loss;
#   3. the run's report is checked: requests served without errors, AUC rose to >= 0.75.
# Arguments go to `bex-cluster run` (e.g. --transport tcp, --mode netns, --set ranker.rate=400).
# Everything is torn down at the end, on failure and on Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh
echo "==> building (release)"
cargo build --release --locked -q -p bex-ps-server -p bex-ranker -p bex-trainer \
    -p bex-launcher -p bex-experiments -p bex-chaos
BIN=target/release
OUT=target/demo

echo "==> local cluster: inference replay, then training (report in $OUT/report.json)"
"$BIN/bex-cluster" run --config configs/local.toml --out "$OUT" "$@"

echo "==> checking the report"
"$BIN/bex-exp" check "$OUT/report.json" --min-auc 0.75
