"""The discrete-event loop: one system, one scenario, one seed, simulated time only.

The product's own loop runs here (:class:`sim.world.World`): the simulated fleet's telemetry
envelopes are folded by the stream's :class:`streams.replay.Replayer`, which decides through the
product's decision step; the product's runtime (:class:`runtime.host.RuntimeHost`: one
inventory, pool and VMM for all deployments, as one runtime worker serving them) carries the
decisions out and its records and serving reports go back to the stream. A heap of
``(time, priority, sequence, kind)`` events drives it:

* fleet — the agents' envelopes of one instant (sample grid, scenario timeline): cluster
  events reach the runtime's inventory and simulated pool at once (processes on a preempted GPU
  die then) and the stream, which decides a topology change after its debounce;
* arrival — the trace's next request is submitted and that deployment's runtime ticks;
* tick — the runtimes tick on a grid: fine (``FAST_TICK_S``) while a transition runs or
  requests wait, coarse otherwise (engines are event-stepped; the grid bounds how late the
  executor, restarts in place and admission notice what happened);
* report / decide — adaptive systems publish serving load every ``serving_publish_s`` and
  decide every ``decision_s`` and on topology changes;
* sample — GPU memory and busy time, every ``SAMPLE_S`` (the benchmark's utilisation).

Nothing reads the wall clock.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

from bench.sim.baselines import RoundRobinRouter, static_layout
from bench.sim.metrics import DeploymentMetrics, Utilisation
from bench.sim.systems import SystemSpec
from flexpipe.config import FlexPipeConfig
from flexpipe.schemas import GearTransition
from gearbox import DeploymentPlan, Trigger
from runtime.admission import ttft_deadline_s
from runtime.deployment import EngineFactory, RuntimeSettings
from runtime.engine.sim import SimEngine
from runtime.engine.simgpu import SimGpuPool
from runtime.executor import KvPolicy
from runtime.host import RuntimeHost
from runtime.router import Router
from runtime.serving import ServingCore
from runtime.timing import ReplicaTiming
from runtime.types import Request, RequestKind
from runtime.vmm.manager import ReservationManager, host_backend_factory
from runtime.worker import runtime_settings
from sim.catalog import with_scenario
from sim.loadgen import offered_tokens
from sim.spec import Preempt, Scenario
from sim.truth import GroundTruth
from sim.world import World
from streams.step import StepOutput

FAST_TICK_S = 0.05  # grid while a transition runs or requests wait (the worker ticks at 20 ms)
SLOW_TICK_S = 0.5  # grid otherwise
SAMPLE_S = 10.0
WARMUP_S = 60.0  # starting plans load before t=0, so no system starts cold


class Kind(IntEnum):
    """Event kinds; the value orders events at the same instant."""

    FLEET = 0
    ARRIVAL = 1
    TICK = 2
    REPORT = 3
    DECIDE = 4
    SAMPLE = 5


@dataclass(frozen=True, slots=True)
class DecisionLog:
    """One decision step's outcome (every step, switches or not)."""

    t_s: float
    deployment: str
    trigger: str
    reason: str
    seq: int | None  # the decision's sequence number when it switched (= transition seq)
    forced: bool
    from_plan_id: str | None
    to_plan_id: str | None
    to_gpus: int
    est_shift_s: float  # gearbox's modelled shift duration
    est_kv_bytes: int  # gearbox's modelled KV migration
    explanation: str
    est_ttft_p95_ms: float | None = None  # gearbox's estimate for the serving plan at this tick
    gain_over_cost: bool = False  # some candidate's gain exceeds its switch cost


def decision_log(out: StepOutput, t_s: float) -> DecisionLog:
    """The benchmark's record of one step of the product's decision loop."""
    d = out.result.decision
    return DecisionLog(
        t_s=t_s,
        deployment=out.decision.deployment,
        trigger=str(out.result.trigger),
        reason=str(out.result.reason),
        seq=out.decision.seq if d is not None else None,
        forced=d.forced if d is not None else False,
        from_plan_id=d.from_plan_id if d is not None else None,
        to_plan_id=d.to_plan_id if d is not None else None,
        to_gpus=d.to_plan.num_gpus if d is not None else 0,
        est_shift_s=d.switch_cost.duration_s if d is not None else 0.0,
        est_kv_bytes=d.switch_cost.kv_migrate_bytes if d is not None else 0,
        explanation=out.result.explanation,
        est_ttft_p95_ms=(
            out.result.current.est_ttft_p95_ms if out.result.current is not None else None
        ),
        gain_over_cost=any(c.gain_tokens > c.cost_tokens for c in out.result.candidates),
    )


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
    violations: list[str]  # broken runtime invariants at the end (ownership, simulated OOMs)
    offered_tokens: dict[str, int]  # prompt + requested output tokens of every arrival


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
        truth: GroundTruth | None = None,
        plans: Mapping[str, DeploymentPlan] | None = None,
        clock_offset_s: float = 0.0,
    ) -> None:
        """``plans``: what to start with instead of the scenario's starting plans (the oracle's
        choice for one interval); ``clock_offset_s``: added to the times the metrics and
        utilisation are keyed by, so a run of one interval records on the whole run's clock."""
        self.system = system
        self.truth = truth
        self.scenario = scenario
        self.duration_s = duration_s
        base = with_scenario(config or FlexPipeConfig(), scenario)
        # NOTE: model_copy does not re-validate, so the "no hysteresis" ablation's config (which
        # the validated section refuses on purpose) reaches the stream as it is.
        self.cfg = base.model_copy(update={"gearbox": system.config})
        names = sorted(d.name for d in scenario.deployments)
        self.metrics = {name: DeploymentMetrics(clock_offset_s=clock_offset_s) for name in names}
        for dep in self.cfg.deployments:
            ttft_ms, tbt_ms = dep.slo_ms(self.cfg.gearbox)
            self.metrics[dep.name].ttft_slo_s = ttft_ms / 1000.0
            self.metrics[dep.name].tbt_slo_s = tbt_ms / 1000.0
        self.engines: dict[str, list[SimEngine]] = {name: [] for name in names}
        routers: dict[str, Router] | None = None
        if system.variant.round_robin:
            routers = {n: RoundRobinRouter(self.cfg.runtime.canary_share) for n in names}
        self.pool = SimGpuPool()
        # Every GPU exists with its memory from the start, as hardware does: one first heard of
        # through a preemption would otherwise stay registered with no memory at all (an
        # oracle interval's world starts with every earlier preemption at t=0).
        for gpu in scenario.gpus:
            self.pool.ensure(gpu.uuid, scenario.gpu_class(gpu.gpu_class).memory_total_bytes)
        self.host = RuntimeHost(
            names,
            self._settings(),
            vmm=ReservationManager(host_backend_factory),
            pool=self.pool,
            models=self.cfg.catalog.model_specs(),
            engine_factories={n: self._engine_factory(n) for n in names},
            routers=routers,
            ttft_deadline_s={
                d.name: ttft_deadline_s(
                    self.cfg.runtime.ttft_deadline_s, self.metrics[d.name].ttft_slo_s
                )
                for d in self.cfg.deployments
            },
        )
        self.world = World(self.cfg, scenario, seed, self.host)
        self.runtimes = self.host.runtimes
        self.trace = trace
        self.start_plans = plans
        self.clock_offset_s = clock_offset_s
        self.kinds = {r.request_id: r.kind for reqs in trace.values() for r in reqs}
        # Tokens of settled requests (refused, or completed) that are not SLO goodput: a
        # deployment's goodput can no longer exceed its offered tokens less these.
        self.lost_tokens = dict.fromkeys(self.runtimes, 0)
        self.clock_s = 0.0  # every event before it is handled (``advance``)
        self._offered = {r.request_id: offered_tokens(r) for reqs in trace.values() for r in reqs}
        self.utilisation = Utilisation()
        self.decisions: list[DecisionLog] = []
        self.transitions: dict[tuple[str, int], TransitionLog] = {}
        self.observed: list[tuple[float, float]] = []
        self._heap: list[tuple[float, int, int, str]] = []
        self._count = 0
        self._cursor = dict.fromkeys(self.runtimes, 0)
        self._work_seen: dict[int, tuple[float, float]] = {}
        self._pending_topology: float | None = None
        self._gpu_class = {g.uuid: g.gpu_class for g in scenario.gpus}
        self._peak = {c.name: c.peak_bf16_tflops * 1e12 for c in scenario.gpu_classes}

    def _settings(self) -> RuntimeSettings:
        # NOTE: the runtime keeps the default cost model for every system; only the decision
        # knobs (cfg.gearbox) and the variant's seams differ between systems.
        base = runtime_settings(self.cfg.runtime)
        kv_policy = KvPolicy.REPLAY_ONLY if self.system.variant.replay_only else KvPolicy.AUTO
        return RuntimeSettings(
            policy=base.policy,
            executor=dataclasses.replace(base.executor, kv_policy=kv_policy),
            serving=base.serving,
            canary_share=base.canary_share,
        )

    def _engine_factory(self, name: str) -> EngineFactory:
        made, observer, truth = self.engines[name], self.metrics[name], self.truth

        def make(timing: ReplicaTiming, pool: SimGpuPool, max_batch: int | None) -> SimEngine:
            # The world's true step times when a ground truth is given; the runtime's router
            # and gearbox keep estimating with ``timing``.
            step_timing = truth.replica(timing) if truth is not None else None
            engine = SimEngine(
                timing, pool, max_batch=max_batch, observer=observer, step_timing=step_timing
            )
            made.append(engine)
            return engine

        return make

    # ---- event queue ---------------------------------------------------------------------------

    def _push(self, t_s: float, kind: Kind, key: str = "") -> None:
        self._count += 1
        heapq.heappush(self._heap, (t_s, int(kind), self._count, key))

    def run(self) -> RunResult:
        """Simulate ``[0, duration_s)`` and return what happened."""
        self.start()
        self.advance(self.duration_s)
        return self.result()

    def start(self) -> None:
        """Load the starting plans and schedule the first events (``run``'s first step)."""
        self._start()

    def advance(self, until_s: float) -> bool:
        """Handle every event before ``until_s`` (and before the run's end), in order; True
        once the run is over. Steps of ``advance`` handle the events ``run`` handles, in the
        same order: a run stepped so ends in the same state."""
        heap, dispatch = self._heap, self._dispatch
        limit = self.clock_s = max(self.clock_s, min(until_s, self.duration_s))
        while heap:
            if heap[0][0] >= limit:
                return heap[0][0] >= self.duration_s
            t_s, kind, _, key = heapq.heappop(heap)
            dispatch(t_s, Kind(kind), key)
        return True

    def result(self) -> RunResult:
        """What happened (after ``advance`` returned True)."""
        return self._result()

    def _start(self) -> None:
        world = self.world
        world.observe(0.0)  # the agents' first round: what the starting plans are built on
        plans = world.starting_plans() if self.start_plans is None else dict(self.start_plans)
        if self.system.static_layout:
            topology, blocks = world.topology()
            deployments = world.deployments
            plans = static_layout(
                self.scenario, deployments, plans, topology, blocks, self.cfg.gearbox
            )
        start_s = -WARMUP_S
        world.start(plans, start_s)
        for name in self.runtimes:
            self._pump(name, start_s)
        # NOTE: without a gear loop and with nothing happening after t=0 (an oracle interval's
        # world), the agents' later envelopes reach only a stream that decides nothing and an
        # inventory with nothing new to learn: they are not simulated (half such a run's time).
        if self.system.adaptive or any(ev.t_s > 0 for ev in self.scenario.timeline):
            instants = world.fleet_instants(self.duration_s)
            next(instants)  # t=0 was observed above
            for t_s in instants:
                self._push(t_s, Kind.FLEET)
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
        elif kind is Kind.FLEET:
            self._observe(t_s)
        elif kind is Kind.REPORT:
            self.world.report(t_s)
            self._push(t_s + self.cfg.runtime.serving_publish_s, Kind.REPORT)
        elif kind is Kind.DECIDE:
            self._decision_step(t_s, Trigger(key))
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
        if not admission.admitted:
            self.lost_tokens[name] += offered_tokens(request)
        rt.tick(t_s)
        self._pump(name, t_s)
        self._next_arrival(name)

    def _tick(self, t_s: float) -> None:
        busy = False
        for name, rt in self.runtimes.items():
            rt.tick(t_s)
            self._pump(name, t_s)
            busy = busy or rt.state.active is not None or rt.core.queue_len() > 0
        self._push(t_s + (FAST_TICK_S if busy else SLOW_TICK_S), Kind.TICK)

    def _pump(self, name: str, t_s: float) -> None:
        """Deliver a runtime's outbox: completions to the metrics, records to the log."""
        out = self.world.pump(name, t_s)
        metrics = self.metrics[name]
        for done in out.completions:
            good = metrics.goodput_tokens
            metrics.on_completion(done, self.kinds.get(done.request_id, RequestKind.CHAT))
            offered = self._offered.get(done.request_id, 0)
            self.lost_tokens[name] += offered - (metrics.goodput_tokens - good)
        for request_id, reason in out.refused:
            self.lost_tokens[name] += self._offered.get(request_id, 0)
            metrics.on_refused(reason, t_s)
        for record in out.records:
            self._note_record(name, t_s, record)

    def _note_record(self, name: str, t_s: float, record: GearTransition) -> None:
        key = (name, record.transition_seq)
        log = self.transitions.get(key)
        imported = self._kv_imported(name)
        if log is None:
            log = self.transitions[key] = TransitionLog(
                name, record.transition_seq, kv_bytes_start=imported
            )
        log.kv_bytes_end = imported
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
        return sum(e.stats.kv_imported_bytes for e in self.engines[name])

    def _observe(self, t_s: float) -> None:
        if not self.world.observe(t_s):
            return
        self.observed.append((t_s, t_s))
        # The runtime's inventory and pool already followed; processes on lost GPUs died.
        for name in self.runtimes:
            self._pump(name, t_s)
        if not self.system.adaptive or self._pending_topology is not None:
            return
        self._pending_topology = t_s
        debounce_s = self.cfg.streams.debounce_ms / 1000.0
        self._push(t_s + debounce_s, Kind.DECIDE, Trigger.TOPOLOGY_CHANGE.value)

    def _decision_step(self, t_s: float, trigger: Trigger) -> None:
        changed_s = None
        if trigger is Trigger.TIMER:
            self._push(t_s + self.cfg.intervals.decision_s, Kind.DECIDE, Trigger.TIMER.value)
        else:
            changed_s, self._pending_topology = self._pending_topology, None
        for out in self.world.decision_step(trigger, t_s, changed_s):
            self.decisions.append(decision_log(out, t_s))
        for name in self.runtimes:
            self._pump(name, t_s)

    def _sample(self, t_s: float) -> None:
        held: dict[str, tuple[int, int, float]] = {}
        busy_gpu_s = flops = 0.0
        for name, rt in self.runtimes.items():
            for uuid in held_gpus_installed(rt.core):
                if not self.pool.is_lost(uuid):
                    peak = self._peak[self._gpu_class[uuid]]
                    held[uuid] = (self.pool.used_bytes(uuid), self.pool.total_bytes(uuid), peak)
            for engine in self.engines[name]:
                seen_busy, seen_flops = self._work_seen.get(id(engine), (0.0, 0.0))
                stats = engine.stats
                self._work_seen[id(engine)] = (stats.busy_s, stats.model_flops)
                busy_gpu_s += (stats.busy_s - seen_busy) * len(engine.timing.gpu_uuids)
                flops += stats.model_flops - seen_flops
        schedulable = len(self.world.fleet.cluster.schedulable_gpus())
        now_s = t_s + self.clock_offset_s
        self.utilisation.add(now_s, SAMPLE_S, held, (busy_gpu_s, flops), schedulable)

    # ---- result --------------------------------------------------------------------------------

    def _result(self) -> RunResult:
        preemptions = [ev.t_s for ev in self.scenario.timeline if isinstance(ev, Preempt)]
        timeline = [(ev.t_s, type(ev).__name__.lower()) for ev in self.scenario.timeline]
        unfinished = {n: len(rt.core.router.ownership()) for n, rt in self.runtimes.items()}
        violations = [
            f"{n}: {v}"
            for n, rt in self.runtimes.items()
            for v in rt.core.router.check_invariants()
        ]
        if self.pool.oom_events:
            violations.append(f"simulated GPUs ran out of memory {self.pool.oom_events} times")
        return RunResult(
            system=self.system,
            metrics=self.metrics,
            utilisation=self.utilisation,
            decisions=self.decisions,
            transitions=sorted(self.transitions.values(), key=lambda x: (x.deployment, x.seq)),
            preemptions=[t for t in preemptions if t < self.duration_s],
            timeline=[e for e in timeline if e[0] < self.duration_s],
            unfinished=unfinished,
            observed_s=self.observed,
            violations=violations,
            offered_tokens={
                name: sum(offered_tokens(r) for r in reqs if r.arrival_s < self.duration_s)
                for name, reqs in self.trace.items()
            },
        )


def held_gpus_installed(core: ServingCore) -> set[str]:
    """GPUs of the replicas installed in a runtime (serving, loading or draining)."""
    return {u for rid in core.replica_ids() for u in core.plan_of(rid).gpu_uuids}


__all__ = ["DecisionLog", "RunResult", "Simulation"]
