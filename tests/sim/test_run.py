"""`flexpipe run` end to end: simulated cluster → real broker → subscriber view → summary."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from aiokafka import TopicPartition

from flexpipe import envelope
from flexpipe.config import FlexPipeConfig
from flexpipe.schemas import ClusterEvent, ClusterEventType
from sim.run import EventTimeMerge


def _event(t_ms: int, node: str) -> envelope.Envelope[ClusterEvent]:
    return envelope.make(
        ClusterEvent(ClusterEventType.NODE_UP, node), event_time_ms=t_ms, source="test", seq=t_ms
    )


@pytest.mark.unit
def test_merge_holds_a_partition_ahead_until_the_lagging_one_catches_up() -> None:
    ahead, behind = TopicPartition("gpu", 0), TopicPartition("gpu", 1)
    merge = EventTimeMerge((ahead, behind))
    for t_ms in (1000, 2000, 3000):
        merge.push(ahead, _event(t_ms, "a"))
    assert merge.release(caught_up=[]) == [], "nothing of partition 1 fetched yet"
    merge.push(behind, _event(1500, "b"))
    assert [e.event_time_ms for e in merge.release(caught_up=[])] == [1000, 1500]
    merge.push(behind, _event(2500, "b"))
    assert [e.event_time_ms for e in merge.release(caught_up=[])] == [2000, 2500]
    assert [e.event_time_ms for e in merge.release(caught_up=[behind])] == [3000]
    merge.push(ahead, _event(4000, "a"))
    assert merge.release(caught_up=[]) == []
    assert [e.event_time_ms for e in merge.release(caught_up=[], final=True)] == [4000]


@pytest.mark.unit
def test_a_caught_up_partition_holds_the_merge_while_it_is_recent() -> None:
    ahead, behind = TopicPartition("gpu", 0), TopicPartition("gpu", 1)
    merge = EventTimeMerge((ahead, behind), idle_ms=1000)
    merge.push(behind, _event(1000, "b"))
    for t_ms in (1500, 2000, 2500):
        merge.push(ahead, _event(t_ms, "a"))
    # Read to its end, 1.5 s behind: gone quiet, waits for nobody.
    assert [e.event_time_ms for e in merge.release(caught_up=[behind])] == [1000, 1500, 2000, 2500]
    merge.push(behind, _event(2600, "b"))
    merge.push(ahead, _event(3000, "a"))
    # Read to its end but only 0.4 s behind: its next fetch may still bring older records.
    assert [e.event_time_ms for e in merge.release(caught_up=[behind])] == [2600]
    assert [e.event_time_ms for e in merge.release(caught_up=[ahead, behind], final=True)] == [3000]


def _view_lines(out: str) -> list[str]:
    """The per-block timeline lines (``HH:MM:SS  A ███…``), in printed order."""
    return [line for line in out.splitlines() if line[:2].isdigit() and "│" in line]


@pytest.mark.e2e
def test_run_prints_block_view_and_summary(kafka_cfg: FlexPipeConfig) -> None:
    env = os.environ | {
        "FLEXPIPE_KAFKA__BOOTSTRAP_SERVERS": kafka_cfg.kafka.bootstrap_servers or "",
        "FLEXPIPE_TOPICS__PREFIX": kafka_cfg.topics.prefix,
    }
    # 2h15m of the seed scenario covers the first preemption (2:00) of block A.
    proc = subprocess.run(
        [sys.executable, "-m", "flexpipe.cli", "run", "--duration", "8100", "--speed", "800"],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    before, preempt, after = out.partition("⚡ preempt on node-a1 (4 GPUs)")
    assert preempt, out
    # NOTE: every view line, not only the last: a view folding partitions out of event-time
    # order showed blocks half-built (``A ██  2/2``) on a busy machine.
    assert all(" A ████████████ 12/12 " in line for line in _view_lines(before)), before
    assert _view_lines(after), "no view line after the preemption"
    assert all(" A ████████░░░░  8/12 " in line for line in _view_lines(after)), after
    summary = out.split("== summary", 1)[1]
    assert "consumed cluster.event" in summary and "invalid" not in summary
    assert "preempt 1" in summary
