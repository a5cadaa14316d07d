#!/usr/bin/env bash
# Push latency under both durability modes (issue 13): ps-bench with a replica pod, push_ack =
# replicated and applied, alternating, RUNS times each; then medians per cell.
#   scripts/push-ack.sh OUT_DIR [RUNS]    (builds ps-server and ps-bench)
set -euo pipefail
out=${1:?usage: scripts/push-ack.sh OUT_DIR [RUNS]}
runs=${2:-3}
mkdir -p "$out"
cd "$(dirname "$0")/.."
cargo build --locked --release -q -p bex-ps-server -p bex-ps-bench
for i in $(seq 1 "$runs"); do
    for mode in replicated applied; do
        target/release/ps-bench --push-ack "$mode" --ops push --modes warm --keys 100,1000 \
            --outstanding 1,16 --quiet --json "$out/$mode-$i.json" > "$out/$mode-$i.txt"
    done
done
python3 scripts/push-ack-medians.py "$out" "$runs" | tee "$out/medians.md"
