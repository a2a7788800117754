"""Integration: the agent rides out a 10 s broker outage on the real broker.

Two simulated node agents publish through the same outage: one with room to buffer everything
(nothing may be lost), one with a small buffer (every missing event is reported as dropped; a
dropped event may still have arrived only if it was sent and never acknowledged before the
broker went down — the broker may have written it, which at-least-once delivery cannot know).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from flexpipe import envelope
from flexpipe.config import FlexPipeConfig
from flexpipe.kafka import create_topics, make_consumer, make_producer, running
from flexpipe.kafka_local import LocalKafka
from flexpipe.topics import Topic, topic_name
from probes.agent import Agent, AgentClock, AgentMetrics
from probes.publisher import BufferedPublisher, PublisherMetrics
from sim.cluster import SimCluster, SimGpuSampler, SimLaunchCounter
from sim.scenario import SEED_FRAGMENTED, load_scenario

pytestmark = pytest.mark.integration

OUTAGE_S = 10.0
SPEED = 4.0  # simulated seconds per wall second: ~150 events/s per agent


def make_agent(cfg: FlexPipeConfig, node: str, max_buffer: int) -> tuple[Agent, BufferedPublisher]:
    scenario = load_scenario(SEED_FRAGMENTED)
    cluster = SimCluster(scenario, seed=3)
    registry = CollectorRegistry()
    publisher = BufferedPublisher(
        lambda: make_producer(cfg, request_timeout_ms=3000),
        PublisherMetrics(registry),
        max_buffer=max_buffer,
        ack_timeout_s=3.0,
        backoff_s=(0.2, 1.0),
    )
    clock = AgentClock(time.monotonic, time.monotonic(), scenario.epoch_ms, speed=SPEED)
    agent = Agent(
        cfg,
        node,
        SimGpuSampler(cluster, node),
        SimLaunchCounter(cluster, node),
        publisher,
        AgentMetrics(registry),
        clock,
    )
    return agent, publisher


async def received_seqs(cfg: FlexPipeConfig, sources: set[str]) -> dict[str, set[int]]:
    topics = [topic_name(cfg, t) for t in (Topic.GPU, Topic.LAUNCHES, Topic.CLUSTER)]
    consumer = make_consumer(cfg, *topics, group_id=None)
    seqs: dict[str, set[int]] = {s: set() for s in sources}
    async with running(consumer):
        idle_rounds = 0
        while idle_rounds < 3:
            batch = await consumer.getmany(timeout_ms=1000)
            idle_rounds = 0 if batch else idle_rounds + 1
            for records in batch.values():
                for rec in records:
                    env = envelope.decode(rec.value)
                    if env.source in seqs:
                        seqs[env.source].add(env.seq)
    return seqs


async def wait_for(condition: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.1)


async def test_outage_loses_nothing_with_room_and_counts_every_loss_as_dropped(
    kafka_cfg: FlexPipeConfig, local_kafka: LocalKafka | None
) -> None:
    if local_kafka is None:
        pytest.skip("a user-configured broker is in use; this test must stop and restart it")
    await create_topics(kafka_cfg)
    roomy, roomy_pub = make_agent(kafka_cfg, "node-a1", max_buffer=100_000)
    tight, tight_pub = make_agent(kafka_cfg, "node-b1", max_buffer=300)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(a.run(stop)) for a in (roomy, tight)]
    await wait_for(lambda: roomy_pub.published > 50 and tight_pub.published > 50, 20)

    await asyncio.to_thread(local_kafka.down)
    await asyncio.sleep(OUTAGE_S)
    await asyncio.to_thread(local_kafka.up)
    await wait_for(lambda: len(roomy_pub) == 0 and len(tight_pub) == 0, 30)
    stop.set()
    await asyncio.gather(*tasks)

    seqs = await received_seqs(kafka_cfg, {"node-a1/sim", "node-b1/sim"})
    for agent, pub, source in (
        (roomy, roomy_pub, "node-a1/sim"),
        (tight, tight_pub, "node-b1/sim"),
    ):
        emitted = agent.emitted()[source]
        missing = set(range(1, emitted + 1)) - seqs[source]
        assert len(missing) <= pub.dropped <= len(missing) + pub.requeued, (
            f"{source}: missing {len(missing)} vs dropped {pub.dropped} "
            f"({pub.requeued} requeued unacknowledged)"
        )
    assert roomy_pub.dropped == 0
    assert tight_pub.dropped > 0, "the small buffer should have overflowed during the outage"
