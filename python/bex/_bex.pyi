"""Type stubs of bex's native module (``bex._bex``); see ``bex`` for the overview."""

from os import PathLike
from typing import Literal, Union

import numpy as np
import numpy.typing as npt

TableRef = Union[str, int]

class Table:
    """A table of the cluster."""

    @property
    def id(self) -> int:
        """Id on the wire (its position in the cluster file)."""
    @property
    def name(self) -> str: ...
    @property
    def dim(self) -> int:
        """Row width (float32 values per row)."""

class Client:
    """A client of a running bex cluster. Thread-safe; calls release the GIL."""

    def __init__(
        self,
        config: Union[str, PathLike[str]],
        pod: int | None = None,
        transport: Literal["rdma", "tcp"] = "rdma",
        client_id: int | None = None,
        bind: str | None = None,
        training: bool = True,
        threads: int = 1,
    ) -> None:
        """Connects to the cluster the cluster TOML file ``config`` describes.

        ``pod``: the mini-pod served first (default: the training pod for a training
        client, else the first other pod). ``transport``: "rdma" (TCP fallback per
        destination) or "tcp". ``client_id``: names the client in logs, seeds replica choice.
        ``bind``: the IP this client binds (default: ``BEX_BIND_IP`` if set, else the file's
        ``[cluster] host``). ``training``: longer deadlines and push
        retries. ``threads``: runtime threads running the calls and their I/O (1 costs the
        fewest wake-ups per call; callers' threads are the concurrency). Raises
        ``ConfigError`` or ``RpcError``. The first fetch or push checks the file's tables
        against the servers' (ids, names, dims) and raises ``ConfigError`` when they differ.

        A client's NIC and registered memory pool stay until the process exits: make one
        per process and share it between threads; after ``fork``, make a new one in the
        child (calls on the parent's raise ``BexError``). Ctrl-C interrupts a waiting call.
        """
    @property
    def tables(self) -> dict[str, Table]:
        """The cluster's tables by name."""
    @property
    def transport(self) -> Literal["rdma", "tcp"]: ...
    def fetch(self, table: TableRef, keys: npt.NDArray[np.uint64]) -> npt.NDArray[np.float32]:
        """Rows of ``keys`` (1-D uint64, duplicates allowed), shape ``(len(keys), dim)``."""
    def push(
        self,
        table: TableRef,
        keys: npt.NDArray[np.uint64],
        grads: npt.NDArray[np.float32],
    ) -> None:
        """Pushes ``grads`` (``(len(keys), dim)`` float32) to the training pod; duplicate
        keys' gradients are summed. Returns once acknowledged (applied exactly once)."""

class SyntheticClicks:
    """The trainer's synthetic click task: per sample one Zipf-distributed id per slot (key
    ``slot << 48 | rank``), label ~ Bernoulli(sigmoid(hidden score)). Seeded and
    deterministic; the defaults are the Rust trainer's."""

    def __init__(
        self,
        slots: int = 4,
        vocab: int = 1000,
        zipf_exponent: float = 1.1,
        hidden_dim: int = 4,
        bias: float = -1.0,
        first_order: float = 1.2,
        interaction: float = 0.6,
        seed: int = 1,
    ) -> None: ...
    @property
    def slots(self) -> int: ...
    @property
    def vocab(self) -> int: ...
    def train(self) -> ClickStream:
        """The training stream (the Rust trainer's)."""
    def held_out(self) -> ClickStream:
        """The held-out stream: same ground truth, independent samples."""
    def stream(self, seed: int) -> ClickStream:
        """The stream of any seed; equal seeds give equal streams."""
    def click_probability(self, keys: npt.NDArray[np.uint64]) -> npt.NDArray[np.float64]:
        """The ground truth's click probability per row of ``keys`` (``(n, slots)``)."""

class ClickStream:
    """An endless, seeded stream of samples."""

    def next_batch(
        self, n: int
    ) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.float32]]:
        """``(keys, labels)``: keys ``(n, slots)`` uint64, labels ``(n,)`` float32 in {0, 1}."""

def auc(scores: npt.NDArray[np.float32], labels: npt.NDArray[np.float32]) -> float | None:
    """Exact ROC AUC (ties count one half); None when only one class is present."""

def dense_keys(model: int, params: int, row_dim: int) -> npt.NDArray[np.uint64]:
    """PS keys of ``params`` dense parameters of model ``model`` in rows ``row_dim`` wide:
    ``1 << 63 | model << 32 | chunk`` (the Rust trainer's and ranker's layout)."""

class BexError(Exception): ...
class ConfigError(BexError): ...
class RpcError(BexError): ...
class ProtocolError(BexError): ...
class ServerError(BexError): ...
class TooOld(ServerError): ...
class BadFrame(ServerError): ...
class UnknownTable(ServerError): ...
class WrongDim(ServerError): ...
class TooLarge(ServerError): ...
class UnknownOp(ServerError): ...
class NotTraining(ServerError): ...
class Unavailable(ServerError): ...
class Overloaded(ServerError): ...
class Internal(ServerError): ...
class BadControl(ServerError): ...
class BadValue(ServerError): ...
