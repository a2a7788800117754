"""Golden trace: recorded telemetry → the live decision core, offline → the pinned decisions.

The replay folds and decides through the very functions the live decider calls
(:func:`streams.step.make_input`, :func:`streams.step.step`); ``test_e2e`` checks that a live
run's recorded decisions are reached again by this replay. Regenerate the golden file after an
intended change with ``FLEXPIPE_UPDATE_GOLDEN=1``.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import replace
from typing import Any

import pytest

from flexpipe import envelope
from flexpipe.envelope import Envelope
from flexpipe.schemas import ClusterEvent, ClusterEventType
from gearbox.decisions import DecisionReason, Trigger
from sim.catalog import with_scenario
from sim.scenario import SEED_FRAGMENTED, load_scenario
from streams.deployments import resolve_deployments
from streams.replay import Replayer, compare, run_free
from streams.step import LoggedDecision, StepOutput, TriggerInfo, tick_due_ms
from tests.streams.builders import streams_config
from tests.streams.golden.record import DECISIONS, TRACE

pytestmark = pytest.mark.unit

CFG = with_scenario(streams_config(deployments=()), load_scenario(SEED_FRAGMENTED))
CATALOG, DEPLOYMENTS = resolve_deployments(CFG)


def trace() -> list[Envelope[Any]]:
    with gzip.open(TRACE, "rb") as f:
        return [envelope.decode(line) for line in f if line.strip()]


def summary(out: StepOutput) -> dict[str, Any]:
    d = out.decision
    return {
        "decision_id": d.decision_id,
        "trigger": d.trigger,
        "trigger_time_ms": out.event_time_ms,
        "reason": d.reason,
        "forced": d.forced,
        "from_plan_id": d.from_plan_id,
        "to_plan_id": d.to_plan_id,
    }


def test_golden_trace_decisions_are_pinned() -> None:
    got = [summary(o) for o in run_free(Replayer(CFG, CATALOG, DEPLOYMENTS), trace())]
    if os.environ.get("FLEXPIPE_UPDATE_GOLDEN"):
        DECISIONS.write_text(json.dumps(got, indent=1) + "\n")
    assert got == json.loads(DECISIONS.read_text())
    forced = [d for d in got if d["reason"] == DecisionReason.FORCED_INFEASIBLE.value]
    assert forced and forced[0]["trigger"] == "topology_change"


def test_replay_reaches_recorded_decisions_and_names_a_difference() -> None:
    outs = run_free(Replayer(CFG, CATALOG, DEPLOYMENTS), trace())
    recorded = [LoggedDecision(o.event_time_ms, o.decision) for o in outs]
    report = compare(Replayer(CFG, CATALOG, DEPLOYMENTS), trace(), recorded)
    assert report.same and report.compared == len(outs)
    tampered = list(recorded)
    first = tampered[0].payload
    tampered[0] = replace(tampered[0], payload=replace(first, reason=DecisionReason.PINNED))
    report = compare(Replayer(CFG, CATALOG, DEPLOYMENTS), trace(), tampered)
    assert report.matched == len(outs) - 1
    (mismatch,) = report.mismatches
    assert mismatch.decision_id == first.decision_id and mismatch.same_inputs


def test_decide_all_is_each_deployments_step_in_the_round_order() -> None:
    """The live decider's order (streams.step.decision_order): configured order while no plan
    is disturbed; a deployment that lost a GPU of its plan first."""
    one, each = Replayer(CFG, CATALOG, DEPLOYMENTS), Replayer(CFG, CATALOG, DEPLOYMENTS)
    for env in trace():
        one.fold(env)
        each.fold(env)
    now_ms = one.clock_ms + 1
    trigger = TriggerInfo(Trigger.TIMER, tick_due_ms(now_ms, CFG.intervals.decision_s), "tick")
    together = one.decide_all(trigger, now_ms)
    apart = [each.decide(d.name, trigger, now_ms) for d in DEPLOYMENTS]
    assert [o.decision.deployment for o in together] == [d.name for d in DEPLOYMENTS]
    assert [(summary(o), o.digest) for o in together] == [
        (summary(o), o.digest) for o in apart if o is not None
    ]
    assert one.decide_all(trigger, now_ms) == []  # the same trigger is never decided twice
    last = DEPLOYMENTS[-1].name
    plan = one.tables[last].plan.current
    assert plan is not None
    lost = sorted(plan.gpu_uuids)[0]
    preempt = ClusterEvent(ClusterEventType.PREEMPT, one.published[lost].node, (lost,))
    for replayer in (one, each):
        assert replayer.fold(envelope.make(preempt, event_time_ms=now_ms, source="s", seq=1))
    changed = TriggerInfo(Trigger.TOPOLOGY_CHANGE, now_ms, "preempt")
    together = one.decide_all(changed, now_ms)
    order = [last, *(d.name for d in DEPLOYMENTS if d.name != last)]
    apart = [each.decide(name, changed, now_ms) for name in order]
    assert [o.decision.deployment for o in together] == order
    assert together[0].decision.forced
    assert [(summary(o), o.digest) for o in together] == [
        (summary(o), o.digest) for o in apart if o is not None
    ]
