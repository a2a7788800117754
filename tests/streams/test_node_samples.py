"""The batched per-node kind: one message per node per interval folds as its items would."""

from __future__ import annotations

import asyncio

import pytest

from flexpipe import envelope
from flexpipe.config import load_config
from flexpipe.schemas import Kind, NodeSamples
from flexpipe.topics import Topic, telemetry_route, topic_name
from streams.deployments import resolve_deployments
from streams.intake import Accepted, DeadLetterReason, Rejected, SourceTopic, admit
from streams.ports import Message
from streams.processor import StreamProcessor
from tests.streams.builders import T0_MS, make_launches, make_sample, streams_config
from tests.streams.fakes import make_engine

pytestmark = pytest.mark.unit

CFG = streams_config()
CATALOG, DEPLOYMENTS = resolve_deployments(CFG)


def _batch(t_ms: int, used_gib: float) -> NodeSamples:
    samples = tuple(
        make_sample(f"gpu-{i}", node="node-0", index=i, used_gib=used_gib + i) for i in range(4)
    )
    launches = tuple(make_launches(f"gpu-{i}") for i in range(4))
    return NodeSamples("node-0", samples=samples, launches=launches)


def _engine() -> StreamProcessor:
    engine, _, _ = make_engine(CFG, CATALOG, DEPLOYMENTS, wall=[T0_MS / 1000])
    return engine


def _events(engine: StreamProcessor, kind: Kind) -> float:
    return engine.metrics.events.labels(kind.value)._value.get()


def _duplicates(engine: StreamProcessor, kind: Kind) -> float:
    return engine.metrics.duplicates.labels(kind.value)._value.get()


async def _feed(engine: StreamProcessor, src: SourceTopic, payload: object, key: str) -> None:
    env = envelope.make(payload, event_time_ms=T0_MS, source="node-0/nvml", seq=1)
    msg = Message("t", 0, 0, key.encode(), envelope.encode(env))
    await engine.on_message(src, msg)


def test_a_batch_folds_as_its_items_folded_one_by_one() -> None:
    batch = _batch(T0_MS, 10.0)
    by_node, one_by_one = _engine(), _engine()

    async def run() -> None:
        await _feed(by_node, SourceTopic.NODE, batch, "node-0")
        for sample in batch.samples:
            await _feed(one_by_one, SourceTopic.GPU, sample, sample.gpu_uuid)
        for report in batch.launches:
            await _feed(one_by_one, SourceTopic.LAUNCHES, report, report.gpu_uuid)

    asyncio.run(run())
    assert by_node._gpus == one_by_one._gpus and len(by_node._gpus) == 4
    assert by_node._loads == one_by_one._loads and len(by_node._loads) == 4
    for kind in (Kind.GPU_SAMPLE, Kind.KERNEL_LAUNCHES):
        assert _events(by_node, kind) == _events(one_by_one, kind) == 4
    by_node.flush()
    one_by_one.flush()
    assert by_node.view.gpus == one_by_one.view.gpus


def test_a_redelivered_batch_counts_as_duplicates_and_changes_nothing() -> None:
    engine = _engine()
    batch = _batch(T0_MS, 10.0)

    async def run() -> None:
        await _feed(engine, SourceTopic.NODE, batch, "node-0")
        before = dict(engine._gpus)
        await _feed(engine, SourceTopic.NODE, batch, "node-0")
        assert engine._gpus == before

    asyncio.run(run())
    assert _events(engine, Kind.GPU_SAMPLE) == 4
    assert _duplicates(engine, Kind.GPU_SAMPLE) == 4
    assert _duplicates(engine, Kind.KERNEL_LAUNCHES) == 4


def _admit(payload: NodeSamples, key: bytes | None) -> Accepted | Rejected:
    env = envelope.make(payload, event_time_ms=T0_MS, source="node-0/nvml", seq=1)
    return admit(SourceTopic.NODE, key, envelope.encode(env), T0_MS / 1000, T0_MS / 1000, 60.0)


def test_intake_admits_a_node_batch_keyed_by_its_node() -> None:
    assert isinstance(_admit(_batch(T0_MS, 1.0), b"node-0"), Accepted)
    wrong_key = _admit(_batch(T0_MS, 1.0), b"gpu-0")
    assert isinstance(wrong_key, Rejected)
    assert wrong_key.reason is DeadLetterReason.KEY_MISMATCH


def test_intake_rejects_an_item_of_another_node() -> None:
    good = _batch(T0_MS, 1.0)
    stray = make_sample("gpu-9", node="node-1")
    verdict = _admit(NodeSamples("node-0", samples=(*good.samples, stray)), b"node-0")
    assert isinstance(verdict, Rejected)
    assert verdict.reason is DeadLetterReason.INVALID_FIELD
    assert verdict.field == "payload.samples.4.node"


def test_node_batches_travel_the_node_topic_keyed_by_node() -> None:
    cfg = load_config()
    topic, key = telemetry_route(cfg, _batch(T0_MS, 1.0))
    assert (topic, key) == (topic_name(cfg, Topic.NODE), b"node-0")
