"""The product runtime, wired for the discrete-event benchmark.

:class:`BenchRuntime` *is* :class:`runtime.deployment.DeploymentRuntime` — transition machine,
executor, serving core, router, VMM ledger, watermark throttle — with three seams set:

* engines: :class:`bench.sim.engine.EventSimEngine` (same contract and timing as the product's
  SimEngine, event-stepped), or the product's ``SimEngine`` itself (``engine="sim"``);
* timing: :class:`bench.sim.timing.MemoTiming` (the same figures, memoised per replica);
* the two baseline/ablation variants the issue asks for, which the runtime has no knob for yet:
  round-robin routing (static-RR baseline) and replay-only KV hand-over (ablation e).

It also carries the two pieces of worker glue the DES needs without Kafka: applying a cluster
event to the shared GPU inventory and simulated pool (as ``RuntimeWorker._cluster_loop`` does),
and restarting a failed replica in place once its GPUs are back (what an orchestrator does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from bench.sim.engine import DecodeObserver, EventSimEngine
from bench.sim.timing import MemoTiming
from flexpipe.schemas import FATAL_XIDS, ClusterEvent, ClusterEventType
from gearbox.plans import ExecutionPlan
from gearbox.switch import KvAction, KvHandover
from runtime.deployment import DeploymentRuntime, RuntimeSettings
from runtime.engine.base import Engine
from runtime.engine.sim import SimEngine
from runtime.engine.simgpu import SimGpuPool
from runtime.executor import TransitionExecutor
from runtime.inventory import GpuInventory
from runtime.router import ReplicaRole, RouteChoice, Router
from runtime.timing import ReplicaTiming
from runtime.types import Request
from runtime.vmm.manager import ReservationManager

_RESTORES = {ClusterEventType.RELEASE, ClusterEventType.GPU_RESTORED}


class VersionedPool(SimGpuPool):
    """The simulated GPU pool with a counter of fault changes.

    Engines check their GPUs on every call; with the counter they re-check only after a
    preemption or restore instead of scanning their GPUs thousands of times a second.
    """

    def __init__(self) -> None:
        super().__init__()
        self.version = 0

    def preempt(self, gpu_uuids: Iterable[str]) -> None:
        """As :meth:`SimGpuPool.preempt`, counted."""
        super().preempt(gpu_uuids)
        self.version += 1

    def restore(self, gpu_uuids: Iterable[str]) -> None:
        """As :meth:`SimGpuPool.restore`, counted."""
        super().restore(gpu_uuids)
        self.version += 1


class RoundRobinRouter(Router):
    """The static baseline's router: routable replicas in rotating order, load ignored.

    Ownership, queues and roles are the product router's; only the order of candidates differs,
    so a full or throttled replica is still skipped the way the serving core skips it.
    """

    def __init__(self, canary_share: float = 0.1) -> None:
        super().__init__(canary_share)
        self._next = 0

    def candidates(self, request: Request, now_s: float) -> tuple[RouteChoice, ...]:
        """Every routable replica, starting one further along on each call."""
        ranked = super().candidates(request, now_s)
        if not ranked:
            return ranked
        ordered = sorted(ranked, key=lambda c: c.replica_id)
        start = self._next % len(ordered)
        self._next += 1
        return tuple(ordered[start:] + ordered[:start])


class ReplayOnlyExecutor(TransitionExecutor):
    """Ablation (e): every hand-over re-prefills on the new plan; no KV is migrated.

    NOTE: overrides a private method of the executor — the runtime should expose a
    ``kv_policy`` ("auto" | "replay_only") in ``ExecutorSettings`` instead.
    """

    def _handover_queue(self, job: Any) -> list[tuple[KvHandover, str, str]]:
        queue = super()._handover_queue(job)
        return [
            (dataclasses.replace(h, action=KvAction.REPLAY, transfer_bytes=0), source, target)
            for h, source, target in queue
        ]


@dataclasses.dataclass(frozen=True, slots=True)
class Variant:
    """How a system's runtimes differ from the product defaults."""

    engine: str = "event"  # "event" (EventSimEngine) or "sim" (the product's SimEngine)
    round_robin: bool = False  # static-RR baseline
    replay_only: bool = False  # ablation (e)


ObserverFor = Callable[[str], DecodeObserver | None]


class BenchRuntime(DeploymentRuntime):
    """A product :class:`DeploymentRuntime` with the benchmark's seams (module docstring)."""

    def __init__(
        self,
        deployment: str,
        *,
        settings: RuntimeSettings,
        pool: SimGpuPool,
        vmm: ReservationManager,
        inventory: GpuInventory,
        variant: Variant,
        observer: DecodeObserver | None = None,
    ) -> None:
        self.variant = variant
        self.engines: list[Engine] = []  # every engine ever made (utilisation accounting)
        self._observer = observer
        self._memo: dict[str, MemoTiming] = {}
        super().__init__(deployment, settings=settings, pool=pool, vmm=vmm, inventory=inventory)
        if variant.round_robin:
            self.core.router = RoundRobinRouter(settings.canary_share)
        if variant.replay_only:
            self.executor = ReplayOnlyExecutor(
                self.core, self.timing_for, self.inventory, settings.executor
            )

    def timing_for(self, plan: ExecutionPlan) -> ReplicaTiming | None:
        """The product's timing for ``plan``, memoised (see :mod:`bench.sim.timing`)."""
        memo = self._memo.get(plan.plan_id)
        if memo is None:
            timing = super().timing_for(plan)
            if timing is None:
                return None
            memo = MemoTiming.wrap(timing)
            self._memo[plan.plan_id] = memo
        return memo

    def _make_engine(self, timing: ReplicaTiming) -> Engine:
        engine: Engine
        if self.variant.engine == "sim":
            engine = SimEngine(timing, self.pool, max_batch=self.settings.max_batch)
        else:
            engine = EventSimEngine(
                timing, self.pool, max_batch=self.settings.max_batch, observer=self._observer
            )
        self.engines.append(engine)
        return engine

    def restart_failed(self, now_s: float) -> int:
        """Reinstall failed replicas of the serving plan whose GPUs are all back; returns count.

        NOTE: the runtime never restarts a replica whose engine died (its sequences wait for a
        decision to re-home them). Here, as an orchestrator would, a failed replica comes back in
        place once every GPU is schedulable again — the same rule for every system compared.
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


def apply_cluster_event(event: ClusterEvent, inventory: GpuInventory, pool: SimGpuPool) -> None:
    """What the runtime worker does with a cluster event, plus fatal XIDs.

    NOTE: the worker ignores XID events, so a GPU that fell off the bus keeps "serving" in the
    simulated pool; here a fatal XID takes the GPU away like an isolation would.
    """
    if event.type is ClusterEventType.XID and event.xid in FATAL_XIDS:
        event = dataclasses.replace(event, type=ClusterEventType.GPU_ISOLATED)
    taken = inventory.apply_event(event)
    pool.preempt(taken)
    if event.type in _RESTORES:
        pool.restore(event.gpu_uuids)
    elif event.type is ClusterEventType.NODE_UP:
        pool.restore(inventory.gpus_on(event.node))
