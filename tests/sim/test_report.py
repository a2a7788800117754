"""Unit: `flexpipe up`'s bookkeeping — the live view's filtering, shift stories, the figure."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from flexpipe import envelope
from flexpipe.config import load_config
from flexpipe.schemas import GearDecision, GearTransition, PhaseStatus, TransitionPhase
from gearbox.decisions import DecisionReason, Trigger
from sim.fleet import SimFleet
from sim.live import Timeline
from sim.record import ClusterMark, Served, plan_shape
from sim.report import (
    handover_text,
    room_waits,
    short_explanation,
    summary_lines,
    write_report,
)
from sim.scenario import SEED_FRAGMENTED, load_scenario
from tests.runtime.builders import gearbox_decision, make_context, make_plan, make_replica

pytestmark = pytest.mark.unit

EPOCH_MS = 1_736_150_400_000
PLAN = make_plan(make_replica(["A0", "A1"]), make_replica(["A2", "A3"]))
EXPLANATION = (
    "chat: forced_infeasible (trigger topology_change). Current dp-1 on 8 GPUs: 1 tok/s. "
    "Problems: gpu A4 is not live; gpu A5 is not live. Switch to dp-2 on 4 GPUs: 1 tok/s. "
    "Gain 1,000 tok vs cost 10 tok (× hysteresis 1.4 = 14); shift ≈ 1.0 s, KV none."
)


def decision(seq: int, reason: str, to_plan: Any = None, trigger: str = "timer") -> GearDecision:
    return GearDecision(
        deployment="chat",
        decision_id=f"chat:{seq}",
        seq=seq,
        trigger=Trigger(trigger),
        reason=DecisionReason(reason),
        forced=reason == "forced_infeasible",
        from_plan_id="dp-1",
        to_plan_id=to_plan.plan_id if to_plan is not None else None,
        explanation=EXPLANATION,
        context=make_context(float(seq)),
        decision=gearbox_decision(to_plan, now_s=float(seq)) if to_plan is not None else None,
    )


def record(seq: int, phase: TransitionPhase, status: PhaseStatus, took_ms: float | None = None,
           detail: str = "") -> GearTransition:  # fmt: skip
    return GearTransition(
        deployment="chat",
        transition_seq=seq,
        decision_id=f"chat:{seq}",
        phase=phase,
        status=status,
        from_plan_id="dp-1",
        to_plan_id=PLAN.plan_id,
        duration_ms=took_ms,
        detail=detail,
        plan=PLAN,
    )


def raw(payload: Any, t_s: float) -> bytes:
    env = envelope.make(payload, event_time_ms=EPOCH_MS + round(t_s * 1000), source="t", seq=1)
    return envelope.encode(env)


def timeline(now_s: float) -> Timeline:
    scenario = load_scenario(SEED_FRAGMENTED)
    fleet = SimFleet(scenario, seed=7, sample_interval_s=5, launch_interval_s=5, heartbeat_s=15)
    return Timeline(load_config(env={}), EPOCH_MS, fleet, lambda: now_s)


def test_plan_shape_and_short_lines() -> None:
    assert plan_shape(PLAN) == "2×TP2@A (4 GPUs)"
    assert plan_shape(None) == "no plan"
    short = short_explanation(EXPLANATION)
    assert short.startswith("gpu A4 is not live (+1 more); gain 1,000 tok vs cost 10 tok")
    assert handover_text("migrated 3 (2000000000 B), replayed 1, left to finish on old 0") == (
        "KV of 3 sequences migrated (2.0 GB), 1 replayed"
    )
    assert handover_text("migrated 0 (0 B), replayed 0, left to finish on old 0").startswith("no ")


def test_holds_are_counted_not_printed_and_changes_are(capsys: pytest.CaptureFixture[str]) -> None:
    tl = timeline(now_s=480.5)
    for seq in (1, 2, 3):
        tl.on_message(raw(decision(seq, "held_by_hysteresis"), 15.0 * seq))
    tl.on_message(raw(decision(4, "forced_infeasible", PLAN, "topology_change"), 480.0))
    printed = capsys.readouterr().out
    assert "held_by_hysteresis" not in printed
    assert "forced_infeasible [topology_change] → 2×TP2@A (4 GPUs)" in printed
    assert tl.record.holds[("chat", "held_by_hysteresis")] == 3
    assert tl.window_holds["held_by_hysteresis"] == 3 and len(tl.record.changes()) == 1


def test_a_shift_is_told_from_its_cause_to_its_phases(tmp_path: Path) -> None:
    tl = timeline(now_s=481.0)
    tl.record.events.append(ClusterMark(480.0, "preempt", "preempt on node-a1 (4 GPUs)"))
    tl.on_message(raw(decision(4, "forced_infeasible", PLAN, "topology_change"), 480.0))
    P, S, C = TransitionPhase.PREPARE, TransitionPhase.SWITCH, TransitionPhase.CLEANUP
    started, completed = PhaseStatus.STARTED, PhaseStatus.COMPLETED
    handover = "migrated 3 (2000000000 B), replayed 1, left to finish on old 0"
    steps = [(P, started, None, ""), (P, completed, 3000.0, ""), (S, started, None, ""),
             (S, completed, 2000.0, handover),
             (C, started, None, ""), (C, completed, 500.0, ""),
             (TransitionPhase.DONE, completed, 6000.0, "")]  # fmt: skip
    for i, (phase, status, took, detail) in enumerate(steps):
        tl.record.transitions.append((481.0 + i, record(4, phase, status, took, detail)))
    for t in range(400, 700, 10):
        tl.record.served.append(Served("chat", float(t), 0.2, 0.02, 100))
    (shift,) = tl.record.shifts()
    assert shift.outcome == "done" and shift.phases_ms["total"] == 6000.0
    lines = "\n".join(summary_lines(tl.record, ["chat"], 600.0))
    assert (
        "chat #4: 00:08:00 preempt on node-a1 (4 GPUs) → forced_infeasible seen 00:08:01" in lines
    )
    assert "prepare 3.0 s, switch 2.0 s (KV of 3 sequences migrated (2.0 GB), 1 replayed)" in lines
    assert "TTFT p95 200 ms in the 2 min before, 200 ms in the 2 min after" in lines
    md, png = write_report(tl.record, ["chat"], 600.0, tmp_path, "test")
    assert "forced_infeasible" in md.read_text() and png.read_bytes()[:4] == b"\x89PNG"


def test_a_rolled_back_shift_names_the_runtimes_reason() -> None:
    tl = timeline(now_s=481.0)
    tl.on_message(raw(decision(4, "evict_cold", PLAN), 480.0))
    P, failed = TransitionPhase.PREPARE, PhaseStatus.FAILED
    why = "not evicted: 1 requests active or queued, 0 held for it"
    recs = [record(4, P, PhaseStatus.STARTED), record(4, P, failed, 0.0, why)]
    recs += [replace(record(4, P, failed, 0.0, why), attempt=3)]
    recs += [record(4, TransitionPhase.ROLLED_BACK, PhaseStatus.COMPLETED, 4500.0)]
    for i, rec in enumerate(recs):
        tl.record.transitions.append((481.0 + i, rec))
    (shift,) = tl.record.shifts()
    assert shift.outcome == "rolled_back" and shift.attempts == 3
    lines = "\n".join(summary_lines(tl.record, ["chat"], 600.0))
    assert "rolled_back in 4.5 s, 3 attempts" in lines
    assert f"last failure: prepare attempt 3: {why}" in lines


def test_a_wait_for_room_is_reported_with_its_last_reason(tmp_path: Path) -> None:
    # the live view counts holds; the report says how long a model waited for room and why
    tl = timeline(now_s=600.0)
    why = "chat: 3 requests wait, no GPU fits it yet. no eviction would make room (active)."
    for seq, t_s in ((1, 100.0), (2, 130.0), (3, 160.0)):
        tl.on_message(raw(replace(decision(seq, "waiting_for_room"), explanation=why), t_s))
    tl.on_message(raw(decision(4, "resident"), 170.0))
    assert room_waits(tl.record) == [f"| chat | 00:01:40 | 00:02:40 | 3 | {why} |"]
    md, _ = write_report(tl.record, ["chat"], 600.0, tmp_path, "test")
    assert f"| chat | 00:01:40 | 00:02:40 | 3 | {why} |" in md.read_text()
