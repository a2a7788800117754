"""Sequence-ownership journal: a compacted topic of admitted-but-unfinished sequences.

Why a topic of its own: the transitions log records *plans*, not the thousands of sequences
admitted between transitions, and a worker's engines die with it (the simulated ones always do),
so after a ``kill -9`` the only way to know which sequences were in flight is a durable record
written when each was admitted. Key ``<deployment>/<request id>``; value the request (prompt
tokens, output budget, arrival, first owner); a tombstone when it finishes. Compaction keeps
exactly the in-flight set, so recovery reads a small topic to its end, replays each sequence on
the serving plan and gives it exactly one owner. Records are envelopes of kind
``runtime.ownership`` (:class:`flexpipe.schemas.OwnershipRecord`); the topic is in the catalog.

The records themselves (keys, values, the in-flight set) are in :mod:`runtime.ownership`, which
is pure; the Kafka helper here only reads a topic to its end; producers and consumers come from
:mod:`flexpipe.kafka`.
"""

from __future__ import annotations

import asyncio

from aiokafka import AIOKafkaConsumer, TopicPartition

from flexpipe.config import FlexPipeConfig
from flexpipe.kafka import make_consumer
from flexpipe.topics import Topic, topic_name


def ownership_topic(cfg: FlexPipeConfig) -> str:
    """The journal's broker-side name (a catalog topic)."""
    return topic_name(cfg, Topic.OWNERSHIP)


async def read_to_end(
    cfg: FlexPipeConfig, topic: str, timeout_s: float = 60.0
) -> list[tuple[bytes | None, bytes | None]]:
    """Every (key, value) of ``topic`` from the beginning up to its end at call time."""
    # NOTE: subscribing (no group: every partition is assigned) makes the client track the
    # topic's metadata, which a bare consumer does not.
    consumer = make_consumer(cfg, topic, group_id=None)
    await consumer.start()
    try:
        return await catch_up(consumer, topic, timeout_s)
    finally:
        await consumer.stop()


async def catch_up(
    consumer: AIOKafkaConsumer, topic: str, timeout_s: float = 60.0
) -> list[tuple[bytes | None, bytes | None]]:
    """Read a started, subscribed consumer's topic from the beginning to its end at call time;
    the consumer stays positioned there, so live consumption continues without a gap.
    """
    partitions = consumer.partitions_for_topic(topic) or set()
    tps = [TopicPartition(topic, p) for p in sorted(partitions)]
    if not tps:
        return []
    end = await consumer.end_offsets(tps)
    await consumer.seek_to_beginning(*tps)
    out: list[tuple[bytes | None, bytes | None]] = []
    async with asyncio.timeout(timeout_s):
        while not await _reached(consumer, tps, end):
            records = await consumer.getmany(*tps, timeout_ms=200)
            for tp, batch in records.items():
                out.extend((r.key, r.value) for r in batch if r.offset < end[tp])
                if batch and batch[-1].offset >= end[tp]:
                    consumer.seek(tp, end[tp])  # overshot: live consumption re-reads those
    return out


async def _reached(
    consumer: AIOKafkaConsumer, tps: list[TopicPartition], end: dict[TopicPartition, int]
) -> bool:
    for tp in tps:
        if await consumer.position(tp) < end[tp]:
            return False
    return True
