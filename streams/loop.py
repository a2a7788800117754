"""The decision step: one deployment's state + snapshots + trigger → gearbox → a GearDecision.

Pure and shared by the live app and ``flexpipe audit replay``, so both run one core. Decision ids
are ``f"{deployment}:{seq}"``; the :class:`Cursor` remembers the last sequence number and the
event time of the last trigger decided, and :func:`step` refuses a trigger that is not newer —
a replayed trigger never yields a second decision. The decisions topic is the source of truth:
the app writes its tables only after the broker acknowledged a decision, and :func:`reconcile`
rolls the tables forward from the last logged decision after a crash or a rebalance.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from flexpipe.config import FlexPipeConfig
from flexpipe.schemas import (
    ControlAction,
    ControlCommand,
    GearDecision,
    GearTransition,
    TransitionPhase,
)
from gearbox.blocks import AtomicBlock, build_blocks
from gearbox.config import GearboxConfig
from gearbox.decide import decide
from gearbox.decisions import DecideResult, Overrides, Trigger
from gearbox.history import GearState, record_failed_target
from gearbox.plans import DeploymentPlan
from gearbox.types import LoadSnapshot, TopologySnapshot
from streams.catalog import Catalog
from streams.deployments import Deployment, hint_plan
from streams.load import ServingWindows, serving_aggregate
from streams.snapshot import build_load, build_topology, snapshot_digest
from streams.state import GpuState, NodeState
from streams.windows import HoppingWindow

__all__ = [
    "TRIGGER_RANK",
    "Cursor",
    "DeploymentTables",
    "LoggedDecision",
    "OverrideState",
    "PlanSource",
    "PlanState",
    "StepInput",
    "StepOutput",
    "TriggerInfo",
    "decision_id",
    "fold_control",
    "fold_rollback",
    "fold_transition",
    "make_input",
    "reconcile",
    "step",
    "tick_due_ms",
    "view_timeout_s",
]

MAX_KNOWN_PLANS = 8  # recent plans kept per deployment, so an operator can pin one by id


class PlanSource(StrEnum):
    """Where a deployment's current plan came from."""

    NONE = "none"  # nothing yet: gearbox makes a first placement
    HINT = "hint"  # the configured starting plan
    DECISION = "decision"  # our own switch decision, not yet confirmed by the runtime
    TRANSITION = "transition"  # a runtime worker finished the transition (phase DONE)


@dataclass(frozen=True, slots=True)
class PlanState:
    """A deployment's current plan as the decision loop assumes it."""

    current: DeploymentPlan | None = None
    source: PlanSource = PlanSource.NONE
    decision_id: str | None = None  # the decision or transition that set ``current``
    confirmed: DeploymentPlan | None = None  # the last plan a runtime worker confirmed
    transition_seq: int = 0  # highest transition sequence number seen
    baseline: DeploymentPlan | None = None  # the hint plan: target of emergency downshifts
    known: tuple[DeploymentPlan, ...] = ()  # recent plans, newest last


@dataclass(frozen=True, slots=True)
class OverrideState:
    """Operator commands in force for a deployment."""

    pinned_plan_id: str | None = None
    emergency: bool = False
    issued_by: str = ""
    reason: str = ""
    updated_ms: int = 0


# NOTE: a tick and a topology change can share one event time (the seed scenario's preemptions
# sit on tick boundaries): the change must still be decided after the tick, so triggers order by
# (event time, rank).
TRIGGER_RANK: dict[Trigger, int] = {
    Trigger.TIMER: 0,
    Trigger.LOAD_CHANGE: 1,
    Trigger.TOPOLOGY_CHANGE: 2,
    Trigger.OPERATOR: 3,
}


@dataclass(frozen=True, slots=True)
class Cursor:
    """How far a deployment's decisions got: last sequence number, last trigger's event time
    and rank (see :data:`TRIGGER_RANK`)."""

    seq: int = 0
    trigger_time_ms: int = -1
    trigger_rank: int = 0

    def admits(self, kind: Trigger, time_ms: int) -> bool:
        """Whether a trigger is newer than the last one decided."""
        return (time_ms, TRIGGER_RANK[kind]) > (self.trigger_time_ms, self.trigger_rank)


@dataclass(frozen=True, slots=True)
class TriggerInfo:
    """Why the loop runs now: gearbox's trigger kind, its event time and what happened."""

    kind: Trigger
    time_ms: int
    description: str


@dataclass(frozen=True, slots=True)
class LoggedDecision:
    """A decision read back from the decisions topic."""

    trigger_time_ms: int  # the envelope's event time
    payload: GearDecision


def decision_id(deployment: str, seq: int) -> str:
    """The deterministic id of a deployment's ``seq``-th decision."""
    return f"{deployment}:{seq}"


def view_timeout_s(cfg: FlexPipeConfig) -> float:
    """Heartbeat timeout applied to shared-view records in snapshots.

    NOTE: shared-view records may trail by up to ``view_refresh_s``; the owning worker's sweep
    enforces the exact timeout through the ``timed_out`` flag.
    """
    return cfg.intervals.heartbeat_timeout_s + cfg.streams.view_refresh_s


def tick_due_ms(clock_ms: int, interval_s: float) -> int:
    """The latest periodic tick at or before ``clock_ms``: ticks sit on multiples of the interval
    in event time, so every worker (and a replay) agrees on them."""
    interval_ms = max(1, round(interval_s * 1000))
    return clock_ms // interval_ms * interval_ms


def _remember(
    known: tuple[DeploymentPlan, ...], plan: DeploymentPlan
) -> tuple[DeploymentPlan, ...]:
    kept = [p for p in known if p.plan_id != plan.plan_id]
    return (*kept, plan)[-MAX_KNOWN_PLANS:]


@dataclass(frozen=True, slots=True)
class StepInput:
    """Everything one decision needs."""

    deployment: Deployment
    deployments: tuple[Deployment, ...]  # all of them, in order: hints skip earlier hints' GPUs
    plan: PlanState
    gear: GearState
    overrides: OverrideState
    cursor: Cursor
    topology: TopologySnapshot
    load: LoadSnapshot
    load_source: str
    trigger: TriggerInfo
    config: GearboxConfig
    worker: str = ""


@dataclass(frozen=True, slots=True)
class StepOutput:
    """The decision to publish and the state to store once the broker acknowledged it."""

    decision: GearDecision
    event_time_ms: int  # the trigger's event time, the envelope's event time
    result: DecideResult
    plan: PlanState
    gear: GearState
    cursor: Cursor
    digest: str  # hash of the snapshot and load the decision saw


@dataclass(frozen=True, slots=True)
class DeploymentTables:
    """One deployment's table values, as :func:`make_input` needs them."""

    plan: PlanState
    gear: GearState
    overrides: OverrideState
    cursor: Cursor
    serving: ServingWindows


def make_input(
    dep: Deployment,
    deployments: tuple[Deployment, ...],
    tables: DeploymentTables,
    view: tuple[Mapping[str, GpuState], Mapping[str, NodeState]],
    catalog: Catalog,
    load_window: HoppingWindow,
    now_ms: int,
    trigger: TriggerInfo,
    heartbeat_timeout_s: float,
    config: GearboxConfig,
    worker: str = "",
    topology: TopologySnapshot | None = None,
) -> StepInput:
    """Build snapshots at ``now_ms`` from the view and tables: the one place live and replay
    turn state into gearbox's inputs. ``topology``, when given, must be what
    :func:`build_topology` returns for the same view and time (a cache)."""
    now_s = now_ms / 1000.0
    if topology is None:
        topology = build_topology(view[0], view[1], catalog, now_s, heartbeat_timeout_s)
    aggregate = serving_aggregate(tables.serving, load_window, now_s)
    load, source = build_load(aggregate, dep.nominal, dep.model, now_s)
    return StepInput(
        dep,
        deployments,
        tables.plan,
        tables.gear,
        tables.overrides,
        tables.cursor,
        topology,
        load,
        source,
        trigger,
        config,
        worker,
    )


def _with_hint(inp: StepInput, blocks: tuple[AtomicBlock, ...]) -> PlanState:
    if inp.plan.source is not PlanSource.NONE:
        return inp.plan
    hint = hint_plan(inp.deployments, inp.deployment.name, inp.topology, blocks)
    if hint is None:
        return inp.plan
    return replace(inp.plan, current=hint, source=PlanSource.HINT, baseline=hint, known=(hint,))


def _overrides(ov: OverrideState, plan: PlanState) -> tuple[Overrides, list[str]]:
    notes: list[str] = []
    pinned = None
    if ov.pinned_plan_id is not None:
        plans = (*plan.known, *((plan.current,) if plan.current else ()))
        pinned = next((p for p in plans if p.plan_id == ov.pinned_plan_id), None)
        if pinned is None:
            notes.append(f"pin to unknown plan {ov.pinned_plan_id} ignored")
    emergency = ov.emergency and plan.baseline is not None
    if ov.emergency and plan.baseline is None:
        notes.append("emergency downshift ignored: no baseline plan (no hint configured)")
    return Overrides(pinned, emergency, plan.baseline if emergency else None), notes


def _context(inp: StepInput, result: DecideResult, digest: str, notes: list[str]) -> dict[str, Any]:
    live = sum(1 for g in inp.topology.gpus if inp.topology.gpu_is_live(g))
    ctx: dict[str, Any] = {
        "trigger": {
            "kind": inp.trigger.kind.value,
            "time_ms": inp.trigger.time_ms,
            "description": inp.trigger.description,
        },
        "now_s": inp.topology.now_s,
        "worker": inp.worker,
        "plan_source": inp.plan.source.value,
        "load_source": inp.load_source,
        "load": inp.load.to_dict(),
        "digest": digest,
        "num_gpus": len(inp.topology.gpus),
        "num_live_gpus": live,
        "blocks": [
            {"block_id": b.block_id, "domain_id": b.domain_id, "num_gpus": b.num_gpus}
            for b in result.state.blocks
        ],
        "notes": notes,
    }
    if result.decision is None:
        ctx["current"] = result.current.to_dict() if result.current else None
        ctx["candidates"] = [c.to_dict() for c in result.candidates]
        ctx["problems"] = list(result.problems)
        ctx["retry_after_s"] = result.retry_after_s
    return ctx


def step(inp: StepInput) -> StepOutput | None:
    """Decide for one trigger; None when the trigger is not newer than the last one decided."""
    if not inp.cursor.admits(inp.trigger.kind, inp.trigger.time_ms):
        return None
    blocks = build_blocks(inp.topology, inp.config, inp.gear.blocks)
    plan = _with_hint(inp, blocks)
    overrides, notes = _overrides(inp.overrides, plan)
    result = decide(
        plan.current,
        inp.topology,
        inp.load,
        inp.gear,
        inp.config,
        model=inp.deployment.model,
        deployment=inp.deployment.name,
        trigger=inp.trigger.kind,
        overrides=overrides,
    )
    seq = inp.cursor.seq + 1
    name = inp.deployment.name
    digest = snapshot_digest(inp.topology, inp.load)
    decided = result.decision
    body: dict[str, Any] = decided.to_dict() if decided is not None else {}
    body["context"] = _context(inp, result, digest, notes)
    extra = (
        f" Trigger: {inp.trigger.description or inp.trigger.kind.value}; load: {inp.load_source}."
    )
    payload = GearDecision(
        deployment=name,
        decision_id=decision_id(name, seq),
        seq=seq,
        trigger=inp.trigger.kind.value,
        reason=result.reason.value,
        forced=decided.forced if decided is not None else False,
        from_plan_id=plan.current.plan_id if plan.current is not None else None,
        to_plan_id=decided.to_plan_id if decided is not None else None,
        explanation=result.explanation + extra + "".join(f" Note: {n}." for n in notes),
        decision=body,
    )
    if decided is not None:
        plan = replace(
            plan,
            current=decided.to_plan,
            source=PlanSource.DECISION,
            decision_id=payload.decision_id,
            known=_remember(plan.known, decided.to_plan),
        )
    cursor = Cursor(seq, inp.trigger.time_ms, TRIGGER_RANK[inp.trigger.kind])
    return StepOutput(payload, inp.trigger.time_ms, result, plan, result.state, cursor, digest)


def _logged_plan(payload: GearDecision) -> DeploymentPlan | None:
    raw = payload.decision.get("to_plan")
    if payload.to_plan_id is None or not isinstance(raw, dict):
        return None
    try:
        return DeploymentPlan.from_dict(raw)
    except (TypeError, ValueError):
        return None


def reconcile(
    cursor: Cursor, plan: PlanState, gear: GearState, last: LoggedDecision | None
) -> tuple[Cursor, PlanState, GearState]:
    """Roll the tables forward to the last decision on the topic (the source of truth)."""
    if last is None:
        return Cursor(), plan, gear
    rank = TRIGGER_RANK.get(_trigger(last.payload.trigger), 0)
    logged = Cursor(last.payload.seq, last.trigger_time_ms, rank)
    if last.payload.seq <= cursor.seq:
        return logged, plan, gear
    # NOTE: the worker died after the broker acknowledged this decision and before its tables
    # were written: take the decision's effects from the topic.
    target = _logged_plan(last.payload)
    if target is None:
        return logged, plan, gear
    now_s = float(last.payload.decision.get("now_s", last.trigger_time_ms / 1000.0))
    plan = replace(
        plan,
        current=target,
        source=PlanSource.DECISION,
        decision_id=last.payload.decision_id,
        known=_remember(plan.known, target),
    )
    gear = replace(
        gear,
        last_switch_s=now_s,
        last_from_plan_id=last.payload.from_plan_id,
        last_to_plan_id=target.plan_id,
    )
    return logged, plan, gear


def _trigger(value: str) -> Trigger:
    try:
        return Trigger(value)
    except ValueError:
        return Trigger.TIMER


def fold_transition(plan: PlanState, tr: GearTransition) -> PlanState:
    """Follow the runtime: a finished transition sets the plan, a rollback undoes our switch.

    Raises ``ValueError`` when a DONE transition carries a plan that does not parse.
    """
    if tr.transition_seq < plan.transition_seq:
        return plan
    plan = replace(plan, transition_seq=tr.transition_seq)
    if tr.phase is TransitionPhase.DONE and tr.plan:
        confirmed = DeploymentPlan.from_dict(tr.plan)
        return replace(
            plan,
            current=confirmed,
            source=PlanSource.TRANSITION,
            decision_id=tr.decision_id,
            confirmed=confirmed,
            known=_remember(plan.known, confirmed),
        )
    undone = plan.source is PlanSource.DECISION and plan.decision_id == tr.decision_id
    if tr.phase is TransitionPhase.ROLLED_BACK and undone:
        previous = plan.confirmed or plan.baseline
        source = PlanSource.TRANSITION if plan.confirmed else PlanSource.HINT
        return replace(plan, current=previous, source=source, decision_id=tr.decision_id)
    return plan


def fold_rollback(
    gear: GearState, tr: GearTransition, event_time_ms: int, config: GearboxConfig
) -> GearState:
    """A rolled-back transition quarantines its target in gearbox's state, so the next ticks
    do not re-propose it (:func:`gearbox.history.record_failed_target`); other records pass."""
    if tr.phase is not TransitionPhase.ROLLED_BACK or tr.to_plan_id is None:
        return gear
    return record_failed_target(gear, tr.to_plan_id, event_time_ms / 1000.0, config)


def fold_control(
    ov: OverrideState, plan: PlanState, cmd: ControlCommand, event_time_ms: int
) -> OverrideState:
    """Apply an operator command; a pin without a plan id pins the current plan."""
    a = ControlAction
    base = replace(ov, issued_by=cmd.issued_by, reason=cmd.reason, updated_ms=event_time_ms)
    if cmd.action is a.PIN:
        pinned = cmd.plan_id or (plan.current.plan_id if plan.current is not None else None)
        return replace(base, pinned_plan_id=pinned)
    if cmd.action is a.UNPIN:
        return replace(base, pinned_plan_id=None)
    if cmd.action is a.EMERGENCY_DOWNSHIFT:
        return replace(base, emergency=True)
    return replace(base, emergency=False)
