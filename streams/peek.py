"""Cluster events ahead of the telemetry backlog: a consumer of its own over the cluster topic's
partitions this worker owns folds each event as soon as the broker has it.

Faust delivers every input topic through one consumer: aiokafka hands out the records it
prefetched partition by partition (up to a fetch's worth each, oldest fetch first), and each
agent's buffer holds ``STREAM_BUFFER`` messages, so a cluster event fetched behind a telemetry
backlog waited for the whole backlog — seconds when the worker runs at capacity, and every
forced switch waited as long. This consumer reads the cluster partitions alone and folds through
the same :meth:`streams.processor.StreamProcessor.on_message`.

Each offset is folded once, in order, by whichever path reaches it first: the processor keeps
the next offset per input partition; this consumer folds only that offset (it seeks back when
it is ahead, and passes what was folded already), and the processor passes over faust's
delivery of an offset read here (until a rebalance). Faust stays the durable path:
it commits the offsets once its agent had each message, folded here or there. A partition is
read here only once faust delivered something of it since this worker got it (its next offset
is known), and not after a revocation, until the next assignment.

On unless ``streams.cluster_peek`` is false in the config. A cluster event folded here moves the
clock ahead of the telemetry still queued; decisions go on while that backlog is within the
heartbeat slack (:meth:`streams.processor.StreamProcessor.trailing`), and a transition record
folded after it is checked against it (:meth:`streams.decider.Decider.after_transition`).
"""

from __future__ import annotations

import asyncio
import logging

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from flexpipe.config import FlexPipeConfig
from flexpipe.kafka import make_consumer
from streams.intake import DeadLetterReason, Rejected, SourceTopic
from streams.ports import Message
from streams.processor import StreamProcessor

__all__ = ["ClusterPeek"]

log = logging.getLogger(__name__)

FETCH_WAIT_MS = 100  # the fetch's long poll: the broker answers as soon as an event arrives
IDLE_S = 0.1  # with no partition to read, how often to look again
RETRY_S = 1.0  # after a failed fetch


class ClusterPeek:
    """Folds cluster events of the owned partitions as soon as they are fetched."""

    def __init__(self, cfg: FlexPipeConfig, engine: StreamProcessor, topic: str) -> None:
        self.cfg = cfg
        self.engine = engine
        self.topic = topic
        self.partitions: frozenset[int] = frozenset()
        self.folded = 0

    def assigned(self, partitions: set[int]) -> None:
        """The cluster topic's partitions this worker owns now (faust's assignment)."""
        self.partitions = frozenset(partitions)

    def revoked(self) -> None:
        """Read nothing until the next assignment."""
        self.partitions = frozenset()

    def _wanted(self) -> dict[TopicPartition, int]:
        out = {}
        for p in self.partitions:
            offset = self.engine.next_offset(self.topic, p)
            if offset is not None:
                out[TopicPartition(self.topic, p)] = offset
        return out

    async def run(self) -> None:
        """Read and fold until cancelled."""
        consumer = make_consumer(
            self.cfg,
            group_id=None,
            client_id=f"{self.cfg.kafka.client_id}-cluster-peek",
            fetch_max_wait_ms=FETCH_WAIT_MS,
        )
        await consumer.start()
        try:
            while True:
                try:
                    await self._round(consumer)
                except (KafkaError, OSError) as exc:
                    log.warning("cluster peek: %r; faust's delivery folds meanwhile", exc)
                    consumer.assign([])
                    await asyncio.sleep(RETRY_S)
        finally:
            await consumer.stop()

    async def _round(self, consumer: AIOKafkaConsumer) -> None:
        wanted = self._wanted()
        if set(wanted) != consumer.assignment():
            consumer.assign(list(wanted))
            for tp, offset in wanted.items():
                consumer.seek(tp, offset)
        if not wanted:
            await asyncio.sleep(IDLE_S)
            return
        batch = await consumer.getmany(timeout_ms=FETCH_WAIT_MS, max_records=500)
        for tp, records in batch.items():
            for rec in records:
                if tp.partition not in self.partitions:
                    break  # NOTE: revoked meanwhile
                after = self.engine.next_offset(tp.topic, tp.partition)
                if after is None or rec.offset < after:
                    continue  # folded already (faust's delivery got there first)
                if rec.offset > after:
                    consumer.seek(tp, after)  # NOTE: behind the processor's position: reread
                    break
                await self._fold(Message(tp.topic, tp.partition, rec.offset, rec.key, rec.value))

    async def _fold(self, msg: Message) -> None:
        try:
            await self.engine.on_message(SourceTopic.CLUSTER, msg, peeked=True)
        except Exception as exc:  # NOTE: as faust's agent does: a stream never stops on input
            log.exception("cluster: message at offset %s failed", msg.offset)
            detail = f"{type(exc).__name__}: {exc}"[:500]
            bad = Rejected(DeadLetterReason.INTERNAL_ERROR, "", detail)
            await self.engine.reject(bad, msg, SourceTopic.CLUSTER.value)
        self.folded += 1
        self.engine.metrics.cluster_peeked.inc()
