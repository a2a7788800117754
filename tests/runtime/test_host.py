"""Unit: the runtime worker's clock-free core — fatal XIDs, restart in place, holds, reports."""

from __future__ import annotations

from dataclasses import replace

import pytest

from flexpipe.schemas import ClusterEvent, ClusterEventType, PhaseStatus, TransitionPhase
from gearbox import DEFAULT_CONFIG, MODEL_7B_MHA
from gearbox.decisions import DecisionReason
from gearbox.presets import MODEL_70B_GQA
from runtime.deployment import RuntimeSettings
from runtime.executor import KvPolicy
from runtime.host import DecisionOutcome, RuntimeHost
from runtime.inventory import GpuInventory
from runtime.router import ReplicaRole
from runtime.timing import ReplicaTiming
from runtime.timing import _prefill_s as uncached_prefill_s
from tests.runtime.builders import (
    DEPLOYMENT,
    FAST_EXECUTOR,
    FAST_POLICY,
    Harness,
    make_decision,
    make_plan,
    make_replica,
    make_request,
)
from tests.streams.builders import make_sample

pytestmark = pytest.mark.unit

A0 = make_replica(["A0"])
A1 = make_replica(["A1"])


def _event(kind: ClusterEventType, *gpus: str, xid: int | None = None) -> ClusterEvent:
    return ClusterEvent(type=kind, node="n0", gpu_uuids=gpus, xid=xid)


def _host(kv_policy: KvPolicy = KvPolicy.AUTO) -> RuntimeHost:
    executor = replace(FAST_EXECUTOR, kv_policy=kv_policy)
    return RuntimeHost([DEPLOYMENT], RuntimeSettings(policy=FAST_POLICY, executor=executor))


def test_a_fatal_xid_takes_the_gpu_until_it_is_restored() -> None:
    inv = GpuInventory()
    assert inv.apply_event(_event(ClusterEventType.XID, "A0", xid=13)) == []  # recoverable
    assert inv.is_available("A0")
    assert inv.apply_event(_event(ClusterEventType.XID, "A0", xid=79)) == ["A0"]
    assert not inv.is_available("A0") and "fatal xid" in inv.problems(["A0"], "d")[0]
    inv.apply_event(_event(ClusterEventType.RELEASE, "A0"))  # not what clears a fatal XID
    assert not inv.is_available("A0")
    inv.apply_event(_event(ClusterEventType.GPU_RESTORED, "A0"))
    assert inv.is_available("A0")


def test_a_failed_replica_restarts_in_place_when_its_gpus_return() -> None:
    host = _host()
    h = Harness(host.runtimes[DEPLOYMENT])
    host.adopt({DEPLOYMENT: make_plan(A0)}, h.now_s)
    h.until(lambda: h.rt.state.active is None and h.rt.state.serving is not None, 30)
    host.on_cluster_event(_event(ClusterEventType.XID, "A0", xid=79))
    assert host.pool.is_lost("A0")
    h.advance_to(h.now_s + 1.0)
    assert h.rt.core.router.role(A0.plan_id) is ReplicaRole.FAILED
    h.advance_to(h.now_s + 5.0)  # still lost: nothing restarts
    assert h.rt.core.router.role(A0.plan_id) is ReplicaRole.FAILED
    host.on_cluster_event(_event(ClusterEventType.GPU_RESTORED, "A0"))
    h.until(lambda: h.rt.core.router.role(A0.plan_id) is ReplicaRole.ACTIVE, 30)
    assert h.submit(make_request(1, arrival_s=h.now_s)).admitted


def test_without_restart_in_place_a_failed_replica_waits_for_a_decision() -> None:
    settings = RuntimeSettings(
        policy=FAST_POLICY, executor=FAST_EXECUTOR, restart_failed_in_place=False
    )
    host = RuntimeHost([DEPLOYMENT], settings)
    h = Harness(host.runtimes[DEPLOYMENT])
    host.adopt({DEPLOYMENT: make_plan(A0)}, h.now_s)
    h.until(lambda: h.rt.state.active is None and h.rt.state.serving is not None, 30)
    host.on_cluster_event(_event(ClusterEventType.PREEMPT, "A0"))
    h.advance_to(h.now_s + 1.0)
    host.on_cluster_event(_event(ClusterEventType.RELEASE, "A0"))
    h.advance_to(h.now_s + 5.0)
    assert h.rt.core.router.role(A0.plan_id) is ReplicaRole.FAILED


def test_holds_and_other_deployments_never_reach_a_runtime() -> None:
    host = _host()
    hold = replace(make_decision(1, make_plan(A0)), to_plan_id=None)
    assert host.on_decision(hold, 0.0) is DecisionOutcome.HELD
    other = replace(make_decision(1, make_plan(A0)), deployment="other")
    assert host.on_decision(other, 0.0) is DecisionOutcome.NOT_OURS
    assert host.runtimes[DEPLOYMENT].state.active is None
    assert host.on_decision(make_decision(1, make_plan(A0)), 0.0) is DecisionOutcome.FED
    assert host.runtimes[DEPLOYMENT].state.active is not None


def test_samples_reach_the_inventory_and_reports_restart_the_window() -> None:
    host = _host()
    host.on_gpu_sample(make_sample("A0", healthy=False))
    assert not host.inventory.is_available("A0")
    (report,) = host.serving_reports(10.0)
    assert report.deployment == DEPLOYMENT
    assert host.runtimes[DEPLOYMENT].core.window.start_s == 10.0


@pytest.mark.parametrize("policy", [KvPolicy.AUTO, KvPolicy.REPLAY_ONLY])
def test_the_kv_policy_decides_whether_kv_crosses_a_link(policy: KvPolicy) -> None:
    host = _host(kv_policy=policy)
    h = Harness(host.runtimes[DEPLOYMENT])
    h.decide(1, make_plan(A0))
    h.until(lambda: h.rt.state.active is None, 30)
    for i in range(8):
        h.submit(make_request(i, 1500, 1500, h.now_s))
    h.advance_to(h.now_s + 3.0)
    h.decide(2, make_plan(A1), from_plan_id=make_plan(A0).plan_id)
    h.until(lambda: h.rt.state.active is None, 120)
    assert h.rt.state.serving_plan_id == make_plan(A1).plan_id
    (switch,) = [
        r.detail
        for r in h.outputs.records
        if r.transition_seq == 2
        and r.phase is TransitionPhase.SWITCH
        and r.status.value == "completed"
    ]
    # NVLink between A0 and A1: gearbox migrates long sequences unless the policy forbids it.
    assert ("migrated 0 " not in switch) == (policy is KvPolicy.AUTO), switch


def test_replica_timing_memo_gives_the_cost_model_figures() -> None:
    timing = ReplicaTiming.build(make_replica(["g0"]), MODEL_7B_MHA, DEFAULT_CONFIG)
    for tokens in (1, 63, 64, 65, 900, 8191):
        bucket = max(64, -(-tokens // 64) * 64)
        expected = uncached_prefill_s(timing.shape, MODEL_7B_MHA, bucket, DEFAULT_CONFIG)
        assert timing.prefill_s(tokens) == expected
        assert timing.prefill_s(tokens) == expected  # from the memo
    assert timing.decode_cycle_s(0, 10.0) == 0.0
    assert timing.decode_cycle_s(17, 700.5) == timing.decode_cycle_s(17, 704.0)  # one bucket
    assert timing == ReplicaTiming.build(make_replica(["g0"]), MODEL_7B_MHA, DEFAULT_CONFIG)


def test_on_demand_claims_share_a_gpu_and_any_other_claim_owns_it_whole() -> None:
    inv = GpuInventory(sharing=("a", "b"))
    inv.claim(["A0"], "a")
    assert inv.problems(["A0"], "b") == ()  # memory shares: the VMM says whether it fits
    inv.claim(["A0"], "b")
    assert inv.problems(["A0"], "whole") == ("A0: claimed by a, b",)
    inv.release(["A0"], "a")
    assert inv.problems(["A0"], "whole") == ("A0: claimed by b",)
    inv.release(["A0"], "b")
    inv.claim(["A0"], "whole")
    assert inv.problems(["A0"], "a") == ("A0: claimed by whole",)


def test_a_forced_switch_onto_a_dead_replicas_surviving_gpus_prepares_at_once() -> None:
    # A 70B TP4 replica loses one GPU; the forced switch, delivered before the runtime's next
    # step, reuses two of its surviving GPUs at TP2 (70 GB a GPU beside the dead replica's
    # 35 GB reservation). The prepare notices the death first, so its first attempt loads.
    host = _host()
    h = Harness(host.runtimes[DEPLOYMENT])
    tp4 = make_replica(["A0", "A1", "A2", "A3"], model=MODEL_70B_GQA)
    tp2 = make_replica(["A0", "A1"], model=MODEL_70B_GQA)
    host.adopt({DEPLOYMENT: make_plan(tp4)}, h.now_s)
    h.until(lambda: h.rt.state.active is None and h.rt.state.serving is not None, 60)
    host.on_cluster_event(_event(ClusterEventType.PREEMPT, "A3"))
    forced = make_decision(2, make_plan(tp2), from_plan_id=make_plan(tp4).plan_id,
                           reason=DecisionReason.FORCED_INFEASIBLE)  # fmt: skip
    assert host.on_decision(forced, h.now_s) is DecisionOutcome.FED
    h.ack()  # the log acknowledges the prepare's start at once: the phase starts now
    h.until(lambda: h.rt.state.active is None, 120)
    assert h.rt.state.serving_plan_id == make_plan(tp2).plan_id
    prepares = [r for r in h.phases if r[0] == 2 and r[1] is TransitionPhase.PREPARE]
    assert [r[2] for r in prepares] == [PhaseStatus.STARTED, PhaseStatus.COMPLETED], prepares
