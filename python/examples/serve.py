#!/usr/bin/env python3
"""Serve the model python/examples/dlrm.py trained, the way bex's ranker does: per request,
one fetch of the distinct ids of all candidates from a serving mini-pod, pooling of each
candidate's ids per slot, then the MLP (dense weights read from the PS, refreshed now and
then). Prints request latency and the AUC of the scores against the held-out labels.

    python python/examples/serve.py target/pyex/cluster.toml --requests 200

A request here is ``--candidates`` held-out samples of the synthetic click task, scored
together (a ranker request: one user, many candidate items).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import bex
import bex.torch
from dlrm import DLRM


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cluster", type=Path, help="the cluster file (bex-cluster's OUT/cluster.toml)")
    p.add_argument("--pod", type=int, default=1, help="serving mini-pod read first (default: 1)")
    p.add_argument("--transport", choices=["rdma", "tcp"], default="rdma")
    p.add_argument("--table", default="emb")
    p.add_argument("--dense-table", default="dense")
    p.add_argument("--model-id", type=int, default=7, help="as given to dlrm.py (default: 7)")
    p.add_argument("--hidden", type=int, default=64, help="as given to dlrm.py (default: 64)")
    p.add_argument("--seed", type=int, default=1, help="synthetic task's seed (default: 1)")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--candidates", type=int, default=100, help="samples scored per request")
    p.add_argument("--dense-refresh", type=int, default=50, help="requests between weight reads")
    p.add_argument("--report", type=Path, help="write latency and AUC here as JSON")
    args = p.parse_args(argv)

    data = bex.SyntheticClicks(seed=args.seed)
    # A serving client: short deadlines, never pushes.
    client = bex.Client(args.cluster, pod=args.pod, transport=args.transport, training=False)
    model = DLRM(client, args.table, data.slots, 0, args.hidden).eval()
    dense = bex.torch.DenseParameters(client, model.dense_modules(), args.dense_table, args.model_id)
    stream = data.held_out()

    latencies, scores, labels = [], [], []
    for r in range(args.requests):
        if r % args.dense_refresh == 0:
            dense.pull()
        keys, y = stream.next_batch(args.candidates)
        started = time.perf_counter()
        # Fetch: every distinct id of the request once.
        distinct, index = np.unique(keys.reshape(-1), return_inverse=True)
        rows = torch.from_numpy(client.fetch(args.table, distinct))
        # Pool: each (candidate, slot) bag of ids summed (one id per slot in this task).
        bags = torch.arange(0, keys.size + 1, dtype=torch.int64)
        pooled = F.embedding_bag(
            torch.from_numpy(index.reshape(-1).astype(np.int64)), rows, bags,
            mode="sum", include_last_offset=True,
        ).reshape(args.candidates, data.slots, -1)
        # MLP.
        with torch.no_grad():
            s = model.score(pooled)
        latencies.append(time.perf_counter() - started)
        scores.append(s.numpy())
        labels.append(y)
    lat = np.array(latencies) * 1e6
    auc = float(bex.auc(np.concatenate(scores).astype(np.float32), np.concatenate(labels)))
    result = {
        "requests": args.requests,
        "candidates": args.candidates,
        "p50_us": float(np.percentile(lat, 50)),
        "p99_us": float(np.percentile(lat, 99)),
        "auc": auc,
    }
    print(f"{args.requests} requests of {args.candidates} candidates over {client.transport}: "
          f"p50 {result['p50_us']:.0f} us, p99 {result['p99_us']:.0f} us; "
          f"held-out AUC {auc:.4f}", flush=True)
    if args.report:
        args.report.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
