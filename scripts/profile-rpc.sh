#!/usr/bin/env bash
# Where one PS call's time goes, per transport: syscalls by kind, context switches and CPU
# (client + server processes, every thread) per request of a ps-bench cell, by the issue's
# method — `perf stat` around a long and a short run of the same cell, the difference
# divided by the difference in requests, so start-up and warm-up cancel out.
#
#   scripts/profile-rpc.sh [BIN_DIR] [KEYS] [OUTSTANDING] > profile.md
#
# BIN_DIR holds ps-bench and ps-server (default target/release): pass another build's
# directory to profile it the same way (before/after). Needs perf (software events and
# syscall tracepoints), as root.
set -euo pipefail
bin=${1:-target/release}
keys=${2:-100}
out=${3:-1}
long=4
short=1
events=(context-switches task-clock)
for s in recvmmsg recvmsg recvfrom sendmsg sendmmsg sendto read write epoll_wait futex ppoll; do
    events+=("syscalls:sys_enter_$s")
done
ev=$(IFS=,; echo "${events[*]}")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

run() { # transport seconds -> perf csv + json
    perf stat -x, -e "$ev" -o "$tmp/$1-$2.perf" -- "$bin/ps-bench" --server "$bin/ps-server" \
        --keys "$keys" --outstanding "$out" --modes warm --ops pull --transports "$1" \
        --seconds "$2" --warmup-seconds 0.3 --quiet --json "$tmp/$1-$2.json" > /dev/null
}

for t in rdma tcp; do
    for secs in $short $long; do
        run "$t" "$secs"
    done
done

python3 - "$tmp" "$short" "$long" "$keys" "$out" "$bin" <<'PY'
import json, sys
tmp, short, long, keys, out, binary = sys.argv[1:]
def perf(path):
    vals = {}
    for line in open(path):
        f = line.strip().split(",")
        if len(f) < 3 or not f[0].replace(".", "").isdigit():
            continue
        vals[f[2].replace("syscalls:sys_enter_", "")] = float(f[0])
    return vals
def requests(path):
    return sum(r["requests"] for r in json.load(open(path))["results"])
rows = {}
for t in ("rdma", "tcp"):
    a, b = perf(f"{tmp}/{t}-{short}.perf"), perf(f"{tmp}/{t}-{long}.perf")
    n = requests(f"{tmp}/{t}-{long}.json") - requests(f"{tmp}/{t}-{short}.json")
    rows[t] = {k: (b[k] - a.get(k, 0)) / max(n, 1) for k in b}
    rows[t]["requests"] = n
keys_all = [k for k in rows["rdma"] if k != "requests"]
print(f"ps-bench Pull {keys} keys x 64, {out} outstanding, warm; binaries: {binary}")
print(f"per request, client + server, ({long} s run - {short} s run) / extra requests\n")
print("| | rdma | tcp | rdma/tcp |")
print("|---|---|---|---|")
for k in keys_all:
    r, c = rows["rdma"][k], rows["tcp"].get(k, 0)
    unit = " µs CPU" if k == "task-clock" else ""
    if k == "task-clock":  # perf reports msec
        r, c = r * 1000, c * 1000
    if r == 0 and c == 0:
        continue
    ratio = f"{r / c:.2f}x" if c else "-"
    print(f"| {k}{unit} | {r:.2f} | {c:.2f} | {ratio} |")
print(f"| requests counted | {rows['rdma']['requests']} | {rows['tcp']['requests']} | |")
PY
