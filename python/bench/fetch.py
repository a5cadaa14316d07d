#!/usr/bin/env python3
"""The Python binding's overhead: ``bex.Client.fetch`` of 1000 keys x 64 float32 against the
Rust client (``ps-bench --cluster``) on the same server, in the same run.

One cluster (1 pod x 1 shard, ``bex-cluster run`` holding it) serves both. Rounds alternate
ps-bench and Python on each transport; each is a closed loop with one request outstanding
over the same warm keys (ps-bench's warm cell: 8 requests' worth of keys fetched once, then
each request a random window of 1000 of them). Placement is ps-bench's split: the server on
the second allowed CPU, the client (ps-bench or this Python process, with the binding's
tokio threads) on the first. The overhead is the median over rounds of Python p50 minus Rust
p50 (and p99), in microseconds and as a ratio.

    python python/bench/fetch.py --out target/pybench          # 5 rounds of 2 s cells
    python python/bench/fetch.py --quick --out target/pybench  # CI: 2 rounds of 0.3 s

Writes OUT/report.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import numpy as np

import bex

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from harness import BIN, REPO, free_port_block, start_cluster, stop_cluster  # noqa: E402
KEYS, DIM = 1000, 64
TRANSPORTS = ("rdma", "tcp")


def cluster_file(out: pathlib.Path) -> pathlib.Path:
    """ps-bench's generated configuration as a cluster file: one table of dim 64 (SGD),
    deadlines a benchmark never hits, one attempt per request, no checkpoints."""
    cfg = out / "in.toml"
    cfg.write_text(
        '[cluster]\nname = "pybench"\npods = 1\nshards = 1\n'
        f"base_port = {free_port_block(3)}\n"
        '[[tables]]\nname = "emb"\ndim = 64\ninit = { kind = "uniform", scale = 0.01 }\n'
        'optimizer = { kind = "sgd", lr = 0.01 }\n'
        "[server]\ncheckpoint_interval_s = 0\ncheckpoint_on_shutdown = false\n"
        "[rpc]\nconnect_timeout_ms = 2000\nrequest_timeout_ms = 10000\n"
        "retry_probability = 0.0\nmax_attempts = 1\n"
    )
    return cfg


def children(pid: int) -> list[int]:
    out = []
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def context_switches() -> int:
    """This process's context switches so far (all threads: the binding's runtime too)."""
    total = 0
    for task in pathlib.Path("/proc/self/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                total += int(line.split()[1])
    return total


def python_cell(client: bex.Client, seconds: float, warmup: float, seed: int) -> dict:
    """ps-bench's warm Pull cell, from Python: latency around client.fetch, and context
    switches per request (warm-up included, as ps-bench counts them)."""
    universe = KEYS * 8
    base = np.uint64(KEYS << 40)
    for chunk in range(8):
        client.fetch(0, base + np.arange(chunk * KEYS, (chunk + 1) * KEYS, dtype=np.uint64))
    rng = np.random.default_rng(seed)
    window = np.arange(KEYS, dtype=np.uint64)
    lat, requests = [], 0
    switches = context_switches()
    start = time.perf_counter()
    measure_from, end = start + warmup, start + warmup + seconds
    while True:
        off = int(rng.integers(universe))
        keys = base + (np.uint64(off) + window) % np.uint64(universe)
        t0 = time.perf_counter()
        if t0 >= end:
            break
        rows = client.fetch(0, keys)
        t1 = time.perf_counter()
        requests += 1
        assert rows.shape == (KEYS, DIM)
        if t0 >= measure_from:
            lat.append((t1 - t0) * 1e6)
    switches = context_switches() - switches
    if not lat:
        return {"n": 0}
    lat = np.array(lat)
    return {"n": len(lat), "p50_us": float(np.percentile(lat, 50)),
            "p99_us": float(np.percentile(lat, 99)), "mean_us": float(lat.mean()),
            "client_switches_per_request": switches / requests}


def rust_cell(cluster: pathlib.Path, server_pid: int, transport: str, seconds: float,
              warmup: float, out: pathlib.Path, cpu: int) -> dict:
    report = out / f"ps-bench-{transport}-{time.monotonic_ns()}.json"
    subprocess.run(
        ["taskset", "-c", str(cpu), str(BIN / "ps-bench"), "--cluster", str(cluster),
         "--server-pid", str(server_pid), "--pin", "none", "--keys", str(KEYS),
         "--outstanding", "1", "--ops", "pull", "--modes", "warm", "--transports", transport,
         "--seconds", str(seconds), "--warmup-seconds", str(warmup), "--quiet",
         "--json", str(report)],
        check=True, stdout=subprocess.DEVNULL,
    )
    cell = json.loads(report.read_text())["results"][0]
    usage = cell["usage"]
    return {"n": cell["requests"], "errors": cell["errors"], "p50_us": cell["p50_us"],
            "p99_us": cell["p99_us"], "mean_us": cell["mean_us"],
            "client_switches_per_request":
                usage["client_context_switches"] / max(usage["requests"], 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=pathlib.Path, default=REPO / "target" / "pybench")
    p.add_argument("--rounds", type=int, help="alternations per transport (default 5; quick 2)")
    p.add_argument("--seconds", type=float, help="measured seconds per cell (default 2; quick 0.3)")
    p.add_argument("--quick", action="store_true", help="a short run for CI")
    args = p.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 5)
    seconds = args.seconds or (0.3 if args.quick else 2.0)
    warmup = 0.05 if args.quick else 0.3
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("BEX_SECRET", os.urandom(32).hex())

    cpus = sorted(os.sched_getaffinity(0))
    client_cpu, server_cpu = cpus[0], cpus[1 % len(cpus)]
    launcher, cluster = start_cluster(cluster_file(args.out), args.out / "run")
    try:
        server_pid = next(c for c in children(launcher.pid)
                          if pathlib.Path(f"/proc/{c}/comm").read_text().strip() == "ps-server")
        # The server and all its threads on the server CPU; this process (and the binding's
        # runtime threads, created after this) on the client CPU.
        subprocess.run(["taskset", "-a", "-p", "-c", str(server_cpu), str(server_pid)],
                       check=True, stdout=subprocess.DEVNULL)
        os.sched_setaffinity(0, {client_cpu})
        clients = {t: bex.Client(cluster, transport=t, training=False) for t in TRANSPORTS}
        runs = {t: {"rust": [], "python": []} for t in TRANSPORTS}
        for r in range(rounds):
            for t in TRANSPORTS:
                runs[t]["rust"].append(rust_cell(cluster, server_pid, t, seconds, warmup,
                                                 args.out, client_cpu))
                runs[t]["python"].append(python_cell(clients[t], seconds, warmup, seed=r))
                print(f"round {r + 1}/{rounds} {t}: rust p50 {runs[t]['rust'][-1]['p50_us']:.0f} us,"
                      f" python p50 {runs[t]['python'][-1]['p50_us']:.0f} us", file=sys.stderr)
    finally:
        stop_cluster(launcher)

    failed = [(t, side, c) for t in TRANSPORTS for side in ("rust", "python")
              for c in runs[t][side] if c["n"] == 0 or c.get("errors", 0)]
    if failed:
        raise SystemExit(f"cells without requests or with errors: {failed}")
    summary = {}
    for t in TRANSPORTS:
        med = lambda side, q: statistics.median(c[q] for c in runs[t][side])  # noqa: E731
        over50 = statistics.median(py["p50_us"] - rs["p50_us"]
                                   for py, rs in zip(runs[t]["python"], runs[t]["rust"]))
        over99 = statistics.median(py["p99_us"] - rs["p99_us"]
                                   for py, rs in zip(runs[t]["python"], runs[t]["rust"]))
        summary[t] = {
            "rust_p50_us": med("rust", "p50_us"), "python_p50_us": med("python", "p50_us"),
            "rust_p99_us": med("rust", "p99_us"), "python_p99_us": med("python", "p99_us"),
            "overhead_p50_us": over50, "overhead_p99_us": over99,
            "ratio_p50": med("python", "p50_us") / med("rust", "p50_us"),
            "rust_client_switches_per_request": med("rust", "client_switches_per_request"),
            "python_client_switches_per_request": med("python", "client_switches_per_request"),
        }
    report = {
        "tool": "python/bench/fetch.py",
        "command_line": sys.argv,
        "keys": KEYS, "dim": DIM, "rounds": rounds, "seconds_per_cell": seconds,
        "placement": {"client_cpu": client_cpu, "server_cpu": server_cpu},
        "summary": summary, "runs": runs,
    }
    (args.out / "report.json").write_text(json.dumps(report, indent=1))
    print(f"Pull {KEYS}x{DIM}, 1 outstanding, medians of {rounds} rounds of {seconds} s:")
    print(f"{'transport':<10}{'Rust p50':>10}{'Python p50':>12}{'overhead':>10}{'ratio':>8}"
          f"{'Rust p99':>10}{'Python p99':>12}{'switches/req Rust, Python':>28}")
    for t, s in summary.items():
        print(f"{t:<10}{s['rust_p50_us']:>8.0f}us{s['python_p50_us']:>10.0f}us"
              f"{s['overhead_p50_us']:>8.0f}us{s['ratio_p50']:>7.2f}x"
              f"{s['rust_p99_us']:>8.0f}us{s['python_p99_us']:>10.0f}us"
              f"{s['rust_client_switches_per_request']:>19.2f}, "
              f"{s['python_client_switches_per_request']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
