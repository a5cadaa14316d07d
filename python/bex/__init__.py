"""bex: the Python client of a bex parameter-server cluster.

    import numpy as np, bex
    client = bex.Client("configs/local.toml")            # RDMA (soft RNIC), TCP fallback
    rows = client.fetch("user", np.array([1, 2, 3], dtype=np.uint64))   # (3, dim) float32
    client.push("user", np.array([1], dtype=np.uint64), np.ones((1, rows.shape[1]), np.float32))

Calls release the GIL while they wait, so many threads can share one client. Server
statuses raise subclasses of ``bex.ServerError`` named after the status (``bex.WrongDim``,
``bex.UnknownTable``, ``bex.Unavailable``, ...); no replica answering raises
``bex.RpcError``; a bad cluster file or argument raises ``bex.ConfigError``.
``bex.SyntheticClicks`` is the trainer's synthetic click task (``bex.auc`` scores it), and
``bex.torch`` has PyTorch modules backed by bex tables (import it explicitly; it needs torch).
"""

from ._bex import (  # noqa: F401  (re-exported)
    BadControl,
    BadFrame,
    BadValue,
    BexError,
    Client,
    ClickStream,
    ConfigError,
    Internal,
    NotTraining,
    Overloaded,
    ProtocolError,
    RpcError,
    ServerError,
    SyntheticClicks,
    Table,
    TooLarge,
    TooOld,
    Unavailable,
    UnknownOp,
    UnknownTable,
    WrongDim,
    auc,
    dense_keys,
)

__all__ = [
    "BadControl",
    "BadFrame",
    "BadValue",
    "BexError",
    "Client",
    "ClickStream",
    "ConfigError",
    "Internal",
    "NotTraining",
    "Overloaded",
    "ProtocolError",
    "RpcError",
    "ServerError",
    "SyntheticClicks",
    "Table",
    "TooLarge",
    "TooOld",
    "Unavailable",
    "UnknownOp",
    "UnknownTable",
    "WrongDim",
    "auc",
    "dense_keys",
]
