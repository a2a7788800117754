"""Event-time hopping windows: pane arithmetic, eviction by event time, monoid aggregates."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streams.load import LAUNCHES, LaunchSums
from streams.windows import HoppingWindow, Panes, add, aggregate, window_range

pytestmark = pytest.mark.unit

WINDOW = HoppingWindow(size_s=10.0, step_s=2.0)


def fill(events: list[tuple[float, int]], window: HoppingWindow = WINDOW) -> Panes[LaunchSums]:
    state: Panes[LaunchSums] = Panes()
    for t, n in events:
        state = add(window, state, t, LaunchSums(n, 1.0), LAUNCHES).state
    return state


def brute(events: list[tuple[float, int]], now_s: float, window: HoppingWindow = WINDOW) -> int:
    start, end = window_range(window, now_s)
    return sum(n for t, n in events if start <= t < end)


def test_window_must_be_a_whole_number_of_steps() -> None:
    with pytest.raises(ValueError, match="whole multiple"):
        HoppingWindow(10.0, 3.0)
    with pytest.raises(ValueError):
        HoppingWindow(1.0, 2.0)
    assert HoppingWindow(60.0, 10.0).num_panes == 6


def test_range_is_the_fullest_window_containing_now() -> None:
    assert window_range(WINDOW, 11.0) == (2.0, 12.0)
    assert window_range(WINDOW, 12.0) == (4.0, 14.0)


def test_aggregate_sums_only_the_window() -> None:
    state = fill([(0.5, 1), (3.0, 10), (9.9, 100), (11.0, 1000)])
    assert aggregate(WINDOW, state, 11.0, LAUNCHES).launches == 1110  # [2, 12)


def test_eviction_runs_on_event_time_not_the_wall_clock() -> None:
    # NOTE: timestamps from 2025 at any replay speed: nothing expires because a wall clock moved.
    base = 1_736_150_400.0
    state = fill([(base + i, 1) for i in range(10)])
    assert aggregate(WINDOW, state, base + 9, LAUNCHES).launches == 10
    state = fill([(base + i, 1) for i in range(10)] + [(base + 100, 5)])
    assert aggregate(WINDOW, state, base + 100, LAUNCHES).launches == 5
    assert len(state.panes) == 1


def test_late_event_is_dropped_and_reported() -> None:
    state = fill([(100.0, 1)])
    result = add(WINDOW, state, 10.0, LaunchSums(7, 1.0), LAUNCHES)
    assert result.late and result.state == state


def test_state_is_bounded_by_the_pane_count() -> None:
    state = fill([(float(t), 1) for t in range(1000)])
    assert len(state.panes) <= WINDOW.num_panes


events_strategy = st.lists(
    st.tuples(st.floats(0.0, 500.0, allow_nan=False), st.integers(0, 1000)), max_size=60
)


@given(events_strategy, st.floats(0.0, 50.0))
@settings(max_examples=200, deadline=None)
def test_aggregate_equals_brute_force_over_the_kept_events(
    events: list[tuple[float, int]], ahead_s: float
) -> None:
    # Events are folded in time order, so none is late; now is at or after the newest event.
    ordered = sorted(events)
    now_s = (ordered[-1][0] if ordered else 0.0) + ahead_s
    assert aggregate(WINDOW, fill(ordered), now_s, LAUNCHES).launches == brute(ordered, now_s)


@given(
    st.floats(0.0, 1e6, allow_nan=False),
    st.lists(st.tuples(st.floats(0.0, 7.999), st.integers(0, 100)), min_size=1, max_size=30),
    st.randoms(use_true_random=False),
)
@settings(max_examples=200, deadline=None)
def test_aggregate_is_independent_of_arrival_order_within_the_window(
    base: float, offsets: list[tuple[float, int]], rnd: object
) -> None:
    # Offsets span less than size - step, so no arrival order can make an event late.
    events = [(base + dt, n) for dt, n in offsets]
    shuffled = list(events)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    now_s = max(t for t, _ in events)
    a = aggregate(WINDOW, fill(events), now_s, LAUNCHES)
    b = aggregate(WINDOW, fill(shuffled), now_s, LAUNCHES)
    assert a.launches == b.launches
    assert math.isclose(a.covered_s, b.covered_s)
