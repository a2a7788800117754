"""The stream engine's adapters as Protocols: tables, sending, the decision log (one fake each
in ``tests/streams/fakes.py``; the Faust implementations live in :mod:`streams.app`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

from gearbox.config import GearboxConfig
from gearbox.decisions import Trigger
from streams.cursor import LoggedDecision, TriggerInfo
from streams.state import NodeState

if TYPE_CHECKING:
    from streams.step import PlanState

__all__ = [
    "DecisionLog",
    "Decisions",
    "Message",
    "Sender",
    "TableName",
    "Tables",
    "TriggerMessage",
]


class TableName(StrEnum):
    """The changelogged tables (key → serialised frozen dataclass)."""

    GPUS = "gpus"  # gpu uuid → GpuState: latest sample, last seen, heartbeat timeout
    GPU_LOAD = "gpu_load"  # gpu uuid → LaunchWindow: kernel launches over a hopping window
    NODES = "nodes"  # node → NodeState: up, isolation, reservations, fatal XIDs, links
    SERVING = "serving"  # deployment → ServingWindows: serving load over hopping windows
    PLANS = "plans"  # deployment → PlanState: current plan (transitions topic, own decisions)
    OVERRIDES = "overrides"  # deployment → OverrideState: pins and emergency downshifts
    # deployment → streams.gearstore.GearRecord: GearState less its block history (blocks, last
    # switch, quarantine, TTFT corrections) + the history as a difference from BLOCK_HISTORY's
    GEAR_STATE = "gear_state"
    BLOCK_HISTORY = "block_history"  # deployment → streams.gearstore.HistoryBase
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


@dataclass(frozen=True, slots=True)
class TriggerMessage:
    """What the cluster agent sends each deployment's owner when the topology changed; it
    carries the node's new record so the owner decides on it even before its view has it."""

    deployment: str
    kind: Trigger
    time_ms: int
    description: str
    node: NodeState | None = None


class Decisions(Protocol):
    """The decision loop (:class:`streams.decider.Decider`) as the processor and the worker
    drive it."""

    gearbox_config: GearboxConfig

    @property
    def lock(self) -> asyncio.Lock:
        """Held while deciding; table writes that a decision reads take it too."""
        ...

    owns: Callable[[str], bool]  # whether this worker decides for a deployment

    async def tick(self) -> None:
        """Decide for every owned deployment whose periodic tick is due."""
        ...

    async def on_triggers(self, batch: Sequence[Message], received_wall_s: float) -> None:
        """Decide for a debounced batch from the triggers topic."""
        ...

    async def on_revoked(self) -> None:
        """Stop deciding before partitions move."""
        ...

    def on_assigned(self) -> None:
        """A new assignment: re-read each deployment's last decision before deciding."""
        ...

    def submit(self, name: str, trigger: TriggerInfo, received_wall_s: float) -> None:
        """Decide for a topology change after the debounce."""
        ...

    async def evaluate(self, name: str, trigger: TriggerInfo, received_wall_s: float) -> None:
        """Decide once for ``trigger`` now."""
        ...

    def after_transition(self, name: str, plan: PlanState, wall_s: float) -> None:
        """Decide again when a transition record left ``name`` on a plan the view disturbs."""
        ...

    def show_plan(self, name: str, plan: PlanState) -> None:
        """Export ``plan`` as the deployment's current plan."""
        ...
