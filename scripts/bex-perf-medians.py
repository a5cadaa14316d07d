#!/usr/bin/env python3
"""Medians over several `bex-perf run --out DIR` runs, and issue 12's transport targets judged
on them (RDMA / TCP in the same run, then the median of the per-run ratios):
  - ping-pong RTT p50, 32 B .. 16 KB: <= 1.0 waiting, <= 0.6 spinning;
  - 1 MB throughput at MTU 4096: >= 1.0 (best over messages outstanding);
  - 512 B rate at 1-8 engines: >= 1.0, with CPU per request <= 1.0.

    scripts/bex-perf-medians.py RUN_DIR [RUN_DIR ...] > medians.md
"""
import json
import statistics
import sys

runs = [json.load(open(f"{d}/bex-perf.json")) for d in sys.argv[1:]]
if not runs:
    sys.exit(__doc__)


def value(p, metric):
    if p.get("status") != "ok":
        return None
    if metric in ("p50", "p99"):
        return (p.get("latency") or {}).get(f"{metric}_us")
    if metric == "gbps":
        return (p.get("throughput") or {}).get("median_gbps")
    if metric == "mreqs":
        return (p.get("throughput") or {}).get("median_mmsgs")
    if metric == "cpu":
        c, s = p.get("client_counters", {}), p.get("server_counters", {})
        n = c.get("messages_received", 0)
        return (c.get("cpu_us", 0) + s.get("cpu_us", 0)) / n if n else None
    raise KeyError(metric)


def per_run(test, series, x, metric):
    out = []
    for r in runs:
        for p in r["points"]:
            if p["test"] == test and p["series"] == series and p["x"] == x:
                v = value(p, metric)
                if v is not None:
                    out.append(v)
    return out


def ratios(test, num, den, x, metric):
    out = []
    for r in runs:
        pts = {(p["series"], p["x"]): p for p in r["points"] if p["test"] == test}
        a, b = pts.get((num, x)), pts.get((den, x))
        va, vb = (value(a, metric) if a else None), (value(b, metric) if b else None)
        if va is not None and vb:
            out.append(va / vb)
    return out


def med(v):
    return statistics.median(v) if v else float("nan")


def xs(test, series):
    return sorted({p["x"] for r in runs for p in r["points"] if p["test"] == test and p["series"] == series})


print(f"# bex-perf: medians of {len(runs)} runs ({', '.join(sys.argv[1:])})\n")
print("Each ratio is RDMA / TCP within one run (same processes, same minute); the table shows")
print("the median over the runs of those ratios and of the values.\n")

print("## lat: RTT p50 (µs)\n")
print("| size | rdma | rdma spin | tcp | rdma/tcp | spin/tcp |")
print("|---|---|---|---|---|---|")
wait_ok, spin_ok, lat_n = 0, 0, 0
for x in xs("lat", "rdma"):
    r, s, t = (med(per_run("lat", n, x, "p50")) for n in ("rdma", "rdma spin", "tcp"))
    rr, sr = med(ratios("lat", "rdma", "tcp", x, "p50")), med(ratios("lat", "rdma spin", "tcp", x, "p50"))
    print(f"| {x} | {r:.1f} | {s:.1f} | {t:.1f} | {rr:.2f}x | {sr:.2f}x |")
    if 32 <= x <= 16384:
        lat_n += 1
        wait_ok += rr <= 1.0
        spin_ok += sr <= 0.6

print("\n## tput: 1 MB messages (Gb/s)\n")
print("| outstanding | rdma mtu4096 | tcp | ratio |")
print("|---|---|---|---|")
best = {"rdma mtu4096": 0.0, "tcp": 0.0}
for x in xs("tput", "tcp"):
    r, t = med(per_run("tput", "rdma mtu4096", x, "gbps")), med(per_run("tput", "tcp", x, "gbps"))
    best["rdma mtu4096"] = max(best["rdma mtu4096"], r)
    best["tcp"] = max(best["tcp"], t)
    print(f"| {x} | {r:.2f} | {t:.2f} | {med(ratios('tput', 'rdma mtu4096', 'tcp', x, 'gbps')):.2f}x |")

print("\n## rate: 512 B requests, 8 outstanding per engine\n")
print("| engines | rdma Mreq/s | tcp Mreq/s | ratio | rdma CPU µs/req | tcp CPU µs/req | ratio |")
print("|---|---|---|---|---|---|---|")
rate_ok, cpu_ok, rate_n = 0, 0, 0
for x in xs("rate", "tcp"):
    rm, tm = med(per_run("rate", "rdma 1 endpoint", x, "mreqs")), med(per_run("rate", "tcp", x, "mreqs"))
    rc, tc = med(per_run("rate", "rdma 1 endpoint", x, "cpu")), med(per_run("rate", "tcp", x, "cpu"))
    qr = med(ratios("rate", "rdma 1 endpoint", "tcp", x, "mreqs"))
    cr = med(ratios("rate", "rdma 1 endpoint", "tcp", x, "cpu"))
    print(f"| {x} | {rm:.3f} | {tm:.3f} | {qr:.2f}x | {rc:.1f} | {tc:.1f} | {cr:.2f}x |")
    if x <= 8:
        rate_n += 1
        rate_ok += qr >= 1.0
        cpu_ok += cr <= 1.0


def judge(name, ok, n):
    print(f"- {name}: {'met' if n and ok == n else 'NOT met'} ({ok}/{n})")


print("\n## Targets (issue 12)\n")
judge("RTT 32 B-16 KB p50 <= 1.0x TCP, waiting drivers", wait_ok, lat_n)
judge("RTT 32 B-16 KB p50 <= 0.6x TCP, spinning drivers", spin_ok, lat_n)
tput = best["rdma mtu4096"] / best["tcp"] if best["tcp"] else float("nan")
judge(f"1 MB throughput, MTU 4096, best over outstanding >= 1.0x TCP ({tput:.2f}x)", int(tput >= 1.0), 1)
judge("512 B rate at 1-8 engines >= 1.0x TCP", rate_ok, rate_n)
judge("512 B CPU per request at 1-8 engines <= 1.0x TCP", cpu_ok, rate_n)
