"""Integration: the real broker keeps every envelope, byte for byte, in order per key."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from flexpipe import envelope
from flexpipe.config import FlexPipeConfig
from flexpipe.errors import FlexPipeError
from flexpipe.kafka import (
    client_kwargs,
    create_topics,
    delete_topics_with_prefix,
    make_consumer,
    make_producer,
)
from flexpipe.schemas import ServingLoad
from flexpipe.topics import CATALOG, Topic, topic_name

pytestmark = pytest.mark.integration

NUM_MESSAGES = 10_000
KEYS = [f"deployment-{i}" for i in range(7)]


def _load(i: int) -> ServingLoad:
    return ServingLoad(
        deployment=KEYS[i % len(KEYS)],
        model="llama-7b-class",
        window_s=10.0,
        arrivals=i,
        arrival_rate_rps=i / 10,
        queue_len=i % 13,
        active_sequences=i % 50,
        prefill_tokens_per_s=1000.0 + i,
        decode_tokens_per_s=200.0 + i,
    )


async def test_topics_create_is_idempotent(kafka_cfg: FlexPipeConfig) -> None:
    first = await create_topics(kafka_cfg)
    assert sorted(first) == sorted(topic_name(kafka_cfg, s.topic) for s in CATALOG)
    assert await create_topics(kafka_cfg) == []
    assert await _cleanup_policy(kafka_cfg, Topic.TRANSITIONS) == "compact"
    assert await _cleanup_policy(kafka_cfg, Topic.DECISIONS) == "delete"


async def test_topics_create_races_count_each_topic_once(kafka_cfg: FlexPipeConfig) -> None:
    # two processes creating at once: each topic is created by exactly one of them
    first, second = await asyncio.gather(create_topics(kafka_cfg), create_topics(kafka_cfg))
    assert sorted(first + second) == sorted(topic_name(kafka_cfg, s.topic) for s in CATALOG)
    assert await create_topics(kafka_cfg) == []


async def test_topics_create_names_a_topic_the_broker_refuses(kafka_cfg: FlexPipeConfig) -> None:
    bad = NewTopic("bad topic name!", num_partitions=1, replication_factor=1)
    with pytest.raises(FlexPipeError, match=r"cannot create topic bad topic name!: InvalidTopic"):
        await create_topics(kafka_cfg, [bad])


async def test_a_runs_topics_are_deleted_by_prefix_and_no_others(kafka_cfg: FlexPipeConfig) -> None:
    run_prefix = f"{kafka_cfg.topics.prefix}up1."  # as `flexpipe up` nests a run's prefix
    run_cfg = kafka_cfg.model_copy(
        update={"topics": kafka_cfg.topics.model_copy(update={"prefix": run_prefix})}
    )
    other = await create_topics(kafka_cfg)
    ours = await create_topics(run_cfg)
    assert await delete_topics_with_prefix(run_cfg, run_prefix) == sorted(ours)
    admin = AIOKafkaAdminClient(**client_kwargs(kafka_cfg))
    await admin.start()
    try:
        left = set(await admin.list_topics())
    finally:
        await admin.close()
    assert not any(t.startswith(run_prefix) for t in left)
    assert set(other) <= left, "a topic outside the prefix was deleted"
    with pytest.raises(FlexPipeError, match="empty prefix"):
        await delete_topics_with_prefix(run_cfg, "")


async def _cleanup_policy(cfg: FlexPipeConfig, topic: Topic) -> str:
    """The topic's cleanup.policy, waiting out the broker's metadata lag after creation."""
    admin = AIOKafkaAdminClient(**client_kwargs(cfg))
    await admin.start()
    try:
        deadline = time.monotonic() + 30
        while True:
            described = await admin.describe_configs([_config_resource(topic_name(cfg, topic))])
            entries = {e[0]: e[1] for e in described[0].resources[0][4]}
            if "cleanup.policy" in entries or time.monotonic() > deadline:
                return str(entries.get("cleanup.policy"))
            await asyncio.sleep(0.5)
    finally:
        await admin.close()


def _config_resource(name: str) -> object:
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    return ConfigResource(ConfigResourceType.TOPIC, name)


async def test_ten_thousand_envelopes_round_trip(kafka_cfg: FlexPipeConfig) -> None:
    await create_topics(kafka_cfg)
    topic = topic_name(kafka_cfg, Topic.SERVING)
    sent: dict[str, list[bytes]] = defaultdict(list)
    producer = make_producer(kafka_cfg)
    await producer.start()
    try:
        futures = []
        for i in range(NUM_MESSAGES):
            env = envelope.make(_load(i), event_time_ms=i, source="test", seq=i)
            raw = envelope.encode(env)
            key = env.payload.deployment
            sent[key].append(raw)
            futures.append(await producer.send(topic, raw, key=key.encode()))
        await asyncio.gather(*futures)
    finally:
        await producer.stop()

    received: dict[str, list[bytes]] = defaultdict(list)
    consumer = make_consumer(kafka_cfg, topic, group_id=None)
    await consumer.start()
    try:
        count = 0
        while count < NUM_MESSAGES:
            batch = await asyncio.wait_for(consumer.getmany(timeout_ms=1000), 30)
            for records in batch.values():
                for rec in records:
                    assert rec.key is not None and rec.value is not None
                    received[rec.key.decode()].append(rec.value)
                    count += 1
    finally:
        await consumer.stop()

    assert count == NUM_MESSAGES
    assert set(received) == set(KEYS)
    for key in KEYS:
        assert received[key] == sent[key], f"order or bytes differ for {key}"
    # Bytes decode back to the same typed payloads.
    first = envelope.decode(received[KEYS[0]][0])
    assert first.payload == _load(0)
