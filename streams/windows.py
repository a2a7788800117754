"""Event-time hopping windows as plain data: no wall clock, no Faust windowed tables.

A :class:`HoppingWindow` of ``size_s`` advancing by ``step_s`` is built from step-sized *panes*:
an event at ``t_s`` lands in pane ``floor(t_s / step_s)``, and the window that ends in pane ``p``
is the union of panes ``p - num_panes + 1 .. p``. Each pane holds one value of a commutative
monoid (sums, maxima, latest-by-time), so the aggregate of a window is the monoid combination
of its panes — independent of the order events arrived in.

Eviction runs on event time only: :func:`add` keeps the newest ``num_panes`` panes relative to
the newest event it has seen, and drops an event older than that (it can no longer be part of
any window that ends at or after the newest event). NOTE: Faust's own windowed tables expire
windows against the wall clock (``table_cleanup_interval``), which silently empties them when a
simulated stream runs faster than real time or replays old timestamps; these do not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

__all__ = [
    "AddResult",
    "HoppingWindow",
    "Monoid",
    "Panes",
    "add",
    "aggregate",
    "window_range",
]

V = TypeVar("V")


class Monoid(Protocol[V]):
    """A commutative, associative combine with an identity: what a pane may hold."""

    def empty(self) -> V:
        """The identity: combining it changes nothing."""
        ...

    def combine(self, a: V, b: V) -> V:
        """Merge two values; must be commutative and associative."""
        ...


@dataclass(frozen=True, slots=True)
class HoppingWindow:
    """Windows of ``size_s`` seconds starting every ``step_s`` seconds (event time)."""

    size_s: float
    step_s: float

    def __post_init__(self) -> None:
        panes = self.size_s / self.step_s if self.step_s > 0 else 0.0
        if self.step_s <= 0 or panes < 1 or abs(panes - round(panes)) > 1e-9:
            raise ValueError(
                f"HoppingWindow: size_s ({self.size_s}) must be a whole multiple (>= 1) of "
                f"step_s ({self.step_s})"
            )

    @property
    def num_panes(self) -> int:
        """Panes per window."""
        return round(self.size_s / self.step_s)

    def pane_of(self, t_s: float) -> int:
        """Index of the pane holding event time ``t_s``."""
        return math.floor(t_s / self.step_s)


@dataclass(frozen=True, slots=True)
class Panes(Generic[V]):
    """A window's state: (pane index, value) pairs, oldest first, at most ``num_panes``."""

    panes: tuple[tuple[int, V], ...] = ()

    @property
    def newest_pane(self) -> int | None:
        """Index of the newest pane, None when empty."""
        return self.panes[-1][0] if self.panes else None


@dataclass(frozen=True, slots=True)
class AddResult(Generic[V]):
    """The new state, and whether the event was too old to count."""

    state: Panes[V]
    late: bool


def add(
    window: HoppingWindow, state: Panes[V], t_s: float, value: V, monoid: Monoid[V]
) -> AddResult[V]:
    """Fold ``value`` observed at event time ``t_s`` into ``state``."""
    pane = math.floor(t_s / window.step_s)  # NOTE: pane_of inlined: this runs per event
    panes = state.panes
    newest = panes[-1][0] if panes else None
    if pane == newest:  # NOTE: the common case, kept cheap: only the newest pane changes
        return AddResult(Panes((*panes[:-1], (pane, monoid.combine(panes[-1][1], value)))), False)
    horizon = max(pane, newest if newest is not None else pane) - window.num_panes + 1
    if pane < horizon:
        return AddResult(state, late=True)
    merged: dict[int, V] = {i: v for i, v in panes if i >= horizon}
    merged[pane] = monoid.combine(merged[pane], value) if pane in merged else value
    return AddResult(Panes(tuple(sorted(merged.items(), key=lambda kv: kv[0]))), late=False)


def window_range(window: HoppingWindow, now_s: float) -> tuple[float, float]:
    """``[start, end)`` of the fullest window containing ``now_s`` (the one ending soonest)."""
    first = window.pane_of(now_s) - window.num_panes + 1
    return first * window.step_s, (first + window.num_panes) * window.step_s


def aggregate(window: HoppingWindow, state: Panes[V], now_s: float, monoid: Monoid[V]) -> V:
    """Combined value of the fullest window containing ``now_s``.

    Exact for ``now_s`` at or after the newest event seen (the stream clock never goes back).
    """
    last = window.pane_of(now_s)
    first = last - window.num_panes + 1
    out = monoid.empty()
    for index, value in state.panes:
        if first <= index <= last:
            out = monoid.combine(out, value)
    return out
