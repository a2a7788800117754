"""Helpers for runtime integration tests: publish to and read from the real broker."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiokafka import TopicPartition

from flexpipe import envelope
from flexpipe.config import FlexPipeConfig
from flexpipe.errors import ValidationError
from flexpipe.kafka import make_consumer, make_producer
from flexpipe.schemas import GearTransition
from flexpipe.topics import Topic, topic_name
from runtime.journal import ownership_topic, read_to_end
from runtime.ownership import unfinished
from runtime.types import Request


async def publish(cfg: FlexPipeConfig, topic: Topic, payload: Any, key: str) -> None:
    """Publish one envelope and wait for the broker's ack."""
    producer = make_producer(cfg)
    await producer.start()
    try:
        env = envelope.make(payload, event_time_ms=int(time.time() * 1000), source="test", seq=1)
        await producer.send_and_wait(topic_name(cfg, topic), envelope.encode(env), key=key.encode())
    finally:
        await producer.stop()


async def transitions(cfg: FlexPipeConfig, deployment: str) -> list[GearTransition]:
    """Every transition record of ``deployment``, in per-key log order."""
    out = []
    for _, value in await read_to_end(cfg, topic_name(cfg, Topic.TRANSITIONS)):
        try:
            payload = envelope.decode(value).payload
        except ValidationError:
            continue
        if isinstance(payload, GearTransition) and payload.deployment == deployment:
            out.append(payload)
    return sorted(out, key=lambda r: r.transition_seq)  # stable: per-seq order is kept


async def transition_partitions(cfg: FlexPipeConfig) -> dict[str, set[int]]:
    """Per deployment, the partitions of the transitions topic its records were written to."""
    topic = topic_name(cfg, Topic.TRANSITIONS)
    consumer = make_consumer(cfg, topic, group_id=None, auto_offset_reset="earliest")
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        end = await consumer.end_offsets(tps)
        out: dict[str, set[int]] = {}
        async with asyncio.timeout(30):
            for tp in tps:
                consumer.seek(tp, 0)
                while await consumer.position(tp) < end[tp]:
                    for record in (await consumer.getmany(tp, timeout_ms=200)).get(tp, []):
                        payload = envelope.decode(record.value or b"").payload
                        out.setdefault(payload.deployment, set()).add(tp.partition)
        return out
    finally:
        await consumer.stop()


async def journal_unfinished(cfg: FlexPipeConfig, deployment: str) -> list[Request]:
    """Sequences the ownership journal holds as admitted and not finished."""
    return unfinished(await read_to_end(cfg, ownership_topic(cfg)), deployment)


async def wait_for(
    check: Callable[[], Awaitable[bool]] | Callable[[], bool],
    timeout_s: float,
    what: str,
    poll_s: float = 0.05,
) -> None:
    """Poll ``check`` until it holds; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(poll_s)
