"""A decision round's order: deployments whose plan the topology disturbed first."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from flexpipe.schemas import ClusterEventType, DomainInfo
from gearbox.plans import DeploymentPlan
from gearbox.presets import LINK_CLASSES, MODEL_7B_MHA
from gearbox.types import Domain, TopologySnapshot
from streams.state import fold_cluster_event
from streams.step import decision_order, plan_disturbed
from tests.gearbox.builders import NOW_S, article_cluster, deployment, tp_plan, with_gpus
from tests.streams.builders import SMALL_CLUSTER, T0_MS, gpu_uuid, make_event
from tests.streams.test_snapshot import folded, topology
from tests.streams.test_step import FRESH, decide

pytestmark = pytest.mark.unit

Event = tuple[ClusterEventType, str, tuple[str, ...], tuple[DomainInfo, ...]]


def tp2(a: str, b: str, name: str = "chat") -> DeploymentPlan:
    return deployment(tp_plan((a, b), MODEL_7B_MHA), name=name)


def test_a_plan_on_live_gpus_of_its_domain_and_link_is_not_disturbed() -> None:
    assert not plan_disturbed(tp2("A-g00", "A-g01"), article_cluster())


@pytest.mark.parametrize(
    "change",
    [
        {"schedulable": False},  # preempted, reserved or isolated
        {"healthy": False},  # a fatal XID
        {"last_seen_s": NOW_S - 60.0},  # silent past the heartbeat timeout
        {"domain": "B"},  # now in another domain
    ],
)
def test_a_plan_is_disturbed_when_one_of_its_gpus_is(change: dict[str, Any]) -> None:
    snap = with_gpus(article_cluster(), ["A-g01"], **change)
    assert plan_disturbed(tp2("A-g00", "A-g01"), snap)
    assert not plan_disturbed(tp2("A-g02", "A-g03"), snap)


def test_a_plan_is_disturbed_when_a_gpu_is_gone_or_its_domain_link_changed() -> None:
    snap = article_cluster()
    gone = replace(snap, gpus=tuple(g for g in snap.gpus if g.uuid != "A-g01"))
    assert plan_disturbed(tp2("A-g00", "A-g01"), gone)
    pcie = LINK_CLASSES["pcie"]
    slower = tuple(Domain("A", pcie) if d.domain_id == "A" else d for d in snap.domains)
    assert plan_disturbed(tp2("A-g00", "A-g01"), replace(snap, domains=slower))


def test_no_plan_needs_a_first_placement() -> None:
    assert plan_disturbed(None, article_cluster())


def test_disturbed_deployments_go_first_each_group_in_the_configured_order() -> None:
    snap = with_gpus(article_cluster(), ["A-g02", "A-g06"], schedulable=False)
    plans = {
        "a": tp2("A-g00", "A-g01", "a"),
        "b": tp2("A-g02", "A-g03", "b"),  # lost a GPU
        "c": tp2("A-g04", "A-g05", "c"),
        "d": tp2("A-g06", "A-g07", "d"),  # lost a GPU
    }
    names = ("a", "b", "c", "d", "e")  # e: no plan yet
    assert decision_order(names, plans, snap) == (("b", "d", "e"), ("a", "c"))
    assert decision_order(("d", "c", "b", "a"), plans, snap) == (("d", "b"), ("c", "a"))
    assert decision_order(names[:4], plans, article_cluster()) == ((), names[:4])


def folded_with(*events: Event) -> TopologySnapshot:
    """The small cluster through the stream's folds and snapshot, after ``events``."""
    gpus, nodes = folded()
    for seq, (kind, node, uuids, domains) in enumerate(events, start=1):
        ev = make_event(kind, node, uuids, domains=domains)
        nodes[node], _ = fold_cluster_event(nodes.get(node), ev, "s", 900 + seq, T0_MS + seq)
    return topology(gpus, nodes)


def test_a_plan_gearbox_made_is_disturbed_by_the_events_that_touch_it_only() -> None:
    """Through the stream's folds and snapshot: the link and domain gearbox planned a stage on
    are what the snapshot shows (no false alarm); a preemption, its node going down or a LINK
    event on its domain disturb the plan, an event elsewhere or a release does not."""
    out = decide(FRESH, T0_MS, view=folded())
    assert out is not None and out.plan.current is not None
    plan = out.plan.current
    assert not plan_disturbed(plan, folded_with())
    mine = sorted(plan.gpu_uuids)[0]
    node = next(n for d, _, _, n, i in SMALL_CLUSTER if gpu_uuid(d, n, i) == mine)
    domain = plan.replicas[0].stages[0].domain_id
    other = gpu_uuid("B", "node-b1", 0)
    assert domain == "A" and node.startswith("node-a")
    t = ClusterEventType
    assert plan_disturbed(plan, folded_with((t.PREEMPT, node, (mine,), ())))
    assert plan_disturbed(plan, folded_with((t.NODE_DOWN, node, (), ())))
    slow = (DomainInfo(domain, "pcie", None),)
    assert plan_disturbed(plan, folded_with((t.LINK, node, (), slow)))
    assert not plan_disturbed(plan, folded_with((t.PREEMPT, "node-b1", (other,), ())))
    back = ((t.PREEMPT, node, (mine,), ()), (t.RELEASE, node, (mine,), ()))
    assert not plan_disturbed(plan, folded_with(*back))
