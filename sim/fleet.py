"""A whole simulated fleet: one "sim" agent per node on one simulated clock, as envelopes.

:class:`SimFleet` runs every node's :class:`~sim.cluster.SimGpuSampler` (through a
:class:`~probes.delta.DeltaFilter`, as the real agent does) and
:class:`~sim.cluster.SimLaunchCounter` over a :class:`~sim.cluster.SimCluster`, and yields the
envelopes in event-time order: cluster events first at an instant, then GPU samples, then
launch counts, node by node. Sources are ``<node>/sim`` (seq strictly increasing per source);
NODE_DOWN, which a dead node's agent cannot send, comes from ``scheduler/sim``. Same scenario
and seed give a byte-identical encoded stream. :func:`paced` replays a stream at ``speed``×
wall time with an injectable clock. Publishing to Kafka is someone else's job.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from flexpipe import envelope
from flexpipe.envelope import Envelope
from flexpipe.schemas import ClusterEvent, ClusterEventType, GpuSample, KernelLaunches
from probes.delta import DeltaFilter, DeltaThresholds
from sim.cluster import Origin, SimCluster, SimGpuSampler, SimLaunchCounter
from sim.spec import Scenario

SCHEDULER_SOURCE = "scheduler/sim"


class _Agent:
    """One node's simulated agent: sampler, delta filter, launch counter."""

    def __init__(
        self, cluster: SimCluster, node: str, thresholds: DeltaThresholds, heartbeat_s: float
    ) -> None:
        self.source = f"{node}/sim"
        self.sampler = SimGpuSampler(cluster, node)
        self.launches = SimLaunchCounter(cluster, node)
        self.delta = DeltaFilter(thresholds, heartbeat_s)


class SimFleet:
    """Every node of a scenario as "sim" agents; :meth:`events` yields their envelopes."""

    def __init__(
        self,
        scenario: Scenario,
        seed: int,
        sample_interval_s: float = 1.0,
        launch_interval_s: float | None = 0.2,
        heartbeat_s: float = 15.0,
        thresholds: DeltaThresholds | None = None,
    ) -> None:
        self.scenario = scenario
        self.cluster = SimCluster(scenario, seed)
        self._sample_ms = _interval_ms(sample_interval_s, "sample_interval_s")
        self._launch_ms = (
            None
            if launch_interval_s is None
            else _interval_ms(launch_interval_s, "launch_interval_s")
        )
        th = thresholds or DeltaThresholds()
        self._agents = [_Agent(self.cluster, n.name, th, heartbeat_s) for n in scenario.nodes]
        # NOTE: t=0 is a cluster-event instant too: startup NODE_UP and isolation events.
        self._event_ms = sorted({0, *(_ms(ev.t_s) for ev in scenario.timeline)})
        self._event_set = frozenset(self._event_ms)  # agents only see news at these instants
        self._seq: dict[str, int] = {}
        self._done_ms = 0  # everything before this instant has been simulated

    def events(self, t0_s: float, t1_s: float) -> Iterator[Envelope[Any]]:
        """Envelopes with ``t0_s <= event time < t1_s``, in event-time order.

        Windows must move forward; a gap since the previous window is simulated silently
        (timeline applied, nothing yielded), as if nobody were listening.
        """
        t0_ms, t1_ms = _ms(t0_s), _ms(t1_s)
        if t0_ms < self._done_ms:
            raise ValueError(
                f"already simulated up to {self._done_ms / 1000} s; windows go forward"
            )
        if t0_ms > self._done_ms:
            self.cluster.advance_to((t0_ms - 1) / 1000.0)
            for agent in self._agents:  # observed while nobody listened
                agent.sampler.poll_events((t0_ms - 1) / 1000.0)
        t_ms = t0_ms
        while t_ms < t1_ms:
            self._done_ms = t_ms + 1  # a consumer may stop mid-window; never replay an instant
            yield from self._instant(t_ms)
            t_ms = self._next_ms(t_ms)
        self._done_ms = max(self._done_ms, t1_ms)

    def _next_ms(self, t_ms: int) -> int:
        """The next instant after ``t_ms`` at which anything happens."""
        cands = [(t_ms // self._sample_ms + 1) * self._sample_ms]
        if self._launch_ms is not None:
            cands.append((t_ms // self._launch_ms + 1) * self._launch_ms)
        i = bisect.bisect_right(self._event_ms, t_ms)
        if i < len(self._event_ms):
            cands.append(self._event_ms[i])
        return min(cands)

    def _instant(self, t_ms: int) -> Iterator[Envelope[Any]]:
        t_s = t_ms / 1000.0
        for te in self.cluster.advance_to(t_s):
            if te.origin is Origin.SCHEDULER:
                yield self._wrap(te.event, t_ms, SCHEDULER_SOURCE)
        for agent in self._agents if t_ms in self._event_set else ():
            for ev in agent.sampler.poll_events(t_s):
                if ev.type is ClusterEventType.NODE_UP:
                    agent.delta.forget()  # a (re)started agent publishes every GPU afresh
                yield self._wrap(ev, t_ms, agent.source)
        if t_ms % self._sample_ms == 0:
            for agent in self._agents:
                for sample in agent.delta.filter(agent.sampler.sample(t_s), t_s):
                    yield self._wrap(sample, t_ms, agent.source)
        if self._launch_ms is not None and t_ms % self._launch_ms == 0:
            for agent in self._agents:
                for counts in agent.launches.drain(t_s):
                    yield self._wrap(counts, t_ms, agent.source)

    def _wrap(
        self, payload: GpuSample | KernelLaunches | ClusterEvent, t_ms: int, source: str
    ) -> Envelope[Any]:
        seq = self._seq.get(source, 0) + 1
        self._seq[source] = seq
        return envelope.make(
            payload, event_time_ms=self.scenario.epoch_ms + t_ms, source=source, seq=seq
        )


def paced(
    events: Iterable[Envelope[Any]],
    speed: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[Envelope[Any]]:
    """Yield ``events`` no sooner than ``speed`` simulated seconds per wall second allow.

    ``speed=60`` plays one simulated minute per wall second; ``math.inf`` never waits. The first
    event is yielded at once and anchors both clocks; a late consumer is not caught up with bursts
    of sleeping, it simply finds the next events already due.
    """
    if not speed > 0:
        raise ValueError(f"speed must be > 0, got {speed}")
    anchor: tuple[float, int] | None = None
    for env in events:
        if anchor is None:
            anchor = (clock(), env.event_time_ms)
        elif not math.isinf(speed):
            due = anchor[0] + (env.event_time_ms - anchor[1]) / 1000.0 / speed
            delay = due - clock()
            if delay > 0:
                sleep(delay)
        yield env


def _ms(t_s: float) -> int:
    return round(t_s * 1000.0)


def _interval_ms(interval_s: float, name: str) -> int:
    interval_ms = _ms(interval_s)
    if interval_ms < 1:
        raise ValueError(f"{name} must be at least 1 ms, got {interval_s}")
    return interval_ms
