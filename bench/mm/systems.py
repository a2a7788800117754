"""The two compared systems: round-robin, and ours (gearbox placement + runtime admission).

**Round-robin** (the article's baseline, "assumes uniform cost"): a model instance goes on the
next GPU in a cluster-wide cycle that can take the weights at all — the one thing any loader
checks — evicting the least recently used *idle* instances there when that makes room (plain
LRU: never one with requests, but with no reload-cost rule); no KV headroom is kept. Requests go
cyclically over the model's ready instances; nothing is throttled, so a KV allocation past the
GPU's memory is an OOM. The engine's own context-length check (``too_long``) applies, as in ours.

**Ours**: placement is ``gearbox.place_model`` (memory estimate with k = 1.3, pre-OOM watermark,
concurrency cap, affinity/free-memory/utilisation score, anti-affinity); a queued decision's
eviction proposals are applied, and only those. Admission mirrors
:meth:`runtime.serving.ServingCore.submit`: candidates least loaded first, the runtime's
``check_watermark`` on the VMM ledger, then ``ReservationManager.commit`` of the request's KV —
the first replica passing both takes it, else a 429 naming the rule.
"""

from __future__ import annotations

from collections.abc import Sequence

from bench.mm.core import MAX_BATCH, Instance, Simulator, footprint_of
from bench.mm.scenario import ModelProfile, SimRequest
from gearbox.placement import PlacementDecision, PlacementStatus, ResidentModel, place_model
from runtime.throttle import DEFAULT_WATERMARK, check_watermark
from runtime.types import Reason
from runtime.vmm.manager import WEIGHTS_REQUEST, ReservationManager

__all__ = ["GearboxSystem", "RoundRobinSystem"]

MAX_QUEUE_PER_INSTANCE = 1024  # ServingSettings.max_queue_per_replica's default
# Most specific rejection wins when several replicas refused (ServingCore's order).
_REJECTION_ORDER = (
    Reason.REJECTED_OOM_RISK,
    Reason.THROTTLED_WATERMARK,
    Reason.QUEUE_FULL,
    Reason.TOO_LONG,
)


class RoundRobinSystem:
    """Cyclic placement and routing without memory awareness (see the module docstring)."""

    name = "round_robin"
    kv_at_admission = False

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        self._gpu_order = tuple(sim.gpus)
        self._next_gpu = 0
        self._next_instance: dict[str, int] = {}

    def place(self, profile: ModelProfile, count: int) -> None:
        """Load ``count`` instances on the next GPUs in the cycle that can take the weights."""
        for _ in range(count):
            if not self._place_one(profile):
                self.sim.metrics.placement_queued += 1
                return

    def _place_one(self, profile: ModelProfile) -> bool:
        weight_bytes = footprint_of(profile, self.sim.config).model_bytes
        n = len(self._gpu_order)
        for k in range(n):
            index = (self._next_gpu + k) % n
            uuid = self._gpu_order[index]
            if self.sim.restarting(uuid) or self.sim.instance(profile.name, uuid) is not None:
                continue
            if self._make_room(uuid, weight_bytes):
                self._next_gpu = (index + 1) % n
                return self.sim.load(profile, uuid) is not None
        return False

    def _make_room(self, uuid: str, weight_bytes: int) -> bool:
        """Evict LRU idle instances on the GPU until the weights fit; False if they never do."""
        cap = self.sim.placement.max_models_per_gpu
        on_gpu = self.sim.instances_on(uuid)
        free, count = self.sim.free_bytes(uuid), len(on_gpu)
        victims: list[Instance] = []
        for inst in sorted((i for i in on_gpu if not i.active), key=lambda i: i.last_request_s):
            if free >= weight_bytes and count < cap:
                break
            victims.append(inst)
            free += inst.weight_bytes
            count -= 1
        if free < weight_bytes or count >= cap:
            return False
        for inst in victims:
            self.sim.evict(inst)
        return True

    def route(self, request: SimRequest, candidates: Sequence[Instance]) -> Instance | str:
        """The next ready instance in the model's cycle (any instance while none is ready)."""
        ready = [i for i in candidates if i.is_ready(self.sim.now_s)] or list(candidates)
        turn = self._next_instance.get(request.model_name, 0)
        self._next_instance[request.model_name] = turn + 1
        choice = ready[turn % len(ready)]
        if request.total_tokens > choice.timing.kv_capacity_tokens:
            return Reason.TOO_LONG.value
        return choice

    def on_loaded(self, instance: Instance) -> bool:
        """Nothing to reserve: memory is taken as it is used."""
        return True

    def on_unloaded(self, instance: Instance) -> None:
        """Nothing reserved."""

    def on_release(self, instance: Instance, request_id: str) -> None:
        """Nothing committed."""


class GearboxSystem:
    """``place_model`` + the runtime's watermark throttle and VMM (see the module docstring)."""

    name = "gearbox"
    kv_at_admission = True

    def __init__(self, sim: Simulator, watermark: float = DEFAULT_WATERMARK) -> None:
        self.sim = sim
        self.watermark = watermark
        self.vmm = ReservationManager()  # host backend: real address-space reservations
        self.decisions: list[PlacementDecision] = []

    # ---- placement ----------------------------------------------------------------------------

    def place(self, profile: ModelProfile, count: int) -> None:
        """Place ``count`` replicas; when queued, apply the proposed evictions and try once more."""
        decision = self._placement(profile, count)
        if decision.status is PlacementStatus.QUEUED and decision.evictions:
            for proposal in decision.evictions:
                victim = self.sim.instance(proposal.model_name, proposal.gpu_uuid)
                if victim is not None:
                    self.sim.evict(victim)
            decision = self._placement(profile, count)
        if decision.status is PlacementStatus.QUEUED:
            self.sim.metrics.placement_queued += 1
            return
        for uuid in decision.gpu_uuids:
            self.sim.load(profile, uuid)

    def _placement(self, profile: ModelProfile, count: int) -> PlacementDecision:
        sim = self.sim
        # NOTE: place_model spreads the replicas of one call; GPUs already holding the model
        # are hidden from it so a new replica never lands beside an existing one.
        holding = frozenset(i.gpu_uuid for i in sim.instances_of(profile.name))
        residents = [
            ResidentModel(
                i.profile.name,
                i.gpu_uuid,
                i.weight_bytes,
                i.active,
                i.last_request_s,
                sim.mean_gap_s(i.profile.name),
                i.timing.weight_load_s(),
            )
            for i in sim.instances.values()
        ]
        request = footprint_of(profile, sim.config, count)
        decision = place_model(request, sim.snapshot(holding), residents, sim.placement)
        self.decisions.append(decision)
        return decision

    # ---- admission ----------------------------------------------------------------------------

    def route(self, request: SimRequest, candidates: Sequence[Instance]) -> Instance | str:
        """ServingCore's admission loop: too long → queue cap → watermark → VMM commit."""
        refused: set[Reason] = set()
        memory = self.vmm.memory()
        for inst in sorted(candidates, key=lambda i: (i.active / MAX_BATCH, i.iid)):
            need = {inst.gpu_uuid: inst.kv_for(request)}
            if request.total_tokens > inst.timing.kv_capacity_tokens:
                refused.add(Reason.TOO_LONG)
            elif len(inst.queue) >= MAX_QUEUE_PER_INSTANCE:
                refused.add(Reason.QUEUE_FULL)
            elif not check_watermark(memory, need, self.watermark).allowed:
                refused.add(Reason.THROTTLED_WATERMARK)
            elif not self.vmm.commit(inst.iid, request.request_id, need):
                refused.add(Reason.REJECTED_OOM_RISK)
            else:
                return inst
        return next(r for r in _REJECTION_ORDER if r in refused).value

    def on_loaded(self, instance: Instance) -> bool:
        """Reserve the GPU's address space for the instance and commit its weights."""
        capacity = self.sim.gpus[instance.gpu_uuid].total_memory_bytes
        uuid = instance.gpu_uuid
        if not self.vmm.reserve_replica(instance.iid, {uuid: (capacity, capacity)}):
            return False
        if not self.vmm.commit(instance.iid, WEIGHTS_REQUEST, {uuid: instance.weight_bytes}):
            self.vmm.unreserve_replica(instance.iid)
            return False
        return True

    def on_unloaded(self, instance: Instance) -> None:
        """Release the reservation and every commit under it."""
        self.vmm.unreserve_replica(instance.iid)

    def on_release(self, instance: Instance, request_id: str) -> None:
        """Return the request's KV pages."""
        self.vmm.release(instance.iid, request_id)
