"""The bounded publisher: order, drop-oldest accounting, recovery after the broker returns."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
from aiokafka.partitioner import DefaultPartitioner
from prometheus_client import CollectorRegistry

from probes.publisher import BufferedPublisher, PublisherMetrics, cached_partitioner

pytestmark = pytest.mark.unit


class FakeBroker:
    """Accepts sends while ``up``; a down broker fails every start and every send.

    ``fail_after`` takes it down after that many more accepted sends, in the middle of a batch.
    """

    def __init__(self) -> None:
        self.up = True
        self.log: list[bytes] = []
        self.starts = 0
        self.fail_after: int | None = None


class FakeProducer:
    def __init__(self, broker: FakeBroker) -> None:
        self.broker = broker

    async def start(self) -> None:
        self.broker.starts += 1
        if not self.broker.up:
            raise ConnectionError("broker down")

    async def stop(self) -> None:
        return None

    async def send(self, topic: str, value: bytes, key: bytes | None = None) -> Any:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.broker.fail_after is not None:
            self.broker.up = self.broker.fail_after > 0
            self.broker.fail_after -= 1
        if self.broker.up:
            self.broker.log.append(value)
            fut.set_result(None)
        else:
            fut.set_exception(ConnectionError("broker down"))
        return fut


class FakeBuilder:
    """aiokafka's BatchBuilder, as far as the publisher uses it: full after ``capacity`` records."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.records: list[tuple[bytes | None, bytes]] = []

    def append(self, *, timestamp: float | None, key: bytes | None, value: bytes) -> Any:
        if len(self.records) == self.capacity:
            return None
        self.records.append((key, value))
        return object()


class FakeBatchProducer(FakeProducer):
    """Also takes whole record batches (aiokafka's ``create_batch`` / ``send_batch``): a batch is
    acknowledged whole or not at all; ``fail_after`` counts its records."""

    partitions = 3
    capacity = 3

    def __init__(self, broker: FakeBroker) -> None:
        super().__init__(broker)
        self.batches: list[tuple[str, int, list[tuple[bytes | None, bytes]]]] = []

    async def partitions_for(self, topic: str) -> set[int]:
        return set(range(self.partitions))

    def create_batch(self) -> FakeBuilder:
        return FakeBuilder(self.capacity)

    async def send_batch(self, batch: FakeBuilder, topic: str, *, partition: int) -> Any:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.broker.fail_after is not None:
            self.broker.up = self.broker.fail_after >= len(batch.records)
            self.broker.fail_after -= len(batch.records)
        if self.broker.up:
            self.batches.append((topic, partition, batch.records))
            self.broker.log.extend(value for _, value in batch.records)
            fut.set_result(None)
        else:
            fut.set_exception(ConnectionError("broker down"))
        return fut


PRODUCERS = [FakeProducer, FakeBatchProducer]


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.001)


def make_publisher(
    broker: FakeBroker, max_buffer: int, producer: type[FakeProducer] = FakeProducer
) -> BufferedPublisher:
    return BufferedPublisher(
        lambda: producer(broker),
        PublisherMetrics(CollectorRegistry()),
        max_buffer=max_buffer,
        batch_size=7,
        backoff_s=(0.001, 0.002),
    )


@pytest.mark.parametrize("producer", PRODUCERS)
async def test_publishes_everything_in_order(producer: type[FakeProducer]) -> None:
    broker = FakeBroker()
    pub = make_publisher(broker, max_buffer=1000, producer=producer)
    stop = asyncio.Event()
    task = asyncio.create_task(pub.run(stop))
    for i in range(100):
        pub.put("t", b"k", str(i).encode())
    stop.set()
    await task
    assert broker.log == [str(i).encode() for i in range(100)]
    assert pub.published == 100 and pub.dropped == 0


@pytest.mark.parametrize("producer", PRODUCERS)
async def test_outage_drops_oldest_and_counts_exactly(producer: type[FakeProducer]) -> None:
    broker = FakeBroker()
    broker.up = False
    pub = make_publisher(broker, max_buffer=50, producer=producer)
    stop = asyncio.Event()
    task = asyncio.create_task(pub.run(stop))
    for i in range(120):
        pub.put("t", b"k", str(i).encode())
        await asyncio.sleep(0)
    # NOTE: a batch may be in flight (out of the buffer) when the last put lands; it fails, goes
    # back and the overflow is trimmed then, so the count settles rather than holds at once
    await until(lambda: pub.dropped == 70)
    broker.up = True
    await until(lambda: len(pub) == 0)
    stop.set()
    await task
    assert broker.log == [str(i).encode() for i in range(70, 120)], "newest 50 survive, in order"
    assert pub.published + pub.dropped == 120
    assert broker.starts > 1, "the producer is rebuilt after failures"


@pytest.mark.parametrize("producer", PRODUCERS)
async def test_partly_acknowledged_batch_is_neither_resent_nor_counted_as_dropped(
    producer: type[FakeProducer],
) -> None:
    # The broker fails in the middle of the first batch (batch_size 7): the 3 acknowledged events
    # must not be re-sent, and overflow while it is down must drop only unacknowledged ones.
    broker = FakeBroker()
    broker.fail_after = 3
    pub = make_publisher(broker, max_buffer=20, producer=producer)
    stop = asyncio.Event()
    for i in range(10):
        pub.put("t", b"k", str(i).encode())
    task = asyncio.create_task(pub.run(stop))
    await until(lambda: broker.starts >= 2)  # the batch failed and a rebuild was attempted
    for i in range(10, 40):
        pub.put("t", b"k", str(i).encode())
    broker.fail_after = None
    broker.up = True
    await until(lambda: len(pub) == 0)
    stop.set()
    await task
    assert broker.log[:3] == [b"0", b"1", b"2"]
    assert len(broker.log) == len(set(broker.log)), "an acknowledged event was sent twice"
    delivered = {int(v) for v in broker.log}
    assert pub.dropped == 40 - len(delivered), "dropped must count exactly what never arrived"
    assert pub.published == len(delivered)
    assert delivered == {0, 1, 2} | set(range(40 - 20, 40)), "the newest 20 survive"


async def test_metrics_count_per_topic_and_read_the_buffer_as_it_is() -> None:
    broker = FakeBroker()
    broker.up = False
    registry = CollectorRegistry()
    pub = BufferedPublisher(
        lambda: FakeProducer(broker),
        PublisherMetrics(registry),
        batch_size=7,
        backoff_s=(1e-3, 2e-3),
    )
    stop = asyncio.Event()
    task = asyncio.create_task(pub.run(stop))
    for i in range(10):
        pub.put("a" if i % 3 else "b", b"k", str(i).encode())
    # a batch failed and went back to the buffer; the next one may be in flight at any instant
    await until(
        lambda: broker.starts >= 2 and registry.get_sample_value("flexpipe_agent_buffered") == 10
    )
    broker.up = True
    await until(lambda: len(pub) == 0)
    assert registry.get_sample_value("flexpipe_agent_buffered") == 0
    stop.set()
    await task
    published = {
        t: registry.get_sample_value("flexpipe_agent_published_total", {"topic": t}) for t in "ab"
    }
    assert published == {"a": 6, "b": 4}
    assert registry.get_sample_value("flexpipe_agent_publish_latency_seconds_count") == 10


@pytest.mark.parametrize("producer", PRODUCERS)
async def test_shutdown_with_broker_down_does_not_hang(producer: type[FakeProducer]) -> None:
    broker = FakeBroker()
    broker.up = False
    pub = make_publisher(broker, max_buffer=10, producer=producer)
    stop = asyncio.Event()
    task = asyncio.create_task(pub.run(stop))
    pub.put("t", b"k", b"x")
    await asyncio.sleep(0.01)
    stop.set()
    await asyncio.wait_for(task, 2.0)
    assert len(pub) == 1 and pub.published == 0


def test_rejects_nonsense_sizes() -> None:
    with pytest.raises(ValueError, match="positive"):
        BufferedPublisher(
            lambda: FakeProducer(FakeBroker()), PublisherMetrics(CollectorRegistry()), 0
        )


def test_cached_partitioner_picks_what_kafkas_default_picks() -> None:
    keys = [f"GPU-{i:08d}-0000".encode() for i in range(200)] + [b"node-a1", b""]
    for n in (1, 2, 3, 7, 12):
        partitions = list(range(n))
        for key in keys * 2:  # the second pass answers from the cache
            expected = DefaultPartitioner()(key, partitions, partitions)
            assert cached_partitioner(key, partitions, partitions) == expected
    assert cached_partitioner(None, [0, 1, 2], [2]) == 2, "no key: an available partition"


async def test_batches_go_one_per_partition_in_order_on_kafkas_default_partition() -> None:
    broker = FakeBroker()
    producers: list[FakeBatchProducer] = []

    def factory() -> FakeBatchProducer:
        producers.append(FakeBatchProducer(broker))
        return producers[-1]

    pub = BufferedPublisher(factory, PublisherMetrics(CollectorRegistry()), batch_size=50)
    keys = [f"GPU-{i}".encode() for i in range(8)]
    for i in range(40):
        pub.put("t", keys[i % 8], str(i).encode())
    stop = asyncio.Event()
    stop.set()
    await pub.run(stop)
    assert pub.published == 40 and sorted(broker.log, key=int) == [
        str(i).encode() for i in range(40)
    ]
    by_partition: dict[int, list[bytes]] = {}
    for _, partition, records in producers[0].batches:
        assert len(records) <= FakeBatchProducer.capacity
        for key, value in records:
            assert partition == cached_partitioner(key, [0, 1, 2], [0, 1, 2])
            by_partition.setdefault(partition, []).append(value)
    for values in by_partition.values():
        assert values == sorted(values, key=int), "order within a partition is kept"


def test_batch_histogram_exposes_what_a_prometheus_histogram_does() -> None:
    from prometheus_client import Histogram

    from probes.publisher import BatchHistogram

    buckets = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5, 30, 120)
    values = [0.0, 0.001, 0.0011, 0.004, 0.01, 0.3, 1.0, 2.5, 119.0, 121.0, 1e6]
    ours_registry, reference_registry = CollectorRegistry(), CollectorRegistry()
    ours = BatchHistogram("x_seconds", "d", buckets, ours_registry)
    reference = Histogram("x_seconds", "d", buckets=buckets, registry=reference_registry)
    ours.observe_many(values[:5])
    ours.observe(values[5])
    ours.observe_many(values[6:])
    for v in values:
        reference.observe(v)

    def samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
        return {
            (s.name, s.labels.get("le", "")): s.value
            for metric in registry.collect()
            for s in metric.samples
            if not s.name.endswith("_created")
        }

    assert samples(ours_registry) == samples(reference_registry)
    assert ours_registry.get_sample_value("x_seconds_count") == len(values)


@pytest.mark.parametrize("producer", PRODUCERS)
async def test_put_many_queues_in_order_and_drops_the_oldest_when_full(
    producer: type[FakeProducer],
) -> None:
    broker = FakeBroker()
    pub = make_publisher(broker, max_buffer=50, producer=producer)
    pub.put_many([("t", b"k", str(i).encode()) for i in range(30)])
    pub.put_many([("t", b"k", str(i).encode()) for i in range(30, 60)])
    assert len(pub) == 50 and pub.dropped == 10
    stop = asyncio.Event()
    stop.set()
    await pub.run(stop)
    assert broker.log == [str(i).encode() for i in range(10, 60)]
    assert pub.published == 50
