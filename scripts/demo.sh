#!/usr/bin/env bash
# The README's first command: builds bex and runs the demo of what is built so far.
#   1. two processes stream messages over the software RNIC (RC verbs over UDP on loopback)
#      and check every byte and the order;
#   2. rnic-perf measures latency and bandwidth of the software RNIC against raw UDP and TCP
#      in the same run.
# The parameter-server cluster demo (rankers, trainers) replaces this with its issue.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh
echo "==> building (release)"
cargo build --release --locked -q -p bex-rnic-perf --example stream_check -p bex-rnic
BIN=target/release

echo "==> two processes, 5000 messages over the software RNIC"
port=$((17000 + RANDOM % 1000))
"$BIN/examples/stream_check" server --bind 127.0.0.1 --control "127.0.0.1:$port" &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
"$BIN/examples/stream_check" client --bind 127.0.0.1 --control "127.0.0.1:$port" --messages 5000
wait "$server"
trap - EXIT

echo "==> rnic-perf: software RNIC vs UDP and TCP (results/demo-rnic-perf.json)"
mkdir -p results
"$BIN/rnic-perf" run --sizes 64,4K,64K,1M --mtu 4096,61440 --iters 1000 --reps 3 \
    --json results/demo-rnic-perf.json --quiet
