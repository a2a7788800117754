"""Sequence-ownership journal: a compacted topic of admitted-but-unfinished sequences.

Why a topic of its own: the transitions log records *plans*, not the thousands of sequences
admitted between transitions, and a worker's engines die with it (the simulated ones always do),
so after a ``kill -9`` the only way to know which sequences were in flight is a durable record
written when each was admitted. Key ``<deployment>/<request id>``; value the request (prompt
tokens, output budget, arrival, first owner); a tombstone when it finishes. Compaction keeps
exactly the in-flight set, so recovery reads a small topic to its end, replays each sequence on
the serving plan and gives it exactly one owner. Records are envelopes of kind
``runtime.ownership`` (:class:`flexpipe.schemas.OwnershipRecord`); the topic is in the catalog.

The Kafka helper here only reads a topic to its end; producers and consumers come from
:mod:`flexpipe.kafka`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from aiokafka import AIOKafkaConsumer, TopicPartition

from flexpipe import envelope
from flexpipe.config import FlexPipeConfig
from flexpipe.errors import ValidationError
from flexpipe.kafka import make_consumer
from flexpipe.schemas import Kind, OwnershipRecord
from flexpipe.topics import Topic, topic_name
from runtime.types import OwnershipEvent, OwnershipKind, Request


def ownership_topic(cfg: FlexPipeConfig) -> str:
    """The journal's broker-side name (a catalog topic)."""
    return topic_name(cfg, Topic.OWNERSHIP)


def ownership_key(deployment: str, request_id: str) -> bytes:
    """The compaction key of one sequence."""
    return f"{deployment}/{request_id}".encode()


def encode_event(
    deployment: str, event: OwnershipEvent, *, source: str, seq: int, now_ms: int
) -> tuple[bytes, bytes | None]:
    """(key, value) for an ownership event; a finished sequence is a tombstone (value None)."""
    req = event.request
    key = ownership_key(deployment, req.request_id)
    if event.kind is OwnershipKind.FINISHED:
        return key, None
    record = OwnershipRecord(
        deployment,
        req.request_id,
        event.replica_id,
        req.prompt_tokens,
        req.max_output_tokens,
        req.arrival_s,
        req.kind,
    )
    env = envelope.make(record, event_time_ms=now_ms, source=source, seq=seq)
    return key, envelope.encode(env)


def decode_record(raw: bytes) -> OwnershipRecord:
    """Validate a journal value; raises :class:`ValidationError` naming the field."""
    env = envelope.decode(raw)
    if env.kind is not Kind.RUNTIME_OWNERSHIP:
        raise ValidationError("kind", f"expected {Kind.RUNTIME_OWNERSHIP.value}, got {env.kind}")
    record: OwnershipRecord = env.payload
    return record


def _request(record: OwnershipRecord) -> Request:
    return Request(
        record.request_id,
        record.prompt_tokens,
        record.max_output_tokens,
        record.arrival_s,
        record.kind,
    )


def unfinished(
    entries: Iterable[tuple[bytes | None, bytes | None]], deployment: str
) -> list[Request]:
    """Admitted-but-unfinished requests of ``deployment`` from (key, value) pairs in log order.

    The last value per key wins; a tombstone means finished. Malformed values are skipped
    (the journal is advisory per record; one bad record must not stop a recovery).
    """
    latest: dict[bytes, bytes | None] = {}
    prefix = f"{deployment}/".encode()
    for key, value in entries:
        if key is not None and key.startswith(prefix):
            latest[key] = value
    out = []
    for value in latest.values():
        if value is None:
            continue
        try:
            out.append(_request(decode_record(value)))
        except ValidationError:
            continue
    return sorted(out, key=lambda r: (r.arrival_s, r.request_id))


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
