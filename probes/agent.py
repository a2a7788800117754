"""The node agent: sample, keep only what changed, publish through the bounded buffer.

One asyncio task per source (GPU sampler, launch counter) plus the publisher's sender. A backend
that fails is reported (``backend_up{backend}`` 0, one log line) and the others keep running;
nothing a GPU or the broker does ends the agent.

With ``batch_per_node`` a round's GPU samples (and a drain's launch counts) go out as one
:class:`~flexpipe.schemas.NodeSamples` message on the node topic instead of one message per GPU:
the same delta and heartbeat rules pick what goes in, and each message costs the stream one
intake instead of eight. Off by default: the offline replay and the simulated fleet read the
per-GPU topics.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from flexpipe import envelope
from flexpipe.config import FlexPipeConfig
from flexpipe.schemas import ClusterEvent, GpuSample, KernelLaunches, Kind, NodeSamples
from flexpipe.topics import telemetry_route
from probes.base import GpuSampler, LaunchCounter
from probes.delta import DeltaFilter
from probes.publisher import BufferedPublisher

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AgentClock:
    """Maps the loop's clock to event time; the simulated backend runs it faster than wall time.

    ``now_s`` is what backends see (seconds since ``origin``), ``speed`` is simulated seconds per
    wall second, and event time is ``epoch_ms + now_s * 1000``.
    """

    wall: Callable[[], float]
    origin_s: float
    epoch_ms: int
    speed: float = 1.0

    def now_s(self) -> float:
        """Seconds of (possibly simulated) time since the agent started."""
        return (self.wall() - self.origin_s) * self.speed

    def event_time_ms(self, now_s: float) -> int:
        """Event time of something observed at ``now_s``."""
        return self.epoch_ms + round(now_s * 1000)


class AgentMetrics:
    """Sampling-side metrics; the publisher registers its own on the same registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.samples = Counter(
            "flexpipe_agent_samples", "GPU samples taken", ["backend"], registry=registry
        )
        self.events = Counter(
            "flexpipe_agent_events", "Events handed to the publisher", ["kind"], registry=registry
        )
        self.backend_up = Gauge(
            "backend_up", "1 while a telemetry backend works", ["backend"], registry=registry
        )
        self._events_of: dict[str, Counter] = {}
        self._round_children: dict[str, tuple[Gauge, Counter]] = {}

    def round_of(self, backend: str) -> tuple[Gauge, Counter]:
        """``backend_up`` and ``samples`` children for ``backend``, looked up once."""
        children = self._round_children.get(backend)
        if children is None:
            children = (self.backend_up.labels(backend), self.samples.labels(backend))
            self._round_children[backend] = children
        return children

    def events_of(self, kind: str) -> Counter:
        """The events counter's child for ``kind``, looked up once (``labels()`` takes a lock and
        builds a key on every call, once per event otherwise)."""
        child = self._events_of.get(kind)
        if child is None:
            child = self._events_of[kind] = self.events.labels(kind)
        return child


class Agent:
    """Runs one node's samplers and hands their events to the publisher."""

    def __init__(
        self,
        cfg: FlexPipeConfig,
        node: str,
        sampler: GpuSampler,
        launches: LaunchCounter | None,
        publisher: BufferedPublisher,
        metrics: AgentMetrics,
        clock: AgentClock,
        delta: DeltaFilter | None = None,
        batch_per_node: bool = False,
    ) -> None:
        self._cfg = cfg
        self._node = node
        self._sampler = sampler
        self._launches = launches
        self._publisher = publisher
        self._metrics = metrics
        self._clock = clock
        self._delta = delta or DeltaFilter(heartbeat_s=cfg.intervals.heartbeat_s)
        self._seq: dict[str, int] = {}
        self._batch = batch_per_node
        # NOTE: a GPU sample's route depends on its type and uuid only (telemetry_route), so it
        # is worked out once per GPU rather than once per sample.
        self._sample_routes: dict[str, tuple[str, bytes]] = {}
        self._encode_sample = envelope.payload_encoder(GpuSample)

    def emitted(self) -> dict[str, int]:
        """Events emitted so far per source: the last sequence number handed out."""
        return dict(self._seq)

    def emit(
        self,
        payload: GpuSample | KernelLaunches | ClusterEvent | NodeSamples,
        now_s: float,
        backend: str,
    ) -> None:
        """Wrap one payload in an envelope with the next per-source sequence number and queue it."""
        source = f"{self._node}/{backend}"
        seq = self._seq.get(source, 0) + 1
        self._seq[source] = seq
        env = envelope.make(
            payload, event_time_ms=self._clock.event_time_ms(now_s), source=source, seq=seq
        )
        topic, key = telemetry_route(self._cfg, payload)
        self._publisher.put(topic, key, envelope.encode(env))
        self._metrics.events_of(env.kind.value).inc()

    def sample_once(self) -> None:
        """Take one GPU sample round and queue what changed plus due heartbeats and events."""
        now_s = self._clock.now_s()
        backend = self._sampler.name
        try:
            samples = self._sampler.sample(now_s)
            events = self._sampler.poll_events(now_s)
        except Exception as exc:  # a backend must never take the agent down
            self._backend_failed(backend, exc)
            return
        up, sampled = self._metrics.round_of(backend)
        up.set(1)
        sampled.inc(len(samples))
        changed = self._delta.filter(samples, now_s)
        if self._batch and changed:
            self.emit(NodeSamples(self._node, samples=tuple(changed)), now_s, backend)
        elif changed:
            self._emit_samples(changed, now_s, backend)
        for event in events:
            self.emit(event, now_s, backend)

    def _emit_samples(self, samples: list[GpuSample], now_s: float, backend: str) -> None:
        """:meth:`emit` for one round's GPU samples: what is per round is worked out once."""
        source = f"{self._node}/{backend}"
        seq = self._seq.get(source, 0)
        event_time_ms = self._clock.event_time_ms(now_s)
        routes, encode = self._sample_routes, self._encode_sample
        events: list[tuple[str, bytes, bytes]] = []
        for sample in samples:
            seq += 1
            route = routes.get(sample.gpu_uuid)
            if route is None:
                route = routes[sample.gpu_uuid] = telemetry_route(self._cfg, sample)
            events.append((route[0], route[1], encode(sample, event_time_ms, source, seq)))
        self._publisher.put_many(events)
        self._seq[source] = seq
        self._metrics.events_of(Kind.GPU_SAMPLE.value).inc(len(samples))

    def drain_launches(self) -> None:
        """Drain the launch counter once and queue its per-GPU counts."""
        if self._launches is None:
            return
        now_s = self._clock.now_s()
        try:
            counts = self._launches.drain(now_s)
        except Exception as exc:
            self._backend_failed(self._launches.name, exc)
            return
        self._metrics.backend_up.labels(self._launches.name).set(1)
        if self._batch and counts:
            self.emit(NodeSamples(self._node, launches=tuple(counts)), now_s, self._launches.name)
            return
        for item in counts:
            self.emit(item, now_s, self._launches.name)

    def _backend_failed(self, backend: str, exc: Exception) -> None:
        self._metrics.backend_up.labels(backend).set(0)
        log.warning("backend %s failed: %s: %s", backend, type(exc).__name__, exc)

    async def run(self, stop: asyncio.Event) -> None:
        """Sample and publish until ``stop`` is set, then flush and close the backends."""
        wall_sample_s = self._cfg.intervals.sample_s / self._clock.speed
        wall_drain_s = self._cfg.intervals.launch_drain_s / self._clock.speed
        sender_stop = asyncio.Event()
        sender = asyncio.create_task(self._publisher.run(sender_stop))
        tickers = [asyncio.create_task(_every(wall_sample_s, self.sample_once, stop))]
        if self._launches is not None:
            tickers.append(asyncio.create_task(_every(wall_drain_s, self.drain_launches, stop)))
        try:
            await stop.wait()
        finally:
            for t in tickers:
                t.cancel()
            await asyncio.gather(*tickers, return_exceptions=True)
            sender_stop.set()
            await sender
            self._sampler.close()
            if self._launches is not None:
                self._launches.close()


async def _every(interval_s: float, fn: Callable[[], None], stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    next_at = loop.time()
    while not stop.is_set():
        fn()
        next_at += interval_s
        # NOTE: a slow round skips ahead instead of bursting to catch up.
        next_at = max(next_at, loop.time())
        await asyncio.sleep(next_at - loop.time())
