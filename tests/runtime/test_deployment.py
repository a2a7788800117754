"""Unit: a deployment runtime under a simulated clock — shifts, faults, throttling, recovery.

Everything here runs without Kafka or the wall clock: the harness acknowledges every record at
once (as the log would) and checks the ownership invariant after every tick.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from flexpipe.schemas import GearTransition, PhaseStatus, TransitionPhase
from gearbox.decisions import DecisionReason
from runtime.deployment import DeploymentRuntime, RuntimeSettings
from runtime.transition import Outcome
from runtime.types import OwnershipKind, Reason, Request, ServingSettings
from runtime.vmm.host import HostReservationBackend
from runtime.vmm.manager import ReservationManager
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
from tests.runtime.logcheck import validate_log

pytestmark = pytest.mark.unit

GIB = 1024**3
P, S, C = TransitionPhase.PREPARE, TransitionPhase.SWITCH, TransitionPhase.CLEANUP
A0 = make_replica(["A0"])
A1 = make_replica(["A1"])  # same NVLink domain as A0: migrating KV beats replaying it
B0 = make_replica(["B0"], domain="B", gpu_class="a100-80g", link="rdma")


def _placed(h: Harness, plan: object, seq: int = 1) -> None:
    h.decide(seq, plan)  # type: ignore[arg-type]
    h.until(lambda: h.rt.state.active is None, 30)
    assert h.rt.state.serving_plan_id == plan.plan_id  # type: ignore[attr-defined]


def _load(
    h: Harness, n: int, prompt: int = 1500, output: int = 1500, prefix: str = "r"
) -> set[str]:
    admitted = set()
    for i in range(n):
        adm = h.submit(make_request(i, prompt, output, h.now_s, prefix=prefix))
        if adm.admitted:
            admitted.add(adm.request_id)
    return admitted


def _switch_record(h: Harness, seq: int) -> GearTransition:
    return next(
        r
        for r in h.outputs.records
        if r.transition_seq == seq and r.phase is S and r.status is PhaseStatus.COMPLETED
    )


def _finish_all(h: Harness, admitted: set[str], limit_s: float = 600) -> None:
    h.until(lambda: not h.rt.core.router.ownership() and not h.rt.core.unplaced(), limit_s)
    done = [c.request_id for c in h.outputs.completions]
    assert sorted(done) == sorted(set(done)), "a sequence completed twice"
    assert admitted <= set(done), f"lost: {sorted(admitted - set(done))[:5]}"


def test_shift_migrates_long_sequences_and_loses_none() -> None:
    h = Harness(make_runtime())
    _placed(h, make_plan(A0))
    admitted = _load(h, 30)
    h.advance(1.0)
    h.decide(2, make_plan(A1), make_plan(A0).plan_id)
    h.until(lambda: h.rt.state.active is None, 60)
    switch = _switch_record(h, 2)
    assert "migrated 0 " not in switch.detail, switch.detail  # NVLink: gearbox picks migration
    assert h.rt.state.serving_plan_id == make_plan(A1).plan_id
    assert h.rt.core.replica_ids() == (A1.plan_id,)
    _finish_all(h, admitted)
    assert validate_log(h.outputs.records) == []


def test_replay_is_chosen_across_a_slow_link() -> None:
    h = Harness(make_runtime())
    _placed(h, make_plan(A0))
    admitted = _load(h, 20, prompt=3000, output=2000)
    h.advance(0.5)
    h.decide(2, make_plan(B0), make_plan(A0).plan_id)
    h.until(lambda: h.rt.state.active is None, 60)
    switch = _switch_record(h, 2)
    assert "replayed 0" not in switch.detail, switch.detail
    _finish_all(h, admitted)


def test_target_gpus_preempted_during_switch_retry_twice_then_roll_back() -> None:
    h = Harness(make_runtime())
    old = make_plan(A0)
    _placed(h, old)
    admitted = _load(h, 20, output=3000)
    h.decide(2, make_plan(B0), old.plan_id)
    h.until(lambda: h.rt.state.active is not None and h.rt.state.active.phase is S, 30)
    admitted |= _load(h, 20, output=50, prefix="canary")  # some land on the canary
    h.rt.pool.preempt(["B0"])
    h.until(lambda: h.rt.state.active is None, 60)
    switch = [(p[1], p[2], p[3]) for p in h.phases if p[0] == 2 and p[1] is S]
    assert switch == [
        (S, "started", 1),
        (S, "failed", 1),
        (S, "started", 2),
        (S, "failed", 2),
        (S, "started", 3),
        (S, "failed", 3),
    ]
    assert h.phases[-1][1] is TransitionPhase.ROLLED_BACK
    assert h.rt.state.serving_plan_id == old.plan_id
    assert h.rt.core.routable() == (A0.plan_id,)
    assert Outcome.ROLLED_BACK in [r.outcome for r in h.outputs.resolved]
    _finish_all(h, admitted)
    assert all(c.replica_id == A0.plan_id for c in h.outputs.completions[-5:])


def test_burst_of_long_prompts_is_throttled_not_out_of_memory() -> None:
    h = Harness(make_runtime())
    _placed(h, make_plan(make_replica(["C0"], gpu_class="l40s")))  # 48 GB
    outcomes = [h.submit(make_request(i, 12_000, 4_000, h.now_s)) for i in range(60)]
    refused = [o for o in outcomes if not o.admitted]
    assert refused and {o.reason for o in refused} == {Reason.THROTTLED_WATERMARK}
    h.advance(30.0)
    assert h.rt.pool.oom_events == 0 and h.rt.core.engine_oom_events == 0
    memory = h.rt.core.vmm.memory()["C0"]
    assert memory.fill <= h.rt.settings.serving.watermark
    admitted = {o.request_id for o in outcomes if o.admitted}
    _finish_all(h, admitted)
    after = h.submit(make_request(999, 200, 20, h.now_s))  # the worker keeps serving
    assert after.admitted


class _ShortBackend(HostReservationBackend):
    """Reports the datasheet size but runs out of pages early (memory taken outside our view)."""

    def capacity_bytes(self) -> int:
        return 80 * GIB


def test_a_vmm_refusal_rejects_the_request_with_its_own_reason() -> None:
    small = ReservationManager(lambda uuid, _cap: _ShortBackend(uuid, 24 * GIB))
    settings = RuntimeSettings(
        policy=FAST_POLICY, executor=FAST_EXECUTOR, serving=ServingSettings(watermark=1.0)
    )
    rt = DeploymentRuntime(DEPLOYMENT, settings=settings, vmm=small)
    h = Harness(rt)
    _placed(h, make_plan(A0))
    outcomes = [h.submit(make_request(i, 8000, 2000, h.now_s)) for i in range(10)]
    assert Reason.REJECTED_OOM_RISK in {o.reason for o in outcomes}
    assert any(o.admitted for o in outcomes)
    h.advance(30.0)
    assert h.rt.pool.oom_events == 0


def test_no_plan_means_no_admission() -> None:
    h = Harness(make_runtime())
    assert h.submit(make_request(1)).reason is Reason.NO_SERVING_PLAN


@pytest.mark.parametrize("phase", [P, S, C])
def test_restart_inside_each_phase_recovers_one_plan_and_every_sequence(
    phase: TransitionPhase,
) -> None:
    old, new = make_plan(A0), make_plan(B0)
    h = Harness(make_runtime())
    _placed(h, old)
    h.rt.executor.pause_in = phase  # hold the next transition just before this phase finishes
    admitted = _load(h, 24, output=2500)
    h.decide(2, new, old.plan_id)
    h.until(lambda: h.rt.executor.paused, 60)
    assert h.rt.state.active is not None and h.rt.state.active.phase is phase
    # kill -9: everything in memory is gone; the logs are what survives.
    records = list(h.outputs.records)
    journal: dict[str, Request | None] = {}
    for event in h.outputs.ownership:
        done = event.kind is OwnershipKind.FINISHED
        journal[event.request.request_id] = None if done else event.request
    unfinished = [r for r in journal.values() if r is not None]
    restarted = Harness(make_runtime(), now_s=h.now_s + 5.0)
    restarted.rt.recover(records, unfinished, restarted.now_s)
    restarted.ack()
    restarted.until(lambda: restarted.rt.state.active is None, 60)
    expected = new if phase is C else old
    assert restarted.rt.state.serving_plan_id == expected.plan_id
    replicas = {r.plan_id for r in expected.replicas}
    assert set(restarted.rt.core.routable()) == replicas
    owners = restarted.rt.core.router.ownership()
    assert sorted(owners) == sorted(r.request_id for r in unfinished)  # each exactly once
    assert set(owners.values()) <= replicas
    _finish_all(restarted, {r.request_id for r in unfinished})
    finished = {e.request.request_id for e in h.outputs.ownership if e.kind == "finished"}
    assert admitted <= finished | {c.request_id for c in restarted.outputs.completions}
    full_log = records + restarted.outputs.records
    assert validate_log(full_log) == []
    assert full_log[-1].phase is (
        TransitionPhase.DONE if phase is C else TransitionPhase.ROLLED_BACK
    )


def test_invalid_decisions_are_rejected_not_started() -> None:
    h = Harness(make_runtime())
    other = make_decision(1, make_plan(A0, deployment="other"), deployment="other")
    h.rt.on_decision(other, 0.0, ref=1)
    hold = replace(make_decision(2, make_plan(A0)), decision=None)  # a hold carries no plan
    h.rt.on_decision(hold, 0.0, ref=2)
    unknown_model = make_decision(3, make_plan(A0))
    h.rt.models = {}
    h.rt.on_decision(unknown_model, 0.0, ref=3)
    h.ack()
    assert [r.outcome for r in h.outputs.resolved] == [Outcome.REJECTED_INVALID] * 3
    assert h.rt.state.active is None and h.outputs.records == []


def test_scale_down_keeps_the_kept_replica_and_drains_the_other() -> None:
    h = Harness(make_runtime())
    both = make_plan(A0, A1)
    _placed(h, both)
    admitted = _load(h, 30)
    h.advance(0.5)
    h.decide(2, make_plan(A1), both.plan_id)
    h.until(lambda: h.rt.state.active is None, 60)
    assert h.rt.core.replica_ids() == (A1.plan_id,)
    prepare = next(r for r in h.outputs.records if r.transition_seq == 2 and r.phase is P)
    assert prepare.status is PhaseStatus.STARTED
    _finish_all(h, admitted)
    assert validate_log(h.outputs.records) == []


def test_rolled_back_first_placement_keeps_its_sequences_for_the_next_plan() -> None:
    h = Harness(make_runtime())
    h.decide(1, make_plan(B0))
    h.until(lambda: h.rt.state.active is not None and h.rt.state.active.phase is S, 30)
    admitted = _load(h, 5, output=2000)  # only the canary exists: it takes them all
    assert admitted
    h.rt.pool.preempt(["B0"])
    h.until(lambda: h.rt.state.active is None, 60)
    assert h.rt.state.serving_plan_id is None
    assert sorted(h.rt.core.unplaced()) == sorted(admitted)  # held, not lost
    h.decide(2, make_plan(A0))
    h.until(lambda: h.rt.state.active is None, 30)
    _finish_all(h, admitted)


def test_status_reports_the_gear_as_a_monitored_object() -> None:
    h = Harness(make_runtime(pause_in=S))
    _placed_records: list[GearTransition] = []
    h.decide(1, make_plan(A0))
    h.until(lambda: h.rt.executor.paused, 30)
    status = h.rt.status(h.now_s, ownership=True)
    assert status["simulated"] is True
    assert status["transition"]["phase"] == "switch"
    assert status["executor"]["paused"] is True
    assert status["executor"]["shadow_replicas"] == [A0.plan_id]
    assert status["invariant_violations"] == []
    assert "ownership" in status and _placed_records == []


def test_a_runtime_adopts_its_starting_plan_and_serves_before_any_decision() -> None:
    h = Harness(make_runtime())
    assert h.rt.adopt(make_plan(A0), h.now_s)
    h.until(lambda: h.rt.state.active is None, 30)
    assert h.rt.state.serving_plan_id == make_plan(A0).plan_id
    assert h.phases[0] == (0, P, PhaseStatus.STARTED, 1) and h.phases[-1][1] is TransitionPhase.DONE
    assert h.submit(make_request(1)).admitted
    assert not h.rt.adopt(make_plan(B0), h.now_s)  # something serves: no second adoption
    h.decide(1, make_plan(B0))  # the stream's first decision is newer than transition 0
    h.until(lambda: h.rt.state.active is None, 60)
    assert h.rt.state.serving_plan_id == make_plan(B0).plan_id
    assert validate_log(h.outputs.records) == []


def test_sequences_still_prefilling_at_the_freeze_are_handed_over_not_drained() -> None:
    # Long prompts keep arriving through the canary: at the freeze one is still prefilling on
    # the old replica, and it starts decoding while the others' KV moves. It is handed over
    # before the swap, so the old replica drains at once instead of after its whole output
    # (the drain timeout here).
    h = Harness(make_runtime())
    _placed(h, make_plan(A0))
    admitted = _load(h, 6)
    h.decide(2, make_plan(A1), make_plan(A0).plan_id)
    h.until(lambda: any(r.transition_seq == 2 and r.phase is S for r in h.outputs.records), 60)
    for i in range(10):  # through the canary (0.5 s)
        admitted |= _load(h, 1, prompt=2000, prefix=f"late{i}-")
        h.advance(0.05)
    h.until(lambda: h.rt.state.active is None, 60)
    assert "left to finish on old 0" in _switch_record(h, 2).detail
    cleanup = next(
        r
        for r in h.outputs.records
        if r.transition_seq == 2 and r.phase is C and r.status is PhaseStatus.COMPLETED
    )
    assert cleanup.duration_ms is not None and cleanup.duration_ms < 1000, cleanup.duration_ms
    _finish_all(h, admitted)
    assert validate_log(h.outputs.records) == []


def test_long_sequences_the_new_plan_has_no_room_for_are_replayed_not_drained() -> None:
    # The new replica (48 GB) cannot take every long sequence's KV when the switch stages
    # them: those left over are replayed at its queue front at the swap, so the old replica
    # drains at once instead of after their whole outputs (the drain timeout here).
    h = Harness(make_runtime())
    _placed(h, make_plan(A0))
    admitted = _load(h, 60, prompt=1500, output=3000)
    h.advance(1.0)
    small = make_replica(["C0"], gpu_class="l40s")
    h.decide(2, make_plan(small), make_plan(A0).plan_id)
    h.until(lambda: h.rt.state.active is None, 60)
    switch = _switch_record(h, 2)
    replayed = int(switch.detail.split("replayed ")[1].split(",")[0])
    assert replayed > 0 and switch.detail.endswith("left to finish on old 0"), switch.detail
    cleanup = next(
        r
        for r in h.outputs.records
        if r.transition_seq == 2 and r.phase is C and r.status is PhaseStatus.COMPLETED
    )
    assert cleanup.duration_ms is not None and cleanup.duration_ms < 1000, cleanup.duration_ms
    _finish_all(h, admitted, limit_s=3600)
    assert validate_log(h.outputs.records) == []


def test_a_sequence_that_ends_before_its_hand_over_starts_is_skipped() -> None:
    # A switch plans its hand-overs once (longest first) and starts one per poll here; answers
    # shorter than the client's cap (the simulated stop) end meanwhile: skipped, not staged.
    executor = replace(FAST_EXECUTOR, max_handovers_per_poll=1)
    h = Harness(make_runtime(settings=RuntimeSettings(policy=FAST_POLICY, executor=executor)))
    _placed(h, make_plan(A0))
    admitted = set()
    for i in range(24):
        stop = 300 if i >= 20 else 1200  # the last four admitted are last in the queue too
        request = Request(f"r{i}", 800, 4000, h.now_s, sim_output_tokens=stop)
        if h.submit(request).admitted:
            admitted.add(request.request_id)
    h.decide(2, make_plan(A1), make_plan(A0).plan_id)
    h.until(lambda: h.rt.state.active is not None and h.rt.state.active.phase is S, 60)
    running = h.rt.core.running_progress(A0.plan_id)
    assert {p.seq_id for p in running} >= {"r20", "r23"}, "the short ones ended before the switch"
    h.until(lambda: h.rt.state.active is None, 60)
    switch = _switch_record(h, 2)
    assert h.rt.state.serving_plan_id == make_plan(A1).plan_id, switch.detail
    assert switch.detail.endswith("left to finish on old 4"), switch.detail  # the short ones
    _finish_all(h, admitted)


@pytest.mark.parametrize(
    ("reason", "canary"),
    [
        (DecisionReason.SWITCH_GAIN, True),
        (DecisionReason.PINNED, True),
        (DecisionReason.FORCED_INFEASIBLE, False),
        (DecisionReason.EMERGENCY_DOWNSHIFT, False),
    ],
)
def test_only_an_urgent_switch_skips_the_canary(reason: DecisionReason, canary: bool) -> None:
    slow_canary = replace(FAST_EXECUTOR, canary_s=20.0)
    h = Harness(make_runtime(settings=RuntimeSettings(policy=FAST_POLICY, executor=slow_canary)))
    on_a0 = make_plan(A0)
    _placed(h, on_a0)
    admitted = _load(h, 4, prompt=200, output=400)
    h.deliver(make_decision(2, make_plan(A1), from_plan_id=on_a0.plan_id, reason=reason))
    h.until(lambda: h.rt.state.active is None, 120)
    switch = _switch_record(h, 2)
    assert switch.duration_ms is not None
    assert (switch.duration_ms >= 20_000) is canary, switch.duration_ms
    assert h.rt.state.serving_plan_id == make_plan(A1).plan_id
    _finish_all(h, admitted)
    assert validate_log(h.outputs.records) == []
