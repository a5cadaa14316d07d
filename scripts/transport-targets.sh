#!/usr/bin/env bash
# Issue 12's transport latency targets, measured in one session: ROUNDS interleaved rounds
# of the raw software RNIC's send_lat (rnic-perf, blocking and polling waits) and the
# transport's ping-pong (bex-perf lat: RDMA waiting, RDMA spinning, TCP), then the medians
# over the rounds and each target judged on them:
#   - RDMA RTT / TCP RTT (p50) <= 1.0 with waiting drivers, <= 0.6 with spinning ones;
#   - the transport adds at most 15 us to the raw RNIC's RTT in the same waiting mode.
#
#   scripts/transport-targets.sh OUT_DIR [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/transport-targets.sh OUT_DIR [ROUNDS]}
rounds=${2:-3}
sizes=32,1024,16384
mkdir -p "$out"
for r in $(seq "$rounds"); do
    echo "round $r of $rounds" >&2
    target/release/rnic-perf run --test send_lat --no-baselines --sizes "$sizes" --spin-polls 0 \
        --json "$out/rnic-blocking-$r.json" > "$out/rnic-blocking-$r.txt"
    target/release/rnic-perf run --test send_lat --no-baselines --sizes "$sizes" \
        --json "$out/rnic-polling-$r.json" > "$out/rnic-polling-$r.txt"
    target/release/bex-perf run -q --test lat --sizes "$sizes" --json "$out/bex-perf-lat-$r.json" \
        > "$out/bex-perf-lat-$r.txt"
done
python3 - "$out" "$rounds" <<'PY' | tee "$out/summary.md"
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
med = statistics.median
def rnic(mode):
    v = {}
    for r in range(1, rounds + 1):
        for p in json.load(open(f"{out}/rnic-{mode}-{r}.json"))["results"]:
            if p["test"] == "send_lat" and p["status"] == "ok":
                v.setdefault(p["size"], []).append(p["latency"]["p50_us"])
    return {k: med(x) for k, x in v.items()}
def bex():
    v = {}
    for r in range(1, rounds + 1):
        for p in json.load(open(f"{out}/bex-perf-lat-{r}.json"))["points"]:
            if p["status"] == "ok":
                v.setdefault((p["series"], p["x"]), []).append(p["latency"]["p50_us"])
    return {k: med(x) for k, x in v.items()}
blocking, polling, b = rnic("blocking"), rnic("polling"), bex()
print(f"# Transport latency targets: medians of {rounds} interleaved rounds (p50 RTT, µs)\n")
print("| size | raw RNIC blocking | raw RNIC polling | RDMA | RDMA spin | TCP | RDMA/TCP | spin/TCP | RDMA − raw blocking | spin − raw polling |")
print("|---|---|---|---|---|---|---|---|---|---|")
verdict = {"wait": [], "spin": [], "add_wait": [], "add_spin": []}
for size in sorted(blocking):
    rd, sp, tc = b[("rdma", size)], b[("rdma spin", size)], b[("tcp", size)]
    rb, rp = blocking[size], polling[size]
    verdict["wait"].append(rd / tc <= 1.0)
    verdict["spin"].append(sp / tc <= 0.6)
    verdict["add_wait"].append(rd - rb <= 15.0)
    verdict["add_spin"].append(sp - rp <= 15.0)
    print(f"| {size} | {rb:.1f} | {rp:.1f} | {rd:.1f} | {sp:.1f} | {tc:.1f} | {rd/tc:.2f}x | {sp/tc:.2f}x | {rd-rb:+.1f} | {sp-rp:+.1f} |")
def judge(name, ok):
    n = sum(ok)
    print(f"- {name}: {'met' if n == len(ok) else 'NOT met'} ({n}/{len(ok)} sizes)")
print()
judge("RDMA RTT ≤ 1.0× TCP, waiting drivers", verdict["wait"])
judge("RDMA RTT ≤ 0.6× TCP, spinning drivers", verdict["spin"])
judge("transport adds ≤ 15 µs to the raw RNIC (blocking vs waiting)", verdict["add_wait"])
judge("transport adds ≤ 15 µs to the raw RNIC (polling vs spinning)", verdict["add_spin"])
PY
