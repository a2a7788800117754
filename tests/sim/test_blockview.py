"""The per-block view folds samples and events the way a subscriber should."""

from __future__ import annotations

from typing import Any

import pytest

from flexpipe import envelope
from flexpipe.schemas import ClusterEvent, ClusterEventType, GpuSample, SampleReason
from sim.blockview import BlockView, render_row

pytestmark = pytest.mark.unit
GIB = 1 << 30


def sample(uuid: str, domain: str, used_gib: int, t_s: float, healthy: bool = True) -> Any:
    payload = GpuSample(
        gpu_uuid=uuid,
        node="n",
        name="sim",
        reason=SampleReason.HEARTBEAT,
        memory_total_bytes=80 * GIB,
        memory_used_bytes=used_gib * GIB,
        memory_free_bytes=(80 - used_gib) * GIB,
        healthy=healthy,
        domain=domain,
    )
    return envelope.make(payload, event_time_ms=int(t_s * 1000), source="n/sim", seq=1)


def test_rows_count_usable_unhealthy_and_silent_gpus() -> None:
    view = BlockView(heartbeat_timeout_s=45.0)
    view.apply(sample("g1", "A", 10, 0.0))
    view.apply(sample("g2", "A", 79, 100.0))  # another tenant holds it
    view.apply(sample("g3", "A", 10, 100.0, healthy=False))
    view.apply(sample("g4", "B", 0, 100.0))
    rows = {r.domain: r for r in view.rows()}
    assert rows["A"].num_gpus == 3
    assert rows["A"].num_silent == 1, "g1 not heard from for 100 s"
    assert rows["A"].num_unhealthy == 1
    assert rows["A"].num_free == 0
    assert rows["B"].num_free == 1 and rows["B"].free_memory_bytes == 80 * GIB
    assert render_row(rows["B"]).startswith("B █  1/1")


def test_cluster_events_are_returned_except_node_up() -> None:
    view = BlockView()
    up = ClusterEvent(type=ClusterEventType.NODE_UP, node="n")
    pre = ClusterEvent(type=ClusterEventType.PREEMPT, node="n", gpu_uuids=("g1",))
    assert view.apply(envelope.make(up, event_time_ms=0, source="n/sim", seq=1)) is None
    assert view.apply(envelope.make(pre, event_time_ms=5, source="n/sim", seq=2)) == pre
    assert [e for _, e in view.events] == [pre]
