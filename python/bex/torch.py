"""PyTorch modules backed by bex tables.

An embedding table lives on the bex cluster, not in the module: forward fetches the rows of
the batch's distinct keys, backward pushes their gradients (summed per key) and the servers
apply the table's own optimizer (the ``optimizer`` of the table in the cluster file). There
is no local copy to step, so a torch optimizer only ever sees the dense parameters.

    import bex, bex.torch
    client = bex.Client("configs/local.toml")
    emb = bex.torch.EmbeddingBag(client, "user", mode="sum")
    pooled = emb(ids, offsets)            # (bags, dim); loss.backward() pushes the gradients

- ``Embedding`` and ``EmbeddingBag`` take ids as int64 tensors (read as uint64: ``-1`` is
  ``2**64 - 1``) or uint64 numpy arrays, like ``torch.nn.Embedding``/``EmbeddingBag``. Inputs
  and outputs are CPU tensors (a tensor on another device is refused with a ValueError).
- ``EmbeddingBagCollection`` pools several features, one fetch per table, from a TorchRec
  ``KeyedJaggedTensor`` (or anything with its ``to_dict()``) or from a dict of
  ``(values, lengths)`` pairs.
- ``DenseParameters`` keeps a module's parameters on the PS as rows of a table, in the layout
  the Rust trainer and ranker use, so either side can serve what the other trained.

What crosses the Python/Rust boundary per step: the distinct keys (one copy into Rust), the
fetched rows (no copy: numpy owns the buffer the rows were merged into and torch shares it),
and the gradients (one copy into Rust). In ``eval()`` mode or under ``torch.no_grad()`` the
modules fetch and never push. A push happens in ``backward()`` and returns once the training
servers acknowledged it, so after ``loss.backward()`` the next forward sees the update; a
push that still fails after the client's retries (``[rpc] push_retry_ms`` for a training
client) raises its ``bex`` exception out of ``backward()``. Such a push may or may not
have been applied (what was lost may be the acknowledgement); within one call, retries are
applied at most once.
"""

from __future__ import annotations

from typing import Mapping, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import Client, dense_keys

Ids = Union[torch.Tensor, np.ndarray]

__all__ = ["Embedding", "EmbeddingBag", "EmbeddingBagCollection", "DenseParameters", "keys_of"]


def _cpu(t, what: str) -> None:
    """Rows come back as CPU tensors: inputs on another device are refused, not moved."""
    if isinstance(t, torch.Tensor) and t.device.type != "cpu":
        raise ValueError(
            f"{what} on {t.device}: bex.torch modules take CPU tensors and return CPU tensors; "
            "pass .cpu() and move the output with .to(device)"
        )


def keys_of(ids: Ids) -> np.ndarray:
    """``ids`` as a 1-D uint64 numpy array: int64 tensors and arrays are reinterpreted, not
    converted (no copy when already contiguous on the CPU)."""
    if isinstance(ids, torch.Tensor):
        if ids.is_floating_point() or ids.is_complex():
            raise TypeError(f"ids must be integers, not {ids.dtype}")
        _cpu(ids, "ids")
        ids = ids.detach().to(torch.int64).contiguous().numpy()
    a = np.ascontiguousarray(ids).reshape(-1)
    if a.dtype == np.uint64:
        return a
    if a.dtype == np.int64:
        return a.view(np.uint64)
    if a.dtype.kind in "iu":
        return a.astype(np.int64).view(np.uint64)
    raise TypeError(f"ids must be integers, not {a.dtype}")


class _Rows(torch.autograd.Function):
    """The rows of distinct keys, fetched in forward; backward pushes the gradient of each row
    (already summed over the key's uses by the indexing op that consumed the rows)."""

    @staticmethod
    def forward(ctx, anchor, client, table, keys):  # noqa: ARG004 (anchor: see _fetch)
        ctx.client, ctx.table, ctx.keys = client, table, keys
        return torch.from_numpy(client.fetch(table, keys))

    @staticmethod
    def backward(ctx, grad):
        g = grad.detach().to("cpu", torch.float32).contiguous().numpy()
        _push_nonzero(ctx.client, ctx.table, ctx.keys, g)
        return None, None, None, None


def _push_nonzero(client: Client, table, keys: np.ndarray, grads: np.ndarray) -> None:
    """Pushes the rows of `grads` that are not all zero. A zero row is not "no change" on the
    servers: Adam and FTRL still move a row (momentum, step count) for a zero gradient,
    where torch's optimizers skip a parameter without one (max pooling gives zero gradients
    to every row but the maxima)."""
    live = np.any(grads != 0, axis=1)
    if live.all():
        client.push(table, keys, grads)
    elif live.any():
        client.push(table, keys[live], np.ascontiguousarray(grads[live]))


def _fetch(client: Client, table: Union[str, int], keys: np.ndarray, track: bool) -> torch.Tensor:
    """Rows of `keys` (distinct), as a tensor whose backward pushes when `track`."""
    if not track:
        return torch.from_numpy(client.fetch(table, keys))
    # autograd calls a Function's backward only if an input requires grad; the rows' real
    # "parameter" is on the PS, so an empty tensor stands in for it (a Parameter would show
    # up in the module's parameters() and in every torch optimizer).
    anchor = torch.empty(0, requires_grad=True)
    return _Rows.apply(anchor, client, table, keys)


def _table_info(client: Client, table: Union[str, int]):
    """The ``bex.Table`` named or numbered ``table``; KeyError naming the cluster's tables."""
    if isinstance(table, str):
        info = client.tables.get(table)
    else:
        info = next((t for t in client.tables.values() if t.id == table), None)
    if info is None:
        raise KeyError(f"no table {table!r}; the cluster has {sorted(client.tables)}")
    return info


class _Table(nn.Module):
    def __init__(self, client: Client, table: Union[str, int]):
        super().__init__()
        info = _table_info(client, table)
        self.client, self.table, self.dim = client, info.name, info.dim

    def _tracking(self) -> bool:
        return self.training and torch.is_grad_enabled()

    def _distinct(self, ids: Ids) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows of the distinct ids, index of each id's row)."""
        keys, inverse = np.unique(keys_of(ids), return_inverse=True)
        rows = _fetch(self.client, self.table, keys, self._tracking())
        return rows, torch.from_numpy(inverse.reshape(-1).astype(np.int64))

    def extra_repr(self) -> str:
        return f"table={self.table!r}, dim={self.dim}"


class Embedding(_Table):
    """``torch.nn.Embedding`` over bex table ``table``: ``forward(ids)`` has shape
    ``ids.shape + (dim,)``."""

    def forward(self, ids: Ids) -> torch.Tensor:
        shape = tuple(ids.shape)
        rows, index = self._distinct(ids)
        return F.embedding(index, rows).reshape(*shape, self.dim)


class EmbeddingBag(_Table):
    """``torch.nn.EmbeddingBag`` over bex table ``table``: sums (``mode="sum"``), averages
    (``"mean"``) or takes the maximum (``"max"``) of each bag's rows. Bags are the rows of a
    2-D ``ids``, or given by ``offsets`` for 1-D ``ids``; ``per_sample_weights`` as in torch
    (``"sum"`` only)."""

    def __init__(self, client: Client, table: Union[str, int], mode: str = "sum"):
        super().__init__(client, table)
        if mode not in ("sum", "mean", "max"):
            raise ValueError(f"mode {mode!r}: 'sum', 'mean' or 'max'")
        self.mode = mode

    def forward(
        self,
        ids: Ids,
        offsets: Ids | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        _cpu(offsets, "offsets")
        _cpu(per_sample_weights, "per_sample_weights")
        if len(ids.shape) == 2:
            if offsets is not None:
                raise ValueError("offsets are for 1-D ids; 2-D ids are one bag per row")
            bags, per_bag = ids.shape
            # Not arange(0, bags * per_bag, per_bag): a step of 0 for empty bags raises.
            offsets_t = torch.arange(bags, dtype=torch.int64) * per_bag
        elif len(ids.shape) == 1:
            if offsets is None:
                raise ValueError("1-D ids need offsets (the start of each bag)")
            offsets_t = torch.as_tensor(np.asarray(offsets, dtype=np.int64).reshape(-1))
        else:
            raise ValueError(f"ids of shape {tuple(ids.shape)}: 1-D with offsets, or 2-D")
        rows, index = self._distinct(ids)
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.reshape(-1)
        return F.embedding_bag(
            index, rows, offsets_t, mode=self.mode, per_sample_weights=per_sample_weights
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mode={self.mode!r}"


def _jagged(features) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """feature → (values, lengths, weights or None), from a KeyedJaggedTensor (anything with
    ``to_dict()`` of JaggedTensors) or a dict of ``(values, lengths)`` pairs."""
    out = {}
    if hasattr(features, "to_dict"):
        for name, jt in features.to_dict().items():
            out[name] = (jt.values(), jt.lengths(), jt.weights_or_none())
    else:
        for name, pair in features.items():
            values, lengths = pair
            out[name] = (torch.as_tensor(values), torch.as_tensor(lengths), None)
    for name, parts in out.items():
        for part in parts:
            _cpu(part, f"feature {name!r}")
    return out


class EmbeddingBagCollection(nn.Module):
    """Pooled embeddings of several sparse features, TorchRec-style: ``tables`` maps each
    feature name to a bex table (features may share a table). ``forward(features)`` takes a
    ``torchrec.KeyedJaggedTensor`` or a dict ``{feature: (values, lengths)}`` (``lengths[b]``
    ids of the feature in sample ``b``; a KJT's weights are used as per-sample weights) and
    returns ``{feature: tensor (batch, dim)}`` in the order of ``tables``. Each table is
    fetched once per batch, for the distinct ids of all its features."""

    def __init__(self, client: Client, tables: Mapping[str, Union[str, int]], mode: str = "sum"):
        super().__init__()
        if not tables:
            raise ValueError("no features")
        self.features = list(tables)
        self.bags = nn.ModuleDict(
            {f: EmbeddingBag(client, t, mode) for f, t in tables.items()}
        )
        self.mode = mode

    def forward(self, features) -> dict[str, torch.Tensor]:
        jagged = _jagged(features)
        missing = [f for f in self.features if f not in jagged]
        if missing:
            raise KeyError(f"features {missing} missing from the input ({sorted(jagged)})")
        by_table: dict[str, list[str]] = {}
        for f in self.features:
            by_table.setdefault(self.bags[f].table, []).append(f)
        out: dict[str, torch.Tensor] = {}
        for _table, names in by_table.items():
            bag = self.bags[names[0]]
            ids = [keys_of(jagged[f][0]) for f in names]
            keys, inverse = np.unique(np.concatenate(ids), return_inverse=True)
            rows = _fetch(bag.client, bag.table, keys, bag._tracking())
            inverse = torch.from_numpy(inverse.reshape(-1).astype(np.int64))
            start = 0
            for f, f_ids in zip(names, ids):
                _, lengths, weights = jagged[f]
                index = inverse[start : start + len(f_ids)]
                start += len(f_ids)
                lengths = torch.as_tensor(lengths, dtype=torch.int64).reshape(-1)
                offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
                torch.cumsum(lengths, 0, out=offsets[1:])
                out[f] = F.embedding_bag(
                    index,
                    rows,
                    offsets,
                    mode=self.mode,
                    per_sample_weights=None if weights is None else weights.reshape(-1),
                    include_last_offset=True,
                )
        return {f: out[f] for f in self.features}


class DenseParameters:
    """Keeps ``module``'s parameters on the PS, as rows of table ``table`` under
    ``bex.dense_keys(model_id, n, dim)``: the flat vector of the parameters in
    ``module.parameters()`` order, zero-padded to whole rows.

    ``pull()`` copies the PS values into the parameters; ``push()`` sends their ``.grad`` (a
    missing grad counts as zero) and the servers apply the table's optimizer. Rows whose
    gradient is all zero are not sent, but a parameter without a grad that shares a row with
    one that has a grad is sent as zero, which Adam still moves: keep frozen parameters in a
    module of their own (or another model id). A training step
    is ``pull()``, forward, ``backward()``, ``push()``. The initial values are the table's
    ``init``, not torch's: the PS is the source of truth, as for the Rust trainer, whose
    ``[W1 | b1 | w2 | b2]`` layout is that of ``Sequential(Linear, ReLU, Linear)``.
    """

    def __init__(
        self,
        client: Client,
        module: nn.Module,
        table: Union[str, int] = "dense",
        model_id: int = 0,
    ):
        self.client = client
        self.params: Sequence[nn.Parameter] = list(module.parameters())
        if not self.params:
            raise ValueError("the module has no parameters")
        info = _table_info(client, table)
        self.table, self.dim = info.name, info.dim
        self.numel = sum(p.numel() for p in self.params)
        self.keys = dense_keys(model_id, self.numel, self.dim)

    def pull(self) -> None:
        """Loads the parameters from the PS."""
        flat = torch.from_numpy(self.client.fetch(self.table, self.keys).reshape(-1))
        at = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                p.copy_(flat[at : at + n].view_as(p))
                at += n

    def push(self) -> None:
        """Sends the parameters' gradients; returns once the training servers applied them."""
        flat = np.zeros(len(self.keys) * self.dim, dtype=np.float32)
        at = 0
        for p in self.params:
            n = p.numel()
            if p.grad is not None:
                flat[at : at + n] = p.grad.detach().to("cpu", torch.float32).reshape(-1).numpy()
            at += n
        _push_nonzero(self.client, self.table, self.keys, flat.reshape(-1, self.dim))
