"""Unit: the transition state machine — phases, persistence order, fencing, retries, recovery."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpipe.schemas import GearTransition, PhaseStatus, TransitionPhase
from runtime.transition import (
    AbortPhase,
    DecisionIn,
    Effect,
    Event,
    MachineState,
    Outcome,
    Persist,
    Persisted,
    PhaseDone,
    PhaseFailed,
    Resolved,
    RollBack,
    RunPhase,
    Tick,
    TransitionPolicy,
    adopt,
    handle,
    recover,
)
from tests.runtime.builders import DEPLOYMENT, make_plan, make_replica
from tests.runtime.logcheck import validate_log

pytestmark = pytest.mark.unit

P, S, C = TransitionPhase.PREPARE, TransitionPhase.SWITCH, TransitionPhase.CLEANUP
DONE, RB = TransitionPhase.DONE, TransitionPhase.ROLLED_BACK
STARTED, COMPLETED, FAILED = PhaseStatus.STARTED, PhaseStatus.COMPLETED, PhaseStatus.FAILED
POLICY = TransitionPolicy(retry_backoff_s=1.0, prepare_timeout_s=10.0)
PLAN_A = make_plan(make_replica(["A0"]))
PLAN_B = make_plan(make_replica(["B0"], domain="B"))
PLAN_C = make_plan(make_replica(["C0"], domain="C"))


class Machine:
    """Feeds events, persists records at once, and records what happened."""

    def __init__(self, state: MachineState | None = None) -> None:
        self.state = state or MachineState(DEPLOYMENT)
        self.records: list[GearTransition] = []
        self.effects: list[Effect] = []
        self.now = 0.0

    def feed(self, event: Event) -> list[Effect]:
        self.state, effects = handle(self.state, event, POLICY)
        out = list(effects)
        for effect in effects:
            self.effects.append(effect)
            if isinstance(effect, Persist):
                self.records.append(effect.record)
                out += self.feed(Persisted(effect.record, self.now))
        return out

    def decide(self, seq: int, plan: object) -> list[Effect]:
        return self.feed(DecisionIn(seq, f"d{seq}", plan, self.now, ref=seq))  # type: ignore[arg-type]

    def running(self) -> RunPhase:
        runs = [e for e in self.effects if isinstance(e, RunPhase)]
        return runs[-1]

    def complete(self) -> list[Effect]:
        run = self.running()
        return self.feed(PhaseDone(run.seq, run.phase, run.attempt, self.now))

    def fail(self, detail: str = "boom") -> list[Effect]:
        run = self.running()
        return self.feed(PhaseFailed(run.seq, run.phase, run.attempt, self.now, detail))

    def tick(self, dt: float) -> list[Effect]:
        self.now += dt
        return self.feed(Tick(self.now))

    @property
    def phases(self) -> list[tuple[int, str, str, int]]:
        return [(r.transition_seq, r.phase, r.status, r.attempt) for r in self.records]


def _run_to_done(m: Machine, seq: int, plan: object) -> None:
    m.decide(seq, plan)
    for _ in range(3):
        m.complete()


def test_phases_run_in_order_each_persisted_before_the_next_starts() -> None:
    m = Machine()
    effects = m.decide(1, PLAN_A)
    # The STARTED record is written before the phase is asked to run.
    kinds = [type(e).__name__ for e in effects]
    assert kinds.index("Persist") < kinds.index("RunPhase")
    for _ in range(3):
        m.complete()
    assert m.phases == [
        (1, P, STARTED, 1),
        (1, P, COMPLETED, 1),
        (1, S, STARTED, 1),
        (1, S, COMPLETED, 1),
        (1, C, STARTED, 1),
        (1, C, COMPLETED, 1),
        (1, DONE, COMPLETED, 1),
    ]
    assert m.state.serving_plan_id == PLAN_A.plan_id and m.state.active is None
    assert validate_log(m.records) == []
    assert Resolved(1, 1, Outcome.DONE) in m.effects


def test_no_phase_starts_until_the_log_acknowledges() -> None:
    state, effects = handle(MachineState(DEPLOYMENT), DecisionIn(1, "d1", PLAN_A, 0.0), POLICY)
    assert not any(isinstance(e, RunPhase) for e in effects)
    state, effects = handle(state, Tick(100.0), POLICY)  # no ack: nothing moves, no timeout
    assert effects == ()


def test_fencing_ignores_decisions_not_newer_than_the_last() -> None:
    m = Machine()
    _run_to_done(m, 5, PLAN_A)
    assert Resolved(4, 4, Outcome.IGNORED_STALE) in m.decide(4, PLAN_B)
    assert Resolved(5, 5, Outcome.IGNORED_STALE) in m.decide(5, PLAN_B)
    assert Resolved(6, 6, Outcome.IGNORED_NO_CHANGE) in m.decide(6, PLAN_A)
    assert m.state.active is None and m.state.last_seq == 6


def test_a_newer_decision_waits_and_supersedes_an_older_waiting_one() -> None:
    m = Machine()
    m.decide(1, PLAN_A)
    assert Resolved(2, 2, Outcome.QUEUED) in m.decide(2, PLAN_B)
    effects = m.decide(3, PLAN_C)
    assert Resolved(2, 2, Outcome.SUPERSEDED) in effects
    assert Resolved(2, 2, Outcome.IGNORED_STALE) in m.decide(2, PLAN_B)
    for _ in range(3):
        m.complete()
    assert m.state.active is not None and m.state.active.seq == 3  # started right after seq 1
    for _ in range(3):
        m.complete()
    assert m.state.serving_plan_id == PLAN_C.plan_id
    assert [s for s, *_ in m.phases if _[0] == DONE] == [1, 3]
    assert validate_log(m.records) == []


def test_a_failed_phase_is_compensated_retried_twice_then_rolled_back() -> None:
    m = Machine()
    _run_to_done(m, 1, PLAN_A)
    m.decide(2, PLAN_B)
    m.complete()  # prepare
    for attempt in (1, 2, 3):
        effects = m.fail("gpus preempted")
        assert AbortPhase(2, S, attempt) in effects or any(isinstance(e, RollBack) for e in effects)
        m.tick(POLICY.retry_backoff_s)
    switch = [p for p in m.phases if p[0] == 2 and p[1] == S]
    assert switch == [
        (2, S, STARTED, 1),
        (2, S, FAILED, 1),
        (2, S, STARTED, 2),
        (2, S, FAILED, 2),
        (2, S, STARTED, 3),
        (2, S, FAILED, 3),
    ]
    assert m.phases[-1] == (2, RB, COMPLETED, 3)
    rollback = next(e for e in m.effects if isinstance(e, RollBack))
    assert rollback.from_plan == PLAN_A and rollback.to_plan == PLAN_B
    assert m.state.serving_plan_id == PLAN_A.plan_id and m.state.active is None
    assert validate_log(m.records) == []


def test_a_phase_past_its_timeout_fails() -> None:
    m = Machine()
    m.decide(1, PLAN_A)
    m.tick(POLICY.prepare_timeout_s + 0.1)
    assert m.phases[-1] == (1, P, FAILED, 1)
    assert "timed out" in m.records[-1].detail


def test_cleanup_is_forced_after_its_retries_never_rolled_back() -> None:
    m = Machine()
    m.decide(1, PLAN_A)
    m.complete()
    m.complete()
    for _ in range(3):
        m.fail("drain stuck")
        m.tick(POLICY.retry_backoff_s)
    assert m.running().force and m.running().phase is C
    m.complete()
    assert m.phases[-1][1] is DONE
    assert not any(isinstance(e, RollBack) for e in m.effects)
    assert validate_log(m.records) == []


def test_the_starting_plan_is_adopted_as_transition_0_and_decisions_stay_newer() -> None:
    m = Machine()
    m.state, effects = adopt(m.state, PLAN_A, "dep:start", m.now)
    for effect in effects:  # the same persisted three phases as any decision's
        if isinstance(effect, Persist):
            m.records.append(effect.record)
            m.feed(Persisted(effect.record, m.now))
    for _ in range(3):
        m.complete()
    assert [p for p in m.phases if p[1] is DONE] == [(0, DONE, COMPLETED, 1)]
    assert m.records[0].decision_id == "dep:start" and m.records[0].from_plan_id is None
    assert m.state.serving_plan_id == PLAN_A.plan_id and m.state.last_seq == 0
    assert Resolved(1, 1, Outcome.STARTED) in m.decide(1, PLAN_B)  # the stream's first decision
    assert validate_log(m.records, require_terminal=False) == []


def test_adoption_is_a_no_op_once_a_plan_serves_or_a_decision_was_accepted() -> None:
    m = Machine()
    _run_to_done(m, 1, PLAN_A)
    assert adopt(m.state, PLAN_B, "dep:start", m.now) == (m.state, ())
    fresh = Machine()
    fresh.decide(1, PLAN_A)  # in flight, nothing serving yet
    assert adopt(fresh.state, PLAN_B, "dep:start", fresh.now) == (fresh.state, ())


def test_an_adopted_plan_survives_a_restart_and_is_not_adopted_again() -> None:
    m = Machine()
    m.state, effects = adopt(m.state, PLAN_A, "dep:start", m.now)
    for effect in effects:
        if isinstance(effect, Persist):
            m.records.append(effect.record)
            m.feed(Persisted(effect.record, m.now))
    for _ in range(3):
        m.complete()
    state, effects = recover(DEPLOYMENT, m.records, 10.0)
    assert state.serving_plan_id == PLAN_A.plan_id and effects == ()
    assert adopt(state, PLAN_B, "dep:start", 10.0) == (state, ())


def _log_until(stop: tuple[TransitionPhase, PhaseStatus]) -> list[GearTransition]:
    """Records of seq 1 (done, plan A) and seq 2 (to plan B) up to and including ``stop``."""
    m = Machine()
    _run_to_done(m, 1, PLAN_A)
    _run_to_done(m, 2, PLAN_B)
    cut = next(
        i for i, r in enumerate(m.records) if r.transition_seq == 2 and (r.phase, r.status) == stop
    )
    return m.records[: cut + 1]


@pytest.mark.parametrize(
    ("stop", "serving", "resumes"),
    [
        ((P, STARTED), PLAN_A, False),
        ((P, COMPLETED), PLAN_A, False),
        ((S, STARTED), PLAN_A, False),
        ((S, COMPLETED), PLAN_B, True),
        ((C, STARTED), PLAN_B, True),
        ((C, COMPLETED), PLAN_B, True),
    ],
)
def test_recovery_rolls_back_before_the_swap_and_resumes_after_it(
    stop: tuple[TransitionPhase, PhaseStatus], serving: object, resumes: bool
) -> None:
    records = _log_until(stop)
    state, effects = recover(DEPLOYMENT, records, now_s=0.0)
    m = Machine(state)
    for effect in effects:
        if isinstance(effect, Persist):
            m.records.append(effect.record)
            m.feed(Persisted(effect.record, 0.0))
        m.effects.append(effect)
    if any(isinstance(e, RunPhase) for e in m.effects):
        m.complete()
    assert m.state.serving == serving and m.state.active is None and m.state.last_seq == 2
    assert any(isinstance(e, RollBack) for e in effects) != resumes
    full = records + m.records
    assert validate_log(full) == []
    assert full[-1].phase is (DONE if resumes else RB)


def test_recovery_uses_only_the_last_record_per_sequence_like_compaction() -> None:
    records = _log_until((S, STARTED))
    compacted = list({r.transition_seq: r for r in records}.values())
    assert recover(DEPLOYMENT, compacted, 0.0)[0].serving == PLAN_A
    assert recover(DEPLOYMENT, [], 0.0)[0] == MachineState(DEPLOYMENT)


def test_validate_log_names_what_is_out_of_order() -> None:
    records = _log_until((S, COMPLETED))
    swapped = [*records[:-2], records[-1], records[-2]]
    assert any("may not follow" in p for p in validate_log(swapped))
    assert any("not terminal" in p for p in validate_log(records))
    assert validate_log(records, require_terminal=False) == []
    rolled_after_swap = [*records, replace(records[-1], phase=RB, status=COMPLETED)]
    assert any("may not follow" in p for p in validate_log(rolled_after_swap))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(["done", "fail", "tick", "decide"]), max_size=60))
def test_any_interleaving_keeps_the_log_valid(script: list[str]) -> None:
    m = Machine()
    seq = 0
    plans = [PLAN_A, PLAN_B, PLAN_C]
    for step in script:
        active = m.state.active
        if step == "decide":
            seq += 1
            m.decide(seq, plans[seq % 3])
        elif step == "tick":
            m.tick(0.6)
        elif active is not None and active.phase in (P, S, C) and active.wait == "running":
            (m.complete if step == "done" else m.fail)()
    for _ in range(200):  # let everything finish
        if m.state.active is None:
            break
        active = m.state.active
        if active.wait == "running":
            m.complete()
        else:
            m.tick(1.0)
    assert m.state.active is None
    assert validate_log(m.records) == []
    done = [r for r in m.records if r.phase is DONE]
    if done:
        last = max(r.transition_seq for r in m.records if r.phase in (DONE, RB))
        final = next(r for r in reversed(m.records) if r.transition_seq == last)
        serving = final.to_plan_id if final.phase is DONE else m.state.serving_plan_id
        assert m.state.serving_plan_id == serving
