#!/usr/bin/env python3
"""Train a DLRM-style click model in PyTorch with its embeddings and dense weights on bex.

The embedding table and the MLP weights live on a running bex cluster: every step fetches
the batch's rows and the current dense weights, runs forward and backward in PyTorch, and
pushes the gradients; the servers apply each table's optimizer (Adagrad for the embeddings,
Adam for the dense weights in python/examples/cluster.toml). Held-out AUC is printed as it
rises.

Data: the synthetic click task the Rust trainer uses (``bex.SyntheticClicks``, default), or
Criteo-format TSV files (label, 13 integer features, 26 hex categorical features per line)
given with ``--criteo-train`` and ``--criteo-test``.

    target/release/bex-cluster run --config python/examples/cluster.toml --out target/pyex &
    export BEX_SECRET=$(cat target/pyex/secret)
    python python/examples/dlrm.py target/pyex/cluster.toml --steps 300
    python python/examples/serve.py target/pyex/cluster.toml

The model: one embedding per categorical slot, for Criteo a bottom MLP over the integer
features, the pairwise dot products of all those vectors (DLRM's interaction), and a top MLP
over [vectors, dot products] giving the logit.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

import bex
import bex.torch

# Criteo's columns: label, I1..I13, C1..C26.
CRITEO_INTS, CRITEO_CATS = 13, 26
RANK_BITS = 48


class DLRM(nn.Module):
    """Embeddings from bex table ``table``; ``dense_in`` integer features through a bottom MLP
    (0: none); pairwise dot-product interaction; top MLP to one logit."""

    def __init__(self, client: bex.Client, table: str, slots: int, dense_in: int, hidden: int):
        super().__init__()
        self.embedding = bex.torch.Embedding(client, table)
        dim = self.embedding.dim
        self.bottom = (
            nn.Sequential(nn.Linear(dense_in, hidden), nn.ReLU(), nn.Linear(hidden, dim), nn.ReLU())
            if dense_in
            else None
        )
        vectors = slots + (1 if dense_in else 0)
        rows, cols = torch.triu_indices(vectors, vectors, offset=1)
        self.register_buffer("pair_rows", rows, persistent=False)
        self.register_buffer("pair_cols", cols, persistent=False)
        self.top = nn.Sequential(
            nn.Linear(vectors * dim + len(rows), hidden), nn.ReLU(), nn.Linear(hidden, 1)
        )

    def dense_modules(self) -> nn.Module:
        """What lives in the dense table (everything but the embeddings)."""
        return nn.ModuleList([m for m in (self.bottom, self.top) if m is not None])

    def score(self, vectors: torch.Tensor) -> torch.Tensor:
        """Logits from the per-sample vectors, shape (batch, vectors, dim)."""
        dots = torch.bmm(vectors, vectors.transpose(1, 2))[:, self.pair_rows, self.pair_cols]
        return self.top(torch.cat([vectors.flatten(1), dots], dim=1)).squeeze(1)

    def vectors(self, embedded: torch.Tensor, dense: torch.Tensor | None) -> torch.Tensor:
        if self.bottom is None:
            return embedded
        return torch.cat([embedded, self.bottom(dense).unsqueeze(1)], dim=1)

    def forward(self, keys: np.ndarray, dense: torch.Tensor | None = None) -> torch.Tensor:
        return self.score(self.vectors(self.embedding(keys), dense))


class Synthetic:
    """Batches of bex.SyntheticClicks (no integer features)."""

    dense_in = 0

    def __init__(self, seed: int):
        self.data = bex.SyntheticClicks(seed=seed)
        self.slots = self.data.slots
        self.train = self.data.train()

    def next_batch(self, n: int):
        keys, labels = self.train.next_batch(n)
        return keys, None, labels

    def held_out(self, n: int):
        keys, labels = self.data.held_out().next_batch(n)
        return keys, None, labels

    def describe(self, keys: np.ndarray, labels: np.ndarray) -> str:
        best = bex.auc(self.data.click_probability(keys).astype(np.float32), labels)
        return f"synthetic click task (the ground truth's own held-out AUC: {best:.3f})"


def parse_criteo(path: Path, limit: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(keys (n, 26) uint64, log1p integer features (n, 13) float32, labels (n,) float32).
    Key of categorical column c with hex value v: ``c << 48 | v`` (v < 2^48; an empty value is
    ``2^48 - 1``)."""
    keys, ints, labels = [], [], []
    missing = (1 << RANK_BITS) - 1
    with open(path) as f:
        for n, line in enumerate(f):
            if len(labels) == limit:
                break
            line = line.rstrip("\r\n")
            if not line:
                continue
            cols = line.split("\t")
            if len(cols) != 1 + CRITEO_INTS + CRITEO_CATS:
                raise ValueError(f"{path}:{n + 1}: {len(cols)} columns, expected 40")
            labels.append(float(cols[0]))
            ints.append([np.log1p(max(int(v), 0)) if v else 0.0 for v in cols[1 : 1 + CRITEO_INTS]])
            keys.append(
                [
                    (c << RANK_BITS) | ((int(v, 16) & missing) if v else missing)
                    for c, v in enumerate(cols[1 + CRITEO_INTS :])
                ]
            )
    if not labels:
        raise ValueError(f"{path}: no samples")
    return (
        np.array(keys, dtype=np.uint64),
        np.array(ints, dtype=np.float32),
        np.array(labels, dtype=np.float32),
    )


class Criteo:
    """Batches of Criteo-format TSV files, cycled."""

    slots, dense_in = CRITEO_CATS, CRITEO_INTS

    def __init__(self, train: Path, test: Path, limit: int):
        self.train = parse_criteo(train, limit)
        self.test = parse_criteo(test, limit)
        self.at = 0

    def next_batch(self, n: int):
        keys, ints, labels = self.train
        idx = np.arange(self.at, self.at + n) % len(labels)
        self.at = (self.at + n) % len(labels)
        return keys[idx], torch.from_numpy(ints[idx]), labels[idx]

    def held_out(self, n: int):
        keys, ints, labels = (a[:n] for a in self.test)
        return keys, torch.from_numpy(ints), labels

    def describe(self, keys: np.ndarray, labels: np.ndarray) -> str:
        return f"Criteo TSV ({len(self.train[2])} train, {len(labels)} held-out samples)"


def evaluate(model: DLRM, held_out) -> float:
    keys, dense, labels = held_out
    model.eval()
    with torch.no_grad():
        scores = model(keys, dense).numpy()
    model.train()
    auc = bex.auc(scores.astype(np.float32), labels)
    if auc is None:
        raise SystemExit("the held-out samples are all of one class: AUC is undefined")
    return auc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cluster", type=Path, help="the cluster file (bex-cluster's OUT/cluster.toml)")
    p.add_argument("--transport", choices=["rdma", "tcp"], default="rdma")
    p.add_argument("--table", default="emb", help="embedding table (default: emb)")
    p.add_argument("--dense-table", default="dense", help="dense weights' table (default: dense)")
    p.add_argument("--model-id", type=int, default=7, help="dense keys' model id (default: 7)")
    p.add_argument("--hidden", type=int, default=64, help="MLP width (default: 64)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--eval-every", type=int, default=50, help="steps between held-out AUCs")
    p.add_argument("--eval-samples", type=int, default=20000)
    p.add_argument("--seed", type=int, default=1, help="synthetic task's seed (default: 1)")
    p.add_argument("--criteo-train", type=Path, help="Criteo-format TSV to train on")
    p.add_argument("--criteo-test", type=Path, help="Criteo-format TSV for held-out AUC")
    p.add_argument("--criteo-limit", type=int, default=1_000_000, help="lines read per file")
    p.add_argument("--report", type=Path, help="write the AUC curve here as JSON")
    args = p.parse_args(argv)
    if (args.criteo_train is None) != (args.criteo_test is None):
        p.error("--criteo-train and --criteo-test go together")
    torch.manual_seed(args.seed)

    data = (
        Criteo(args.criteo_train, args.criteo_test, args.criteo_limit)
        if args.criteo_train
        else Synthetic(args.seed)
    )
    client = bex.Client(args.cluster, pod=0, transport=args.transport)
    model = DLRM(client, args.table, data.slots, data.dense_in, args.hidden)
    dense = bex.torch.DenseParameters(client, model.dense_modules(), args.dense_table, args.model_id)
    held_out = data.held_out(args.eval_samples)
    loss_fn = nn.BCEWithLogitsLoss()
    print(f"{data.describe(held_out[0], held_out[2])}; {dense.numel} dense parameters in "
          f"{len(dense.keys)} rows of {args.dense_table!r}, embeddings in {args.table!r} "
          f"(dim {model.embedding.dim}), over {client.transport}", flush=True)

    curve = []
    dense.pull()
    auc = evaluate(model, held_out)
    curve.append({"step": 0, "auc": auc})
    print(f"step {0:5d}  held-out AUC {auc:.4f}", flush=True)
    started = time.monotonic()
    for step in range(1, args.steps + 1):
        keys, ints, labels = data.next_batch(args.batch)
        dense.pull()
        for q in model.parameters():
            q.grad = None
        loss = loss_fn(model(keys, ints), torch.from_numpy(labels))
        loss.backward()  # pushes the embedding gradients (bex.torch.Embedding)
        dense.push()
        if step % args.eval_every == 0 or step == args.steps:
            dense.pull()
            auc = evaluate(model, held_out)
            curve.append({"step": step, "auc": auc, "loss": loss.item()})
            rate = step * args.batch / (time.monotonic() - started)
            print(f"step {step:5d}  loss {loss.item():.4f}  held-out AUC {auc:.4f}  "
                  f"({rate:,.0f} samples/s)", flush=True)
    if args.report:
        args.report.write_text(json.dumps({"curve": curve, "model_id": args.model_id,
                                           "hidden": args.hidden}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
