"""The runtime worker's clock-free core: the deployments one worker serves, and their glue.

:class:`RuntimeHost` owns the simulated GPU pool, the GPU inventory, the VMM ledger and one
:class:`~runtime.deployment.DeploymentRuntime` per deployment, and turns the topics' payloads
into calls on them: cluster events and GPU samples into the inventory (and the simulated pool),
decisions into transitions (holds filtered out), the serving windows into ``ServingLoad``
reports, starting plans into transition 0. The Kafka worker (:mod:`runtime.worker`) and the
discrete-event benchmark drive the same object; time is always the caller's ``now_s``.

NOTE: one host = one inventory shared by its deployments, as a production worker serving
several deployments (``runtime.deployments``) has: a GPU claimed by one is not free for the
others, except that on-demand deployments share GPUs: each holds a share of the memory, and the
one VMM ledger (per GPU, across their engines) holds the watermark and refuses what does not
fit; their routers see how many other replicas with work share a replica's GPUs. Workers
started one per deployment do not see each other's claims; the decision step's
view of what other deployments hold (telemetry) is then the only guard.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum

from flexpipe.schemas import (
    ClusterEvent,
    ClusterEventType,
    GearDecision,
    GearTransition,
    GpuSample,
    ServingLoad,
    TransitionPhase,
)
from gearbox.model import ModelSpec
from gearbox.plans import DeploymentPlan
from gearbox.presets import MODELS
from runtime.deployment import DeploymentRuntime, EngineFactory, RuntimeSettings, sim_engine
from runtime.engine.simgpu import SimGpuPool
from runtime.inventory import GpuInventory
from runtime.ownership import unfinished
from runtime.router import ROUTABLE, ReplicaRole, Router
from runtime.stats import ServingWindow
from runtime.timing import ReplicaTiming
from runtime.types import Request
from runtime.vmm.manager import ReservationManager

_RESTORES = {ClusterEventType.RELEASE, ClusterEventType.GPU_RESTORED}


class DecisionOutcome(StrEnum):
    """What the host did with a decision."""

    FED = "fed"  # handed to the deployment's runtime
    HELD = "held"  # a hold (no target plan): audit trail only
    NOT_OURS = "not_ours"  # a deployment this host does not serve


class RuntimeHost:
    """One worker's deployments on one pool, inventory and VMM (see the module docstring).

    ``engine_factories`` and ``routers`` (by deployment; default: SimEngine and the product
    router) are the seams a benchmark sets.
    """

    def __init__(
        self,
        deployments: Sequence[str],
        settings: RuntimeSettings,
        *,
        vmm: ReservationManager | None = None,
        pool: SimGpuPool | None = None,
        models: Mapping[str, ModelSpec] = MODELS,
        pause_in: TransitionPhase | None = None,
        pause_from_seq: int = 0,
        engine_factories: Mapping[str, EngineFactory] | None = None,
        routers: Mapping[str, Router] | None = None,
        hold_s: Mapping[str, float] | None = None,
        kv_floor_tokens: Mapping[str, int] | None = None,
        memory_wait_s: Mapping[str, float] | None = None,
        ttft_deadline_s: Mapping[str, float] | None = None,
    ) -> None:
        self.pool = pool or SimGpuPool()
        # NOTE: on-demand deployments (those that hold requests for a load) share GPUs' memory
        self.inventory = GpuInventory(sharing=(hold_s or {}).keys())
        self.vmm = vmm or ReservationManager()
        self.runtimes = {
            d: DeploymentRuntime(
                d,
                settings=settings,
                pool=self.pool,
                vmm=self.vmm,
                inventory=self.inventory,
                pause_in=pause_in,
                pause_from_seq=pause_from_seq,
                models=models,
                engine_factory=(engine_factories or {}).get(d, sim_engine),
                router=(routers or {}).get(d),
            )
            for d in deployments
        }
        # On-demand deployments hold requests for a load (runtime.serving); the rest refuse.
        for d, wait_s in (hold_s or {}).items():
            if d in self.runtimes:
                self.runtimes[d].core.hold_s = wait_s
        # A transient watermark refusal waits for memory this long at most (runtime.admission).
        for d, wait_s in (memory_wait_s or {}).items():
            if d in self.runtimes:
                self.runtimes[d].core.memory_wait_s = wait_s
        # A new request with no first token this long after its arrival is refused (0: never).
        for d, deadline_s in (ttft_deadline_s or {}).items():
            if d in self.runtimes:
                self.runtimes[d].core.ttft_deadline_s = deadline_s
        # On a shared GPU each on-demand replica is guaranteed its footprint's KV (a VMM floor).
        for d, tokens in (kv_floor_tokens or {}).items():
            if d in self.runtimes:
                self.runtimes[d].core.kv_floor_tokens = tokens
        # On-demand deployments' routers see the GPU time their replicas share with the others.
        self._sharing = [d for d in self.runtimes if d in (hold_s or {})]
        for d in self._sharing:
            self.runtimes[d].core.router.neighbours_busy = self._busy_beside(d)

    def _busy_beside(self, deployment: str) -> Callable[[ReplicaTiming], int]:
        """How many other on-demand replicas with work hold one of a replica's GPUs."""

        def busy(timing: ReplicaTiming) -> int:
            gpus = set(timing.gpu_uuids)
            count = 0
            for d in self._sharing:
                router = self.runtimes[d].core.router
                for rid in router.replicas(*ROUTABLE, ReplicaRole.DRAINING, ReplicaRole.FROZEN):
                    if (d, rid) == (deployment, timing.replica_id) or not router.has_work(rid):
                        continue
                    if gpus.intersection(router.gpu_uuids(rid)):
                        count += 1
            return count

        return busy

    def on_cluster_event(self, event: ClusterEvent) -> None:
        """A cluster event: the inventory learns it; the simulated hardware follows."""
        taken = self.inventory.apply_event(event)
        self.pool.preempt(taken)
        if event.type in _RESTORES:
            self.pool.restore(event.gpu_uuids)
        elif event.type is ClusterEventType.NODE_UP:
            self.pool.restore(self.inventory.gpus_on(event.node))

    def catch_up(self, events: Sequence[ClusterEvent]) -> None:
        """Replay a cluster-event log (no side effects), then put the simulated GPUs in the
        state it describes, so a plan is never loaded onto GPUs another tenant holds."""
        for event in events:
            self.inventory.apply_event(event)
        lost = {u for u in self.inventory.known_gpus() if not self.inventory.is_available(u)}
        self.pool.preempt(sorted(lost))

    def on_gpu_sample(self, sample: GpuSample) -> None:
        """A GPU sample: node and health for the inventory."""
        self.inventory.apply_sample(sample)

    def on_decision(
        self, decision: GearDecision, now_s: float, ref: int | None = None
    ) -> DecisionOutcome:
        """Feed a decision to its deployment's runtime, unless it is a hold or not ours."""
        rt = self.runtimes.get(decision.deployment)
        if rt is None:
            return DecisionOutcome.NOT_OURS
        if decision.to_plan_id is None:
            return DecisionOutcome.HELD
        rt.on_decision(decision, now_s, ref)
        return DecisionOutcome.FED

    def recover(
        self,
        records: Sequence[GearTransition],
        journal: Sequence[tuple[bytes | None, bytes | None]],
        now_s: float,
    ) -> dict[str, int]:
        """Rebuild every deployment from the transitions log's records and the ownership
        journal's (key, value) pairs after a (re)start; the sequences replayed per deployment.

        Recovered requests restart their clock: latency counts from the recovery.
        """
        out = {}
        for deployment, rt in self.runtimes.items():
            pending = [
                Request(r.request_id, r.prompt_tokens, r.max_output_tokens, now_s, r.kind)
                for r in unfinished(journal, deployment)
            ]
            rt.recover(records, pending, now_s)
            out[deployment] = len(pending)
        return out

    def adopt(self, plans: Mapping[str, DeploymentPlan], now_s: float) -> list[str]:
        """Load each deployment's starting plan as transition 0 where nothing serves yet; the
        deployments that started one."""
        return [d for d, rt in self.runtimes.items() if d in plans and rt.adopt(plans[d], now_s)]

    def tick(self, now_s: float) -> None:
        """Tick every deployment's runtime."""
        for rt in self.runtimes.values():
            rt.tick(now_s)

    def serving_reports(self, now_s: float, only: Sequence[str] | None = None) -> list[ServingLoad]:
        """Each deployment's (or ``only`` those's) serving window as a report; the windows
        restart at ``now_s``. Requests held for a load or for memory count in the queue."""
        out = []
        for deployment, rt in self.runtimes.items():
            if only is not None and deployment not in only:
                continue
            core = rt.core
            out.append(
                core.window.report(
                    deployment,
                    core.model_name or deployment,
                    now_s,
                    queue_len=core.queue_len() + len(core.held()),
                    active_sequences=core.active_sequences(),
                    kv_bytes=core.kv_bytes(),
                    plan_id=rt.state.serving_plan_id,
                )
            )
            core.window = ServingWindow(start_s=now_s)
        return out


__all__ = ["DecisionOutcome", "RuntimeHost"]
