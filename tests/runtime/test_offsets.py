"""Unit: decision offsets are committed only past decisions that reached an outcome."""

from __future__ import annotations

import pytest
from aiokafka import TopicPartition

from runtime.clock import SimClock
from runtime.offsets import OffsetTracker

pytestmark = pytest.mark.unit

TP0, TP1 = TopicPartition("d", 0), TopicPartition("d", 1)


def test_commits_only_the_contiguous_done_prefix_per_partition() -> None:
    offsets = OffsetTracker()
    a, b, c = offsets.add(TP0, 10), offsets.add(TP0, 11), offsets.add(TP0, 12)
    d = offsets.add(TP1, 3)
    offsets.done(b)  # 10 still open: nothing to commit on partition 0
    offsets.done(d)
    assert offsets.commits() == {TP1: 4}
    offsets.done(a)
    assert offsets.commits() == {TP0: 12}  # 10 and 11 done, 12 open
    offsets.done(c)
    offsets.done(c)  # idempotent
    offsets.done(None)
    assert offsets.commits() == {TP0: 13}
    assert offsets.commits() == {}


def test_sim_clock_runs_at_its_speed() -> None:
    clock = SimClock(speed=1000.0)
    first = clock.now_s()
    assert clock.now_s() >= first >= 0.0
