"""`flexpipe run` and `flexpipe sim`: the simulated cluster through a real Kafka broker.

``sim`` publishes the simulated fleet's telemetry, paced in event time; ``run`` is the main job:
it starts the local broker when none is configured, publishes, and prints a live per-block view
from a subscriber reading the same topics, then a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import itertools
import shutil
import time
from collections import Counter
from collections.abc import AsyncIterator, Collection, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiokafka import TopicPartition

from flexpipe import envelope
from flexpipe.config import FlexPipeConfig
from flexpipe.errors import FlexPipeError, ValidationError
from flexpipe.kafka import (
    bootstrap_servers,
    create_topics,
    make_consumer,
    make_producer,
    running,
    with_bootstrap,
)
from flexpipe.kafka_local import LocalKafka
from flexpipe.topics import Topic, telemetry_route, topic_name
from sim.blockview import BlockRow, BlockView, render_row
from sim.fleet import SimFleet
from sim.scenario import load_scenario, scenario_path
from sim.spec import Scenario

DEFAULT_WALL_S = 90.0  # `make run` fits in two minutes with start-up and the summary
TRANSPORT_DELAY_S = 1.0  # wall seconds a record may take from the fleet to the view
DEFAULT_LAUNCH_DRAIN_S = 5.0  # the demo drains launch maps less often than agents (200 ms)


@asynccontextmanager
async def broker(cfg: FlexPipeConfig) -> AsyncIterator[str]:
    """The configured broker, or a local one started (and afterwards stopped) for this job."""
    if cfg.kafka.bootstrap_servers:
        yield bootstrap_servers(cfg)
        return
    local = LocalKafka(cfg.local_kafka)
    was_running = local.status().running
    address = await _start(local, fresh=False, ours=not was_running)
    print(f"kafka: {'using running' if was_running else 'started'} local broker {address}")
    try:
        yield address
    finally:
        if not was_running:
            await asyncio.to_thread(local.down)
            print("kafka: stopped the local broker")


@asynccontextmanager
async def dedicated_broker(cfg: FlexPipeConfig, name: str) -> AsyncIterator[LocalKafka]:
    """A fresh local broker of this job's own (run directory ``name``), stopped and removed
    afterwards: one this job may stop and start again (``flexpipe up --chaos``) without
    touching a broker anyone else uses."""
    if cfg.kafka.bootstrap_servers:
        raise FlexPipeError(
            "this job stops and restarts its broker: it needs the local one"
            " (unset kafka.bootstrap_servers / FLEXPIPE_KAFKA__BOOTSTRAP_SERVERS)"
        )
    local = LocalKafka(cfg.local_kafka, name=name)
    try:
        address = await _start(local, fresh=True, ours=True)
    except asyncio.CancelledError:
        shutil.rmtree(local.run_dir, ignore_errors=True)
        raise
    print(f"kafka: started a broker of this run's own, {address}")
    try:
        yield local
    finally:
        await asyncio.to_thread(local.down)
        shutil.rmtree(local.run_dir, ignore_errors=True)
        print("kafka: stopped and removed this run's broker")


async def _start(local: LocalKafka, fresh: bool, ours: bool) -> str:
    """``local.up`` in a thread. When the job is cancelled meanwhile (SIGTERM, Ctrl-C) the start
    still runs to its end in its thread, so a broker this job starts (``ours``) is stopped once it
    is up instead of being left running with nobody to stop it."""
    starting = asyncio.ensure_future(asyncio.to_thread(local.up, fresh))
    try:
        return await asyncio.shield(starting)
    except asyncio.CancelledError:
        if ours:
            with contextlib.suppress(Exception):  # a failed start leaves nothing to stop
                await starting
            await asyncio.to_thread(local.down)
        raise


def fleet_events(
    scenario: Scenario, seed: int, duration_s: float, cfg: FlexPipeConfig
) -> Iterator[envelope.Envelope[Any]]:
    """Every envelope the simulated node agents emit over ``duration_s``."""
    fleet = SimFleet(
        scenario,
        seed=seed,
        sample_interval_s=cfg.intervals.sample_s,
        launch_interval_s=DEFAULT_LAUNCH_DRAIN_S,
        heartbeat_s=cfg.intervals.heartbeat_s,
    )
    return fleet.events(0.0, duration_s)


async def paced(
    events: Iterator[envelope.Envelope[Any]], speed: float, t0_ms: int, start: float
) -> AsyncIterator[envelope.Envelope[Any]]:
    """Yield each envelope at its event time: ``speed`` simulated seconds per wall second from
    ``start`` (a ``time.monotonic()`` value, simulated time ``t0_ms``)."""
    for env in events:
        due = start + (env.event_time_ms - t0_ms) / 1000.0 / speed
        delay = due - time.monotonic()
        if delay > 0.005:
            await asyncio.sleep(delay)
        yield env


async def publish(
    cfg: FlexPipeConfig,
    events: Iterator[envelope.Envelope[Any]],
    speed: float,
    t0_ms: int,
    t0: float | None = None,
) -> int:
    """Publish envelopes paced so that ``speed`` simulated seconds pass per wall second.

    ``t0`` (a ``time.monotonic()`` value) is the wall time of simulated time 0; pass the one the
    other components' clocks share.
    """
    producer = make_producer(cfg)
    start = time.monotonic() if t0 is None else t0
    pending: list[Any] = []
    count = 0
    async with running(producer):
        async for env in paced(events, speed, t0_ms, start):
            topic, key = telemetry_route(cfg, env.payload)
            pending.append(await producer.send(topic, envelope.encode(env), key=key))
            count += 1
            if len(pending) >= 2000:
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*pending)
    return count


async def publish_buffered(
    cfg: FlexPipeConfig,
    events: Iterator[envelope.Envelope[Any]],
    speed: float,
    t0_ms: int,
    t0: float,
) -> int:
    """:func:`publish` through the node agents' own path to Kafka, the bounded buffer that
    rides out broker outages (:class:`probes.publisher.BufferedPublisher`); returns the events
    the broker acknowledged.

    NOTE: what the agents do on a real cluster; `flexpipe up --chaos` stops the broker for a
    while and the simulated agents must carry on as real ones would.
    """
    from prometheus_client import CollectorRegistry

    from probes.publisher import BufferedPublisher, PublisherMetrics

    buffer = BufferedPublisher(lambda: make_producer(cfg), PublisherMetrics(CollectorRegistry()))
    stop = asyncio.Event()
    sender = asyncio.create_task(buffer.run(stop))
    try:
        async for env in paced(events, speed, t0_ms, t0):
            topic, key = telemetry_route(cfg, env.payload)
            buffer.put(topic, key, envelope.encode(env))
            if sender.done():  # it only ends early by raising
                sender.result()
    finally:
        stop.set()
        await sender
    return buffer.published


@dataclass
class ViewPrinter:
    """Prints the per-block view every ``every_s`` simulated seconds and keeps its history."""

    epoch_ms: int
    every_s: float
    next_s: float = -1.0  # first line after one full sample round; set in __post_init__
    history: list[tuple[float, list[BlockRow]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.next_s = self.every_s

    def maybe_print(self, view: BlockView) -> None:
        """Print one timeline line when the view's clock passed the next mark."""
        t_s = view.now_s - self.epoch_ms / 1000.0
        if t_s < self.next_s:
            return
        rows = view.rows()
        self.history.append((t_s, rows))
        print(f"{_hms(t_s)}  " + "  │  ".join(render_row(r) for r in rows), flush=True)
        self.next_s = (t_s // self.every_s + 1) * self.every_s


def _hms(t_s: float) -> str:
    t = int(t_s)
    return f"{t // 3600:02d}:{t // 60 % 60:02d}:{t % 60:02d}"


async def end_offsets(cfg: FlexPipeConfig, topics: list[str]) -> dict[TopicPartition, int]:
    """Current end offset of every partition of ``topics``."""
    consumer = make_consumer(cfg, *topics, group_id=None)
    async with running(consumer):
        parts = [
            TopicPartition(t, p)
            for t in topics
            for p in sorted(consumer.partitions_for_topic(t) or ())
        ]
        return dict(await consumer.end_offsets(parts)) if parts else {}


@dataclass
class EventTimeMerge:
    """Envelopes of several partitions, released in event-time order.

    Each partition is in event-time order by itself, but a consumer fetches them in chunks, one
    partition far ahead of another when it lags (a busy machine). A view folding records as
    they come would then take the GPUs of a lagging partition for silent (its clock is the
    newest event seen) and print blocks half-built. So records wait here until every partition
    that still has records to fetch has reached their event time (the low watermark).
    """

    partitions: tuple[TopicPartition, ...]
    idle_ms: int = 0  # a partition read to its end this far behind the newest waits for nobody
    _heap: list[tuple[int, int, envelope.Envelope[Any]]] = field(default_factory=list)
    _newest_ms: dict[TopicPartition, int] = field(default_factory=dict)
    _order: Iterator[int] = field(default_factory=itertools.count)

    def push(self, tp: TopicPartition, env: envelope.Envelope[Any]) -> None:
        """Hold one envelope fetched from ``tp``."""
        heapq.heappush(self._heap, (env.event_time_ms, next(self._order), env))
        self._newest_ms[tp] = max(self._newest_ms.get(tp, env.event_time_ms), env.event_time_ms)

    def release(
        self, caught_up: Collection[TopicPartition], final: bool = False
    ) -> list[envelope.Envelope[Any]]:
        """The held envelopes no partition can precede any more, oldest first: every one when
        ``final``, else those up to the newest event time of the most lagging partition, leaving
        out partitions read to their end (``caught_up``) that trail the newest event by more
        than ``idle_ms`` (they have gone quiet: their GPUs are silent, not late).

        NOTE: a partition read to the end of the last fetch can still receive older records
        than another partition's newest: the producer batches per partition, and at hundreds
        of simulated seconds per wall second one batch spans minutes of event time. Folding
        past it would show that partition's GPUs as silent (the flaky `8/12` line of the
        block-view test), so it keeps holding the watermark while it is recent.
        """
        newest = max(self._newest_ms.values(), default=-1)

        def waits_for(tp: TopicPartition) -> bool:
            ms = self._newest_ms.get(tp, -1)
            return tp not in caught_up or (self.idle_ms > 0 and newest - ms <= self.idle_ms)

        lagging = [self._newest_ms.get(tp, -1) for tp in self.partitions if waits_for(tp)]
        watermark = None if final or not lagging else min(lagging)
        out = []
        while self._heap and (watermark is None or self._heap[0][0] <= watermark):
            out.append(heapq.heappop(self._heap)[2])
        return out


async def watch(
    cfg: FlexPipeConfig,
    start: dict[TopicPartition, int],
    done: asyncio.Future[dict[TopicPartition, int]],
    view: BlockView,
    printer: ViewPrinter,
    speed: float = 1.0,
) -> Counter[str]:
    """Consume from ``start`` until the offsets ``done`` resolves to; fold into ``view`` in
    event-time order across partitions (:class:`EventTimeMerge`).

    NOTE: a partition is taken for quiet only past the heartbeat timeout plus what a wall
    second of transport delay (producer batching, fetch) spans at ``speed``: at 800× a 60 ms
    hiccup already spans a heartbeat timeout, and the view would show live GPUs as silent.
    """
    consumer = make_consumer(cfg, group_id=None)
    seen: Counter[str] = Counter()
    idle_ms = round((cfg.intervals.heartbeat_timeout_s + speed * TRANSPORT_DELAY_S) * 1000)
    merge = EventTimeMerge(tuple(start), idle_ms)
    async with running(consumer):
        consumer.assign(list(start))
        for tp, offset in start.items():
            consumer.seek(tp, offset)
        while True:
            batch = await consumer.getmany(timeout_ms=200, max_records=5000)
            for tp, records in batch.items():
                for rec in records:
                    env = _decode(rec.value, seen)
                    if env is not None:
                        merge.push(tp, env)
            final = done.done() and all(await _reached(consumer, done.result()))
            caught_up = [tp for tp in start if await _caught_up(consumer, tp)]
            for env in merge.release(caught_up, final):
                _fold(env, view, printer)
            if final:
                return seen


async def _reached(consumer: Any, target: dict[TopicPartition, int]) -> list[bool]:
    return [await consumer.position(tp) >= off for tp, off in target.items()]


async def _caught_up(consumer: Any, tp: TopicPartition) -> bool:
    highwater = consumer.highwater(tp)  # None until a fetch answered for this partition
    return highwater is not None and await consumer.position(tp) >= highwater


def _decode(raw: bytes | None, seen: Counter[str]) -> envelope.Envelope[Any] | None:
    try:
        env = envelope.decode(raw)
    except ValidationError as exc:
        seen["invalid"] += 1
        print(f"  skipped invalid message: {exc}")
        return None
    seen[env.kind.value] += 1
    return env


def _fold(env: envelope.Envelope[Any], view: BlockView, printer: ViewPrinter) -> None:
    event = view.apply(env)
    if event is not None:
        t_s = env.event_time_s - printer.epoch_ms / 1000.0
        gpus = f" ({len(event.gpu_uuids)} GPUs)" if event.gpu_uuids else ""
        print(f"{_hms(t_s)}  ⚡ {event.type.value} on {event.node}{gpus} {event.detail}".rstrip())
    printer.maybe_print(view)


async def run_sim_publish(cfg: FlexPipeConfig, args: argparse.Namespace) -> int:
    """`flexpipe sim`: publish the scenario's telemetry to the configured or local broker."""
    scenario = load_scenario(scenario_path(args.scenario))
    duration_s = args.duration or scenario.duration_s
    speed = args.speed or duration_s / DEFAULT_WALL_S
    cfg = with_bootstrap(cfg, bootstrap_servers(cfg))
    await create_topics(cfg)
    count = await publish(
        cfg, fleet_events(scenario, args.seed, duration_s, cfg), speed, scenario.epoch_ms
    )
    print(f"sim: published {count} events for {scenario.name} ({duration_s:.0f} simulated s)")
    return 0


async def run_main_job(cfg: FlexPipeConfig, args: argparse.Namespace) -> int:
    """`flexpipe run`: broker, simulated cluster, live per-block view, summary."""
    scenario = load_scenario(scenario_path(args.scenario))
    duration_s = args.duration or scenario.duration_s
    speed = args.speed or duration_s / DEFAULT_WALL_S
    async with broker(cfg) as address:
        cfg = with_bootstrap(cfg, address)
        await create_topics(cfg)
        watched = [topic_name(cfg, Topic.GPU), topic_name(cfg, Topic.CLUSTER)]
        start = await end_offsets(cfg, watched)
        view = BlockView(heartbeat_timeout_s=cfg.intervals.heartbeat_timeout_s)
        printer = ViewPrinter(epoch_ms=scenario.epoch_ms, every_s=max(duration_s / 24, 60.0))
        hours = duration_s / 3600
        print(f"run: {scenario.name}, {hours:.1f} simulated h at {speed:.0f}× (seed {args.seed})")
        done: asyncio.Future[dict[TopicPartition, int]] = asyncio.get_running_loop().create_future()
        watcher = asyncio.create_task(watch(cfg, start, done, view, printer, speed))
        wall0 = time.monotonic()
        events = fleet_events(scenario, args.seed, duration_s, cfg)
        published = await publish(cfg, events, speed, scenario.epoch_ms)
        done.set_result(await end_offsets(cfg, watched))
        seen = await watcher
        wall_s = time.monotonic() - wall0
    _summary(view, printer, seen, published, wall_s)
    return 0 if seen["invalid"] == 0 else 1


def _summary(
    view: BlockView, printer: ViewPrinter, seen: Counter[str], published: int, wall_s: float
) -> None:
    print("\n== summary")
    rate = published / wall_s
    consumed = ", ".join(f"{k} {v}" for k, v in sorted(seen.items()))
    print(
        f"published {published} events in {wall_s:.1f} s wall ({rate:.0f}/s); consumed {consumed}"
    )
    events = Counter(e.type.value for _, e in view.events)
    print("cluster events: " + (", ".join(f"{k} {v}" for k, v in sorted(events.items())) or "none"))
    header = ("block", "GPUs", "free min", "free max", "free GiB min", "free GiB max")
    print(
        f"{header[0]:<8}{header[1]:>5}{header[2]:>10}{header[3]:>10}{header[4]:>14}{header[5]:>14}"
    )
    by_domain: dict[str, list[BlockRow]] = {}
    for _, rows in printer.history:
        for row in rows:
            by_domain.setdefault(row.domain, []).append(row)
    for domain, rows in sorted(by_domain.items()):
        free = [r.num_free for r in rows]
        gib = [r.free_memory_bytes / (1 << 30) for r in rows]
        print(
            f"{domain:<8}{rows[-1].num_gpus:>5}{min(free):>10}{max(free):>10}{min(gib):>14.0f}{max(gib):>14.0f}"
        )
