"""The cluster consumer of the worker's own (streams.peek): only the next offset is folded."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from aiokafka import TopicPartition

from flexpipe import envelope
from flexpipe.schemas import ClusterEventType
from streams.intake import SourceTopic
from streams.peek import ClusterPeek
from streams.ports import Message
from tests.streams.builders import SMALL_CLUSTER, T0_MS, env, gpu_uuid, make_event
from tests.streams.test_processor import CFG, started

pytestmark = pytest.mark.unit
TOPIC = SourceTopic.CLUSTER.value


@dataclass
class Rec:
    offset: int
    key: bytes
    value: bytes


@dataclass
class FakeConsumer:
    log: list[Rec]
    assigned: set[TopicPartition] = field(default_factory=set)
    position: dict[TopicPartition, int] = field(default_factory=dict)

    def assignment(self) -> set[TopicPartition]:
        return set(self.assigned)

    def assign(self, tps: list[TopicPartition]) -> None:
        self.assigned = set(tps)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.position[tp] = offset

    async def getmany(self, **_: Any) -> dict[TopicPartition, list[Rec]]:
        out = {}
        for tp in self.assigned:
            recs = [r for r in self.log if r.offset >= self.position[tp]]
            if recs:
                out[tp] = recs
                self.position[tp] = recs[-1].offset + 1
        return out


async def test_the_peek_folds_the_next_offsets_and_passes_what_faust_folded() -> None:
    engine, _, _, wall = await started()
    wall[0] = (T0_MS + 1000) / 1000
    domain, _, _, node, i = SMALL_CLUSTER[0]
    at = engine.next_offset(TOPIC, 0)
    assert at is not None
    kinds = (ClusterEventType.PREEMPT, ClusterEventType.RELEASE, ClusterEventType.PREEMPT)
    log = [
        Rec(
            at + n,
            node.encode(),
            envelope.encode(
                env(
                    make_event(k, node, gpus=(gpu_uuid(domain, node, i),)),
                    T0_MS + 1000 + n,
                    "scheduler",
                    500 + n,
                )
            ),
        )
        for n, k in enumerate(kinds)
    ]
    # faust's delivery folds the first; the peek then folds the other two, in order
    first = log[0]
    await engine.on_message(
        SourceTopic.CLUSTER, Message(TOPIC, 0, first.offset, first.key, first.value)
    )
    peek = ClusterPeek(CFG, engine, TOPIC)
    peek.assigned({0})
    consumer = FakeConsumer(log)
    consumer.position[TopicPartition(TOPIC, 0)] = at  # NOTE: as if behind: passes offset `at`
    consumer.assigned = {TopicPartition(TOPIC, 0)}
    await peek._round(consumer)
    assert peek.folded == 2 and engine.next_offset(TOPIC, 0) == at + 3
    gpu = gpu_uuid(domain, node, i)
    assert gpu in engine.view.nodes[node].reserved
    # faust's deliveries of the two are passed over
    for rec in log[1:]:
        await engine.on_message(
            SourceTopic.CLUSTER, Message(TOPIC, 0, rec.offset, rec.key, rec.value)
        )
    assert engine.metrics.cluster_peeked._value.get() == 2
    assert engine.metrics.duplicates.labels("cluster.event")._value.get() == 0
    # revoked: nothing is read
    peek.revoked()
    await peek._round(consumer)
    assert consumer.assigned == set()
