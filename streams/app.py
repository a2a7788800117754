"""The Faust app: topics, tables, agents and timers wired to the
:class:`~streams.processor.StreamProcessor`.

Thin on purpose — it decodes nothing itself (every topic is raw bytes), routes each message to
the engine, and adapts Faust tables, topic sends and partition assignment to the engine's ports.

Keys: telemetry by GPU uuid, cluster events by node, everything else by deployment. All topics
(and so all table changelogs) have ``topics.partitions`` partitions, which Faust assigns
co-partitioned: partition *p* of every topic goes to one worker, so one worker owns everything
about a deployment — its serving load, transitions, control commands, triggers and decisions.

Delivery: Faust's at-least-once processing, an idempotent ``acks=all`` producer, and
deterministic decision ids made unique by :mod:`streams.decider` (see the README).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import faust
from aiokafka.admin import NewTopic
from faust.transport.drivers import aiokafka as faust_aiokafka
from prometheus_client import CollectorRegistry

from flexpipe.config import FlexPipeConfig
from flexpipe.errors import FlexPipeError
from flexpipe.kafka import bootstrap_servers, catalog_topics, client_kwargs, create_topics
from flexpipe.topics import Topic, topic_name
from streams.decider import Decider
from streams.delivery import IntakeConsumer
from streams.deployments import resolve_deployments
from streams.health import (
    FailureLog,
    FailureVerdict,
    InputWatch,
    stalled_inputs,
    wait_writable,
)
from streams.intake import DeadLetterReason, Rejected, SourceTopic
from streams.metrics import StreamsMetrics
from streams.peek import ClusterPeek
from streams.ports import Message, TableName
from streams.processor import ProcessorTopics, StreamProcessor
from streams.readers import KafkaDecisionLog, ViewReader, partition_for

__all__ = [
    "FatalDecisionPath",
    "StreamsApp",
    "Wiring",
    "create_app",
    "ensure_topics",
]

log = logging.getLogger(__name__)
CLOCK_POLL_S = 0.1  # how often the periodic-tick check runs (wall seconds)
GAUGES_S = 2.0  # how often view/table/clock gauges are refreshed
PAUSED_GRACE_S = 10.0  # an input partition paused this long after recovery is resumed
BEHIND_WARN_S = 30.0  # input trailing the clock this long is logged with each partition's state
# NOTE: small per-agent buffers and fetches: a message for the control agent (or the triggers
# agent) waits behind at most this much queued telemetry in Faust's single fetch loop.
STREAM_BUFFER = 512
MAX_POLL_RECORDS = 500
TRIGGER_BATCH = 512
# NOTE: table writes queue in Faust's producer buffer, and while it holds more than this Faust
# stops handing any input to agents (cluster events too) until it drained. Its default (100) is
# below one flush of a 1,000-GPU worker (a GPU record and a launch window per GPU every
# view_refresh_s, all GPUs at once on the first samples): a worker driven by bench.pipeline
# logged "producer buffer full" (intake paused) flush after flush. Real overload still pauses.
PRODUCER_BUFFER_MESSAGES = 4096

_SOURCES: dict[SourceTopic, Topic] = {
    SourceTopic.GPU: Topic.GPU,
    SourceTopic.LAUNCHES: Topic.LAUNCHES,
    SourceTopic.NODE: Topic.NODE,
    SourceTopic.SERVING: Topic.SERVING,
    SourceTopic.CLUSTER: Topic.CLUSTER,
    SourceTopic.TRANSITIONS: Topic.TRANSITIONS,
    SourceTopic.CONTROL: Topic.CONTROL,
}


class FatalDecisionPath(FlexPipeError):
    """The decision path failed ``streams.max_tick_failures`` times in a row."""


class DurableProducer(faust_aiokafka.Producer):
    """Faust's producer with ``acks=all`` and idempotence (Faust enables them only inside
    transactions; aiokafka's defaults are ``acks=1`` without idempotence), which starts only once
    its metadata lists every topic the worker writes (:func:`streams.health.wait_writable`), and
    whose buffer of table writes holds ``PRODUCER_BUFFER_MESSAGES`` before it pauses intake."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.buffer.max_messages = PRODUCER_BUFFER_MESSAGES

    def _settings_extra(self) -> Mapping[str, Any]:
        return {**super()._settings_extra(), "acks": "all", "enable_idempotence": True}

    async def on_start(self) -> None:
        await super().on_start()
        app = self.app
        assert isinstance(app, StreamsApp)  # NOTE: only StreamsApp makes this producer
        await wait_writable(self._ensure_producer(), app.topic_partitions, app.ready_timeout_s)
        log.info("ready: %d topics visible in the producer's metadata", len(app.topic_partitions))
        app.writable.set()


class StreamsApp(faust.App):
    """A Faust app whose producer is durable and gates processing on its topics' metadata.

    ``writable`` is set once the producer sees every topic in ``topic_partitions``; agents wait
    for it and timers skip until then, so no table write races the changelog's metadata.
    """

    topic_partitions: Mapping[str, int]
    ready_timeout_s: float
    writable: asyncio.Event

    def _new_producer(self) -> DurableProducer:
        return DurableProducer(self.transport, loop=self.loop, beacon=self.beacon)

    def _new_consumer(self) -> IntakeConsumer:
        # NOTE: faust's own (App._new_consumer via Transport.create_consumer), with the record
        # hand-over of streams.delivery
        transport = self.transport
        return IntakeConsumer(
            transport,
            callback=self.topics.on_message,
            on_partitions_revoked=self._on_partitions_revoked,
            on_partitions_assigned=self._on_partitions_assigned,
            beacon=self.beacon,
            loop=transport.loop,
        )


@dataclass(frozen=True, slots=True)
class Wiring:
    """The app and what the worker entry point and tests need to reach."""

    app: StreamsApp
    engine: StreamProcessor
    app_id: str
    triggers_topic: str
    failures: FailureLog  # the decision path's failures; ``exhausted`` once the bound was hit


def app_id(cfg: FlexPipeConfig) -> str:
    """Faust app id = consumer group = changelog topic prefix."""
    return f"{cfg.topics.prefix}{cfg.streams.app_id}"


def triggers_topic(cfg: FlexPipeConfig) -> str:
    """The internal topic carrying topology triggers to each deployment's owner."""
    return f"{app_id(cfg)}-triggers"


def changelog_topic(cfg: FlexPipeConfig, table: TableName) -> str:
    """The changelog topic Faust names for ``table``."""
    return f"{app_id(cfg)}-{table.value}-changelog"


def internal_topics(cfg: FlexPipeConfig) -> list[NewTopic]:
    """The worker's own topics: triggers, and one compacted changelog per table."""
    n, rf = cfg.topics.partitions, cfg.topics.replication_factor
    triggers = NewTopic(
        triggers_topic(cfg),
        num_partitions=n,
        replication_factor=rf,
        topic_configs={"cleanup.policy": "delete", "retention.ms": str(86_400_000)},
    )
    changelogs = [
        NewTopic(
            changelog_topic(cfg, table),
            num_partitions=n,
            replication_factor=rf,
            topic_configs={"cleanup.policy": "compact"},
        )
        for table in TableName
    ]
    return [triggers, *changelogs]


def worker_topics(cfg: FlexPipeConfig) -> dict[str, int]:
    """Every topic a worker reads or writes, with its partitions."""
    topics = [*catalog_topics(cfg), *internal_topics(cfg)]
    return {t.name: t.num_partitions for t in topics}


async def ensure_topics(cfg: FlexPipeConfig) -> None:
    """Create every topic the worker reads or writes — the catalog, the triggers topic and the
    tables' changelogs — and wait until the broker lists them all (Faust would otherwise declare
    changelogs itself at start-up, racing its own first writes)."""
    await create_topics(cfg, internal_topics(cfg))


def _data_dir(cfg: FlexPipeConfig) -> str:
    """The configured data directory, or a temporary one removed at exit (Faust's default,
    ``{app id}-data`` in the working directory, was left behind by every worker)."""
    if cfg.streams.data_dir is not None:
        return cfg.streams.data_dir
    path = tempfile.mkdtemp(prefix=f"{app_id(cfg)}-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def _faust_app(cfg: FlexPipeConfig) -> StreamsApp:
    s = cfg.streams
    brokers = [f"kafka://{h.strip()}" for h in bootstrap_servers(cfg).split(",") if h.strip()]
    app = StreamsApp(
        app_id(cfg),
        broker=brokers,
        datadir=_data_dir(cfg),
        store="memory://",
        web_enabled=False,
        autodiscover=False,
        topic_partitions=cfg.topics.partitions,
        topic_replication_factor=cfg.topics.replication_factor,
        topic_allow_declare=True,
        producer_acks=-1,
        producer_linger=0.002,
        consumer_auto_offset_reset="earliest",
        processing_guarantee="at_least_once",
        broker_session_timeout=s.session_timeout_s,
        broker_heartbeat_interval=max(0.5, s.session_timeout_s / 10),
        broker_commit_interval=1.0,
        table_standby_replicas=0,
        stream_buffer_maxsize=STREAM_BUFFER,
        broker_max_poll_records=MAX_POLL_RECORDS,
        broker_credentials=_credentials(cfg),
    )
    app.topic_partitions = worker_topics(cfg)
    app.ready_timeout_s = s.ready_timeout_s
    app.writable = asyncio.Event()
    return app


def _credentials(cfg: FlexPipeConfig) -> Any:
    k = cfg.kafka
    ssl_context = client_kwargs(cfg).get("ssl_context")
    if k.security_protocol.startswith("SASL"):
        return faust.SASLCredentials(
            username=k.sasl_username,
            password=k.sasl_password,
            mechanism=k.sasl_mechanism,
            ssl_context=ssl_context,
        )
    return faust.SSLCredentials(ssl_context) if ssl_context is not None else None


class _FaustTables:
    """The engine's Tables port over Faust tables of raw bytes."""

    def __init__(self, tables: Mapping[TableName, Any]) -> None:
        self._tables = tables

    def get(self, table: TableName, key: bytes) -> bytes | None:
        value: bytes | None = self._tables[table].get(key)
        return value

    def set(self, table: TableName, key: bytes, value: bytes) -> None:
        self._tables[table][key] = value  # NOTE: reassignment is what publishes to the changelog

    def keys(self, table: TableName) -> Iterable[bytes]:
        keys: Iterable[bytes] = self._tables[table].keys()
        return keys


def _raw(app: StreamsApp, name: str) -> Any:
    return app.topic(
        name, key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw"
    )


def create_app(
    cfg: FlexPipeConfig,
    registry: CollectorRegistry,
    *,
    worker_id: str | None = None,
) -> Wiring:
    """Build the Faust app (call :func:`ensure_topics` before starting it); deployments, catalog
    and gearbox's knobs come from ``cfg``."""
    app = _faust_app(cfg)
    catalog, deployments = resolve_deployments(cfg)
    worker = worker_id or cfg.streams.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    n = cfg.topics.partitions
    tables = {
        name: app.Table(
            name.value,
            key_type=bytes,  # bytes in, bytes out: Faust serialises nothing ("raw")
            value_type=bytes,
            partitions=n,
            use_partitioner=True,  # writes from timers and batches, outside one event's scope
        )
        for name in TableName
    }
    send_topics: dict[str, Any] = {}

    async def send(topic: str, key: bytes | None, value: bytes, *, wait: bool) -> None:
        channel = send_topics.get(topic) or send_topics.setdefault(topic, _raw(app, topic))
        fut = await channel.send(key=key, value=value)
        if wait:
            await fut

    triggers = triggers_topic(cfg)
    owned: dict[str, set[int]] = {"partitions": set()}

    def owns(name: str) -> bool:
        return partition_for(name, n) in owned["partitions"]

    topics = ProcessorTopics(
        topic_name(cfg, Topic.DECISIONS), topic_name(cfg, Topic.DEADLETTER), triggers
    )
    decision_log = KafkaDecisionLog(cfg, topics.decisions, n)
    engine = StreamProcessor(
        cfg,
        catalog=catalog,
        deployments=deployments,
        tables=_FaustTables(tables),
        send=send,
        decisions=lambda p: Decider(p, decision_log, owns, cfg.gearbox),
        topics=topics,
        metrics=StreamsMetrics(registry),
        worker=worker,
    )
    failures = FailureLog(cfg.streams.max_tick_failures)
    cluster_topic = topic_name(cfg, Topic.CLUSTER)
    peek = ClusterPeek(cfg, engine, cluster_topic)
    _agents(app, cfg, engine)
    _triggers_agent(app, cfg, engine, triggers, failures)
    _housekeeping(app, cfg, engine, tables, decision_log, failures)

    async def _revoked(_sender: Any, /, *_args: Any, signal: Any, **_kwargs: Any) -> None:
        peek.revoked()
        await engine.decider.on_revoked()

    async def _assigned(_sender: Any, /, *_args: Any, signal: Any, **_kwargs: Any) -> None:
        current = app.consumer.assignment()  # the whole assignment, not only the news
        owned["partitions"] = {tp.partition for tp in current if tp.topic == triggers}
        engine.decider.on_assigned()
        peek.assigned({tp.partition for tp in current if tp.topic == cluster_topic})

    @app.task
    async def _peek() -> None:
        if not cfg.streams.cluster_peek:
            return
        await app.writable.wait()
        await peek.run()

    app.on_partitions_revoked.connect(_revoked)
    app.on_partitions_assigned.connect(_assigned)

    return Wiring(app, engine, app_id(cfg), triggers, failures)


def _agents(app: StreamsApp, cfg: FlexPipeConfig, engine: StreamProcessor) -> None:
    by_topic = {topic_name(cfg, topic): src for src, topic in _SOURCES.items()}

    async def agent(stream: Any) -> None:
        await app.writable.wait()
        async for event in stream.events():
            m = event.message
            src = by_topic[m.topic]
            msg = Message(m.topic, m.partition, m.offset, event.key, event.value)
            try:
                await engine.on_message(src, msg)
            except Exception as exc:  # NOTE: a stream never stops on input
                log.exception("%s: message at offset %s failed", src.value, m.offset)
                detail = f"{type(exc).__name__}: {exc}"[:500]
                bad = Rejected(DeadLetterReason.INTERNAL_ERROR, "", detail)
                await engine.reject(bad, msg, src.value)

    # NOTE: one agent over the high-volume telemetry topics, one over cluster events (the
    # topology triggers) and one over the rest: a trigger never queues behind a telemetry
    # backlog inside an agent's buffer, nor behind a transition that waits for the decider's
    # lock while a decision is being published (the runtime answers every decision with one).
    hot = (SourceTopic.GPU, SourceTopic.LAUNCHES, SourceTopic.NODE)
    for name, sources in (
        ("telemetry", hot),
        ("cluster", (SourceTopic.CLUSTER,)),
        ("control", tuple(s for s in _SOURCES if s not in (*hot, SourceTopic.CLUSTER))),
    ):
        names = [topic_name(cfg, _SOURCES[s]) for s in sources]
        channel = app.topic(
            *names,
            key_type=bytes,
            value_type=bytes,
            key_serializer="raw",
            value_serializer="raw",
        )
        app.agent(channel, name=f"streams.{name}")(agent)


def _triggers_agent(
    app: StreamsApp, cfg: FlexPipeConfig, engine: StreamProcessor, name: str, failures: FailureLog
) -> None:
    within_s = max(cfg.streams.debounce_ms / 1000.0, 0.001)

    async def triggers(stream: Any) -> None:
        await app.writable.wait()
        # NOTE: take() is the debounce: a burst of topology events inside one window becomes
        # one decision per deployment, and the batch is acknowledged only after deciding.
        async for values in stream.take(TRIGGER_BATCH, within=within_s):
            msgs = [Message(name, -1, -1, None, v) for v in values]
            try:
                await engine.decider.on_triggers(msgs, engine.wall())
            except Exception as exc:  # NOTE: keep deciding on later triggers
                await _decision_failed(app, engine, failures, "triggers", exc)
            else:
                failures.succeeded()

    app.agent(_raw(app, name), name="streams.triggers")(triggers)


async def _decision_failed(
    app: StreamsApp, engine: StreamProcessor, failures: FailureLog, path: str, exc: Exception
) -> None:
    """Count a failed decision run, log each distinct error once with its count, and stop the
    worker (non-zero, see :mod:`streams.worker`) after ``streams.max_tick_failures`` in a row."""
    engine.metrics.tick_failures.labels(path).inc()
    verdict = failures.failed(exc)
    if verdict.first:
        log.error("%s failed (first time for this error)", path, exc_info=exc)
    elif _milestone(verdict):
        log.error(
            "%s failed again: %s (%d times, %d in a row)",
            path,
            FailureLog.key(exc),
            verdict.count,
            verdict.consecutive,
        )
    if verdict.fatal and not failures.exhausted:
        failures.exhausted = True
        log.critical(
            "stopping: %d decision runs failed in a row (streams.max_tick_failures); errors: %s",
            verdict.consecutive,
            "; ".join(f"{k} ×{n}" for k, n in failures.counts.items()),
        )
        await app.crash(FatalDecisionPath(f"{verdict.consecutive} decision runs failed in a row"))


def _check_inputs(
    app: StreamsApp, engine: StreamProcessor, topics: frozenset[str], paused: InputWatch
) -> None:
    """Set ``engine.input_current``: no partition of ``topics`` this worker reads has records
    left whose event time trails the clock (:meth:`StreamProcessor.trailing`); and resume input
    partitions faust left paused after its recovery (:class:`streams.health.InputWatch`).

    NOTE: a partition counts as read to its end when the next offset to process reaches the
    high watermark of the last fetch; before it processed anything, the next offset is the
    committed one faust seeked to at assignment (none: behind whenever the partition holds
    records).
    """
    consumer = app.consumer
    _resume_paused(app, engine, topics, paused)
    committed: Mapping[Any, int | None] = getattr(consumer, "_committed_offset", {})
    behind = []
    for tp in consumer.assignment():
        if tp.topic not in topics:
            continue
        highwater = consumer.highwater(tp)
        after = engine.next_offset(tp.topic, tp.partition)
        done = committed.get(tp)
        if after is None or (done is not None and done > after):
            after = done  # another owner read further while the partition was away
        if highwater is None or (highwater > 0 and (after is None or after < highwater)):
            behind.append((tp.topic, tp.partition))
    trailing = engine.trailing(behind)
    current = not trailing
    if current != engine.input_current:
        if current:
            log.info("input current again: deciding")
        else:
            shown = ", ".join(f"{t}[{p}]" for t, p in sorted(trailing)[:4])
            log.info("input behind the clock (%s …): not deciding until caught up", shown)
            paused.behind_since = engine.wall()
    elif not current and engine.wall() - paused.behind_since >= BEHIND_WARN_S:
        # NOTE: once per stretch: what each trailing partition shows, for whoever reads the log
        paused.behind_since = float("inf")
        by_tp = {(tp.topic, tp.partition): tp for tp in consumer.assignment()}
        held = stalled_inputs(
            consumer.assignment(),
            getattr(consumer, "_active_partitions", None),
            set(getattr(consumer, "_paused_partitions", ())),
            topics,
        )
        now_ms = engine.now_ms()
        log.warning(
            "input behind the clock for %.0f s, not deciding: %s",
            BEHIND_WARN_S,
            "; ".join(
                f"{t}[{p}] next offset {engine.next_offset(t, p)}, highwater "
                f"{consumer.highwater(by_tp[(t, p)])}, newest event "
                f"{(now_ms - engine.newest_ms(t, p)) / 1000:.0f} s old"
                f"{', not fetched (paused or inactive)' if by_tp[(t, p)] in held else ''}"
                for t, p in sorted(trailing)
            ),
        )
    engine.input_current = current


def _resume_paused(
    app: StreamsApp, engine: StreamProcessor, topics: frozenset[str], watch: InputWatch
) -> None:
    consumer = app.consumer
    recovery: Any = getattr(app.tables, "recovery", None)  # faust's TableManager, not its ABC
    done = recovery is not None and recovery.completed.is_set()
    recovered = done and not getattr(app, "rebalancing", True)
    # NOTE: faust's own records of what it fetches; nothing else here pauses any partition.
    held: set[Any] = set()
    if recovered:
        held = stalled_inputs(
            consumer.assignment(),
            getattr(consumer, "_active_partitions", None),
            set(getattr(consumer, "_paused_partitions", ())),
            topics,
        )
    due = set(watch.overdue({(tp.topic, tp.partition) for tp in held}, engine.wall()))
    if not due:
        return
    resume = {tp for tp in held if (tp.topic, tp.partition) in due}
    log.warning(
        "input partitions %s stayed unfetched (paused or inactive) %.0f s after recovery"
        " completed: resuming them",
        ", ".join(f"{t}[{p}]" for t, p in sorted(due)),
        watch.grace_s,
    )
    consumer.resume_partitions(resume)
    engine.metrics.resumed_partitions.inc(len(resume))
    watch.since.clear()


def _milestone(verdict: FailureVerdict) -> bool:
    # 10, 100, 1000, ... repeats of one error, so a persistent failure stays visible in the log
    n = verdict.count
    return n >= 10 and str(n).strip("0") == "1"


def _housekeeping(
    app: StreamsApp,
    cfg: FlexPipeConfig,
    engine: StreamProcessor,
    tables: Mapping[TableName, Any],
    decision_log: KafkaDecisionLog,
    failures: FailureLog,
) -> None:
    @app.timer(interval=cfg.streams.flush_interval_s, name="streams.flush")
    async def _flush() -> None:
        if app.writable.is_set():
            engine.sweep()
            engine.flush()

    @app.timer(interval=GAUGES_S, name="streams.gauges")
    async def _gauges() -> None:
        engine.export_gauges()

    view_inputs = frozenset(topic_name(cfg, t) for t in (Topic.GPU, Topic.NODE, Topic.CLUSTER))
    paused = InputWatch(grace_s=PAUSED_GRACE_S)

    async def _tick() -> None:
        if not app.writable.is_set():
            return
        _check_inputs(app, engine, view_inputs, paused)
        try:
            await engine.decider.tick()
        except Exception as exc:  # NOTE: a failed tick must not stop the next one
            await _decision_failed(app, engine, failures, "tick", exc)
        else:
            ended = failures.succeeded()
            if ended:
                log.warning("tick recovered after %d failures in a row", ended)

    @app.task
    async def _ticks() -> None:
        # NOTE: a loop, not app.timer: a round of decisions may outlast the poll (many
        # deployments on a busy host; flexpipe_streams_decision_processing_seconds times it),
        # which faust's timer logs as an overlap warning on every such round
        while True:
            await asyncio.sleep(CLOCK_POLL_S)
            await _tick()

    def caught_up() -> None:
        engine.view_caught_up = True

    reader = ViewReader(
        cfg,
        tables[TableName.GPUS].changelog_topic.get_topic_name(),
        tables[TableName.NODES].changelog_topic.get_topic_name(),
        engine.view,
        caught_up,
    )

    @app.task
    async def _view() -> None:
        try:
            await reader.run()
        finally:
            await decision_log.close()
