"""One decision in flight per deployment, stepped by hand: decide → fake transitions → assert.

The cluster is :data:`tests.streams.builders.SMALL_CLUSTER` with block A's nodes down at first:
the 7B deployment starts on its hint (TP1 on block B), the first tick switches it to a bigger
plan on block B, and once block A is back gearbox wants block A — a voluntary switch that must
wait while the first one is in flight.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace

import pytest

from flexpipe.config import ConfigError, DeploymentConfig, load_config
from flexpipe.schemas import ClusterEventType, GearTransition, PhaseStatus, TransitionPhase
from gearbox.config import DEFAULT_CONFIG
from gearbox.decisions import DecisionReason, Trigger
from gearbox.history import GearState
from gearbox.plans import DeploymentPlan
from streams import codec
from streams.codec import dumps, loads
from streams.deployments import resolve_deployments
from streams.inflight import InFlight
from streams.load import ServingWindows
from streams.ports import TableName
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
    fold_rollback,
    fold_transition,
    make_input,
    reconcile,
    step,
)
from streams.windows import HoppingWindow
from tests.streams.builders import T0_MS, env, heartbeats, make_event, streams_config
from tests.streams.fakes import FakeBroker
from tests.streams.test_processor import feed, started
from tests.streams.test_snapshot import folded

pytestmark = pytest.mark.unit

CFG = streams_config(
    deployments=(
        DeploymentConfig(name="chat", model="llama-2-7b", block="B", tp=1, arrival_rps=40.0),
    )
)
CATALOG, DEPLOYMENTS = resolve_deployments(CFG)
TIMEOUT_S = CFG.streams.transition_timeout_s
BLOCK_A = ("node-a1", "node-a2")
P, S, C = TransitionPhase.PREPARE, TransitionPhase.SWITCH, TransitionPhase.CLEANUP
DONE, ROLLED_BACK = TransitionPhase.DONE, TransitionPhase.ROLLED_BACK
STARTED, COMPLETED, FAILED = PhaseStatus.STARTED, PhaseStatus.COMPLETED, PhaseStatus.FAILED


def ms(at_s: float) -> int:
    return T0_MS + round(at_s * 1000)


def record(
    seq: int,
    phase: TransitionPhase,
    plan: DeploymentPlan,
    status: PhaseStatus = COMPLETED,
    decision: str | None = None,
) -> GearTransition:
    """A transitions-topic record as the runtime writes it (every record carries its target)."""
    return GearTransition(
        "chat",
        seq,
        decision or f"chat:{seq}",
        phase,
        status,
        None,
        plan.plan_id,
        plan=plan,
    )


@dataclass
class Loop:
    """One deployment's tables and the cluster view, decided by hand like the live worker."""

    tables: DeploymentTables = field(
        default_factory=lambda: DeploymentTables(
            PlanState(), GearState(), OverrideState(), Cursor(), ServingWindows()
        )
    )
    view: tuple[dict[str, GpuState], dict[str, NodeState]] = field(default_factory=folded)
    timeout_s: float = TIMEOUT_S
    outs: list[StepOutput] = field(default_factory=list)
    events: int = 0

    def __post_init__(self) -> None:
        for node in BLOCK_A:
            self.event(ClusterEventType.NODE_DOWN, node, at_s=0.0)

    def event(
        self, kind: ClusterEventType, node: str, gpus: tuple[str, ...] = (), *, at_s: float
    ) -> None:
        self.events += 1
        nodes = self.view[1]
        nodes[node], _ = fold_cluster_event(
            nodes[node], make_event(kind, node, gpus), "scheduler", 1000 + self.events, ms(at_s)
        )

    def block_a_back(self, at_s: float) -> None:
        for node in BLOCK_A:
            self.event(ClusterEventType.NODE_UP, node, at_s=at_s)

    def decide(self, at_s: float, kind: Trigger = Trigger.TIMER) -> StepOutput:
        """Decide, then store the outcome as the worker does after the broker's ack."""
        inp = make_input(
            DEPLOYMENTS[0],
            DEPLOYMENTS,
            self.tables,
            self.view,
            CATALOG,
            HoppingWindow(60, 10),
            ms(at_s),
            TriggerInfo(kind, ms(at_s), "test"),
            1e9,  # heartbeats never time out here: the view is folded once
            DEFAULT_CONFIG,
            "w",
            transition_timeout_s=self.timeout_s,
        )
        out = step(inp)
        assert out is not None
        self.tables = replace(self.tables, plan=out.plan, gear=out.gear, cursor=out.cursor)
        return out

    def fold(self, *records: GearTransition, at_s: float = 0.0) -> None:
        """Fold transitions-topic records as the engine does (plan, then the quarantine)."""
        for tr in records:
            plan = fold_transition(self.tables.plan, tr)
            gear = fold_rollback(self.tables.gear, tr, ms(at_s), DEFAULT_CONFIG)
            self.tables = replace(self.tables, plan=plan, gear=gear)

    @property
    def plan(self) -> PlanState:
        return self.tables.plan

    def ticks(self, from_s: float, to_s: float) -> list[StepOutput]:
        return [self.decide(15.0 * i) for i in range(round(from_s / 15), round(to_s / 15) + 1)]


def first_switch(loop: Loop) -> tuple[DeploymentPlan, DeploymentPlan]:
    """The hint and the first switch's target; the switch is in flight from now on."""
    out = loop.decide(0.0)
    loop.outs.append(out)
    hint, target = out.plan.baseline, out.result.decision
    assert hint is not None and target is not None
    assert out.decision.reason == DecisionReason.SWITCH_GAIN.value
    assert out.plan.in_flight == InFlight("chat:1", 1, target.to_plan_id, T0_MS)
    in_flight = out.decision.context.in_flight
    assert in_flight is not None and in_flight.decision_id == "chat:1"
    return hint, target.to_plan


def adopted(hint: DeploymentPlan) -> tuple[GearTransition, ...]:
    """The runtime's start-up transition 0: it loads the hint, which then serves."""
    steps = ((P, STARTED), (P, COMPLETED), (S, COMPLETED), (C, COMPLETED), (DONE, COMPLETED))
    return tuple(record(0, phase, hint, status, "chat:start") for phase, status in steps)


def test_a_switch_in_flight_is_never_emitted_twice_nor_followed_by_another() -> None:
    loop = Loop()
    hint, target = first_switch(loop)
    # The runtime's start-up transition finishes after our decision: it must not rewind us.
    loop.fold(*adopted(hint), record(1, P, target, STARTED), record(1, P, target, FAILED))
    assert loop.plan.current == target and loop.plan.confirmed == hint
    assert loop.plan.in_flight is not None and loop.plan.in_flight.decision_id == "chat:1"
    loop.block_a_back(at_s=30.0)
    outs = loop.ticks(15.0, TIMEOUT_S - 15.0)
    assert [o.decision.to_plan_id for o in outs] == [None] * len(outs)
    held = [o for o in outs if o.decision.reason == DecisionReason.TRANSITION_IN_FLIGHT.value]
    assert held, "gearbox wanted block A once the cooldown ended: held while chat:1 is in flight"
    assert "chat:1 → " in held[0].decision.explanation
    assert held[0].result.retry_after_s == ms(TIMEOUT_S) / 1000.0
    assert loop.tables.gear.last_switch_s == T0_MS / 1000.0  # a held switch is no switch
    assert loop.plan.in_flight is not None and loop.plan.in_flight.decision_id == "chat:1"


def test_the_in_flight_target_is_never_targeted_again() -> None:
    loop = Loop()
    hint, target = first_switch(loop)
    # Tables that lost the decision's effects but its marker (the flapping seen live): gearbox,
    # deciding from the hint again, proposes the very switch that is in flight.
    loop.tables = replace(loop.tables, plan=replace(loop.plan, current=hint), gear=GearState())
    out = loop.decide(15.0)
    assert out.decision.to_plan_id is None
    assert out.decision.reason == DecisionReason.TRANSITION_IN_FLIGHT.value
    assert f"{target.plan_id} is the target of chat:1" in out.decision.explanation


def test_done_settles_the_flight_and_the_next_switch_goes_out() -> None:
    loop = Loop()
    _, target = first_switch(loop)
    loop.block_a_back(at_s=30.0)
    held = loop.decide(150.0)
    assert held.decision.reason == DecisionReason.TRANSITION_IN_FLIGHT.value
    loop.fold(record(1, P, target, STARTED), record(1, C, target), record(1, DONE, target))
    assert loop.plan.in_flight is None
    assert loop.plan.confirmed == target and loop.plan.source is PlanSource.TRANSITION
    out = loop.decide(165.0)
    assert out.decision.reason == DecisionReason.SWITCH_GAIN.value
    assert out.decision.from_plan_id == target.plan_id and out.decision.to_plan_id is not None
    assert out.plan.in_flight is not None and out.plan.in_flight.decision_id == "chat:3"


def test_a_rollback_settles_the_flight_and_the_loop_decides_from_the_serving_plan() -> None:
    loop = Loop()
    hint, target = first_switch(loop)
    loop.fold(*adopted(hint))
    loop.block_a_back(at_s=30.0)
    assert loop.decide(150.0).decision.reason == DecisionReason.TRANSITION_IN_FLIGHT.value
    loop.fold(record(1, S, target, FAILED), record(1, ROLLED_BACK, target), at_s=155.0)
    assert loop.plan.in_flight is None
    assert loop.plan.current == hint and loop.plan.source is PlanSource.TRANSITION
    out = loop.decide(165.0)
    assert out.decision.reason == DecisionReason.SWITCH_GAIN.value
    assert out.decision.from_plan_id == hint.plan_id
    assert out.decision.to_plan_id not in (None, hint.plan_id, target.plan_id)


def test_after_the_timeout_the_loop_decides_again_from_the_confirmed_plan() -> None:
    loop = Loop()
    hint, target = first_switch(loop)
    loop.fold(*adopted(hint), record(1, P, target, STARTED))
    loop.block_a_back(at_s=30.0)
    before = loop.decide(TIMEOUT_S - 15.0)
    assert before.decision.reason == DecisionReason.TRANSITION_IN_FLIGHT.value
    out = loop.decide(TIMEOUT_S)
    assert out.decision.reason == DecisionReason.SWITCH_GAIN.value
    assert f"not reported done or rolled back within {TIMEOUT_S:g} s" in out.decision.explanation
    assert f"deciding again from {hint.plan_id}" in out.decision.explanation
    assert out.decision.from_plan_id == hint.plan_id and out.decision.to_plan_id is not None
    assert out.plan.in_flight is not None and out.plan.in_flight.decision_id == "chat:3"
    # The late DONE of the timed-out transition is still followed (the runtime serves it now),
    # and leaves the new decision in flight: it is the runtime's next transition.
    loop.fold(record(1, DONE, target))
    assert loop.plan.confirmed == target and loop.plan.in_flight == out.plan.in_flight
    decided = out.result.decision
    assert decided is not None and loop.plan.current == decided.to_plan


def test_after_the_timeout_without_any_runtime_report_the_flight_is_dropped() -> None:
    loop = Loop(timeout_s=60.0)
    _, target = first_switch(loop)
    assert loop.decide(45.0).plan.in_flight is not None
    out = loop.decide(60.0)
    assert out.plan.in_flight is None and "deciding again" in out.decision.explanation
    assert out.plan.current == target  # nothing confirmed another plan: keep assuming it


def test_a_forced_decision_supersedes_the_flight() -> None:
    loop = Loop()
    hint, target = first_switch(loop)
    loop.fold(*adopted(hint), record(1, P, target, STARTED))
    loop.block_a_back(at_s=10.0)
    lost = tuple(sorted(target.gpu_uuids))
    for node in sorted({u.split("-", 2)[2].rsplit("-", 1)[0] for u in lost}):
        on_node = tuple(u for u in lost if node in u)
        loop.event(ClusterEventType.PREEMPT, node, on_node, at_s=10.0)
    out = loop.decide(10.0, Trigger.TOPOLOGY_CHANGE)
    assert out.decision.forced and out.decision.reason == DecisionReason.FORCED_INFEASIBLE.value
    assert out.decision.to_plan_id not in (None, hint.plan_id, target.plan_id)
    assert "supersedes chat:1" in out.decision.explanation
    assert out.plan.in_flight is not None and out.plan.in_flight.decision_id == "chat:2"
    # The runtime rolls the first transition back (its GPUs are gone); ours stays in flight.
    loop.fold(record(1, ROLLED_BACK, target), at_s=12.0)
    assert loop.plan.in_flight == out.plan.in_flight
    decided = out.result.decision
    assert decided is not None and loop.plan.current == decided.to_plan
    loop.fold(record(2, DONE, loop.plan.current), at_s=20.0)
    assert loop.plan.in_flight is None and loop.plan.confirmed == loop.plan.current


def test_no_decision_targets_the_plan_that_serves() -> None:
    loop = Loop()
    hint, target = first_switch(loop)
    loop.fold(record(1, DONE, target))
    # The plan table lost ``current`` (back on the hint) while the runtime serves ``target``:
    # gearbox proposes ``target`` again, which would only repeat what already happened.
    lost = replace(loop.plan, current=hint, source=PlanSource.HINT)
    loop.tables = replace(loop.tables, plan=lost, gear=GearState())
    out = loop.decide(15.0)
    assert out.decision.to_plan_id is None
    assert out.decision.reason == DecisionReason.ALREADY_SERVING.value
    assert f"{target.plan_id} is the plan the runtime serves" in out.decision.explanation
    assert out.gear.last_switch_s is None and out.plan.in_flight is None


def test_reconcile_restores_the_flight_from_the_last_logged_decision() -> None:
    loop = Loop()
    before = loop.tables
    _, target = first_switch(loop)
    logged = LoggedDecision(T0_MS, loop.outs[0].decision)
    marker = InFlight("chat:1", 1, target.plan_id, T0_MS)
    # Crash after the ack, before the table writes: the log's switch is in flight again.
    _, plan, _ = reconcile(before.cursor, before.plan, before.gear, logged)
    assert plan.in_flight == marker and plan.current == target
    # Tables written: reconciling changes nothing.
    t = loop.tables
    assert reconcile(t.cursor, t.plan, t.gear, logged) == (t.cursor, t.plan, t.gear)
    # Writes lost, but the runtime finished (or rolled back) meanwhile: nothing in flight.
    done = fold_transition(before.plan, record(1, DONE, target))
    _, plan, _ = reconcile(before.cursor, done, before.gear, logged)
    assert plan.in_flight is None and plan.current == target
    back = fold_transition(before.plan, record(1, ROLLED_BACK, target))
    _, plan, _ = reconcile(before.cursor, back, before.gear, logged)
    assert plan.in_flight is None and plan.current != target
    # The last logged decision is a hold: its context carries the marker.
    hold = loop.decide(15.0).decision
    assert hold.to_plan_id is None
    _, plan, _ = reconcile(Cursor(2), PlanState(), GearState(), LoggedDecision(ms(15.0), hold))
    assert plan.in_flight == marker
    # Nothing on the topic: nothing of ours is in flight.
    assert reconcile(t.cursor, t.plan, t.gear, None)[1].in_flight is None


def test_plan_state_with_a_flight_round_trips_through_the_tables() -> None:
    plan = PlanState(in_flight=InFlight("chat:4", 4, "dp-x", T0_MS), settled_seq=3)
    assert loads(PlanState, dumps(plan)) == plan
    assert loads(PlanState, b'{"transition_seq": 2}') == PlanState(transition_seq=2)


def test_the_timeout_is_configured_with_a_unit_and_bounds() -> None:
    assert load_config(env={}).streams.transition_timeout_s == 300.0
    env = {"FLEXPIPE_STREAMS__TRANSITION_TIMEOUT_S": "90"}
    assert load_config(env=env).streams.transition_timeout_s == 90.0
    with pytest.raises(ConfigError, match="transition_timeout_s"):
        load_config(env={"FLEXPIPE_STREAMS__TRANSITION_TIMEOUT_S": "0"})


@dataclass
class GatedBroker(FakeBroker):
    """Holds acknowledged sends until ``gate`` opens; ``sending`` is set while one waits."""

    gate: asyncio.Event = field(default_factory=asyncio.Event)
    sending: asyncio.Event = field(default_factory=asyncio.Event)

    async def __call__(self, topic: str, key: bytes | None, value: bytes, *, wait: bool) -> None:
        if wait:
            self.sending.set()
            await self.gate.wait()
        await super().__call__(topic, key, value, wait=wait)


async def test_a_transition_folded_while_a_decision_is_published_is_kept() -> None:
    engine, tables, broker, wall = await started()
    await engine.decider.tick()  # chat:1 (a hold on the hint), published and stored
    plan = engine.load(TableName.PLANS, "chat", PlanState)
    assert plan is not None and plan.baseline is not None and plan.confirmed is None
    gated = GatedBroker(sent=broker.sent)
    engine.send = gated
    await feed(engine, heartbeats(T0_MS + 15_000, 400), wall)
    deciding = asyncio.create_task(engine.decider.tick())
    await gated.sending.wait()  # chat:2 is being published; the runtime's start-up ends now
    done = GearTransition(
        "chat",
        0,
        "chat:start",
        DONE,
        COMPLETED,
        None,
        plan.baseline.plan_id,
        plan=plan.baseline,
    )
    folding = asyncio.create_task(feed(engine, [env(done, T0_MS + 15_000, "runtime", 1)], wall))
    await asyncio.sleep(0)  # one turn of the loop: the fold completes or waits for the lock
    gated.gate.set()
    await asyncio.gather(deciding, folding)
    assert [d.decision_id for d in gated.decisions()] == ["chat:1", "chat:2"]
    stored = codec.loads(PlanState, tables.data[TableName.PLANS][b"chat"])
    assert stored.confirmed == plan.baseline and stored.transition_seq == 0
