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
    ) -> None:
        """Connects to the cluster the cluster TOML file ``config`` describes.

        ``pod``: the mini-pod served first (default 1 when there are several, else 0).
        ``transport``: "rdma" (TCP fallback per destination) or "tcp". ``client_id``: names
        the client in logs, seeds replica choice. ``bind``: the IP this client binds
        (default: the file's ``[cluster] host``). ``training``: longer deadlines and push
        retries. Raises ``ConfigError`` or ``RpcError``.
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
