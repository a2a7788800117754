"""Unit: `flexpipe up`'s own checks, on hand-built run records with injected violations.

The healthy run: chat serves TP8 on A0–A7 from 00:00:20; a preemption takes A4–A7 at 00:08:00,
the stream answers with a forced decision read at 00:08:01, and TP4 on A0–A3 is done at
00:08:13. Each test breaks one thing and expects exactly that invariant to be named.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from flexpipe.schemas import GearTransition, PhaseStatus, TransitionPhase
from gearbox.plans import DeploymentPlan
from sim.invariants import count_flaps, evaluate, measured_from, unserved_s
from sim.summary import (
    DecisionFact,
    DeploymentFacts,
    EventFact,
    Invariant,
    Outage,
    RunFacts,
    SequenceFacts,
    Summary,
)
from tests.runtime.builders import make_plan, make_replica

pytestmark = pytest.mark.unit

DEP = "chat"
TP8 = make_plan(make_replica([f"A{i}" for i in range(8)]), deployment=DEP)
TP4 = make_plan(make_replica([f"A{i}" for i in range(4)]), deployment=DEP)
LOST = tuple(f"A{i}" for i in range(4, 8))
PREEMPT = EventFact(480.0, "preempt", "node-a1", LOST)


def shift(
    seq: int,
    plan: DeploymentPlan,
    start_s: float,
    end_s: float,
    outcome: TransitionPhase = TransitionPhase.DONE,
    from_plan: DeploymentPlan | None = None,
) -> list[tuple[float, GearTransition]]:
    """A transition's records: prepare started, then its terminal record."""

    def rec(phase: TransitionPhase, status: PhaseStatus) -> GearTransition:
        return GearTransition(
            deployment=DEP,
            transition_seq=seq,
            decision_id=f"{DEP}:{seq}",
            phase=phase,
            status=status,
            from_plan_id=from_plan.plan_id if from_plan else None,
            to_plan_id=plan.plan_id,
            plan=plan,
        )

    return [
        (start_s, rec(TransitionPhase.PREPARE, PhaseStatus.STARTED)),
        (end_s, rec(outcome, PhaseStatus.COMPLETED)),
    ]


def decision(
    seq: int,
    t_s: float,
    seen_s: float,
    to: DeploymentPlan | None,
    reason: str = "forced_infeasible",
    frm: DeploymentPlan = TP8,
) -> DecisionFact:
    return DecisionFact(
        decision_id=f"{DEP}:{seq}",
        deployment=DEP,
        t_s=t_s,
        seen_s=seen_s,
        forced=reason == "forced_infeasible",
        reason=reason,
        from_plan_id=frm.plan_id,
        to_plan_id=to.plan_id if to is not None else None,
    )


def make_run(**changes: object) -> RunFacts:
    """The healthy run of the module docstring, with ``changes`` applied."""
    facts = RunFacts(
        deployments=(
            DeploymentFacts(
                DEP,
                served=900,
                rejected={"no_serving_plan": 12},
                unserved_s=13.0,
                sequences=SequenceFacts(admitted=920, completed=900, in_flight=20),
            ),
        ),
        decisions=(
            decision(10, 300.0, 300.2, None, reason="no_better_candidate"),
            decision(32, 480.0, 481.0, TP4),
            decision(33, 495.0, 495.1, None, reason="cooldown", frm=TP4),
        ),
        transitions=(*shift(0, TP8, 1.0, 20.0), *shift(32, TP4, 481.5, 493.0, from_plan=TP8)),
        events=(EventFact(0.0, "node_up", "node-a1"), PREEMPT),
        end_s=600.0,
        gpu_nodes={f"A{i}": "node-a1" for i in range(8)},
    )
    return replace(facts, **changes)  # type: ignore[arg-type]


def broken(summary: Summary) -> set[str]:
    return {str(c.invariant) for c in summary.broken()}


def test_a_healthy_run_holds_every_invariant_with_its_figures() -> None:
    summary = evaluate(make_run())
    assert summary.invariants_ok, summary.broken_line()
    (event,) = summary.events
    assert event.deployment == DEP and event.plan_id == TP8.plan_id and event.lost_gpus == 4
    assert event.answered_after_s == pytest.approx(1.0)
    assert event.serving_again_after_s == pytest.approx(13.0)
    assert event.decision_id == "chat:32" and event.serving_plan_id == TP4.plan_id
    assert event.enough_gpus and event.judged
    dep = summary.deployments[DEP]
    assert (dep.shifts, dep.rolled_back, dep.flaps_10min) == (1, 0, 0)
    assert dep.rejected == {"no_serving_plan": 12} and dep.unserved_s == 13.0
    assert summary.broken_line() == ""
    assert summary.lines()[0] == "== invariants: 8 of 8 held (all held)"


def test_a_late_answer_is_named_with_its_event() -> None:
    late = decision(32, 480.0, 530.0, TP4)
    summary = evaluate(make_run(decisions=(late,)))
    assert broken(summary) == {Invariant.INFEASIBLE_ANSWERED}
    line = summary.broken_line()
    assert line.startswith("invariant broken: infeasible_answered: chat: preempt on node-a1")
    assert "at 00:08:00 answered after 50.0 s (limit 40 s)" in line


def test_a_deployment_never_served_again_after_a_rollback() -> None:
    # The bug this guards: the forced shift rolled back and nothing re-planned chat after it.
    rolled = shift(32, TP4, 481.5, 495.0, TransitionPhase.ROLLED_BACK, from_plan=TP8)
    summary = evaluate(make_run(transitions=(*shift(0, TP8, 1.0, 20.0), *rolled)))
    assert broken(summary) == {Invariant.SERVING_AGAIN}
    assert "serving again never (limit 90 s)" in summary.broken_line()
    assert summary.deployments[DEP].rolled_back == 1


def test_no_feasible_plan_answers_without_requiring_service() -> None:
    none_fits = decision(32, 480.0, 482.0, None, reason="no_feasible_plan")
    summary = evaluate(make_run(decisions=(none_fits,), transitions=tuple(shift(0, TP8, 1, 20))))
    assert summary.invariants_ok, summary.broken_line()
    (event,) = summary.events
    assert not event.enough_gpus and event.serving_again_after_s is None
    assert "1 without enough GPUs" in summary.checks[1].detail
    assert summary.to_dict()["events"][0]["enough_gpus"] is False


def test_no_feasible_plan_then_a_plan_that_never_serves_is_not_excused() -> None:
    # After an outage the stream first saw no plan (a stale view), then found one that rolled
    # back: GPUs existed, so serving again was required.
    none_fits = decision(32, 480.0, 482.0, None, reason="no_feasible_plan")
    forced = decision(33, 500.0, 500.5, TP4)
    rolled = shift(33, TP4, 501.0, 515.0, TransitionPhase.ROLLED_BACK, from_plan=TP8)
    run = make_run(decisions=(none_fits, forced), transitions=(*shift(0, TP8, 1, 20), *rolled))
    summary = evaluate(run)
    assert broken(summary) == {Invariant.SERVING_AGAIN}
    (event,) = summary.events
    assert event.enough_gpus and event.answer_reason == "forced_infeasible"
    assert event.answered_after_s == pytest.approx(20.5)
    # Found only after the limit: the stale "no plan" does not count as the answer.
    late = replace(forced, decision_id="chat:34", seen_s=560.0)
    summary = evaluate(replace(run, decisions=(none_fits, late)))
    assert Invariant.INFEASIBLE_ANSWERED in broken(summary)


def test_a_shift_decided_before_the_event_that_clears_the_lost_gpus_needs_no_answer() -> None:
    moving = decision(31, 470.0, 471.0, TP4, reason="switch_gain")
    run = make_run(
        decisions=(moving,),
        transitions=(*shift(0, TP8, 1.0, 20.0), *shift(31, TP4, 471.5, 484.0, from_plan=TP8)),
    )
    summary = evaluate(run)
    assert summary.invariants_ok, summary.broken_line()
    assert summary.events[0].answer_reason == "shift_under_way"
    assert summary.events[0].serving_again_after_s == pytest.approx(4.0)


def test_a_decision_id_twice_is_counted_and_named() -> None:
    run = make_run()
    summary = evaluate(replace(run, decisions=(*run.decisions, run.decisions[1])))
    assert broken(summary) == {Invariant.UNIQUE_DECISION_IDS}
    assert summary.duplicate_decisions == 1 and "chat:32 ×2" in summary.broken_line()


def test_a_decision_for_the_plan_already_serving_is_named() -> None:
    again = decision(40, 540.0, 540.1, TP4, reason="switch_gain", frm=TP8)
    run = make_run()
    summary = evaluate(replace(run, decisions=(*run.decisions, again)))
    assert broken(summary) == {Invariant.NO_DECISION_TARGETS_SERVING}
    assert f"chat:40 at 00:09:00 targets {TP4.plan_id}, serving since 00:08:13" in (
        summary.broken_line()
    )


@pytest.mark.parametrize(("failed", "source"), [(3, "metric"), (None, "none")])
def test_failed_ticks_break_the_run(failed: int | None, source: str) -> None:
    summary = evaluate(make_run(failed_ticks=failed, failed_ticks_source=source))
    assert broken(summary) == {Invariant.NO_FAILED_TICKS}
    assert summary.to_dict()["run"]["failed_ticks"] == failed


def test_a_transition_left_unfinished_is_named() -> None:
    started = shift(40, TP8, 590.0, 0.0, from_plan=TP4)[:1]
    run = make_run()
    summary = evaluate(replace(run, transitions=(*run.transitions, *started)))
    assert broken(summary) == {Invariant.TRANSITIONS_FINISHED}
    assert "chat #40 prepare started" in summary.broken_line()
    busy = evaluate(make_run(active_at_exit=(DEP,)))
    assert broken(busy) == {Invariant.TRANSITIONS_FINISHED}


def test_lost_or_doubly_owned_sequences_break_the_run() -> None:
    run = make_run()
    seqs = SequenceFacts(admitted=920, completed=890, in_flight=20, lost=10, owned_twice=1)
    dep = replace(run.deployments[0], sequences=seqs)
    summary = evaluate(replace(run, deployments=(dep,)))
    assert broken(summary) == {Invariant.SEQUENCES_ACCOUNTED}
    assert "chat: 10 lost, 1 owned twice" in summary.broken_line()


def test_answers_are_measured_from_the_recovery_of_a_planned_outage() -> None:
    worker_down = Outage("stream_worker_killed", 470.0, 700.0)
    answer = decision(32, 480.0, 705.0, TP4)
    run = make_run(
        decisions=(answer,),
        transitions=(*shift(0, TP8, 1.0, 20.0), *shift(32, TP4, 706.0, 720.0, from_plan=TP8)),
        outages=(worker_down,),
        end_s=900.0,
    )
    summary = evaluate(run)
    assert summary.invariants_ok, summary.broken_line()
    (event,) = summary.events
    assert event.measured_from_s == 700.0
    assert event.answered_after_s == pytest.approx(5.0)
    assert event.serving_again_after_s == pytest.approx(20.0)
    # Without the outage the same run is late.
    assert broken(evaluate(replace(run, outages=()))) == {
        Invariant.INFEASIBLE_ANSWERED,
        Invariant.SERVING_AGAIN,
    }


def test_an_outage_after_the_answer_restarts_only_the_serving_clock() -> None:
    broker_down = Outage("broker_stopped", 482.0, 650.0)
    assert measured_from(480.0, [broker_down], 481.0) == 480.0  # answered before it began
    assert measured_from(480.0, [broker_down], 660.0) == 650.0
    assert measured_from(480.0, [broker_down], 600.0) == 480.0  # done during it: no restart
    assert measured_from(480.0, [broker_down], None) == 650.0


def test_only_events_that_hit_a_serving_plan_count() -> None:
    unused = EventFact(480.0, "preempt", "node-c1", ("C0",))
    benign_xid = EventFact(480.0, "xid", "node-a1", ("A0",), xid=13)
    fatal_xid = EventFact(480.0, "xid", "node-a1", ("A0",), xid=79)
    node_down = EventFact(480.0, "node_down", "node-a1")
    for event, hits in ((unused, 0), (benign_xid, 0), (fatal_xid, 1), (node_down, 1)):
        summary = evaluate(make_run(events=(event,)))
        assert len(summary.events) == hits, event


def test_an_event_the_run_ended_too_soon_to_judge_is_not_a_failure() -> None:
    late_event = replace(PREEMPT, t_s=590.0)
    run = make_run(events=(late_event,), decisions=(), transitions=tuple(shift(0, TP8, 1, 20)))
    summary = evaluate(run)
    assert summary.invariants_ok, summary.broken_line()
    assert summary.events[0].judged is False


def test_summary_json_carries_the_figures_behind_each_invariant() -> None:
    data = json.loads(json.dumps(evaluate(make_run()).to_dict()))
    assert data["invariants_ok"] is True and data["broken"] == []
    assert set(data["invariants"]) == {str(i) for i in Invariant}
    assert {"failed_ticks", "duplicate_decisions", "invariants_ok"} <= set(data["run"])
    event = data["events"][0]
    assert {"answered_after_s", "serving_again_after_s", "enough_gpus"} <= set(event)
    dep = data["deployments"][DEP]
    assert {"unserved_s", "served", "rejected", "shifts", "flaps_10min"} <= set(dep)
    assert dep["sequences"]["lost"] == 0


def test_unserved_time_and_flaps() -> None:
    samples = [(0.0, True), (100.0, False), (130.0, True), (500.0, False)]
    assert unserved_s(samples, start_s=50.0, end_s=520.0) == pytest.approx(50.0)
    shifts = [(100.0, "p1", "p2"), (300.0, "p2", "p1"), (1000.0, "p1", "p2"), (1900.0, "p2", "p1")]
    assert count_flaps(shifts, window_s=600.0) == 1


def test_a_record_the_stream_refused_breaks_the_run_and_is_named() -> None:
    refused = {"flexpipe.gear.transitions key_mismatch": 28}
    summary = evaluate(make_run(dead_letters=refused))
    assert broken(summary) == {Invariant.NOTHING_DEAD_LETTERED}
    assert "28 flexpipe.gear.transitions key_mismatch" in summary.broken_line()
