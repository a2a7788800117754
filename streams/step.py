"""The decision step: one deployment's state + snapshots + trigger → gearbox → a GearDecision.

Pure and shared by the live app and ``flexpipe audit replay``, so both run one core. Decision ids
are ``f"{deployment}:{seq}"``; the :class:`Cursor` remembers the last sequence number and the
event time of the last trigger decided, and :func:`step` refuses a trigger that is not newer —
a replayed trigger never yields a second decision. The decisions topic is the source of truth:
the app writes its tables only after the broker acknowledged a decision, and :func:`reconcile`
rolls the tables forward from the last logged decision after a crash or a rebalance.

One decision in flight per deployment (:mod:`streams.inflight`): from a switch until the
transitions topic reports it DONE or ROLLED_BACK, or ``streams.transition_timeout_s`` of event
time, a voluntary switch is held; and no decision targets the plan the runtime serves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from flexpipe.config import FlexPipeConfig, StreamsConfig
from flexpipe.schemas import (
    BlockSummary,
    ControlAction,
    ControlCommand,
    DecisionContext,
    GearDecision,
    GearTransition,
    PlanSource,
    TransitionPhase,
)
from gearbox.blocks import build_blocks
from gearbox.config import DEFAULT_PLACEMENT_CONFIG, GearboxConfig, PlacementConfig
from gearbox.decide import decide
from gearbox.decisions import DecideResult, Overrides
from gearbox.history import GearState, record_failed_target
from gearbox.joint import Neighbour
from gearbox.plans import DeploymentPlan
from gearbox.residency import OnDemandModel
from gearbox.starting import starting_plan
from gearbox.types import LoadSnapshot, TopologySnapshot
from streams.catalog import Catalog
from streams.cursor import (
    TRIGGER_RANK,
    Cursor,
    LoggedDecision,
    TriggerInfo,
    decision_id,
    tick_due_ms,
)
from streams.deployments import Deployment
from streams.inflight import InFlight, guard, logged_marker, unsettled
from streams.load import ServingWindows, serving_aggregate
from streams.ondemand import is_on_demand, residency_result
from streams.order import RoundOrder, decision_order, plan_disturbed
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
    "RoundOrder",
    "StepInput",
    "StepOutput",
    "TriggerInfo",
    "claimed_gpus",
    "decision_id",
    "decision_order",
    "fold_control",
    "fold_rollback",
    "fold_transition",
    "make_input",
    "plan_disturbed",
    "reconcile",
    "serving_plan_id",
    "step",
    "taken_gpus",
    "tick_due_ms",
    "view_timeout_s",
]

MAX_KNOWN_PLANS = 8  # recent plans kept per deployment, so an operator can pin one by id
DEFAULT_TRANSITION_TIMEOUT_S = float(StreamsConfig.model_fields["transition_timeout_s"].default)
_TERMINAL = (TransitionPhase.DONE, TransitionPhase.ROLLED_BACK)


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
    settled_seq: int = -1  # highest transition sequence seen reaching DONE or ROLLED_BACK
    in_flight: InFlight | None = None  # our switch the runtime has not finished yet
    last_demand_ms: int = -1  # on demand: event time it last had requests (-1: never)
    changed_ms: int = -1  # event time a finished transition last changed its plan (-1: never)
    # on demand: the deployment its last eviction by the displace rule made room for (None:
    # none, or its last decision was another); read while that eviction is in flight
    evicting_for: str | None = None


def serving_plan_id(plan: PlanState) -> str | None:
    """Id of the plan the runtime serves, as far as the transitions topic told (None: unknown)."""
    return plan.confirmed.plan_id if plan.confirmed is not None else None


def _unsettled(plan: PlanState, marker: InFlight | None) -> InFlight | None:
    return unsettled(
        marker,
        transition_seq=plan.transition_seq,
        settled_seq=plan.settled_seq,
        serving_plan_id=serving_plan_id(plan),
    )


@dataclass(frozen=True, slots=True)
class OverrideState:
    """Operator commands in force for a deployment."""

    pinned_plan_id: str | None = None
    emergency: bool = False
    issued_by: str = ""
    reason: str = ""
    updated_ms: int = 0


def view_timeout_s(cfg: FlexPipeConfig) -> float:
    """Heartbeat timeout applied to shared-view records in snapshots.

    NOTE: shared-view records may trail by up to ``view_refresh_s``; the owning worker's sweep
    enforces the exact timeout through the ``timed_out`` flag.
    """
    return cfg.intervals.heartbeat_timeout_s + cfg.streams.view_refresh_s


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
    transition_timeout_s: float = DEFAULT_TRANSITION_TIMEOUT_S  # streams.transition_timeout_s
    claims: frozenset[str] = frozenset()  # GPUs other deployments' plans hold (see claimed_gpus)
    # every on-demand deployment (streams.ondemand.on_demand_view); empty when none is
    on_demand: tuple[OnDemandModel, ...] = ()
    placement: PlacementConfig = DEFAULT_PLACEMENT_CONFIG  # the config's placement section
    # the other resident deployments, whose standby a switch weighs (gearbox.joint;
    # streams.neighbours.neighbours_view)
    neighbours: tuple[Neighbour, ...] = ()
    # (GPU, taker) for GPUs other deployments' handovers take (see taken_gpus): full even if ours
    taken: tuple[tuple[str, str], ...] = ()


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
    transition_timeout_s: float = DEFAULT_TRANSITION_TIMEOUT_S,
    claims: frozenset[str] = frozenset(),
    on_demand: tuple[OnDemandModel, ...] = (),
    placement: PlacementConfig = DEFAULT_PLACEMENT_CONFIG,
    neighbours: tuple[Neighbour, ...] = (),
    taken: tuple[tuple[str, str], ...] = (),
) -> StepInput:
    """Build snapshots at ``now_ms`` from the view and tables: the one place live and replay
    turn state into gearbox's inputs. ``topology``, when given, must be what
    :func:`build_topology` returns for the same view and time (a cache); ``claims`` are the GPUs
    other deployments' plans hold (:func:`claimed_gpus`); ``on_demand`` every on-demand
    deployment's view (:func:`streams.ondemand.on_demand_view`); ``neighbours`` the other
    resident deployments (:func:`streams.neighbours.neighbours_view`); ``taken`` the GPUs other
    deployments' handovers in flight take (:func:`taken_gpus`)."""
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
        transition_timeout_s,
        claims,
        on_demand,
        placement,
        neighbours,
        taken,
    )


def claimed_gpus(plans: Mapping[str, PlanState], deployment: str) -> frozenset[str]:
    """GPUs that deployments other than ``deployment`` hold or are moving to: their assumed
    plan (a switch in flight included) and the plan the runtime last confirmed."""
    held: set[str] = set()
    for name, plan in plans.items():
        if name != deployment:
            for p in (plan.current, plan.confirmed):
                if p is not None:
                    held |= p.gpu_uuids
    return frozenset(held)


def taken_gpus(plans: Mapping[str, PlanState], deployment: str) -> tuple[tuple[str, str], ...]:
    """(GPU, the deployment taking it) for every GPU another deployment's handover in flight
    takes (:attr:`gearbox.decisions.Decision.taken_gpus`), sorted; ``deployment``'s own among
    them are full for it, so its plan moves off them."""
    return tuple(
        sorted(
            (u, name)
            for name, plan in plans.items()
            if name != deployment and plan.in_flight is not None
            for u in plan.in_flight.taken_gpus
        )
    )


def _without_claims(topology: TopologySnapshot, claims: frozenset[str]) -> TopologySnapshot:
    """The topology as one deployment may plan on it: another deployment's GPUs are full.

    NOTE: telemetry shows a GPU's memory only once the runtime loaded onto it and a sample
    went out; without this a forced decision taken in that gap (or while telemetry is behind,
    e.g. after a broker outage) targets GPUs another plan holds, and the runtime rolls it back.
    """
    if not claims:
        return topology
    gpus = tuple(replace(g, free_memory_bytes=0) if g.uuid in claims else g for g in topology.gpus)
    return replace(topology, gpus=gpus)


def _with_hint(inp: StepInput) -> PlanState:
    if inp.plan.source is not PlanSource.NONE:
        return inp.plan
    # NOTE: blocks only for the hint (a deployment's first decision): decide builds its own
    blocks = build_blocks(inp.topology, inp.config, inp.gear.blocks)
    hint = starting_plan(inp.deployments, inp.deployment.name, inp.topology, blocks)
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


def _context(
    inp: StepInput,
    plan: PlanState,
    after: PlanState,
    result: DecideResult,
    digest: str,
    notes: list[str],
) -> DecisionContext:
    live = sum(1 for g in inp.topology.gpus if inp.topology.gpu_is_live(g))
    held = result.decision is None
    return DecisionContext(
        trigger_time_ms=inp.trigger.time_ms,
        trigger_description=inp.trigger.description,
        now_s=inp.topology.now_s,
        worker=inp.worker,
        plan_source=inp.plan.source,
        load_source=inp.load_source,
        load=inp.load,
        digest=digest,
        num_gpus=len(inp.topology.gpus),
        num_live_gpus=live,
        blocks=tuple(
            BlockSummary(b.block_id, b.domain_id, b.num_gpus) for b in result.state.blocks
        ),
        notes=tuple(notes),
        serving_plan_id=serving_plan_id(plan),
        in_flight=after.in_flight,
        current=result.current if held else None,
        candidates=result.candidates if held else (),
        problems=result.problems if held else (),
        retry_after_s=result.retry_after_s if held else None,
    )


def _expire(plan: PlanState, inp: StepInput) -> tuple[PlanState, list[str]]:
    """Drop a decision in flight past its timeout; its target, never confirmed, gives way to the
    plan the runtime last confirmed (if known), which the step decides from again."""
    f = plan.in_flight
    if f is None or inp.trigger.time_ms < f.deadline_ms(inp.transition_timeout_s):
        return plan, []
    note = (
        f"{f.describe()} not reported done or rolled back within "
        f"{inp.transition_timeout_s:g} s: deciding again"
    )
    current_id = plan.current.plan_id if plan.current is not None else None
    if plan.confirmed is None or current_id != f.to_plan_id:
        return replace(plan, in_flight=None), [note]
    note += f" from {plan.confirmed.plan_id}, the plan the runtime last confirmed"
    plan = replace(
        plan, current=plan.confirmed, source=PlanSource.TRANSITION, decision_id=None, in_flight=None
    )
    return plan, [note]


def _handed_note(handed: Mapping[str, str], plan: PlanState) -> list[str]:
    """Why a plan on GPUs a neighbour's handover takes is infeasible now."""
    current = plan.current.gpu_uuids if plan.current is not None else frozenset()
    by: dict[str, list[str]] = {}
    for u, taker in sorted(handed.items()):
        if u in current:
            by.setdefault(taker, []).append(u)
    return [
        f"{', '.join(gpus)} handed over to {taker} (its handover in flight): moving off them"
        for taker, gpus in sorted(by.items())
    ]


def _flight_note(marker: InFlight | None, result: DecideResult) -> list[str]:
    if marker is None:
        return []
    if result.decision is not None:  # forced: see streams.inflight.guard
        return [
            f"supersedes {marker.describe()}, still in flight (a forced decision does not wait)"
        ]
    return [f"{marker.describe()} in flight since t={marker.since_ms / 1000.0:.1f} s"]


def step(inp: StepInput) -> StepOutput | None:
    """Decide for one trigger; None when the trigger is not newer than the last one decided.

    While a switch is in flight a voluntary switch is held and a forced one supersedes it; no
    decision targets the serving plan (:func:`streams.inflight.guard`). GPUs another
    deployment's handover in flight takes (``inp.taken``) are full for this one even where its
    plan holds them, so that plan is infeasible and a forced switch moves it off them (in the
    same round: the neighbour is decided after the deployment taking them).
    """
    if not inp.cursor.admits(inp.trigger.kind, inp.trigger.time_ms):
        return None
    plan, notes = _expire(_with_hint(inp), inp)
    own = frozenset().union(*(p.gpu_uuids for p in (plan.current, plan.confirmed) if p))
    handed = {u: by for u, by in inp.taken if u in own}
    topology = _without_claims(inp.topology, inp.claims - (own - handed.keys()))
    notes += _handed_note(handed, plan)
    if is_on_demand(inp.deployment):
        # NOTE: on-demand models share GPUs: the round takes what each holds off its GPUs
        # (gearbox.residency.room); only GPUs that other deployments' plans hold are full.
        shared = frozenset(u for m in inp.on_demand for u in m.gpu_uuids)
        result, plan, more = _on_demand(
            inp, plan, _without_claims(inp.topology, inp.claims - shared)
        )
    else:
        overrides, more = _overrides(inp.overrides, plan)
        result = decide(
            plan.current,
            topology,
            inp.load,
            inp.gear,
            inp.config,
            model=inp.deployment.model,
            deployment=inp.deployment.name,
            trigger=inp.trigger.kind,
            overrides=overrides,
            neighbours=inp.neighbours,
            handed_over=frozenset(handed),
        )
    marker = plan.in_flight
    result = guard(result, inp.gear, marker, serving_plan_id(plan), inp.transition_timeout_s)
    notes += more + _flight_note(marker, result)
    seq = inp.cursor.seq + 1
    digest = snapshot_digest(inp.topology, inp.load)
    payload, after = _publish(inp, plan, result, seq, notes, digest)
    cursor = Cursor(seq, inp.trigger.time_ms, TRIGGER_RANK[inp.trigger.kind])
    return StepOutput(payload, inp.trigger.time_ms, result, after, result.state, cursor, digest)


def _on_demand(
    inp: StepInput, plan: PlanState, topology: TopologySnapshot
) -> tuple[DecideResult, PlanState, list[str]]:
    """An on-demand deployment's residency decision (operator overrides do not apply), and its
    plan state with the time it last had requests and, deciding, whom a displacement is for."""
    mine = next((m for m in inp.on_demand if m.name == inp.deployment.name), None)
    if mine is None:  # NOTE: the caller built no view: nothing to place from
        raise ValueError(f"{inp.deployment.name}: on demand, but no on-demand view was given")
    if math.isfinite(mine.last_demand_s):
        plan = replace(plan, last_demand_ms=round(mine.last_demand_s * 1000))
    notes = []
    if inp.overrides.pinned_plan_id is not None or inp.overrides.emergency:
        notes.append("operator overrides do not apply to an on-demand deployment")
    result, evicting_for = residency_result(
        inp.deployment,
        plan.current,
        inp.on_demand,
        topology,
        inp.gear,
        inp.placement,
        inp.trigger.kind,
    )
    if result.decision is not None:
        plan = replace(plan, evicting_for=evicting_for)
    return result, plan, notes


def _publish(
    inp: StepInput, plan: PlanState, result: DecideResult, seq: int, notes: list[str], digest: str
) -> tuple[GearDecision, PlanState]:
    """The decision as the topic carries it, and the plan state it leaves."""
    name = inp.deployment.name
    decided = result.decision
    did = decision_id(name, seq)
    after = plan
    if decided is not None:
        after = replace(
            plan,
            current=decided.to_plan,
            source=PlanSource.DECISION,
            decision_id=did,
            known=_remember(plan.known, decided.to_plan),
            in_flight=InFlight(
                did, seq, decided.to_plan_id, inp.trigger.time_ms, decided.taken_gpus
            ),
        )
    extra = (
        f" Trigger: {inp.trigger.description or inp.trigger.kind.value}; load: {inp.load_source}."
    )
    payload = GearDecision(
        deployment=name,
        decision_id=did,
        seq=seq,
        trigger=inp.trigger.kind,
        reason=result.reason,
        forced=decided.forced if decided is not None else False,
        from_plan_id=plan.current.plan_id if plan.current is not None else None,
        to_plan_id=decided.to_plan_id if decided is not None else None,
        explanation=result.explanation + extra + "".join(f" Note: {n}." for n in notes),
        context=_context(inp, plan, after, result, digest, notes),
        decision=decided,
    )
    return payload, after


def _runtime_past(plan: PlanState, seq: int) -> bool:
    """Whether the transitions topic reported decision ``seq``'s transition finished, or a later
    one."""
    return plan.settled_seq >= seq or plan.transition_seq > seq


def reconcile(
    cursor: Cursor, plan: PlanState, gear: GearState, last: LoggedDecision | None
) -> tuple[Cursor, PlanState, GearState]:
    """Roll the tables forward to the last decision on the topic (the source of truth), and
    restore the decision in flight it left, less what the transitions folded since settled."""
    if last is None:
        return Cursor(), replace(plan, in_flight=None), gear
    p = last.payload
    rank = TRIGGER_RANK[p.trigger]
    logged = Cursor(p.seq, last.trigger_time_ms, rank)
    target = p.decision.to_plan if p.decision is not None else None
    # NOTE: the worker died after the broker acknowledged this decision and before its tables
    # were written (or the plan table came back without it): take the decision's effects from
    # the topic, unless the runtime already reported on it (its folds then set the plan).
    if target is not None and plan.decision_id != p.decision_id and not _runtime_past(plan, p.seq):
        plan = replace(
            plan,
            current=target,
            source=PlanSource.DECISION,
            decision_id=p.decision_id,
            known=_remember(plan.known, target),
        )
    if target is not None and p.seq > cursor.seq:
        gear = replace(
            gear,
            last_switch_s=p.context.now_s,
            last_from_plan_id=p.from_plan_id,
            last_to_plan_id=target.plan_id,
        )
    plan = replace(plan, in_flight=_unsettled(plan, logged_marker(p, last.trigger_time_ms)))
    return logged, plan, gear


def fold_transition(plan: PlanState, tr: GearTransition, event_ms: int = -1) -> PlanState:
    """Follow the runtime: a finished transition confirms its plan, a rollback undoes our switch,
    and either settles our decision in flight (:func:`streams.inflight.unsettled`). While a newer
    decision of ours is still in flight, ``current`` stays its target. ``event_ms``: the
    record's event time, kept as ``changed_ms`` when it confirms a different plan.
    """
    if tr.transition_seq < plan.transition_seq:
        return plan
    settled = (
        max(plan.settled_seq, tr.transition_seq) if tr.phase in _TERMINAL else plan.settled_seq
    )
    plan = replace(plan, transition_seq=tr.transition_seq, settled_seq=settled)
    done = tr.plan if tr.phase is TransitionPhase.DONE else None
    if done is not None:
        changed = plan.confirmed is None or plan.confirmed.plan_id != done.plan_id
        plan = replace(plan, confirmed=done, known=_remember(plan.known, done))
        if changed and event_ms >= 0:
            plan = replace(plan, changed_ms=event_ms)
    plan = replace(plan, in_flight=_unsettled(plan, plan.in_flight))
    if plan.in_flight is not None:
        return plan
    if done is not None:
        return replace(
            plan, current=plan.confirmed, source=PlanSource.TRANSITION, decision_id=tr.decision_id
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
