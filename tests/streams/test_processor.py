"""The engine over fake ports: folding, throttled publication, dead letters, deciding, recovery."""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Iterable
from typing import Any

import orjson
import pytest

from flexpipe import envelope
from flexpipe.envelope import Envelope
from flexpipe.schemas import ClusterEventType
from gearbox.decisions import Trigger
from streams import decider as decider_module
from streams.deployments import resolve_deployments
from streams.intake import SourceTopic
from streams.ports import Message, TableName
from streams.processor import StreamProcessor
from streams.step import PlanState, TriggerInfo
from tests.streams.builders import (
    SMALL_CLUSTER,
    T0_MS,
    cluster_envelopes,
    env,
    gpu_uuid,
    heartbeats,
    make_event,
    make_sample,
    streams_config,
)
from tests.streams.fakes import TOPICS, FakeBroker, FakeTables, make_engine

pytestmark = pytest.mark.unit

CFG = streams_config()
CATALOG, DEPLOYMENTS = resolve_deployments(CFG)
_TOPIC = {
    "gpu.sample": SourceTopic.GPU,
    "kernel.launches": SourceTopic.LAUNCHES,
    "cluster.event": SourceTopic.CLUSTER,
    "serving.load": SourceTopic.SERVING,
    "gear.transition": SourceTopic.TRANSITIONS,
    "control.command": SourceTopic.CONTROL,
}


def key_of(e: Envelope[Any]) -> bytes:
    p = e.payload
    for attr in ("gpu_uuid", "deployment", "node"):
        if hasattr(p, attr):
            return str(getattr(p, attr)).encode()
    raise AssertionError(p)


async def feed(
    engine: StreamProcessor, envs: Iterable[Envelope[Any]], wall: list[float] | None = None
) -> None:
    for i, e in enumerate(envs):
        if wall is not None:
            wall[0] = e.event_time_ms / 1000
        src = _TOPIC[e.kind.value]
        await engine.on_message(src, Message(src.value, 0, i, key_of(e), envelope.encode(e)))


async def started() -> tuple[StreamProcessor, FakeTables, FakeBroker, list[float]]:
    """An engine that has seen the cluster come up, before it owned any deployment (so the
    NODE_UP topology changes decided nothing)."""
    wall = [T0_MS / 1000]
    owned: set[str] = set()
    engine, tables, broker = make_engine(CFG, CATALOG, DEPLOYMENTS, wall=wall, owned=owned)
    await feed(engine, cluster_envelopes(), wall)
    engine.flush()
    owned.update(d.name for d in DEPLOYMENTS)
    return engine, tables, broker, wall


async def test_samples_reach_the_view_only_on_material_change_or_refresh() -> None:
    engine, tables, _, wall = await started()
    assert len(engine.view.gpus) == 12 and tables.writes[TableName.GPUS] == 12
    await feed(engine, heartbeats(T0_MS + 1000, 100), wall)  # same values, 1 s later
    engine.flush()
    assert tables.writes[TableName.GPUS] == 12
    await feed(engine, heartbeats(T0_MS + 6000, 200), wall)  # past view_refresh_s
    engine.flush()
    assert tables.writes[TableName.GPUS] == 24
    assert all(g.rev == 2 for g in engine.view.gpus.values())


async def test_topology_change_is_stored_and_triggers_every_deployment() -> None:
    engine, _, broker, wall = await started()
    before = len(broker.sent[TOPICS.triggers])  # one per NODE_UP so far
    preempt = make_event(ClusterEventType.PREEMPT, "node-a1", (gpu_uuid("A", "node-a1", 0),))
    ev = env(preempt, T0_MS + 5, "s", 500)
    await feed(engine, [ev, ev], wall)  # the second is a redelivery
    assert len(broker.sent[TOPICS.triggers]) == before + 1
    assert engine.view.nodes["node-a1"].reserved == (gpu_uuid("A", "node-a1", 0),)
    assert engine.metrics.duplicates.labels("cluster.event")._value.get() == 1


async def test_topology_change_is_decided_in_process_after_the_debounce() -> None:
    engine, _, broker, wall = await started()
    preempt = make_event(ClusterEventType.PREEMPT, "node-a1", (gpu_uuid("A", "node-a1", 0),))
    started_s = time.monotonic()
    await feed(engine, [env(preempt, T0_MS + 5, "s", 500)], wall)
    assert broker.decisions() == []
    deadline_s = started_s + 30  # a busy machine may run the debounce timer late, never early
    while not broker.decisions():
        assert time.monotonic() < deadline_s, "no decision after the debounce"
        await asyncio.sleep(0.01)
    assert time.monotonic() - started_s >= CFG.streams.debounce_ms / 1000
    (decision,) = broker.decisions()
    assert decision.trigger == "topology_change" and "preempt on node-a1" in decision.explanation
    # The durable copy from the triggers topic arrives later and is recognised as decided.
    triggers = [
        Message("triggers", 0, i, k, v) for i, (k, v) in enumerate(broker.sent[TOPICS.triggers])
    ]
    await engine.decider.on_triggers(triggers[-1:], wall[0])
    assert len(broker.decisions()) == 1
    assert engine.metrics.skipped.labels("already_decided")._value.get() == 1


async def _settled(engine: StreamProcessor, broker: FakeBroker, decisions: int) -> None:
    """Wait until the debounced evaluation ran: a decision past ``decisions``, or a refusal."""
    refused = engine.metrics.skipped.labels("already_decided")
    before = refused._value.get()
    deadline_s = time.monotonic() + 30  # a busy machine may run the debounce timer late
    while len(broker.decisions()) == decisions and refused._value.get() == before:
        assert time.monotonic() < deadline_s, "the debounced evaluation never ran"
        await asyncio.sleep(0.01)


async def test_a_cluster_event_folded_after_a_later_decision_is_still_decided() -> None:
    engine, _, broker, wall = await started()
    await engine.decider.tick()  # chat:1, on the hint plan
    plan = engine.load(TableName.PLANS, "chat", PlanState)
    assert plan is not None and plan.current is not None
    serving = sorted(plan.current.gpu_uuids)[0]
    await feed(engine, heartbeats(T0_MS + 3000, 100), wall)
    other = make_event(ClusterEventType.PREEMPT, "node-b1", (gpu_uuid("B", "node-b1", 0),))
    await feed(engine, [env(other, T0_MS + 3000, "s", 500)], wall)
    await _settled(engine, broker, 1)  # chat:2 at t0 + 3 s
    # Cluster events are keyed by node: this one, a second older, reaches the worker after
    # the decision at t0 + 3 s, from a partition that trailed. It takes a GPU chat serves on.
    node = serving.split("-", 2)[2].rsplit("-", 1)[0]
    late = env(make_event(ClusterEventType.PREEMPT, node, (serving,)), T0_MS + 2000, "s", 501)
    await feed(engine, [late])
    await _settled(engine, broker, 2)
    decisions = broker.decisions()
    assert [d.decision_id for d in decisions] == ["chat:1", "chat:2", "chat:3"]
    assert decisions[2].forced and decisions[2].trigger == "topology_change"
    assert f"preempt on {node}" in decisions[2].explanation
    times = [envelope.decode(v).event_time_ms for _, v in broker.sent[TOPICS.decisions]]
    assert times[2] > times[1] == T0_MS + 3000, "decided after the cursor, at the clock"
    # The durable copies of both triggers arrive later and are recognised as decided.
    durable = [
        Message("triggers", 0, i, k, v) for i, (k, v) in enumerate(broker.sent[TOPICS.triggers])
    ]
    await engine.decider.on_triggers(durable[-2:], wall[0])
    assert len(broker.decisions()) == 3


async def test_a_cluster_event_folded_while_the_last_one_is_decided_is_decided_next() -> None:
    engine, _, broker, wall = await started()
    await engine.decider.tick()  # chat:1
    publishing, published = asyncio.Event(), asyncio.Event()
    record = engine.send

    async def slow(topic: str, key: bytes | None, value: bytes, *, wait: bool) -> None:
        if wait:  # NOTE: a decision's send, acknowledged once the test says so
            publishing.set()
            await published.wait()
        await record(topic, key, value, wait=wait)

    engine.send = slow
    first = make_event(ClusterEventType.PREEMPT, "node-b1", (gpu_uuid("B", "node-b1", 0),))
    await feed(engine, [env(first, T0_MS + 3000, "s", 500)], wall)
    await asyncio.wait_for(publishing.wait(), 30)  # its debounced decision is being sent ...
    second = make_event(ClusterEventType.PREEMPT, "node-b2", (gpu_uuid("B", "node-b2", 0),))
    await feed(engine, [env(second, T0_MS + 4000, "s", 501)], wall)  # ... when this one folds
    published.set()
    deadline_s = time.monotonic() + 30
    while len(broker.decisions()) < 3:
        assert time.monotonic() < deadline_s, "the second cluster event was never decided"
        await asyncio.sleep(0.01)
    decisions = broker.decisions()
    assert [d.trigger for d in decisions] == ["timer", "topology_change", "topology_change"]
    assert "preempt on node-b2" in decisions[2].explanation


async def test_bad_input_is_dead_lettered_and_the_stream_goes_on() -> None:
    engine, _, broker, wall = await started()
    await engine.on_message(SourceTopic.GPU, Message("gpu", 2, 41, b"k", b"{nope"))
    await feed(engine, heartbeats(T0_MS + 6000, 300), wall)
    ((_, value),) = broker.sent[TOPICS.deadletter]
    record = orjson.loads(value)
    assert record["reason"] == "not_json" and record["offset"] == 41 and record["partition"] == 2
    assert engine.metrics.dead_letters.labels("not_json", "gpu")._value.get() == 1
    assert engine.metrics.events.labels("gpu.sample")._value.get() == 24


async def test_ticks_decide_once_per_boundary_after_the_ack() -> None:
    engine, tables, broker, wall = await started()
    await engine.decider.tick()
    await engine.decider.tick()
    decisions = broker.decisions()
    assert [d.decision_id for d in decisions] == ["chat:1"]
    assert tables.writes[TableName.CURSORS] == 1
    # the TTFT gauges: nothing observed yet, so the estimate is the model's (factor 1)
    current = decisions[0].context.current
    assert current is not None and current.ttft_correction == 1.0
    metrics = engine.metrics
    assert metrics.ttft_correction.labels("chat")._value.get() == 1.0
    assert metrics.ttft_estimate.labels("chat")._value.get() == pytest.approx(
        current.est_ttft_p95_ms / 1000
    )
    assert metrics.ttft_observed.labels("chat")._value.get() == 0.0
    await feed(engine, heartbeats(T0_MS + 15_000, 400), wall)
    await engine.decider.tick()
    assert [d.decision_id for d in broker.decisions()] == ["chat:1", "chat:2"]


async def test_failed_send_writes_nothing_and_the_retry_reuses_the_id() -> None:
    engine, tables, broker, _ = await started()
    broker.fail_next = True
    await engine.decider.tick()  # logged, not raised: the next trigger or tick decides again
    assert tables.writes[TableName.CURSORS] == 0
    await engine.decider.tick()
    assert [d.decision_id for d in broker.decisions()] == ["chat:1"]


async def test_restart_after_ack_before_table_write_rolls_forward_from_the_log() -> None:
    engine, tables, broker, wall = await started()
    await engine.decider.tick()
    before_second = copy.deepcopy(tables)  # the worker dies after the ack of chat:2 ...
    await feed(engine, heartbeats(T0_MS + 15_000, 400), wall)
    await engine.decider.tick()
    assert len(broker.decisions()) == 2
    # ... and a new worker starts from the changelogs as they were, plus the same topic.
    again, _, _ = make_engine(
        CFG, CATALOG, DEPLOYMENTS, tables=before_second, broker=broker, wall=wall
    )
    await feed(again, heartbeats(T0_MS + 16_000, 500), wall)
    await again.decider.tick()  # boundary 15 s: already decided as chat:2 -> refused
    await feed(again, heartbeats(T0_MS + 30_000, 600), wall)
    await again.decider.tick()
    ids = [d.decision_id for d in broker.decisions()]
    assert ids == ["chat:1", "chat:2", "chat:3"]


async def test_a_topology_trigger_is_decided_and_revocation_stops_deciding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(decider_module, "LATER_S", 0.05)  # chat's plan is not disturbed
    engine, _, broker, wall = await started()
    await engine.decider.tick()
    info = TriggerInfo(Trigger.TOPOLOGY_CHANGE, T0_MS + 2000, "preempt")
    await engine.decider.on_revoked()
    await engine.decider.evaluate("chat", info, wall[0])
    assert len(broker.decisions()) == 1
    reads = engine.decider.decision_log.reads  # type: ignore[attr-defined]
    engine.decider.on_assigned()
    await feed(engine, heartbeats(T0_MS + 2000, 700), wall)
    await engine.decider.evaluate("chat", info, wall[0])
    deadline_s = time.monotonic() + 30
    while len(broker.decisions()) < 2:
        assert time.monotonic() < deadline_s, "the topology trigger was never decided"
        await asyncio.sleep(0.01)
    assert [d.trigger for d in broker.decisions()] == ["timer", "topology_change"]
    assert engine.decider.decision_log.reads == reads + 1  # type: ignore[attr-defined]


async def test_not_ready_and_not_owner_do_not_decide() -> None:
    wall = [T0_MS / 1000]
    cfg = streams_config(warmup_s=10.0)
    engine, _, broker = make_engine(cfg, CATALOG, DEPLOYMENTS, wall=wall, owned=set())
    await feed(engine, cluster_envelopes(), wall)
    await engine.decider.tick()
    assert broker.decisions() == []
    engine.decider.owns = lambda name: True
    await engine.decider.tick()  # owner now, but only 0 s of the 10 s warm-up seen
    assert broker.decisions() == []
    await feed(engine, heartbeats(T0_MS + 10_000, 100), wall)
    engine.flush()
    await engine.decider.tick()
    assert len(broker.decisions()) == 1


async def test_heartbeat_sweep_marks_silent_gpus() -> None:
    engine, _, _, wall = await started()
    silent = gpu_uuid("B", "node-b2", 1)
    later = [e for e in heartbeats(T0_MS + 50_000, 800) if e.payload.gpu_uuid != silent]
    await feed(engine, later, wall)
    assert engine.sweep() == 1
    engine.flush()
    assert engine.view.gpus[silent].timed_out
    await feed(
        engine,
        [
            env(
                make_sample(silent, node="node-b2", gpu_class="a100-80g", domain="B", index=1),
                T0_MS + 51_000,
                "x",
                1,
            )
        ],
        wall,
    )
    engine.flush()
    assert not engine.view.gpus[silent].timed_out


async def test_an_unacknowledged_decision_frees_the_decider_and_its_id_is_not_reused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(decider_module, "PUBLISH_WAIT_S", 0.05)
    engine, tables, broker, wall = await started()
    broker_back = asyncio.Event()
    record = engine.send

    async def away(topic: str, key: bytes | None, value: bytes, *, wait: bool) -> None:
        if wait:  # NOTE: the record lands once the broker is back, as a producer's retry does
            await broker_back.wait()
        await record(topic, key, value, wait=wait)

    engine.send = away
    await asyncio.wait_for(engine.decider.tick(), 1.0)  # bounded: the lock is free again
    assert not engine.decider.lock.locked() and tables.writes[TableName.CURSORS] == 0
    preempt = TriggerInfo(Trigger.TOPOLOGY_CHANGE, T0_MS + 2000, "preempt")
    await engine.decider.evaluate("chat", preempt, wall[0])  # chat:1 unresolved: deferred
    assert broker.decisions() == []
    broker_back.set()
    deadline = asyncio.get_running_loop().time() + 2.0
    while not broker.decisions() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
    await feed(engine, heartbeats(T0_MS + 2000, 700), wall)
    await engine.decider.tick()  # the deferred topology change first, after reading the log
    decisions = broker.decisions()
    assert [(d.decision_id, d.trigger) for d in decisions] == [
        ("chat:1", "timer"),
        ("chat:2", "topology_change"),
    ]


async def test_a_trailing_input_partition_holds_decisions_until_it_is_current() -> None:
    engine, _, broker, wall = await started()
    gpu = SourceTopic.GPU.value
    assert engine.trailing([(gpu, 0)]) == [], "its newest event is at the clock"
    assert engine.trailing([(gpu, 1)]) == [(gpu, 1)], "nothing processed from it yet"
    engine.input_current = False  # what the app sets from its consumer's positions
    preempt = TriggerInfo(Trigger.TOPOLOGY_CHANGE, T0_MS + 2000, "preempt")
    await engine.decider.evaluate("chat", preempt, wall[0])
    await engine.decider.tick()
    assert broker.decisions() == []
    engine.input_current = True
    await engine.decider.tick()
    assert [d.trigger for d in broker.decisions()] == ["topology_change"]


async def test_a_partition_trails_once_its_gpus_could_look_dead() -> None:
    # An agent sends each GPU at least once per heartbeat interval, so a partition read up to t
    # heard every GPU at t − heartbeat_s or later; its GPUs look dead once the clock passes
    # that by the heartbeat timeout, and only then may the partition hold decisions.
    engine, _, _, wall = await started()
    gpu = SourceTopic.GPU.value
    intervals = CFG.intervals
    hb_ms, timeout_ms = (
        round(intervals.heartbeat_s * 1000),
        round(intervals.heartbeat_timeout_s * 1000),
    )
    await feed(engine, heartbeats(T0_MS, 100), wall)
    engine.flush()
    one = next(heartbeats(T0_MS + hb_ms, 200))  # one GPU heard again; the others are not due
    await feed(engine, [one], wall)
    newest = T0_MS + hb_ms

    async def clock_to(t_ms: int, offset: int) -> None:
        # NOTE: another partition's sample moves the clock, as a cluster event read ahead does
        ahead = next(heartbeats(t_ms, 300 + offset))
        wall[0] = t_ms / 1000
        await engine.on_message(
            SourceTopic.GPU, Message(gpu, 1, offset, key_of(ahead), envelope.encode(ahead))
        )

    await clock_to(newest + timeout_ms - hb_ms, 0)
    assert engine.trailing([(gpu, 0)]) == [], "every GPU of partition 0 is live still"
    assert engine.sweep() == 0
    await clock_to(newest + timeout_ms - hb_ms + 1000, 1)
    assert engine.trailing([(gpu, 0)]) == [(gpu, 0)], "its GPUs heard at T0 would look dead"
    engine.input_current = False  # what the app sets from the trailing partition
    assert engine.sweep() == 0, "their news is still queued: silence is no evidence yet"
    engine.input_current = True
    assert engine.sweep() == len(engine.view.gpus) - 1, "all but the GPU heard since"


async def test_a_rebalance_keeps_how_far_each_partition_was_read() -> None:
    # A partition kept through a rebalance is not delivered again: forgetting how far it was
    # read made the input check count it behind for good when no new record came (a worker
    # that kept a cluster-events partition never decided again).
    engine, _, _, _ = await started()
    src = SourceTopic.CLUSTER
    read = engine.next_offset(src.value, 0)
    assert read is not None and read > 0
    engine.forget()
    assert engine.next_offset(src.value, 0) == read


async def test_a_cluster_event_read_ahead_is_folded_once_until_a_rebalance() -> None:
    engine, tables, _, wall = await started()
    domain, _, _, node, i = SMALL_CLUSTER[0]
    ev = make_event(ClusterEventType.PREEMPT, node, gpus=(gpu_uuid(domain, node, i),))
    raw = envelope.encode(env(ev, T0_MS + 1000, source="scheduler", seq=500))
    wall[0] = (T0_MS + 1000) / 1000
    topic = SourceTopic.CLUSTER.value
    at = engine.next_offset(topic, 0)
    assert at is not None
    writes = tables.writes[TableName.NODES]
    folded = engine.metrics.events.labels("cluster.event")
    before = folded._value.get()
    # streams.peek reads the next offset first; faust's delivery of it later is passed over
    await engine.on_message(
        SourceTopic.CLUSTER, Message(topic, 0, at, node.encode(), raw), peeked=True
    )
    await engine.on_message(SourceTopic.CLUSTER, Message(topic, 0, at, node.encode(), raw))
    assert tables.writes[TableName.NODES] == writes + 1 and folded._value.get() == before + 1
    assert engine.next_offset(topic, 0) == at + 1
    # after a rebalance, faust's delivery from the committed offset is folded (a duplicate here)
    engine.forget()
    await engine.on_message(SourceTopic.CLUSTER, Message(topic, 0, at, node.encode(), raw))
    assert engine.metrics.duplicates.labels("cluster.event")._value.get() == 1
