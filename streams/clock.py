"""The stream's event-time clock: the newest event time seen, moving on by itself only when idle.

Decisions, window aggregates and heartbeat timeouts all run on this clock, never on the wall
clock, so a time-compressed simulation or a replay of old data behaves like the live cluster.
NOTE: when nothing at all arrives for ``idle_grace_s`` wall seconds (every agent silent), the
clock advances with the wall clock from there, or dead agents could never time out.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EventClock"]


@dataclass(frozen=True, slots=True)
class EventClock:
    """Watermark in event-time milliseconds plus the wall time it last moved."""

    watermark_ms: int = -1
    moved_wall_s: float = 0.0
    first_ms: int = -1  # first event time seen (readiness: how much history this worker saw)
    idle_grace_s: float = 30.0

    def observe(self, event_time_ms: int, wall_s: float) -> EventClock:
        """The clock after seeing an event stamped ``event_time_ms``."""
        if event_time_ms <= self.watermark_ms:
            return self
        first = self.first_ms if self.first_ms >= 0 else event_time_ms
        # NOTE: the constructor, not dataclasses.replace: this runs for every event.
        return EventClock(event_time_ms, wall_s, first, self.idle_grace_s)

    def now_ms(self, wall_s: float) -> int:
        """Event time now: the watermark, plus wall time beyond the idle grace."""
        if self.watermark_ms < 0:
            return -1
        idle_s = wall_s - self.moved_wall_s - self.idle_grace_s
        return self.watermark_ms + (round(idle_s * 1000) if idle_s > 0 else 0)

    @property
    def started(self) -> bool:
        """Whether any event was seen."""
        return self.watermark_ms >= 0
