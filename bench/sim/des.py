"""The discrete-event loop: one system, one scenario, one seed, simulated time only.

A heap of ``(time, priority, sequence, kind)`` events drives the product code:

* timeline — :class:`sim.cluster.SimCluster` applies the scenario's events (preemptions,
  releases, XIDs); the runtime's inventory and simulated pool follow at once (the processes on a
  preempted GPU die then); the streams see it at the agent's next sample plus the debounce;
* arrival — the trace's next request is submitted (:meth:`DeploymentRuntime.submit`) and that
  deployment's runtime ticks, so a request reaches an engine when it arrives;
* tick — every runtime ticks on a grid: fine (``FAST_TICK_S``) while a transition runs or
  requests wait, coarse otherwise; engines are event-stepped, so the grid only bounds how late
  the executor and the admission of waiting requests notice what happened;
* report / decide — FlexPipe systems publish serving load every ``serving_publish_s`` and run
  the gear loop every ``decision_s`` and on observed topology changes;
* sample — GPU memory and busy time, every ``SAMPLE_S``.

Transition records are acknowledged as soon as they are produced (an in-memory coordination
store). Nothing reads the wall clock.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

from bench.sim.controller import DecisionLog, GearLoop, LoadTracker
from bench.sim.engine import EventSimEngine
from bench.sim.metrics import DeploymentMetrics, Utilisation
from bench.sim.runtime import BenchRuntime, VersionedPool, apply_cluster_event
from bench.sim.systems import SystemSpec
from bench.sim.topology import ClusterView, model_of, starting_plan, static_layout
from flexpipe.config import FlexPipeConfig
from flexpipe.schemas import GearTransition, TransitionPhase
from gearbox import DEFAULT_CONFIG, ModelSpec, Trigger
from runtime.deployment import RuntimeSettings
from runtime.inventory import GpuInventory
from runtime.types import Request, RequestKind
from runtime.vmm.manager import ReservationManager, host_backend_factory
from runtime.worker import runtime_settings
from sim.cluster import SimCluster
from sim.spec import Preempt, Scenario
from streams.windows import HoppingWindow

FAST_TICK_S = 0.05  # grid while a transition runs or requests wait (the worker ticks at 20 ms)
SLOW_TICK_S = 0.5  # grid otherwise
SAMPLE_S = 10.0
WARMUP_S = 60.0  # starting plans load before t=0, so no system starts cold


class Kind(IntEnum):
    """Event kinds; the value orders events at the same instant."""

    TIMELINE = 0
    ARRIVAL = 1
    TICK = 2
    REPORT = 3
    OBSERVE = 4
    DECIDE = 5
    SAMPLE = 6


@dataclass
class TransitionLog:
    """A transition's persisted records and the KV bytes imported while it ran."""

    deployment: str
    seq: int
    records: list[tuple[float, str, str, int, float | None, str]] = field(default_factory=list)
    kv_bytes_start: int = 0
    kv_bytes_end: int = 0


@dataclass
class RunResult:
    """Everything one system's run produced (turned into JSON by :mod:`bench.sim.report`)."""

    system: SystemSpec
    metrics: dict[str, DeploymentMetrics]
    utilisation: Utilisation
    decisions: list[DecisionLog]
    transitions: list[TransitionLog]
    preemptions: list[float]
    timeline: list[tuple[float, str]]
    unfinished: dict[str, int]
    observed_s: list[tuple[float, float]]  # (event time, time the streams saw it)


class Simulation:
    """One system over one scenario (see the module docstring)."""

    def __init__(
        self,
        system: SystemSpec,
        scenario: Scenario,
        trace: Mapping[str, Sequence[Request]],
        *,
        seed: int,
        duration_s: float,
        config: FlexPipeConfig | None = None,
    ) -> None:
        self.system = system
        self.scenario = scenario
        self.duration_s = duration_s
        self.cfg = config or FlexPipeConfig()
        self.cluster = SimCluster(scenario, seed)
        self.view = ClusterView(scenario, self.cluster)
        self.pool = VersionedPool()
        self.inventory = GpuInventory()
        self.vmm = ReservationManager(host_backend_factory)
        self.specs = {d.name: d for d in scenario.deployments}
        self.models: dict[str, ModelSpec] = {n: model_of(d) for n, d in self.specs.items()}
        self.metrics = {name: DeploymentMetrics() for name in sorted(self.specs)}
        settings = self._settings()
        self.runtimes = {
            name: BenchRuntime(
                name,
                settings=settings,
                pool=self.pool,
                vmm=self.vmm,
                inventory=self.inventory,
                variant=system.variant,
                observer=self.metrics[name],
            )
            for name in sorted(self.specs)
        }
        window = HoppingWindow(self.cfg.streams.load_window_s, self.cfg.streams.load_step_s)
        self.trackers = {
            n: LoadTracker(self.specs[n], self.models[n], window) for n in self.runtimes
        }
        self.loop = GearLoop(self.runtimes, self.models, self.view, system.config, self.trackers)
        self.trace = trace
        self.kinds = {r.request_id: r.kind for reqs in trace.values() for r in reqs}
        self.utilisation = Utilisation()
        self.transitions: dict[tuple[str, int], TransitionLog] = {}
        self.observed: list[tuple[float, float]] = []
        self._heap: list[tuple[float, int, int, str]] = []
        self._count = 0
        self._cursor = dict.fromkeys(self.runtimes, 0)
        self._work_seen: dict[int, tuple[float, float]] = {}
        self._pending_topology: float | None = None

    def _settings(self) -> RuntimeSettings:
        # NOTE: the runtime keeps the default cost model for every system; only the gear loop's
        # decision knobs differ between systems (see bench.sim.systems).
        base = runtime_settings(self.cfg.runtime)
        return RuntimeSettings(
            policy=base.policy,
            executor=base.executor,
            serving=base.serving,
            canary_share=base.canary_share,
            gearbox=DEFAULT_CONFIG,
        )

    # ---- event queue ---------------------------------------------------------------------------

    def _push(self, t_s: float, kind: Kind, key: str = "") -> None:
        self._count += 1
        heapq.heappush(self._heap, (t_s, int(kind), self._count, key))

    def run(self) -> RunResult:
        """Simulate ``[0, duration_s)`` and return what happened."""
        self._start()
        while self._heap:
            t_s, kind, _, key = heapq.heappop(self._heap)
            if t_s >= self.duration_s:
                break
            self._dispatch(t_s, Kind(kind), key)
        return self._result()

    def _start(self) -> None:
        start_s = -WARMUP_S
        self._apply_timeline(start_s)
        self.view.observe()
        block_of = self.view.block_ids(DEFAULT_CONFIG)
        deployments = [self.specs[n] for n in self.runtimes]
        if self.system.static_layout:
            plans = static_layout(self.view, deployments, block_of, DEFAULT_CONFIG)
        else:
            plans = {d.name: starting_plan(self.view, d, block_of) for d in deployments}
        for name in self.runtimes:
            self.loop.place(name, plans[name], start_s)
            self._pump(name, start_s)
        for t_s in sorted({ev.t_s for ev in self.scenario.timeline}):
            self._push(t_s, Kind.TIMELINE)
        for name in self.runtimes:
            self._next_arrival(name)
        self._push(start_s, Kind.TICK)
        self._push(SAMPLE_S, Kind.SAMPLE)
        if self.system.adaptive:
            self._push(self.cfg.runtime.serving_publish_s, Kind.REPORT)
            self._push(self.cfg.intervals.decision_s, Kind.DECIDE, Trigger.TIMER.value)

    def _dispatch(self, t_s: float, kind: Kind, key: str) -> None:
        if kind is Kind.ARRIVAL:
            self._arrival(t_s, key)
        elif kind is Kind.TICK:
            self._tick(t_s)
        elif kind is Kind.TIMELINE:
            self._apply_timeline(t_s)
        elif kind is Kind.REPORT:
            for name, tracker in self.trackers.items():
                tracker.report(self.runtimes[name], t_s)
            self._push(t_s + self.cfg.runtime.serving_publish_s, Kind.REPORT)
        elif kind is Kind.OBSERVE:
            self._observe(t_s, float(key))
        elif kind is Kind.DECIDE:
            self._decide(t_s, Trigger(key))
        elif kind is Kind.SAMPLE:
            self._sample(t_s)
            self._push(t_s + SAMPLE_S, Kind.SAMPLE)

    # ---- handlers ------------------------------------------------------------------------------

    def _next_arrival(self, name: str) -> None:
        requests = self.trace[name]
        index = self._cursor[name]
        if index < len(requests):
            self._push(requests[index].arrival_s, Kind.ARRIVAL, name)

    def _arrival(self, t_s: float, name: str) -> None:
        request = self.trace[name][self._cursor[name]]
        self._cursor[name] += 1
        rt = self.runtimes[name]
        admission = rt.submit(request, t_s)
        self.metrics[name].on_admission(admission, t_s)
        rt.tick(t_s)
        self._pump(name, t_s)
        self._next_arrival(name)

    def _tick(self, t_s: float) -> None:
        busy = False
        for name, rt in self.runtimes.items():
            rt.restart_failed(t_s)
            rt.tick(t_s)
            self._pump(name, t_s)
            busy = busy or rt.state.active is not None or rt.core.queue_len() > 0
        self._push(t_s + (FAST_TICK_S if busy else SLOW_TICK_S), Kind.TICK)

    def _pump(self, name: str, t_s: float) -> None:
        """Deliver a runtime's outbox: completions to the metrics, records acknowledged."""
        rt = self.runtimes[name]
        metrics = self.metrics[name]
        while True:
            out = rt.drain()
            for done in out.completions:
                metrics.on_completion(done, self.kinds.get(done.request_id, RequestKind.CHAT))
            if not out.records:
                return
            for record in out.records:
                self._note_record(name, record.transition_seq, t_s, record)
                rt.on_persisted(record, t_s)

    def _note_record(self, name: str, seq: int, t_s: float, record: GearTransition) -> None:
        key = (name, seq)
        log = self.transitions.get(key)
        imported = self._kv_imported(name)
        if log is None:
            log = self.transitions[key] = TransitionLog(name, seq, kv_bytes_start=imported)
        log.kv_bytes_end = imported
        if record.phase is TransitionPhase.ROLLED_BACK and record.to_plan_id is not None:
            self.loop.note_rollback(name, record.to_plan_id, t_s)
        log.records.append(
            (
                t_s,
                str(record.phase),
                str(record.status),
                record.attempt,
                record.duration_ms,
                record.detail,
            )
        )

    def _kv_imported(self, name: str) -> int:
        return sum(
            e.stats.kv_imported_bytes
            for e in self.runtimes[name].engines
            if isinstance(e, EventSimEngine)
        )

    def _apply_timeline(self, t_s: float) -> None:
        changed = False
        for timed in self.cluster.advance_to(t_s):
            apply_cluster_event(timed.event, self.inventory, self.pool)
            changed = True
        if changed and t_s >= 0:
            # The agent reports at its next sample; the streams debounce topology events.
            sample_s = self.cfg.intervals.sample_s
            seen = (int(t_s // sample_s) + 1) * sample_s
            self._push(seen, Kind.OBSERVE, repr(t_s))

    def _observe(self, t_s: float, event_s: float) -> None:
        self.view.observe()
        self.observed.append((event_s, t_s))
        if not self.system.adaptive or self._pending_topology is not None:
            return
        self._pending_topology = t_s
        debounce_s = self.cfg.streams.debounce_ms / 1000.0
        self._push(t_s + debounce_s, Kind.DECIDE, Trigger.TOPOLOGY_CHANGE.value)

    def _decide(self, t_s: float, trigger: Trigger) -> None:
        if trigger is Trigger.TIMER:
            self._push(t_s + self.cfg.intervals.decision_s, Kind.DECIDE, Trigger.TIMER.value)
        else:
            self._pending_topology = None
        self.loop.tick(t_s, trigger)
        for name in self.runtimes:
            self._pump(name, t_s)

    def _sample(self, t_s: float) -> None:
        held: dict[str, tuple[int, int, float]] = {}
        busy_gpu_s = flops = 0.0
        for rt in self.runtimes.values():
            for uuid in held_gpus_installed(rt):
                if not self.pool.is_lost(uuid):
                    peak = self.view.gpu_class_of[uuid].peak_bf16_tflops * 1e12
                    held[uuid] = (self.pool.used_bytes(uuid), self.pool.total_bytes(uuid), peak)
            for engine in rt.engines:
                if isinstance(engine, EventSimEngine):
                    seen_busy, seen_flops = self._work_seen.get(id(engine), (0.0, 0.0))
                    stats = engine.stats
                    self._work_seen[id(engine)] = (stats.busy_s, stats.model_flops)
                    busy_gpu_s += (stats.busy_s - seen_busy) * len(engine.timing.gpu_uuids)
                    flops += stats.model_flops - seen_flops
        schedulable = len(self.cluster.schedulable_gpus())
        self.utilisation.add(t_s, SAMPLE_S, held, (busy_gpu_s, flops), schedulable)

    # ---- result --------------------------------------------------------------------------------

    def _result(self) -> RunResult:
        preemptions = [ev.t_s for ev in self.scenario.timeline if isinstance(ev, Preempt)]
        timeline = [(ev.t_s, type(ev).__name__.lower()) for ev in self.scenario.timeline]
        unfinished = {n: len(rt.core.router.ownership()) for n, rt in self.runtimes.items()}
        return RunResult(
            system=self.system,
            metrics=self.metrics,
            utilisation=self.utilisation,
            decisions=list(self.loop.log),
            transitions=sorted(self.transitions.values(), key=lambda x: (x.deployment, x.seq)),
            preemptions=[t for t in preemptions if t < self.duration_s],
            timeline=[e for e in timeline if e[0] < self.duration_s],
            unfinished=unfinished,
            observed_s=self.observed,
        )


def held_gpus_installed(rt: BenchRuntime) -> set[str]:
    """GPUs of the replicas installed in a runtime (serving, loading or draining)."""
    return {u for rid in rt.core.replica_ids() for u in rt.core.plan_of(rid).gpu_uuids}


__all__ = ["RunResult", "Simulation"]
