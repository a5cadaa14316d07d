#!/usr/bin/env bash
# The paper's end-to-end comparisons on local clusters (issue 6, item 4); results in results/.
#   inference (Tables 5-6): RDMA vs TCP at matched load, default transport knobs, with
#     eager messages up to 64 KiB (no RTS/CTS rendezvous for most fetch replies), and with
#     that plus the software RNIC's 60 KiB MTU (one packet per such message; loopback only);
#   training (Table 7): TCP vs RDMA without and with the per-engine send window, 2-8
#     trainers in network namespaces with 200 Mbit/s links (root).
# Each writes runs.json, summary.json, summary.md and an SVG. Takes ~20 minutes.
# `--quick` runs one short repeat of each (a smoke test, ~2 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
[ "${1:-}" = "--quick" ] && quick=1

scripts/install-deps.sh
cargo build --release --locked -q -p bex-ps-server -p bex-ranker -p bex-trainer \
    -p bex-launcher -p bex-experiments
BIN=target/release
if [ "$quick" = 1 ]; then
    OUT=target/experiments; inf=(--rates 200 --seconds 4 --repeats 1)
    trn=(--trainers 4 --seconds 5 --repeats 1)
else
    OUT=results; inf=(--rates 100,200,400 --seconds 10 --repeats 3)
    trn=(--trainers 2,4,6,8 --seconds 10 --repeats 2)
fi

"$BIN/bex-exp" inference --out "$OUT/exp-inference" "${inf[@]}"
"$BIN/bex-exp" inference --out "$OUT/exp-inference-eager64k" "${inf[@]}" \
    --set transport.eager_max=65536
"$BIN/bex-exp" inference --out "$OUT/exp-inference-eager64k-mtu60k" "${inf[@]}" \
    --set transport.eager_max=65536 --set transport.path_mtu=61440
if [ "$(id -u)" -eq 0 ]; then
    "$BIN/bex-exp" training --out "$OUT/exp-training" "${trn[@]}" \
        --link-rate 200mbit --link-queue 64kb
else
    echo "SKIPPED: the training experiment needs root (network namespaces)"
fi
echo "summaries: $OUT/exp-*/summary.md"
