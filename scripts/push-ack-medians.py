#!/usr/bin/env python3
"""Medians of push latency per cell over `scripts/push-ack.sh` runs, and replicated / applied
ratios taken within each run pair (same minute), then their median.

    scripts/push-ack-medians.py OUT_DIR RUNS
"""
import json
import statistics
import sys

if len(sys.argv) != 3:
    sys.exit(__doc__)
out, runs = sys.argv[1], int(sys.argv[2])
med = statistics.median


def cells(mode, i):
    doc = json.load(open(f"{out}/{mode}-{i}.json"))
    return {(r["transport"], r["keys"], r["outstanding"]): r for r in doc["results"]}


pairs = [(cells("replicated", i), cells("applied", i)) for i in range(1, runs + 1)]
print(f"Push, warm table, 64 f32 per key, 2 pods (medians of {runs} runs; µs)\n")
print("| transport | keys | outstanding | replicated p50 | applied p50 | ratio | "
      "replicated p99 | applied p99 | ratio | replicated req/s | applied req/s |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for key in sorted(pairs[0][0]):
    rep = [p[0][key] for p in pairs]
    app = [p[1][key] for p in pairs]
    row = [key[0], key[1], key[2]]
    for q in ("p50_us", "p99_us"):
        row += [f"{med(r[q] for r in rep):.0f}", f"{med(a[q] for a in app):.0f}",
                f"{med(r[q] / a[q] for r, a in zip(rep, app)):.2f}"]
    row += [f"{med(r['requests_per_s'] for r in rep):.0f}", f"{med(a['requests_per_s'] for a in app):.0f}"]
    print("| " + " | ".join(str(x) for x in row) + " |")
