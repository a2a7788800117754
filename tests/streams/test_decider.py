"""The live decider's rounds: the deployment a cluster event disturbed is decided and sent at
once; the others are decided ``LATER_S`` later, merged with the changes that came meanwhile."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from flexpipe.config import DeploymentConfig
from flexpipe.envelope import Envelope
from flexpipe.schemas import (
    ClusterEventType,
    GearDecision,
    GearTransition,
    PhaseStatus,
    TransitionPhase,
)
from gearbox.plans import DeploymentPlan
from streams import decider as decider_module
from streams.decider import Decider
from streams.deployments import resolve_deployments
from streams.ports import TableName
from streams.processor import StreamProcessor
from streams.step import PlanState, StepInput, StepOutput
from tests.streams.builders import (
    SMALL_CLUSTER,
    T0_MS,
    cluster_envelopes,
    env,
    gpu_uuid,
    heartbeats,
    make_event,
    make_load,
    node_up,
    streams_config,
)
from tests.streams.fakes import FakeBroker, make_engine
from tests.streams.test_processor import feed

pytestmark = pytest.mark.unit

# NOTE: "chat" comes first in the configured order; "batch" is the one the events disturb.
CFG = streams_config(
    deployments=(
        DeploymentConfig(name="chat", model="llama-2-7b", block="A", tp=2, arrival_rps=2.0),
        DeploymentConfig(name="batch", model="llama-2-7b", block="B", tp=2, arrival_rps=1.0),
    )
)
CATALOG, DEPLOYMENTS = resolve_deployments(CFG)
T1_MS = T0_MS + 3000


async def ticked() -> tuple[StreamProcessor, FakeBroker, list[float]]:
    """An engine whose first tick decided chat:1 and batch:1."""
    wall = [T0_MS / 1000]
    owned: set[str] = set()
    engine, _, broker = make_engine(CFG, CATALOG, DEPLOYMENTS, wall=wall, owned=owned)
    await feed(engine, cluster_envelopes(), wall)
    engine.flush()
    owned.update(d.name for d in DEPLOYMENTS)
    await engine.decider.tick()
    assert [d.decision_id for d in broker.decisions()] == ["chat:1", "batch:1"]
    return engine, broker, wall


def preempt_one_of(engine: StreamProcessor, name: str, t_ms: int, seq: int) -> Envelope[Any]:
    """A PREEMPT of one GPU of ``name``'s plan."""
    plan = engine.load(TableName.PLANS, name, PlanState)
    assert plan is not None and plan.current is not None
    lost = sorted(plan.current.gpu_uuids)[0]
    node = next(n for d, _, _, n, i in SMALL_CLUSTER if gpu_uuid(d, n, i) == lost)
    return env(make_event(ClusterEventType.PREEMPT, node, (lost,)), t_ms, "scheduler", seq)


def quiet_event(t_ms: int) -> Envelope[Any]:
    """A topology change that disturbs no plan: a new node comes up."""
    return env(node_up("node-x1", "X", "nvlink"), t_ms, "scheduler", 501)


async def until(broker: FakeBroker, count: int) -> list[GearDecision]:
    deadline_s = time.monotonic() + 30  # a busy machine may run the debounce timer late
    while len(broker.decisions()) < count:
        assert time.monotonic() < deadline_s, f"{len(broker.decisions())} of {count} decisions"
        await asyncio.sleep(0.01)
    return broker.decisions()


def while_deciding(
    monkeypatch: pytest.MonkeyPatch,
    engine: StreamProcessor,
    name: str,
    then: Callable[[], Awaitable[None]],
) -> None:
    """Run ``then`` as ``name``'s next step ends (cluster events folded while it decided)."""
    decider = engine.decider
    assert isinstance(decider, Decider)
    step = decider._step
    fired: list[bool] = []

    async def stepped(inp: StepInput) -> StepOutput | None:
        out = await step(inp)
        if inp.deployment.name == name and not fired:
            fired.append(True)
            await then()
        return out

    monkeypatch.setattr(decider, "_step", stepped)


async def test_the_disturbed_deployment_is_decided_at_once_the_others_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(decider_module, "LATER_S", 0.2)
    engine, broker, wall = await ticked()
    started_s = time.monotonic()
    await feed(engine, [preempt_one_of(engine, "batch", T1_MS, 500)], wall)
    decisions = (await until(broker, 3))[2:]
    assert [(d.decision_id, d.forced) for d in decisions] == [("batch:2", True)]
    decisions = (await until(broker, 4))[2:]
    assert time.monotonic() - started_s >= 0.2, "chat's step waited LATER_S"
    assert [(d.decision_id, d.forced) for d in decisions] == [("batch:2", True), ("chat:2", False)]
    assert decisions[1].context.trigger_time_ms == T1_MS
    assert engine.metrics.skipped.labels("later")._value.get() == 1


async def test_changes_left_for_later_are_merged_into_one_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(decider_module, "LATER_S", 0.2)
    engine, broker, wall = await ticked()
    while_deciding(
        monkeypatch, engine, "batch", lambda: feed(engine, [quiet_event(T1_MS + 1000)], wall)
    )
    await feed(engine, [preempt_one_of(engine, "batch", T1_MS, 500)], wall)
    decisions = (await until(broker, 5))[2:]
    # chat's step for both events, and batch's for the second, in the configured order
    assert [d.decision_id for d in decisions] == ["batch:2", "chat:2", "batch:3"]
    assert decisions[1].context.trigger_time_ms == T1_MS + 1000
    assert "preempt on node-" in decisions[1].explanation
    assert "node_up on node-x1" in decisions[1].explanation
    assert engine.metrics.skipped.labels("later")._value.get() == 3


async def test_a_change_left_for_decision_s_is_decided_in_the_next_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(decider_module, "LATER_S", 60.0)  # only the bound decides chat
    engine, broker, wall = await ticked()
    await feed(engine, [preempt_one_of(engine, "batch", T1_MS, 500)], wall)
    await until(broker, 3)  # batch:2; chat's step left for later
    late_ms = T1_MS + round(CFG.intervals.decision_s * 1000)
    await feed(engine, [*heartbeats(late_ms, 600), quiet_event(late_ms)], wall)
    decisions = (await until(broker, 4))[2:]
    assert [d.decision_id for d in decisions] == ["batch:2", "chat:2"]
    assert decisions[1].context.trigger_time_ms == late_ms
    assert "preempt on node-" in decisions[1].explanation, "with the change it left"
    assert engine.metrics.skipped.labels("later")._value.get() == 2  # chat, then batch


async def test_a_tick_round_gives_way_to_a_pending_topology_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # chat's tick step is under way when batch's GPU is preempted: batch's tick step, not begun
    # yet, is left for later, so the forced switch waits for chat's step only
    monkeypatch.setattr(decider_module, "LATER_S", 60.0)  # the topology round decides batch
    engine, broker, wall = await ticked()
    due_ms = T0_MS + round(CFG.intervals.decision_s * 1000)
    await feed(engine, heartbeats(due_ms, 600), wall)
    preempt = preempt_one_of(engine, "batch", due_ms + 100, 500)
    while_deciding(monkeypatch, engine, "chat", lambda: feed(engine, [preempt], wall))
    await engine.decider.tick()
    decisions = (await until(broker, 4))[2:]
    assert [(d.decision_id, d.trigger, d.forced) for d in decisions] == [
        ("chat:2", "timer", False),
        ("batch:2", "topology_change", True),
    ]
    assert engine.metrics.skipped.labels("later")._value.get() == 2  # batch's tick, chat's change
    decider = engine.decider
    assert isinstance(decider, Decider) and decider._urgent == 0, "no round left counted waiting"


def done(name: str, seq: int, plan: DeploymentPlan, decision_id: str) -> GearTransition:
    """The runtime's report that transition ``seq`` of ``name`` now serves ``plan``."""
    return GearTransition(name, seq, decision_id, TransitionPhase.DONE, PhaseStatus.COMPLETED,
                          None, plan.plan_id, plan=plan)  # fmt: skip


async def test_a_switch_reported_done_onto_a_lost_gpu_is_decided_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A cluster event folded before the runtime's report of a switch is decided on the plan the
    # worker knew (with a feasible serving plan, a hold: the runtime is expected to roll back).
    # When the report says the target serves after all, its lost GPU is decided at once, not at
    # the next tick.
    engine, broker, wall = await ticked()
    plan = engine.load(TableName.PLANS, "batch", PlanState)
    assert plan is not None and plan.current is not None
    serving = plan.current
    await feed(engine, [env(done("batch", 0, serving, "batch:start"), T1_MS, "rt", 1)], wall)
    decider = engine.decider
    assert isinstance(decider, Decider)
    held: list[str] = []
    # NOTE: the event's own trigger, decided as such a hold: nothing new goes out for it
    monkeypatch.setattr(decider, "submit", lambda name, *_: held.append(name))
    await feed(engine, [preempt_one_of(engine, "batch", T1_MS + 100, 500)], wall)
    assert "batch" in held and len(broker.decisions()) == 2
    monkeypatch.undo()
    report = done("batch", 1, serving, "batch:1")
    await feed(engine, [env(report, T1_MS + 200, "rt", 2)], wall)
    answer = (await until(broker, 3))[-1]
    assert (answer.decision_id, answer.forced, answer.trigger) == (
        "batch:2",
        True,
        "topology_change",
    )
    assert "lost GPUs since it was decided" in answer.explanation


async def test_the_on_demand_steps_of_one_batch_read_one_view() -> None:
    """Each on-demand deployment decides from one round over all of them: the batch's later
    steps read the view its first one read, though serving reports fold and earlier steps
    decide meanwhile (else the round a later victim sees differs from the waiting model's)."""
    names = ("od-1", "od-2", "od-3")
    cfg = streams_config(
        deployments=tuple(
            DeploymentConfig(
                name=n, model="llama-2-7b", residency="on_demand", block="B", arrival_rps=0.5
            )
            for n in names
        )
    )
    catalog, deployments = resolve_deployments(cfg)
    wall = [T0_MS / 1000]
    owned: set[str] = set()
    engine, _, broker = make_engine(cfg, catalog, deployments, wall=wall, owned=owned)
    await feed(engine, cluster_envelopes(), wall)
    waiting = {"arrivals": 3, "arrival_rate_rps": 0.3, "queue_len": 2, "active_sequences": 0}
    loads = [env(make_load(n, **waiting), T0_MS + 1000 + i, "rt", 1) for i, n in enumerate(names)]
    await feed(engine, loads, wall)
    engine.flush()
    owned.update(names)
    decider = engine.decider
    assert isinstance(decider, Decider)
    step = decider._step
    inputs: list[StepInput] = []

    async def stepped(inp: StepInput) -> StepOutput | None:
        inputs.append(inp)
        out = await step(inp)
        # NOTE: a later report folds while the batch decides: od-3's requests went away
        quiet = make_load("od-3", arrivals=0, arrival_rate_rps=0.0, queue_len=0)
        wall[0] += 0.5
        await feed(engine, [env(quiet, round(wall[0] * 1000), "rt", 1 + len(inputs))], wall)
        return out

    decider._step = stepped  # type: ignore[method-assign]
    wall[0] = (T0_MS + 15_000) / 1000
    await decider.tick()
    assert [i.deployment.name for i in inputs] == list(names)
    first = inputs[0]
    for later in inputs[1:]:
        assert later.on_demand == first.on_demand
        assert later.topology == first.topology
    reasons = {d.deployment: d.reason for d in broker.decisions()}
    assert reasons == dict.fromkeys(names, "load_on_demand"), reasons
