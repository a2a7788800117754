"""Triggers and cursors: when a trigger is newer than the last one decided, where periodic ticks
fall, and the deterministic decision ids — what makes a replayed trigger yield no second decision.

Pure; :mod:`streams.step` re-exports these names.
"""

from __future__ import annotations

from dataclasses import dataclass

from flexpipe.schemas import GearDecision
from gearbox.decisions import Trigger

__all__ = [
    "TRIGGER_RANK",
    "Cursor",
    "LoggedDecision",
    "TriggerInfo",
    "decision_id",
    "tick_due_ms",
]

# NOTE: a tick and a topology change can share one event time (the seed scenario's preemptions
# sit on tick boundaries): the change must still be decided after the tick, so triggers order by
# (event time, rank).
TRIGGER_RANK: dict[Trigger, int] = {
    Trigger.TIMER: 0,
    Trigger.LOAD_CHANGE: 1,
    Trigger.TOPOLOGY_CHANGE: 2,
    Trigger.OPERATOR: 3,
}


@dataclass(frozen=True, slots=True)
class Cursor:
    """How far a deployment's decisions got: last sequence number, last trigger's event time
    and rank (see :data:`TRIGGER_RANK`)."""

    seq: int = 0
    trigger_time_ms: int = -1
    trigger_rank: int = 0

    def admits(self, kind: Trigger, time_ms: int) -> bool:
        """Whether a trigger is newer than the last one decided."""
        return (time_ms, TRIGGER_RANK[kind]) > (self.trigger_time_ms, self.trigger_rank)


@dataclass(frozen=True, slots=True)
class TriggerInfo:
    """Why the loop runs now: gearbox's trigger kind, its event time and what happened."""

    kind: Trigger
    time_ms: int
    description: str


@dataclass(frozen=True, slots=True)
class LoggedDecision:
    """A decision read back from the decisions topic."""

    trigger_time_ms: int  # the envelope's event time
    payload: GearDecision


def decision_id(deployment: str, seq: int) -> str:
    """The deterministic id of a deployment's ``seq``-th decision."""
    return f"{deployment}:{seq}"


def tick_due_ms(clock_ms: int, interval_s: float) -> int:
    """The latest periodic tick at or before ``clock_ms``: ticks sit on multiples of the interval
    in event time, so every worker (and a replay) agrees on them."""
    interval_ms = max(1, round(interval_s * 1000))
    return clock_ms // interval_ms * interval_ms
