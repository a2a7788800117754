"""One deployment's runtime: the transition machine, its executor and the serving core, joined.

Synchronous and clock-free: the worker (wall clock, Kafka) and a discrete-event benchmark
(simulated clock, no broker) drive the same object through four calls — :meth:`on_decision`,
:meth:`tick`, :meth:`on_persisted` and :meth:`submit` (plus :meth:`recover` and :meth:`adopt` at
start-up) — and drain its outboxes: transition records to persist (acknowledge each through
``on_persisted`` before the machine moves on), ownership events for the journal, completions,
and resolved decisions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flexpipe.schemas import GearDecision, GearTransition, TransitionPhase
from gearbox.config import DEFAULT_CONFIG, GearboxConfig
from gearbox.decisions import DecisionReason
from gearbox.model import ModelSpec
from gearbox.plans import DeploymentPlan, ExecutionPlan
from gearbox.presets import MODELS
from runtime.engine.base import Engine
from runtime.engine.sim import SimEngine
from runtime.engine.simgpu import SimGpuPool
from runtime.executor import ExecutorSettings, TransitionExecutor
from runtime.inventory import GpuInventory
from runtime.router import ROUTABLE, ReplicaRole, Router
from runtime.serving import ServingCore
from runtime.throttle import is_throttled
from runtime.timing import ReplicaTiming
from runtime.transition import (
    AbortPhase,
    DecisionIn,
    Event,
    MachineState,
    Outcome,
    Persist,
    Persisted,
    Resolved,
    RollBack,
    RunPhase,
    Tick,
    TransitionPolicy,
    adopt,
    handle,
    recover,
)
from runtime.types import Admission, Completion, OwnershipEvent, Reason, Request, ServingSettings
from runtime.vmm.manager import ReservationManager


@dataclass(frozen=True, slots=True)
class RuntimeSettings:
    """Everything a deployment runtime is tuned by (built from ``RuntimeConfig``)."""

    policy: TransitionPolicy = field(default_factory=TransitionPolicy)
    executor: ExecutorSettings = field(default_factory=ExecutorSettings)
    serving: ServingSettings = field(default_factory=ServingSettings)
    canary_share: float = 0.1
    gearbox: GearboxConfig = DEFAULT_CONFIG
    max_batch: int | None = None  # engine batch cap (default: gearbox's max_batch_sequences)
    # Reinstall a failed replica of the serving plan once all its GPUs are back (what an
    # orchestrator restarting a crashed pod does); off: it waits for a decision to re-home it.
    restart_failed_in_place: bool = True


EngineFactory = Callable[[ReplicaTiming, SimGpuPool, int | None], Engine]


# reasons whose switch runs no canary (TransitionExecutor.note_decision)
_URGENT = (DecisionReason.FORCED_INFEASIBLE, DecisionReason.EMERGENCY_DOWNSHIFT)


def sim_engine(timing: ReplicaTiming, pool: SimGpuPool, max_batch: int | None) -> Engine:
    """The default engine: :class:`SimEngine` on the simulated pool."""
    return SimEngine(timing, pool, max_batch=max_batch)


@dataclass
class Outbox:
    """What the runtime produced since the last drain."""

    records: list[GearTransition] = field(default_factory=list)
    ownership: list[OwnershipEvent] = field(default_factory=list)
    completions: list[Completion] = field(default_factory=list)
    resolved: list[Resolved] = field(default_factory=list)
    refused: list[tuple[str, Reason]] = field(default_factory=list)  # held or late, refused


class DeploymentRuntime:
    """Machine + executor + serving core of one deployment (see the module docstring)."""

    def __init__(
        self,
        deployment: str,
        *,
        settings: RuntimeSettings | None = None,
        pool: SimGpuPool | None = None,
        vmm: ReservationManager | None = None,
        inventory: GpuInventory | None = None,
        models: Mapping[str, ModelSpec] = MODELS,
        pause_in: TransitionPhase | None = None,
        pause_from_seq: int = 0,
        engine_factory: EngineFactory = sim_engine,
        router: Router | None = None,
    ) -> None:
        self.deployment = deployment
        self.settings = settings or RuntimeSettings()
        self.pool = pool or SimGpuPool()
        self.inventory = inventory or GpuInventory()
        self.models = models
        self._engine_factory = engine_factory
        self.core = ServingCore(
            deployment,
            self._make_engine,
            vmm or ReservationManager(),
            router or Router(self.settings.canary_share),
            self.settings.serving,
        )
        self.executor = TransitionExecutor(
            self.core,
            self.timing_for,
            self.inventory,
            self.settings.executor,
            pause_in,
            pause_from_seq,
        )
        self.state = MachineState(deployment)
        self.history: list[GearTransition] = []  # records acknowledged by the log, oldest first
        self._outbox = Outbox()
        self._timings: dict[str, ReplicaTiming] = {}

    # ---- wiring --------------------------------------------------------------------------------

    def timing_for(self, plan: ExecutionPlan) -> ReplicaTiming | None:
        """The replica's cost-model figures; ``None`` for a model gearbox has no spec of."""
        cached = self._timings.get(plan.plan_id)
        if cached is None:
            model = self.models.get(plan.model_name)
            if model is None:
                return None
            cached = ReplicaTiming.build(plan, model, self.settings.gearbox)
            self._timings[plan.plan_id] = cached
        return cached

    def _make_engine(self, timing: ReplicaTiming) -> Engine:
        return self._engine_factory(timing, self.pool, self.settings.max_batch)

    # ---- inputs --------------------------------------------------------------------------------

    def on_decision(self, decision: GearDecision, now_s: float, ref: int | None = None) -> None:
        """Feed a decision from the decisions topic (fenced, queued or started)."""
        plan = self._target_plan(decision)
        if plan is None:
            self._outbox.resolved.append(Resolved(ref, decision.seq, Outcome.REJECTED_INVALID))
            return
        event = DecisionIn(decision.seq, decision.decision_id, plan, now_s, ref)
        assert decision.decision is not None, "a target plan comes from a decision"
        self.executor.note_decision(
            decision.seq,
            urgent=decision.reason in _URGENT,
            takes_from=decision.decision.takes_from,
            now_s=now_s,
            when_idle=decision.reason is DecisionReason.EVICT_DISPLACE,
        )
        self._handle(event, now_s)

    def _target_plan(self, decision: GearDecision) -> DeploymentPlan | None:
        if decision.deployment != self.deployment:
            return None
        if decision.decision is None:
            return None
        plan = decision.decision.to_plan
        if any(self.timing_for(r) is None for r in plan.replicas):
            return None
        return plan

    def on_persisted(self, record: GearTransition, now_s: float) -> None:
        """The log acknowledged ``record``; the machine may move on."""
        self.history.append(record)
        self._handle(Persisted(record, now_s), now_s)

    def tick(self, now_s: float) -> None:
        """Restart failed replicas whose GPUs are back, serve up to ``now_s``, advance the
        running phase, check timeouts."""
        if self.settings.restart_failed_in_place:
            self.restart_failed(now_s)
        self.core.step(now_s)
        result = self.executor.poll(now_s)
        if result is not None:
            self._handle(dataclasses.replace(result, now_s=now_s), now_s)
        if not self.executor.paused:  # a held phase must not time out under a crash test
            self._handle(Tick(now_s), now_s)

    def restart_failed(self, now_s: float) -> int:
        """Reinstall failed replicas of the serving plan whose GPUs are all back; the count.

        NOTE: only between transitions — during one, the executor owns the replicas and a
        forced decision re-homes what a dead replica held.
        """
        if self.state.active is not None:
            return 0
        restarted = 0
        for rid in self.core.replica_ids():
            if self.core.router.role(rid) is not ReplicaRole.FAILED:
                continue
            plan = self.core.plan_of(rid)
            if not all(self._gpu_back(u) for u in plan.gpu_uuids):
                continue
            timing = self.timing_for(plan)
            self.core.unplace_all(rid)
            if timing is None or not self.core.retire(rid):
                continue
            if self.core.install(timing, now_s, ReplicaRole.ACTIVE).ok:
                self.inventory.claim(plan.gpu_uuids, self.deployment)
                restarted += 1
        return restarted

    def _gpu_back(self, uuid: str) -> bool:
        return not self.pool.is_lost(uuid) and self.inventory.is_available(uuid)

    def submit(self, request: Request, now_s: float) -> Admission:
        """Admit or reject a new request."""
        return self.core.submit(request, now_s)

    def recover(
        self, records: Iterable[GearTransition], unfinished: Sequence[Request], now_s: float
    ) -> None:
        """Rebuild from the transitions log and the ownership journal after a (re)start.

        The serving plan is loaded again, the in-flight transition resumed or rolled back, and
        every sequence the journal holds as admitted-but-unfinished is replayed on the serving
        plan — each owned by exactly one replica.
        """
        self.state, effects = recover(self.deployment, records, now_s)
        self._bootstrap(self.state.serving, now_s)
        self._apply(effects, now_s)
        for request in unfinished:
            self.core.readmit(request, now_s)

    def adopt(self, plan: DeploymentPlan, now_s: float) -> bool:
        """Load ``plan`` as the starting plan (transition 0) when nothing serves and no decision
        was accepted yet; True when that transition started.

        The deployment's configured starting plan is the stream's assumed current plan until a
        transition confirms one (config ``deployments``); adopting it makes that true, in the
        transitions log, before the first decision arrives.
        """
        if any(self.timing_for(r) is None for r in plan.replicas):
            return False  # an unknown model: nothing could load it
        self.state, effects = adopt(self.state, plan, f"{self.deployment}:start", now_s)
        self._apply(effects, now_s)
        return bool(effects)

    def _bootstrap(self, plan: DeploymentPlan | None, now_s: float) -> None:
        if plan is None:
            return
        for replica in plan.replicas:
            timing = self.timing_for(replica)
            if timing is not None and self.core.install(timing, now_s, ReplicaRole.ACTIVE).ok:
                self.inventory.claim(replica.gpu_uuids, self.deployment)
        self.core.serving_plan_id = plan.plan_id

    # ---- machine plumbing ----------------------------------------------------------------------

    def _handle(self, event: Event, now_s: float) -> None:
        self.state, effects = handle(self.state, event, self.settings.policy)
        self._apply(effects, now_s)

    def _apply(self, effects: Iterable[object], now_s: float) -> None:
        for effect in effects:
            if isinstance(effect, Persist):
                self._outbox.records.append(effect.record)
            elif isinstance(effect, RunPhase):
                result = self.executor.run(effect, now_s)
                if result is not None:
                    self._handle(dataclasses.replace(result, now_s=now_s), now_s)
            elif isinstance(effect, AbortPhase):
                self.executor.abort(effect, now_s)
            elif isinstance(effect, RollBack):
                self.executor.rollback(effect, now_s)
            elif isinstance(effect, Resolved):
                self._outbox.resolved.append(effect)

    def drain(self) -> Outbox:
        """Everything produced since the last call (records must be persisted in order)."""
        out = self._outbox
        out.ownership.extend(self.core.ownership_events)
        out.completions.extend(self.core.completions)
        out.refused.extend(self.core.refused)
        self.core.ownership_events, self.core.completions, self.core.refused = [], [], []
        self._outbox = Outbox()
        return out

    # ---- views ---------------------------------------------------------------------------------

    def status(self, now_s: float, *, ownership: bool = False) -> dict[str, Any]:
        """The gear as a monitored object: plan, phase, migration queue, shadow plan (simulated)."""
        a, core = self.state.active, self.core
        serving = self.state.serving
        serving_ids = {r.plan_id for r in serving.replicas} if serving else set()
        routable = core.router.replicas(*ROUTABLE)
        out: dict[str, Any] = {
            "deployment": self.deployment,
            "simulated": True,  # SimEngine on simulated GPUs
            "serving_plan_id": self.state.serving_plan_id,
            "route_table_plan_id": core.serving_plan_id,
            "routable_replicas": list(routable),
            "routable_outside_plan": [r for r in routable if r not in serving_ids],
            "last_seq": self.state.last_seq,
            "pending_seq": self.state.pending.seq if self.state.pending else None,
            "transition": None,
            "executor": self.executor.status(),
            "replicas": self._replicas_status(now_s),
            "owned_sequences": len(core.router.ownership()),
            "queue_len": core.queue_len(),
            "held_for_load": len(core.held(Reason.HELD_FOR_LOAD)),
            "held_for_memory": len(core.held(Reason.HELD_FOR_MEMORY)),
            "active_sequences": core.active_sequences(),
            "unplaced": list(core.unplaced()),
            "invariant_violations": core.router.check_invariants(),
            "rejections": {str(k): v for k, v in core.rejections.items()},
            "engine_oom_events": core.engine_oom_events,
            "preemptions": core.preemptions,
            "sim_oom_events": self.pool.oom_events,
        }
        if a is not None:
            out["transition"] = {
                "seq": a.seq,
                "phase": str(a.phase),
                "attempt": a.attempt,
                "wait": str(a.wait),
                "from_plan_id": a.from_plan.plan_id if a.from_plan else None,
                "to_plan_id": a.to_plan.plan_id,
            }
        if ownership:
            out["ownership"] = dict(core.router.ownership())
        return out

    def _replicas_status(self, now_s: float) -> list[dict[str, Any]]:
        """Per replica: role, readiness, health, queue, running, GPUs, KV, memory fill."""
        core = self.core
        memory = core.vmm.memory()
        out = []
        for rid in core.replica_ids():
            engine, gpus = core.engine(rid), core.plan_of(rid).gpu_uuids
            out.append(
                {
                    "replica_id": rid,
                    "role": str(core.router.role(rid)),
                    "ready": engine.is_ready(now_s),
                    "fault": engine.health(),
                    "queued": core.router.queue_len(rid),
                    "running": len(core.router.running(rid)),
                    "gpus": list(gpus),
                    "kv_bytes": engine.kv_bytes(),
                    "max_fill": max((memory[g].fill for g in gpus if g in memory), default=0.0),
                    "throttled": is_throttled(memory, gpus, self.settings.serving.watermark),
                }
            )
        return out
