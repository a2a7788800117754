"""The decision step: deterministic ids, replays refused, plans followed, log reconciliation."""

from __future__ import annotations

from dataclasses import replace

import pytest

from flexpipe.schemas import (
    ClusterEventType,
    ControlAction,
    ControlCommand,
    GearTransition,
    InFlight,
    PhaseStatus,
    TransitionPhase,
)
from gearbox.config import DEFAULT_CONFIG
from gearbox.decisions import DecisionReason, Trigger
from gearbox.history import GearState
from gearbox.plans import DeploymentPlan
from streams.deployments import resolve_deployments
from streams.load import ServingWindows
from streams.state import GpuState, NodeState, fold_cluster_event
from streams.step import (
    Cursor,
    DeploymentTables,
    LoggedDecision,
    OverrideState,
    PlanSource,
    PlanState,
    StepOutput,
    TriggerInfo,
    claimed_gpus,
    fold_control,
    fold_rollback,
    fold_transition,
    make_input,
    reconcile,
    step,
    taken_gpus,
    tick_due_ms,
)
from streams.windows import HoppingWindow
from tests.streams.builders import T0_MS, make_event, streams_config
from tests.streams.test_snapshot import folded

pytestmark = pytest.mark.unit

CFG = streams_config()
CATALOG, DEPLOYMENTS = resolve_deployments(CFG)
CHAT = DEPLOYMENTS[0]
FRESH = DeploymentTables(PlanState(), GearState(), OverrideState(), Cursor(), ServingWindows())


View = tuple[dict[str, GpuState], dict[str, NodeState]]


def decide(
    tables: DeploymentTables,
    t_ms: int,
    kind: Trigger = Trigger.TIMER,
    view: View | None = None,
    claims: frozenset[str] = frozenset(),
    taken: tuple[tuple[str, str], ...] = (),
) -> StepOutput | None:
    gpus, nodes = view if view is not None else folded()
    inp = make_input(
        CHAT,
        DEPLOYMENTS,
        tables,
        (gpus, nodes),
        CATALOG,
        HoppingWindow(60, 10),
        t_ms,
        TriggerInfo(kind, t_ms, "test"),
        45.0,
        DEFAULT_CONFIG,
        "w",
        claims=claims,
        taken=taken,
    )
    return step(inp)


def after(tables: DeploymentTables, out: StepOutput) -> DeploymentTables:
    return replace(tables, plan=out.plan, gear=out.gear, cursor=out.cursor)


def test_first_decision_starts_from_the_hint_and_ids_are_deterministic() -> None:
    out = decide(FRESH, T0_MS)
    assert out is not None
    assert out.decision.decision_id == "chat:1" and out.decision.seq == 1
    assert out.event_time_ms == T0_MS and out.cursor == Cursor(1, T0_MS)
    hint = out.plan.baseline
    assert hint is not None and out.decision.from_plan_id == hint.plan_id
    assert out.decision.context.plan_source is PlanSource.NONE
    assert out.decision.explanation.startswith("chat:")
    again = decide(FRESH, T0_MS)
    assert again is not None and again.decision == out.decision  # pure: same inputs, same output


def test_a_trigger_not_newer_than_the_last_decided_is_refused() -> None:
    out = decide(FRESH, T0_MS)
    assert out is not None
    tables = after(FRESH, out)
    assert decide(tables, T0_MS) is None
    assert decide(tables, T0_MS - 1) is None
    nxt = decide(tables, T0_MS + 15_000)
    assert nxt is not None and nxt.decision.decision_id == "chat:2"


def test_losing_the_plans_gpus_forces_a_switch_away_from_them() -> None:
    out = decide(FRESH, T0_MS)
    assert out is not None
    tables = after(FRESH, out)
    current = tables.plan.current
    assert current is not None
    gpus, nodes = folded()
    taken = tuple(sorted(current.gpu_uuids))
    node = "node-a1"  # the hint takes the first GPUs of block A, all on node-a1
    assert all(node in u for u in taken)
    nodes[node], _ = fold_cluster_event(
        nodes[node], make_event(ClusterEventType.PREEMPT, node, taken), "s", 99, T0_MS
    )
    forced = decide(tables, T0_MS + 1000, Trigger.TOPOLOGY_CHANGE, (gpus, nodes))
    assert forced is not None and forced.decision.forced
    assert forced.decision.reason == DecisionReason.FORCED_INFEASIBLE.value
    assert forced.plan.current is not None and forced.plan.current.gpu_uuids.isdisjoint(taken)
    assert forced.plan.source is PlanSource.DECISION and "not live" in forced.decision.explanation
    assert forced.decision.decision is not None
    assert forced.decision.decision.to_plan_id == forced.decision.to_plan_id


def test_a_forced_switch_never_targets_gpus_another_deployments_plan_holds() -> None:
    out = decide(FRESH, T0_MS)
    assert out is not None and out.plan.current is not None
    tables = after(FRESH, out)
    taken = tuple(sorted(out.plan.current.gpu_uuids))
    gpus, nodes = folded()
    nodes["node-a1"], _ = fold_cluster_event(
        nodes["node-a1"], make_event(ClusterEventType.PREEMPT, "node-a1", taken), "s", 99, T0_MS
    )
    free = decide(tables, T0_MS + 1000, Trigger.TOPOLOGY_CHANGE, (gpus, nodes))
    assert free is not None and free.plan.current is not None
    # another deployment holds exactly the GPUs the unconstrained answer picked (its telemetry
    # not caught up yet): the answer must go elsewhere, and still be forced
    held = free.plan.current.gpu_uuids
    other = DeploymentPlan("assist", free.plan.current.model_name, free.plan.current.replicas)
    claims = claimed_gpus({"assist": PlanState(current=other)}, CHAT.name)
    assert claims == held
    boxed = decide(tables, T0_MS + 1000, Trigger.TOPOLOGY_CHANGE, (gpus, nodes), claims)
    assert boxed is not None and boxed.decision.forced
    assert boxed.plan.current is not None and boxed.plan.current.gpu_uuids.isdisjoint(held)
    assert boxed.plan.current.gpu_uuids.isdisjoint(taken)


def test_gpus_a_neighbours_handover_takes_force_the_plan_off_them() -> None:
    out = decide(FRESH, T0_MS)
    assert out is not None and out.plan.current is not None
    tables = after(FRESH, out)
    mine = sorted(out.plan.current.gpu_uuids)
    # "assist" decided a handover onto two of our GPUs; its switch is in flight
    handed = tuple(mine[:2])
    target = DeploymentPlan("assist", out.plan.current.model_name, out.plan.current.replicas)
    marker = InFlight("assist:4", 4, target.plan_id, T0_MS, handed)
    plans = {CHAT.name: tables.plan, "assist": PlanState(current=target, in_flight=marker)}
    taken = taken_gpus(plans, CHAT.name)
    assert taken == tuple((u, "assist") for u in handed)
    assert taken_gpus(plans, "assist") == ()
    claims = claimed_gpus(plans, CHAT.name)
    moved = decide(tables, T0_MS + 1000, Trigger.TOPOLOGY_CHANGE, None, claims, taken)
    assert moved is not None and moved.decision.forced
    assert moved.plan.current is not None and moved.plan.current.gpu_uuids.isdisjoint(handed)
    assert f"{', '.join(handed)} handed over to assist" in moved.decision.explanation
    # once the handover settled (no marker), nothing is taken: the GPUs are a plain claim
    settled = {**plans, "assist": PlanState(current=target)}
    assert taken_gpus(settled, CHAT.name) == ()


def test_claims_are_other_deployments_assumed_and_confirmed_plans() -> None:
    out = decide(FRESH, T0_MS)
    assert out is not None and out.plan.current is not None
    mine = out.plan.current
    plans = {CHAT.name: out.plan, "assist": PlanState(confirmed=mine)}
    assert claimed_gpus(plans, CHAT.name) == mine.gpu_uuids  # assist's confirmed plan
    assert claimed_gpus(plans, "assist") == mine.gpu_uuids  # chat's assumed plan
    assert claimed_gpus({CHAT.name: out.plan}, CHAT.name) == frozenset()


def test_tick_boundaries_are_shared_by_every_worker() -> None:
    assert tick_due_ms(T0_MS + 14_999, 15.0) == T0_MS
    assert tick_due_ms(T0_MS + 15_000, 15.0) == T0_MS + 15_000


def test_reconcile_takes_the_log_as_truth() -> None:
    out = decide(FRESH, T0_MS)
    assert out is not None
    logged = LoggedDecision(T0_MS, out.decision)
    # Tables behind the log (crash after the ack, before the table writes): roll forward.
    cursor, plan, _ = reconcile(Cursor(), PlanState(), GearState(), logged)
    assert cursor == Cursor(1, T0_MS)
    if out.decision.to_plan_id is not None:
        assert plan.current is not None and plan.current.plan_id == out.decision.to_plan_id
    # Nothing on the topic: start counting from zero.
    assert reconcile(Cursor(5, 9), PlanState(), GearState(), None)[0] == Cursor()


def test_transitions_confirm_and_roll_back() -> None:
    out = decide(FRESH, T0_MS)
    assert out is not None and out.plan.baseline is not None
    base = out.plan.baseline
    done = GearTransition(
        "chat",
        3,
        "chat:1",
        TransitionPhase.DONE,
        PhaseStatus.COMPLETED,
        None,
        base.plan_id,
        plan=base,
    )
    plan = fold_transition(PlanState(), done)
    assert plan.current == base and plan.confirmed == base and plan.source is PlanSource.TRANSITION
    stale = replace(done, transition_seq=2, plan=None)
    assert fold_transition(plan, stale) == plan
    ours = replace(plan, current=None, source=PlanSource.DECISION, decision_id="chat:7")
    back = GearTransition(
        "chat", 4, "chat:7", TransitionPhase.ROLLED_BACK, PhaseStatus.COMPLETED, None, None
    )
    assert fold_transition(ours, back).current == base


def test_a_rollback_quarantines_its_target_in_the_gear_state() -> None:
    back = GearTransition(
        "chat", 4, "chat:7", TransitionPhase.ROLLED_BACK, PhaseStatus.COMPLETED, "dp-a", "dp-b"
    )
    gear = fold_rollback(GearState(), back, T0_MS, DEFAULT_CONFIG)
    assert [(f.plan_id, f.t_s) for f in gear.failed] == [("dp-b", T0_MS / 1000.0)]
    done = replace(back, phase=TransitionPhase.DONE)
    assert fold_rollback(GearState(), done, T0_MS, DEFAULT_CONFIG) == GearState()


def test_operator_commands_override_the_optimiser() -> None:
    out = decide(FRESH, T0_MS)
    assert out is not None
    tables = after(FRESH, out)
    cmd = ControlCommand("chat", ControlAction.PIN)
    ov = fold_control(OverrideState(), tables.plan, cmd, T0_MS)
    assert tables.plan.current is not None and ov.pinned_plan_id == tables.plan.current.plan_id
    down = fold_control(
        ov, tables.plan, ControlCommand("chat", ControlAction.EMERGENCY_DOWNSHIFT), T0_MS
    )
    assert down.emergency
    res = decide(replace(tables, overrides=down), T0_MS + 1, Trigger.OPERATOR)
    assert res is not None
    assert res.decision.reason in {DecisionReason.EMERGENCY_DOWNSHIFT.value}
    unknown = replace(OverrideState(), pinned_plan_id="dp-nope")
    held = decide(replace(tables, overrides=unknown), T0_MS + 2)
    assert held is not None and "unknown plan dp-nope ignored" in held.decision.explanation
    cleared = fold_control(
        down, tables.plan, ControlCommand("chat", ControlAction.CLEAR_DOWNSHIFT), T0_MS
    )
    assert not cleared.emergency
    assert isinstance(tables.plan.current, DeploymentPlan)
