"""Plain-consumer readers every worker runs beside Faust: the shared view and the decision log.

* :class:`ViewReader` reads the ``gpus`` and ``nodes`` table changelogs from the beginning, in
  full, into the worker's :class:`~streams.view.ClusterView`. NOTE: this is a hand-rolled global
  table; Faust's own ``GlobalTable`` warns that with several app instances it may loop forever in
  recovery, and every worker here needs the whole topology.
* :class:`KafkaDecisionLog` reads a deployment's newest decision back from the decisions topic
  (the source of truth for sequence numbers after a crash or a rebalance).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from flexpipe import envelope
from flexpipe.config import FlexPipeConfig
from flexpipe.errors import ValidationError
from flexpipe.kafka import make_consumer, partition_for
from flexpipe.schemas import GearDecision
from streams import codec
from streams.state import GpuState, NodeState
from streams.step import LoggedDecision
from streams.view import ClusterView

__all__ = ["KafkaDecisionLog", "ViewReader", "partition_for"]

log = logging.getLogger(__name__)
TOPIC_WAIT_S = 0.2


async def _partitions(consumer: AIOKafkaConsumer, topic: str, timeout_s: float) -> set[int]:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        parts = consumer.partitions_for_topic(topic)
        if parts:
            return set(parts)
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"topic {topic} does not exist")
        await consumer._client.force_metadata_update()  # NOTE: only way to refresh in aiokafka
        await asyncio.sleep(TOPIC_WAIT_S)


class ViewReader:
    """Folds the GPU and node changelogs into ``view``; ``caught_up`` once it read to the end
    offsets it found at start."""

    def __init__(
        self,
        cfg: FlexPipeConfig,
        gpus_topic: str,
        nodes_topic: str,
        view: ClusterView,
        on_caught_up: Callable[[], None],
    ) -> None:
        self.cfg = cfg
        self.topics = (gpus_topic, nodes_topic)
        self.view = view
        self.on_caught_up = on_caught_up
        self.records = 0
        self.unreadable = 0

    async def run(self, topic_timeout_s: float = 60.0) -> None:
        """Read forever (until cancelled)."""
        consumer = make_consumer(
            self.cfg, group_id=None, client_id=f"{self.cfg.kafka.client_id}-view"
        )
        await consumer.start()
        try:
            tps = []
            for topic in self.topics:
                parts = await _partitions(consumer, topic, topic_timeout_s)
                tps += [TopicPartition(topic, p) for p in sorted(parts)]
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            end = await consumer.end_offsets(tps)
            caught_up = False
            while True:
                batch = await consumer.getmany(timeout_ms=100, max_records=10_000)
                for tp, records in batch.items():
                    for rec in records:
                        self._apply(tp.topic, rec.value, rec.key)
                if not caught_up and await _reached(consumer, end):
                    caught_up = True
                    log.info("view caught up: %d records", self.records)
                    self.on_caught_up()
        finally:
            await consumer.stop()

    def _apply(self, topic: str, value: bytes | None, key: bytes | None = None) -> None:
        if value is None:
            return
        try:
            if topic == self.topics[0]:
                if self.view.is_own_gpu_echo(key, value):
                    self.records += 1  # this worker's own write, applied as it wrote it
                    return
                self.view.apply_gpu(codec.loads(GpuState, value))
            else:
                self.view.apply_node(codec.loads(NodeState, value))
            self.records += 1
        except ValueError:
            self.unreadable += 1


async def _reached(consumer: AIOKafkaConsumer, end: dict[TopicPartition, int]) -> bool:
    for tp, offset in end.items():
        if await consumer.position(tp) < offset:
            return False
    return True


DECISION_LOG_FETCH_WAIT_MS = 10  # the decision log's fetch long poll (see KafkaDecisionLog)


class KafkaDecisionLog:
    """Reads the newest decision of a deployment, scanning its partition backwards."""

    def __init__(self, cfg: FlexPipeConfig, topic: str, num_partitions: int) -> None:
        self.cfg = cfg
        self.topic = topic
        self.num_partitions = num_partitions
        self._consumer: AIOKafkaConsumer | None = None

    async def _started(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            # NOTE: an offsets request waits behind the fetcher's long poll of the assigned
            # partition (fetch_max_wait_ms, 500 ms by default): 0.5 s per read, 13 s for the
            # first decisions of 24 deployments. Reads unassign when done, so the short poll
            # never spins between them.
            consumer = make_consumer(
                self.cfg,
                group_id=None,
                client_id=f"{self.cfg.kafka.client_id}-decision-log",
                fetch_max_wait_ms=DECISION_LOG_FETCH_WAIT_MS,
            )
            await consumer.start()
            self._consumer = consumer
        return self._consumer

    async def close(self) -> None:
        """Stop the consumer."""
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None

    async def last(self, deployment: str) -> LoggedDecision | None:
        """The newest valid decision of ``deployment``; None when it never decided."""
        consumer = await self._started()
        tp = TopicPartition(self.topic, partition_for(deployment, self.num_partitions))
        consumer.assign([tp])
        try:
            begin = (await consumer.beginning_offsets([tp]))[tp]
            high = (await consumer.end_offsets([tp]))[tp]
            chunk = 64
            key = deployment.encode()
            while high > begin:
                low = max(begin, high - chunk)
                found = await _last_in(consumer, tp, low, high, key)
                if found is not None:
                    return found
                high, chunk = low, chunk * 4
            return None
        finally:
            consumer.assign([])


async def _last_in(
    consumer: AIOKafkaConsumer, tp: TopicPartition, low: int, high: int, key: bytes
) -> LoggedDecision | None:
    consumer.seek(tp, low)
    records: list[Any] = []
    while await consumer.position(tp) < high:
        batch = await consumer.getmany(tp, timeout_ms=1000, max_records=1000)
        records += batch.get(tp, [])
    best: LoggedDecision | None = None
    for rec in records:
        if rec.offset >= high or rec.key != key:
            continue
        try:
            env = envelope.decode(rec.value)
        except ValidationError:
            continue
        if isinstance(env.payload, GearDecision):
            best = LoggedDecision(env.event_time_ms, env.payload)
    return best
