"""On-demand deployments in the runtime: requests held for a load, refused after the wait,
evictions (transitions to the empty plan) that never unload a model with requests, and several
on-demand models sharing one GPU under one watermark."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import replace

import pytest

from flexpipe.schemas import PhaseStatus, TransitionPhase
from gearbox.config import DEFAULT_CONFIG
from gearbox.decisions import DecisionReason
from gearbox.plans import DeploymentPlan
from gearbox.presets import MODEL_7B_MHA
from runtime.deployment import RuntimeSettings
from runtime.host import RuntimeHost
from runtime.timing import ReplicaTiming
from runtime.types import Reason
from runtime.vmm.manager import WEIGHTS_REQUEST
from tests.runtime.builders import (
    DEPLOYMENT,
    FAST_EXECUTOR,
    FAST_POLICY,
    Harness,
    make_decision,
    make_plan,
    make_replica,
    make_request,
    make_runtime,
)

pytestmark = pytest.mark.unit
SWITCH = TransitionPhase.SWITCH

HOLD_S = 30.0
PLAN = make_plan(make_replica(["A0"]))
EMPTY = DeploymentPlan(DEPLOYMENT, PLAN.model_name, ())


def _on_demand() -> Harness:
    h = Harness(make_runtime())
    h.rt.core.hold_s = HOLD_S
    return h


def test_a_request_for_a_cold_model_is_held_and_served_once_it_loads() -> None:
    h = _on_demand()
    assert h.submit(make_request(1, output=16)).reason is Reason.HELD_FOR_LOAD
    assert h.rt.core.held() == ("r1",)
    h.advance(5.0)
    h.decide(1, PLAN)
    h.until(lambda: any(c.request_id == "r1" for c in h.outputs.completions), 60)
    assert h.rt.core.held() == () and h.outputs.refused == []
    done = next(c for c in h.outputs.completions if c.request_id == "r1")
    assert done.ttft_s >= 5.0  # NOTE: the wait for the load counts in its latency


def test_a_held_request_is_refused_model_loading_after_the_wait() -> None:
    h = _on_demand()
    h.submit(make_request(1))
    h.advance(HOLD_S - 1.0)
    assert h.outputs.refused == []
    h.advance(2.0)
    assert h.outputs.refused == [("r1", Reason.MODEL_LOADING)]
    assert h.rt.core.rejections[Reason.MODEL_LOADING] == 1 and h.rt.core.held() == ()


def test_giving_back_a_replica_in_use_drains_it_and_fails_no_request() -> None:
    # gearbox's drain rule: one of two replicas goes while both serve; its requests finish
    h = _on_demand()
    two = make_plan(make_replica(["A0"]), make_replica(["A1"]))
    h.decide(1, two)
    h.until(lambda: h.rt.state.active is None and h.rt.state.serving is not None, 60)
    ids = [f"r{n}" for n in range(6)]
    assert all(h.submit(make_request(n, output=300)).admitted for n in range(6))
    owners = set(h.rt.core.router.ownership().values())
    assert len(owners) == 2  # both replicas hold requests
    h.decide(2, make_plan(make_replica(["A0"])), from_plan_id=two.plan_id)
    h.until(lambda: all(i in {c.request_id for c in h.outputs.completions} for i in ids), 120)
    h.until(lambda: h.rt.state.active is None, 60)
    phases = [(r.transition_seq, r.phase) for r in h.outputs.records]
    assert (2, TransitionPhase.DONE) in phases and (2, TransitionPhase.ROLLED_BACK) not in phases
    assert h.outputs.refused == [] and not h.rt.core.rejections


def test_a_resident_deployment_still_refuses_with_no_plan() -> None:
    h = Harness(make_runtime())
    assert h.submit(make_request(1)).reason is Reason.NO_SERVING_PLAN


def test_an_eviction_with_a_request_in_flight_rolls_back_and_the_request_finishes() -> None:
    h = _on_demand()
    h.decide(1, PLAN)
    h.until(lambda: h.rt.state.active is None, 30)
    assert h.submit(make_request(1, output=400)).admitted
    h.decide(2, EMPTY, from_plan_id=PLAN.plan_id)
    h.until(lambda: h.rt.state.active is None, 120)
    phases = [(r.transition_seq, r.phase) for r in h.outputs.records]
    assert (2, TransitionPhase.ROLLED_BACK) in phases and (2, TransitionPhase.DONE) not in phases
    assert any("not evicted" in r.detail for r in h.outputs.records if r.transition_seq == 2)
    assert h.rt.state.serving_plan_id == PLAN.plan_id
    h.until(lambda: any(c.request_id == "r1" for c in h.outputs.completions), 120)


def test_an_idle_model_is_evicted_and_its_next_request_is_held() -> None:
    h = _on_demand()
    h.decide(1, PLAN)
    h.until(lambda: h.rt.state.active is None, 30)
    h.decide(2, EMPTY, from_plan_id=PLAN.plan_id)
    h.until(lambda: h.rt.state.active is None, 60)
    assert h.rt.state.serving_plan_id == EMPTY.plan_id and h.rt.core.replica_ids() == ()
    assert h.submit(make_request(1)).reason is Reason.HELD_FOR_LOAD


# ---- on-demand models sharing one GPU ------------------------------------------------------


def _shared_host() -> tuple[RuntimeHost, dict[str, Harness]]:
    """Two on-demand 7B deployments and one that is not, on one host (one inventory, one VMM
    ledger), each with a driver."""
    settings = RuntimeSettings(policy=FAST_POLICY, executor=FAST_EXECUTOR)
    host = RuntimeHost(("a", "b", "whole"), settings, hold_s={"a": HOLD_S, "b": HOLD_S})
    return host, {d: Harness(rt) for d, rt in host.runtimes.items()}


def _step_all(drivers: dict[str, Harness], predicate: Callable[[], bool], limit_s: float) -> None:
    """Tick every deployment together until ``predicate`` holds; fail after ``limit_s``."""
    end = min(h.now_s for h in drivers.values()) + limit_s
    while not predicate():
        now_s = max(h.now_s for h in drivers.values())
        assert now_s < end, f"not met within {limit_s} simulated s"
        for h in drivers.values():
            h.advance_to(now_s + 0.05)


def _committed(host: RuntimeHost, uuid: str) -> int:
    return host.vmm.memory()[uuid].committed_bytes


def test_two_on_demand_models_share_a_gpu_and_the_watermark_counts_both() -> None:
    host, hs = _shared_host()
    plans = {d: make_plan(make_replica(["A0"]), deployment=d) for d in ("a", "b", "whole")}
    hs["a"].deliver(make_decision(1, plans["a"], deployment="a"))
    hs["b"].deliver(make_decision(1, plans["b"], deployment="b"))
    _step_all(hs, lambda: all(hs[d].rt.state.serving is not None for d in "ab"), 60)
    assert all(hs[d].rt.state.serving == plans[d] for d in "ab")  # both DONE on A0
    b_replica = plans["b"].replicas[0].plan_id
    b_weights = host.vmm.held_bytes(hs["b"].rt.core.ledger_id(b_replica), WEIGHTS_REQUEST)["A0"]
    # a deployment that owns GPUs whole is still refused a GPU others hold
    hs["whole"].deliver(make_decision(1, plans["whole"], deployment="whole"))
    _step_all(hs, lambda: hs["whole"].rt.state.active is None, 60)
    assert hs["whole"].rt.state.serving is None
    assert any("claimed by a, b" in r.detail for r in hs["whole"].outputs.records)
    # "a" fills the GPU with KV until the next prompt would pass 85 % across both models
    admitted = 0
    while hs["a"].submit(make_request(admitted, prompt=8000, output=2000, prefix="a")).admitted:
        admitted += 1
    assert admitted > 0 and hs["a"].admissions[-1].reason is Reason.THROTTLED_WATERMARK
    refused = hs["b"].submit(make_request(1, prompt=8000, output=16, prefix="b"))
    assert refused.reason is Reason.THROTTLED_WATERMARK  # b's own replica holds only weights
    assert host.vmm.memory()["A0"].fill <= 0.85 and host.pool.oom_events == 0
    # evicting the idle "b" frees its share only: "a" keeps its weights, KV and sequences
    before = _committed(host, "A0")
    empty = DeploymentPlan("b", plans["b"].model_name, ())
    hs["b"].deliver(make_decision(2, empty, from_plan_id=plans["b"].plan_id, deployment="b"))
    _step_all(hs, lambda: hs["b"].rt.state.active is None, 60)
    assert hs["b"].rt.state.serving_plan_id == empty.plan_id
    assert before - _committed(host, "A0") == b_weights > 0
    assert hs["a"].rt.core.replica_ids() == (plans["a"].replicas[0].plan_id,)
    assert len(hs["a"].rt.core.router.ownership()) == admitted


def test_on_demand_routers_count_the_busy_replicas_beside_theirs_on_a_gpu() -> None:
    # "a" on A0, "b" on A0 and A1: b's replica on A0 shares the GPU with a's, which is busy
    # once it has a request; the router then prefers b's replica alone on A1. A deployment that
    # owns its GPUs whole shares nothing: its router has no such view.
    _, hs = _shared_host()
    a_plan = make_plan(make_replica(["A0"]), deployment="a")
    b_plan = make_plan(make_replica(["A0"]), make_replica(["A1"]), deployment="b")
    hs["a"].deliver(make_decision(1, a_plan, deployment="a"))
    hs["b"].deliver(make_decision(1, b_plan, deployment="b"))
    _step_all(hs, lambda: all(hs[d].rt.state.serving is not None for d in "ab"), 60)
    router = hs["b"].rt.core.router
    busy = router.neighbours_busy
    assert busy is not None and hs["whole"].rt.core.router.neighbours_busy is None
    on_a0, on_a1 = (r.plan_id for r in b_plan.replicas)
    timing = {
        r.plan_id: ReplicaTiming.build(r, MODEL_7B_MHA, DEFAULT_CONFIG) for r in b_plan.replicas
    }
    assert busy(timing[on_a0]) == 0 and busy(timing[on_a1]) == 0
    probe = make_request(50, prompt=500, output=16, prefix="b")
    quiet = router.candidates(probe, hs["b"].now_s)
    assert hs["a"].submit(make_request(1, prompt=4000, output=2000, prefix="a")).admitted
    assert busy(timing[on_a0]) == 1 and busy(timing[on_a1]) == 0
    ranked = router.candidates(probe, hs["b"].now_s)
    assert ranked[0].replica_id == on_a1
    shared = next(c for c in ranked if c.replica_id == on_a0)
    before = next(c for c in quiet if c.replica_id == on_a0)
    assert shared.predicted_completion_s > before.predicted_completion_s


def test_a_kv_floor_keeps_a_busy_neighbour_from_starving_a_quiet_model() -> None:
    settings = RuntimeSettings(policy=FAST_POLICY, executor=FAST_EXECUTOR)
    floors = {"a": 16_000, "b": 16_000}  # 8 GiB of a 7B's KV each
    host = RuntimeHost(
        ("a", "b"), settings, hold_s=dict.fromkeys("ab", HOLD_S), kv_floor_tokens=floors
    )
    hs = {d: Harness(rt) for d, rt in host.runtimes.items()}
    plans = {d: make_plan(make_replica(["A0"]), deployment=d) for d in "ab"}
    for d in "ab":
        hs[d].deliver(make_decision(1, plans[d], deployment=d))
    _step_all(hs, lambda: all(hs[d].rt.state.serving is not None for d in "ab"), 60)
    admitted = 0
    while hs["a"].submit(make_request(admitted, prompt=8000, output=2000, prefix="a")).admitted:
        admitted += 1
    assert hs["a"].admissions[-1].reason is Reason.THROTTLED_WATERMARK
    # "a" stopped short of b's floor: b's requests inside it are admitted (without a floor
    # its first one was refused, above), and the GPU stays under the watermark
    served = 0
    while hs["b"].submit(make_request(served, prompt=4000, output=16, prefix="b")).admitted:
        served += 1
    assert served >= 3 and hs["b"].admissions[-1].reason is (  # 3 × (4000 + a page) < 16000
        Reason.THROTTLED_WATERMARK
    )
    assert host.vmm.memory()["A0"].fill <= 0.85


def test_a_floor_past_the_watermark_is_cut_to_it_and_still_admits() -> None:
    # 200,000 tokens of a 7B's KV (~98 GiB) cannot fit the card: uncut, the replica's own floor
    # would put every request of it past the watermark and refuse it
    settings = RuntimeSettings(policy=FAST_POLICY, executor=FAST_EXECUTOR)
    host = RuntimeHost(("a",), settings, hold_s={"a": HOLD_S}, kv_floor_tokens={"a": 200_000})
    h = Harness(host.runtimes["a"])
    h.deliver(make_decision(1, make_plan(make_replica(["A0"]), deployment="a"), deployment="a"))
    _step_all({"a": h}, lambda: h.rt.state.serving is not None, 60)
    assert h.submit(make_request(1, prompt=1000, output=16, prefix="a")).admitted
    assert host.vmm.memory()["A0"].fill <= settings.serving.watermark


# ---- a handover: one deployment's prepare waits for GPUs another moves off ----------------


def _handover(settings: RuntimeSettings) -> tuple[RuntimeHost, dict[str, Harness], DeploymentPlan]:
    """ "small" serves on A0; "big" is decided onto A0 + A1, taking A0 from "small"."""
    host = RuntimeHost(("small", "big"), settings)
    hs = {d: Harness(rt) for d, rt in host.runtimes.items()}
    on_a0 = make_plan(make_replica(["A0"]), deployment="small")
    hs["small"].deliver(make_decision(1, on_a0, deployment="small"))
    _step_all(hs, lambda: hs["small"].rt.state.serving == on_a0, 60)
    wide = make_plan(make_replica(["A0", "A1"]), deployment="big")
    taking = make_decision(1, wide, deployment="big")
    assert taking.decision is not None
    decision = replace(taking.decision, takes_from="small", taken_gpus=("A0",))
    hs["big"].deliver(replace(taking, decision=decision))
    return host, hs, on_a0


def test_a_handovers_prepare_waits_for_the_gpus_it_takes() -> None:
    settings = RuntimeSettings(policy=FAST_POLICY, executor=FAST_EXECUTOR)
    _, hs, on_a0 = _handover(settings)
    _step_all(hs, lambda: hs["small"].now_s >= 20.0, 30)
    # still waiting: no failed attempt, nothing loaded on A1 yet
    big = hs["big"].outputs.records
    assert not any(r.status is PhaseStatus.FAILED for r in big)
    assert hs["big"].rt.state.serving is None and hs["big"].rt.state.active is not None
    moved = make_plan(make_replica(["A2"]), deployment="small")
    hs["small"].deliver(make_decision(2, moved, from_plan_id=on_a0.plan_id, deployment="small"))
    _step_all(hs, lambda: hs["big"].rt.state.active is None, 60)
    assert hs["small"].rt.state.serving == moved
    assert hs["big"].rt.state.serving is not None
    assert hs["big"].rt.state.serving.gpu_uuids == {"A0", "A1"}


def test_a_handover_not_made_fails_after_the_wait_and_rolls_back() -> None:
    executor = dataclasses.replace(FAST_EXECUTOR, handover_wait_s=10.0)
    _, hs, on_a0 = _handover(RuntimeSettings(policy=FAST_POLICY, executor=executor))
    _step_all(hs, lambda: hs["big"].rt.state.active is None, 60)
    assert hs["big"].rt.state.serving is None
    failed = [r for r in hs["big"].outputs.records if r.status is PhaseStatus.FAILED]
    assert failed and "A0: claimed by small" in failed[0].detail
    assert "not handed over within 10 s" in failed[0].detail
    # the first failure came at the wait's end, not at once; the retries did not wait again
    assert failed[0].duration_ms is not None and failed[0].duration_ms >= 9_000
    assert all(r.duration_ms is not None and r.duration_ms < 1_000 for r in failed[1:])
    assert hs["small"].rt.state.serving == on_a0


def _displace(h: Harness, seq: int) -> None:
    """Deliver gearbox's displace eviction (a model in use) as transition ``seq``."""
    reason = DecisionReason.EVICT_DISPLACE
    h.deliver(make_decision(seq, EMPTY, from_plan_id=PLAN.plan_id, reason=reason))


def test_a_displaced_model_serves_until_it_is_idle_then_goes_and_no_request_fails() -> None:
    # gearbox's displace rule: the eviction of a model in use waits for an idle moment (up to
    # the drain timeout, 5 s here); its entry stays open meanwhile, so a request that comes is
    # served there, and the unload takes none with it
    h = _on_demand()
    h.decide(1, PLAN)
    h.until(lambda: h.rt.state.active is None, 30)
    assert h.submit(make_request(1, output=20)).admitted
    _displace(h, 2)
    h.advance(0.2)
    assert h.rt.core.replica_ids() != ()
    assert h.submit(make_request(2, output=20)).admitted  # served, not held
    h.until(lambda: h.rt.state.active is None, 60)
    phases = [(r.transition_seq, r.phase) for r in h.outputs.records]
    assert (2, TransitionPhase.DONE) in phases and (2, TransitionPhase.ROLLED_BACK) not in phases
    assert {"r1", "r2"} <= {c.request_id for c in h.outputs.completions}
    assert h.outputs.refused == [] and h.rt.core.replica_ids() == ()


def test_a_displaced_model_still_busy_after_the_drain_timeout_stays() -> None:
    h = _on_demand()
    h.decide(1, PLAN)
    h.until(lambda: h.rt.state.active is None, 30)
    assert h.submit(make_request(1, output=4000)).admitted  # longer than the 5-s timeout
    _displace(h, 2)
    h.until(lambda: h.rt.state.active is None, 120)
    phases = [(r.transition_seq, r.phase) for r in h.outputs.records]
    assert (2, TransitionPhase.ROLLED_BACK) in phases and (2, TransitionPhase.DONE) not in phases
    detail = " ".join(r.detail for r in h.outputs.records if r.transition_seq == 2)
    assert "not idle within 5 s" in detail
    h.until(lambda: any(c.request_id == "r1" for c in h.outputs.completions), 300)
    assert h.outputs.refused == [] and h.rt.state.serving_plan_id == PLAN.plan_id


def test_a_request_admitted_after_a_displaced_models_idle_moment_finishes_before_it_goes() -> None:
    # the prepare saw it idle; a request admitted before the switch freezes the entry runs on
    # the frozen replica to its end, one that comes after the freeze is held for a reload
    h = _on_demand()
    h.decide(1, PLAN)
    h.until(lambda: h.rt.state.active is None, 30)
    _displace(h, 2)
    h.until(lambda: any(r.transition_seq == 2 for r in h.outputs.records), 30)
    assert h.submit(make_request(1, output=30)).admitted

    def switching() -> bool:
        return any(r.transition_seq == 2 and r.phase is SWITCH for r in h.outputs.records)

    h.until(switching, 30, dt_s=0.01)
    assert h.rt.core.router.ownership() != {}  # r1 runs on the frozen replica
    assert h.submit(make_request(2, output=30)).reason is Reason.HELD_FOR_LOAD
    h.until(lambda: h.rt.state.active is None, 60)
    phases = [(r.transition_seq, r.phase) for r in h.outputs.records]
    assert (2, TransitionPhase.DONE) in phases and (2, TransitionPhase.ROLLED_BACK) not in phases
    assert "r1" in {c.request_id for c in h.outputs.completions}
    assert h.rt.core.replica_ids() == () and h.outputs.refused == []
    assert h.rt.core.held() == ("r2",)  # it waits for a reload
