#!/usr/bin/env python3
"""Medians over several `ps-bench --json` runs and issue 12's PS targets judged on them:
Pull and Push of 1000 x 64, 1 and 16 outstanding (warm table): RDMA / TCP p50 and p99
<= 0.8, and context switches and CPU per request (client + server) <= 1.0. Ratios are taken
within each run (same minute), then the median over the runs.

    scripts/ps-bench-medians.py RUN.json [RUN.json ...] > targets.md
"""
import json
import statistics
import sys

runs = [json.load(open(p))["results"] for p in sys.argv[1:]]
if not runs:
    sys.exit(__doc__)
med = statistics.median


def cell(run, op, keys, out, transport, mode="warm"):
    for r in run:
        if (r["op"], r["keys"], r["outstanding"], r["transport"], r["mode"]) == (
            op, keys, out, transport, mode):
            return r
    return None


def metric(r, m):
    u = r.get("usage", {})
    return {
        "p50": r["p50_us"],
        "p99": r["p99_us"],
        "csw": u.get("context_switches_per_request"),
        "cpu": u.get("cpu_us_per_request"),
    }[m]


print(f"# ps-bench: issue 12 targets, medians of {len(runs)} runs\n")
print("Each cell: RDMA / TCP median (ratio median over runs). Warm table, dim 64.\n")
print("| op | keys | out | p50 µs | p99 µs | context switches / req | CPU µs / req |")
print("|---|---|---|---|---|---|---|")
verdicts = []
for op in ("pull", "push"):
    for keys in (100, 1000, 10000):
        for out in (1, 16):
            cols = []
            for m, limit in (("p50", 0.8), ("p99", 0.8), ("csw", 1.0), ("cpu", 1.0)):
                pairs = [(cell(r, op, keys, out, "rdma"), cell(r, op, keys, out, "tcp")) for r in runs]
                pairs = [(a, b) for a, b in pairs if a and b and metric(a, m) is not None]
                if not pairs:
                    cols.append("-")
                    continue
                va = med([metric(a, m) for a, _ in pairs])
                vb = med([metric(b, m) for _, b in pairs])
                ratio = med([metric(a, m) / metric(b, m) for a, b in pairs if metric(b, m)])
                cols.append(f"{va:.1f} / {vb:.1f} ({ratio:.2f}x)")
                if keys == 1000:
                    verdicts.append((f"{op} 1000x64 out={out} {m} <= {limit}x", ratio <= limit, ratio))
            if any(c != "-" for c in cols):
                print(f"| {op} | {keys} | {out} | " + " | ".join(cols) + " |")
print("\n## Targets\n")
for name, ok, ratio in verdicts:
    print(f"- {name}: {'met' if ok else 'NOT met'} ({ratio:.2f}x)")
