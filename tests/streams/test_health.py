"""The worker's guards: readiness on its topics' metadata, and counted decision failures."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from aiokafka import TopicPartition
from prometheus_client import CollectorRegistry

from flexpipe.config import FlexPipeConfig
from flexpipe.kafka import create_topics, make_producer, running
from flexpipe.topics import CATALOG, topic_name
from streams.app import FatalDecisionPath, _decision_failed, internal_topics, worker_topics
from streams.health import FailureLog, InputWatch, NotReadyError, stalled_inputs, wait_writable
from streams.metrics import StreamsMetrics


def _boom(message: str) -> BaseException:
    try:
        raise TypeError(message)
    except TypeError as exc:
        return exc


@pytest.mark.unit
def test_failure_log_counts_distinct_errors_and_runs() -> None:
    failures = FailureLog(max_consecutive=3)
    a, b = _boom("a"), _boom("b")
    v1 = failures.failed(a)
    v2 = failures.failed(a)
    assert (v1.first, v1.count, v1.consecutive, v1.fatal) == (True, 1, 1, False)
    assert (v2.first, v2.count, v2.consecutive, v2.fatal) == (False, 2, 2, False)
    assert failures.succeeded() == 2
    assert failures.failed(b).first
    assert failures.failed(a).consecutive == 2
    assert failures.failed(a).fatal  # three in a row, whatever the errors
    assert failures.total == 5
    assert sorted(failures.counts.values()) == [1, 4]


@pytest.mark.unit
def test_input_watch_resumes_only_partitions_paused_past_the_grace() -> None:
    watch = InputWatch(grace_s=10.0)
    a, b = ("gpu", 1), ("gpu", 2)
    assert watch.overdue({a}, 100.0) == []
    assert watch.overdue({a, b}, 105.0) == []
    assert watch.overdue({a, b}, 110.0) == [a]  # b was paused later
    # A partition faust resumed by itself starts over when it is paused again.
    assert watch.overdue({b}, 112.0) == []
    assert watch.overdue({a, b}, 114.0) == []
    assert watch.overdue({a, b}, 124.0) == [a, b]


@pytest.mark.unit
def test_stalled_inputs_are_paused_or_missing_from_the_active_set_of_input_topics() -> None:
    gpu0, gpu1 = TopicPartition("gpu", 0), TopicPartition("gpu", 1)
    ev0, log0 = TopicPartition("events", 0), TopicPartition("changelog", 0)
    assigned = [gpu0, gpu1, ev0, log0]
    topics = {"gpu", "events"}
    # faust has not built its active set yet: every assigned partition is fetched
    assert stalled_inputs(assigned, None, set(), topics) == set()
    assert stalled_inputs(assigned, None, {gpu1}, topics) == {gpu1}
    # assigned but left out of the active set without being paused (the stall seen in the
    # two-worker rebalance test), and a changelog partition that is not input
    assert stalled_inputs(assigned, {gpu0}, set(), topics) == {gpu1, ev0}
    assert stalled_inputs(assigned, {gpu0, gpu1, ev0}, set(), topics) == set()


@pytest.mark.unit
def test_worker_topics_cover_catalog_triggers_and_every_changelog(
    kafka_cfg: FlexPipeConfig,
) -> None:
    topics = worker_topics(kafka_cfg)
    assert {topic_name(kafka_cfg, s.topic) for s in CATALOG} <= set(topics)
    changelogs = {n for n in topics if n.endswith("-changelog")}
    assert len(changelogs) == len(internal_topics(kafka_cfg)) - 1
    assert set(topics.values()) == {kafka_cfg.topics.partitions}


@pytest.mark.integration
async def test_not_ready_names_the_missing_topic(kafka_cfg: FlexPipeConfig) -> None:
    await create_topics(kafka_cfg)
    wanted = {topic_name(kafka_cfg, CATALOG[0].topic): 3, f"{kafka_cfg.topics.prefix}absent": 3}
    producer = make_producer(kafka_cfg)
    async with running(producer):
        with pytest.raises(NotReadyError, match=r"absent") as err:
            await wait_writable(producer, wanted, timeout_s=1.0)
    assert CATALOG[0].topic.value not in str(err.value)


@pytest.mark.integration
async def test_ready_once_every_worker_topic_is_in_producer_metadata(
    kafka_cfg: FlexPipeConfig,
) -> None:
    await create_topics(kafka_cfg, internal_topics(kafka_cfg))
    wanted = worker_topics(kafka_cfg)
    producer = make_producer(kafka_cfg)
    async with running(producer):
        await wait_writable(producer, wanted, timeout_s=30.0)
        for name, partitions in wanted.items():
            assert len(producer.client.cluster.partitions_for_topic(name) or ()) == partitions


class _CrashingApp:
    def __init__(self) -> None:
        self.crashes: list[BaseException] = []

    async def crash(self, reason: BaseException) -> None:
        self.crashes.append(reason)


@pytest.mark.unit
async def test_decision_failures_are_counted_and_stop_the_worker_once() -> None:
    registry = CollectorRegistry()
    engine = SimpleNamespace(metrics=StreamsMetrics(registry))
    app = _CrashingApp()
    failures = FailureLog(max_consecutive=4)
    for _ in range(6):
        await _decision_failed(app, engine, failures, "tick", _boom("changelog"))  # type: ignore[arg-type]
    counted = registry.get_sample_value("flexpipe_streams_tick_failures_total", {"path": "tick"})
    assert counted == 6
    assert failures.exhausted
    assert len(app.crashes) == 1
    assert isinstance(app.crashes[0], FatalDecisionPath)
