"""The stream engine's adapters as Protocols: tables, sending, the decision log (one fake each
in ``tests/streams/fakes.py``; the Faust implementations live in :mod:`streams.app`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from streams.loop import LoggedDecision

__all__ = ["DecisionLog", "Message", "Sender", "TableName", "Tables"]


class TableName(StrEnum):
    """The changelogged tables (key → serialised frozen dataclass)."""

    GPUS = "gpus"  # gpu uuid → GpuState: latest sample, last seen, heartbeat timeout
    GPU_LOAD = "gpu_load"  # gpu uuid → LaunchWindow: kernel launches over a hopping window
    NODES = "nodes"  # node → NodeState: up, isolation, reservations, fatal XIDs, links
    SERVING = "serving"  # deployment → ServingWindows: serving load over hopping windows
    PLANS = "plans"  # deployment → PlanState: current plan (transitions topic, own decisions)
    OVERRIDES = "overrides"  # deployment → OverrideState: pins and emergency downshifts
    GEAR_STATE = "gear_state"  # deployment → GearState: atomic blocks and block-size history
    CURSORS = "cursors"  # deployment → Cursor: last decision's sequence and trigger time


class Tables(Protocol):
    """Byte-valued tables keyed by entity name (Faust tables in production)."""

    def get(self, table: TableName, key: bytes) -> bytes | None:
        """The stored value, or None."""
        ...

    def set(self, table: TableName, key: bytes, value: bytes) -> None:
        """Store and publish to the table's changelog."""
        ...

    def keys(self, table: TableName) -> Iterable[bytes]:
        """Keys held locally (the partitions this worker owns)."""
        ...


class Sender(Protocol):
    """Produces to a topic; ``wait`` awaits the broker's acknowledgement."""

    async def __call__(self, topic: str, key: bytes | None, value: bytes, *, wait: bool) -> None:
        """Send one message."""
        ...


class DecisionLog(Protocol):
    """Reads the decisions topic back."""

    async def last(self, deployment: str) -> LoggedDecision | None:
        """The newest decision of ``deployment`` on the topic, or None."""
        ...


@dataclass(frozen=True, slots=True)
class Message:
    """One consumed message, as the engine needs it."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
