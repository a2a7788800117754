"""The agent's path to Kafka: a bounded buffer that survives broker outages.

Events wait in a bounded deque. A sender task moves a batch into flight, publishes it with a
durable producer (idempotent, acks=all, lz4) and removes each event once the broker acknowledged
it. When the broker is unreachable the unacknowledged rest of the batch goes back to the head of
the buffer, the producer is rebuilt after an exponential backoff, and while the buffer is full the
*oldest* events are dropped and counted, so the newest state always gets through first after an
outage. Delivery is at-least-once: an event whose acknowledgement was lost may be sent twice;
consumers drop duplicates by (source, seq).
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import functools
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from aiokafka.partitioner import murmur2
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

log = logging.getLogger(__name__)


class Producer(Protocol):
    """The slice of AIOKafkaProducer the publisher uses (a fake in unit tests).

    A producer that also has ``partitions_for``, ``create_batch`` and ``send_batch`` (aiokafka's
    does) gets one batch per partition instead of one ``send`` per event.
    """

    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    async def send(self, topic: str, value: bytes, key: bytes | None = None) -> Any: ...


class Outgoing(NamedTuple):
    """One encoded event waiting for the broker.

    NOTE: a named tuple, not a frozen dataclass: one is built per event, and a frozen dataclass's
    ``__init__`` costs several times as much.
    """

    topic: str
    key: bytes
    value: bytes
    enqueued_s: float


class BatchHistogram(Collector):
    """A Prometheus histogram (same exposition as ``prometheus_client.Histogram``, without the
    ``_created`` sample) that takes a batch of observations at once.

    NOTE: ``Histogram.observe`` takes two locks and walks the buckets in Python, ~1 µs per
    acknowledged event; here a batch is counted under one lock with a C bisect per value.
    """

    def __init__(
        self, name: str, documentation: str, buckets: tuple[float, ...], registry: CollectorRegistry
    ) -> None:
        self._name, self._documentation = name, documentation
        self._bounds = tuple(sorted(float(b) for b in buckets))
        self._counts = [0] * (len(self._bounds) + 1)  # the last: above every bound (+Inf)
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, value: float) -> None:
        """One observation."""
        self.observe_many((value,))

    def observe_many(self, values: list[float] | tuple[float, ...]) -> None:
        """Each of ``values``, as that many ``observe`` calls would."""
        bounds, counts, where = self._bounds, self._counts, bisect.bisect_left
        with self._lock:
            for value in values:
                counts[where(bounds, value)] += 1  # the first bound >= value: le semantics
            self._sum += sum(values)

    def collect(self) -> list[HistogramMetricFamily]:
        """The histogram's samples, cumulative by bucket."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, buckets = 0, []
        for bound, count in zip((*self._bounds, float("inf")), counts, strict=True):
            cumulative += count
            buckets.append((floatToGoString(bound), float(cumulative)))
        return [HistogramMetricFamily(self._name, self._documentation, buckets, total)]

    def describe(self) -> list[HistogramMetricFamily]:
        """What :meth:`collect` yields, for the registry's name check."""
        return [HistogramMetricFamily(self._name, self._documentation, [("+Inf", 0.0)], 0.0)]


class PublisherMetrics:
    """Prometheus metrics of one publisher, registered on the given registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.published = Counter(
            "flexpipe_agent_published",
            "Events acknowledged by the broker",
            ["topic"],
            registry=registry,
        )
        self.dropped = Counter(
            "flexpipe_agent_dropped",
            "Events dropped because the buffer was full",
            registry=registry,
        )
        self.buffered = Gauge("flexpipe_agent_buffered", "Events waiting", registry=registry)
        self.latency = BatchHistogram(
            "flexpipe_agent_publish_latency_seconds",
            "Enqueue to broker acknowledgement",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5, 30, 120),
            registry=registry,
        )
        self.broker_up = Gauge(
            "flexpipe_agent_broker_up", "1 when the last send succeeded", registry=registry
        )


class BufferedPublisher:
    """Publish encoded events in order, through outages, with a bounded memory footprint."""

    def __init__(
        self,
        producer_factory: Callable[[], Producer],
        metrics: PublisherMetrics,
        max_buffer: int = 100_000,
        batch_size: int = 2_000,
        ack_timeout_s: float = 10.0,
        backoff_s: tuple[float, float] = (0.2, 5.0),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_buffer < 1 or batch_size < 1:
            raise ValueError("max_buffer and batch_size must be positive")
        self._factory = producer_factory
        self._metrics = metrics
        self._buffer: deque[Outgoing] = deque()
        self._max_buffer = max_buffer
        self._batch_size = batch_size
        self._ack_timeout_s = ack_timeout_s
        self._backoff_min_s, self._backoff_max_s = backoff_s
        self._clock = clock
        self._wakeup = asyncio.Event()
        self._producer: Producer | None = None
        self.dropped = 0
        self.published = 0
        # sent but never acknowledged, then put back: the broker may have written them, so one
        # of these dropped later may still have arrived (at-least-once cannot know)
        self.requeued = 0
        # NOTE: read when scraped rather than set on every put and every batch: always current,
        # and nothing per event
        metrics.buffered.set_function(lambda: len(self._buffer))

    def __len__(self) -> int:
        return len(self._buffer)

    def put(self, topic: str, key: bytes, value: bytes) -> None:
        """Queue one event; drops the oldest queued event when the buffer is full."""
        buffer = self._buffer
        buffer.append(Outgoing(topic, key, value, self._clock()))
        if len(buffer) > self._max_buffer:
            self._trim()
        self._wakeup.set()

    def put_many(self, events: list[tuple[str, bytes, bytes]]) -> None:
        """:meth:`put` for each ``(topic, key, value)``, in order, enqueued at one instant.

        NOTE: one clock read and one wake-up per sample round instead of per event.
        """
        now = self._clock()
        buffer = self._buffer
        buffer.extend([Outgoing(topic, key, value, now) for topic, key, value in events])
        if len(buffer) > self._max_buffer:
            self._trim()
        self._wakeup.set()

    def _trim(self) -> None:
        excess = len(self._buffer) - self._max_buffer
        for _ in range(max(excess, 0)):
            self._buffer.popleft()
        if excess > 0:
            self.dropped += excess
            self._metrics.dropped.inc(excess)

    async def run(self, stop: asyncio.Event) -> None:
        """Send until ``stop`` is set, then flush what the broker will take within the timeout."""
        backoff_s = self._backoff_min_s
        while not (stop.is_set() and not self._buffer):
            if not self._buffer:
                self._wakeup.clear()
                await _wait_any(self._wakeup, stop)
                continue
            if await self._send_batch():
                backoff_s = self._backoff_min_s
                continue
            if stop.is_set():
                break  # broker gone at shutdown: what is left is reported by the caller
            await _sleep_or(stop, backoff_s)
            backoff_s = min(backoff_s * 2, self._backoff_max_s)
        await self._close_producer()

    async def _send_batch(self) -> bool:
        batch = [self._buffer.popleft() for _ in range(min(self._batch_size, len(self._buffer)))]
        # each future acknowledges its events, all of one topic: one per event, or one per
        # partition batch
        sent: list[tuple[asyncio.Future[Any], list[Outgoing]]] = []
        error: BaseException | None = None
        try:
            producer = await self._ensure_producer()
            if hasattr(producer, "send_batch"):
                await _send_by_partition(producer, batch, sent)
            else:
                for o in batch:
                    sent.append((await producer.send(o.topic, o.value, key=o.key), [o]))
        except Exception as exc:  # any broker or network failure: requeue what was not acked
            error = exc
        if sent:
            _, pending = await asyncio.wait([f for f, _ in sent], timeout=self._ack_timeout_s)
            if pending and error is None:
                error = TimeoutError(f"{len(pending)} sends not acknowledged")
        # NOTE: a batch spans partitions, so part of it can be acknowledged when the broker
        # fails; only the unacknowledged rest goes back, so an acknowledged event is never
        # sent twice nor counted as dropped when the buffer overflows afterwards.
        acked = [events for f, events in sent if _succeeded(f)]
        self._record_published(acked)
        if sum(len(events) for events in acked) == len(batch):
            self._metrics.broker_up.set(1)
            return True
        acked_ids = {id(o) for events in acked for o in events}
        if error is None:
            failed = next(f for f, _ in sent if not _succeeded(f))
            error = asyncio.CancelledError() if failed.cancelled() else failed.exception()
        unacked = [o for o in batch if id(o) not in acked_ids]  # in their order
        log.warning(
            "publish failed (%s: %s); %d events requeued, %d acknowledged",
            type(error).__name__,
            error,
            len(unacked),
            len(acked_ids),
        )
        self._buffer.extendleft(reversed(unacked))
        self.requeued += len(unacked)
        self._trim()
        self._metrics.broker_up.set(0)
        await self._close_producer()
        return False

    def _record_published(self, acked: list[list[Outgoing]]) -> None:
        """Count the acknowledged events, one list per acknowledged send (of one topic).

        NOTE: topics counted per send, not per event: a batch is ~2,000 events in a few sends.
        """
        now = self._clock()
        self._metrics.latency.observe_many([now - o.enqueued_s for sent in acked for o in sent])
        per_topic: collections.Counter[str] = collections.Counter()
        for sent in acked:
            per_topic[sent[0].topic] += len(sent)
        for topic, count in per_topic.items():
            self._metrics.published.labels(topic).inc(count)
        self.published += per_topic.total()

    async def _ensure_producer(self) -> Producer:
        if self._producer is None:
            producer = self._factory()
            try:
                await asyncio.wait_for(producer.start(), self._ack_timeout_s)
            except BaseException:
                await _quiet_stop(producer)
                raise
            self._producer = producer
        return self._producer

    async def _close_producer(self) -> None:
        if self._producer is not None:
            producer, self._producer = self._producer, None
            await _quiet_stop(producer)


# NOTE: aiokafka's murmur2 is pure Python, ~8 µs per key, paid on every send; an agent's keys are
# its GPUs and its node, a handful, so each is hashed once.
_key_hash = functools.lru_cache(maxsize=4096)(murmur2)


def cached_partitioner(key: bytes | None, all_partitions: list[int], available: list[int]) -> int:
    """aiokafka's default partitioner (Kafka's murmur2 of the key), with each key hashed once.

    Pass as ``partitioner=`` to the producer: a key lands on the same partition as with the
    default, so per-key order and the consumers' partitioning do not change.
    """
    if key is None:
        return random.choice(available or all_partitions)
    return all_partitions[(_key_hash(key) & 0x7FFFFFFF) % len(all_partitions)]


async def _send_by_partition(
    producer: Any, batch: list[Outgoing], sent: list[tuple[asyncio.Future[Any], list[Outgoing]]]
) -> None:
    """Queue ``batch`` as one record batch per partition (more where a batch fills up).

    NOTE: ``send`` per event built a future, partitioned and appended one record at a time, and
    was most of the publisher's CPU; here the events of a partition share one batch and one
    future. Partitions are Kafka's default for keyed records (``cached_partitioner``, what the
    agent's producer and aiokafka's default pick), in the events' order within each partition.
    """
    partitions: dict[str, list[int]] = {}
    partition_of: dict[tuple[str, bytes], tuple[str, int]] = {}  # a batch's keys: a handful
    groups: dict[tuple[str, int], list[Outgoing]] = {}
    for o in batch:
        tp = partition_of.get((o.topic, o.key))
        if tp is None:
            all_partitions = partitions.get(o.topic)
            if all_partitions is None:
                all_partitions = list(await producer.partitions_for(o.topic))
                partitions[o.topic] = all_partitions
            tp = (o.topic, cached_partitioner(o.key, all_partitions, all_partitions))
            partition_of[(o.topic, o.key)] = tp
        group = groups.get(tp)
        if group is None:
            groups[tp] = [o]
        else:
            group.append(o)
    for (topic, partition), events in groups.items():
        builder = producer.create_batch()
        in_builder: list[Outgoing] = []
        for o in events:
            if builder.append(timestamp=None, key=o.key, value=o.value) is None:  # full
                future = await producer.send_batch(builder, topic, partition=partition)
                sent.append((future, in_builder))
                builder, in_builder = producer.create_batch(), []
                if builder.append(timestamp=None, key=o.key, value=o.value) is None:
                    raise ValueError(f"an event of {len(o.value)} bytes exceeds a batch")
            in_builder.append(o)
        sent.append((await producer.send_batch(builder, topic, partition=partition), in_builder))


def _succeeded(future: asyncio.Future[Any]) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None


async def _quiet_stop(producer: Producer) -> None:
    try:
        await asyncio.wait_for(producer.stop(), 5.0)
    except Exception as exc:  # a dead broker makes stop() fail too; nothing left to save
        log.debug("producer stop failed: %s", exc)


async def _wait_any(*events: asyncio.Event) -> None:
    waiters = [asyncio.create_task(e.wait()) for e in events]
    _, pending = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()


async def _sleep_or(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
