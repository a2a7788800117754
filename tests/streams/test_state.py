"""Per-GPU and per-node folds: latest sample, dedupe, heartbeat timeout, cluster events."""

from __future__ import annotations

import pytest

from flexpipe.schemas import ClusterEventType, DomainInfo
from streams.state import (
    FoldOutcome,
    GpuState,
    NodeState,
    fold_cluster_event,
    fold_gpu_sample,
    mark_timed_out,
    material_gpu_change,
)
from tests.streams.builders import GIB, make_event, make_sample, node_up

pytestmark = pytest.mark.unit

E = ClusterEventType


def fold(
    state: GpuState | None, t_ms: int, seq: int, source: str = "n/agent", **kw: object
) -> tuple[GpuState | None, FoldOutcome]:
    return fold_gpu_sample(state, make_sample(**kw), source, seq, t_ms)  # type: ignore[arg-type]


def test_latest_sample_rebuilds_the_state() -> None:
    s, outcome = fold(None, 1000, 1, used_gib=10, util_pct=55.0)
    assert outcome is FoldOutcome.APPLIED and s is not None
    assert s.free_memory_bytes == 70 * GIB and s.utilisation == pytest.approx(0.55)
    assert s.last_seen_s == 1.0
    s2, _ = fold(s, 2000, 2, used_gib=20)
    assert s2 is not None and s2.free_memory_bytes == 60 * GIB and s2.last_seen_s == 2.0


def test_redelivery_is_dropped_but_a_restarted_agent_is_not() -> None:
    s, _ = fold(None, 5000, 7)
    same, outcome = fold(s, 5000, 7)
    assert outcome is FoldOutcome.DUPLICATE and same == s
    # The agent restarted: its sequence begins again, but time moved on.
    s2, outcome = fold(s, 6000, 1)
    assert outcome is FoldOutcome.APPLIED and s2 is not None and s2.last_seen_s == 6.0


def test_older_sample_does_not_replace_a_newer_one() -> None:
    s, _ = fold(None, 5000, 7, source="a")
    s2, outcome = fold(s, 4000, 1, source="b")
    assert outcome is FoldOutcome.STALE and s2 == s


def test_heartbeat_timeout_marks_and_next_sample_clears() -> None:
    s, _ = fold(None, 0, 1)
    assert s is not None
    assert mark_timed_out(s, 45.0, 45.0) is None
    dead = mark_timed_out(s, 45.1, 45.0)
    assert dead is not None and dead.timed_out
    assert mark_timed_out(dead, 100.0, 45.0) is None  # already marked
    back, _ = fold(dead, 101_000, 2)
    assert back is not None and not back.timed_out


def test_material_change_ignores_noise_but_not_health_or_refresh() -> None:
    s, _ = fold(None, 0, 1, used_gib=10, util_pct=50.0)
    assert s is not None
    assert material_gpu_change(None, s, 5.0)
    noise, _ = fold(s, 1000, 2, used_gib=10.2, util_pct=51.0)
    assert noise is not None and not material_gpu_change(s, noise, 5.0)
    sick, _ = fold(s, 1000, 2, used_gib=10, util_pct=50.0, healthy=False)
    assert sick is not None and material_gpu_change(s, sick, 5.0)
    later, _ = fold(s, 5000, 3, used_gib=10, util_pct=50.0)
    assert later is not None and material_gpu_change(s, later, 5.0)


def fold_node(state: NodeState | None, ev: object, seq: int, t_ms: int = 0) -> NodeState:
    node, _ = fold_cluster_event(state, ev, "sched", seq, t_ms)  # type: ignore[arg-type]
    return node


def test_node_lifecycle() -> None:
    n = fold_node(None, node_up("n1", "A", "nvlink", 400.0), 1)
    assert n.up and {d.domain_id for d in n.domains} == {"A", "inter-domain"}
    n = fold_node(n, make_event(E.PREEMPT, "n1", ("g1", "g2")), 2)
    assert n.reserved == ("g1", "g2")
    n = fold_node(n, make_event(E.RELEASE, "n1", ("g1",)), 3)
    assert n.reserved == ("g2",)
    n = fold_node(n, make_event(E.GPU_ISOLATED, "n1", ("g3",)), 4)
    n = fold_node(n, make_event(E.XID, "n1", ("g4",), xid=79), 5)
    assert n.isolated == ("g3",) and n.failed == ("g4",)
    n = fold_node(n, make_event(E.GPU_RESTORED, "n1", ("g3", "g4")), 6)
    assert n.isolated == () and n.failed == ()
    n = fold_node(n, make_event(E.NODE_DOWN, "n1"), 7)
    assert not n.up
    n = fold_node(n, make_event(E.LINK, "n1", domains=(DomainInfo("A", "nvlink", 100.0),)), 8)
    assert next(d for d in n.domains if d.domain_id == "A").bandwidth_gbps == 100.0


def test_recoverable_xid_changes_nothing_and_duplicates_are_dropped() -> None:
    n = fold_node(None, node_up("n1", "A", "nvlink"), 1)
    same, outcome = fold_cluster_event(n, make_event(E.XID, "n1", ("g1",), xid=13), "sched", 2, 0)
    assert outcome is FoldOutcome.NO_CHANGE and same.failed == ()
    again, outcome = fold_cluster_event(
        same, make_event(E.XID, "n1", ("g1",), xid=13), "sched", 2, 0
    )
    assert outcome is FoldOutcome.DUPLICATE and again == same
