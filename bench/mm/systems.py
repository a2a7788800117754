"""The compared systems. Every one runs the same engine (paged KV, youngest-first preemption,
:mod:`bench.mm.core`) on the same requests; they differ in placement, routing/admission,
eviction and KV pool layout.

**Naive round-robin** (the second article's baseline, "assumes uniform cost"): each request goes
to the next GPU in one cluster-wide cycle, whatever that GPU has loaded; a GPU without the model
loads it there (skipping GPUs that can never hold its weights, and evicting least recently used
*idle* models to make room — never one with requests; a GPU where no room can be made is
skipped). It starts with the catalogue's live models loaded as model-aware round-robin does.

**Model-aware round-robin**: a model's instances go on the next GPUs in a cluster-wide cycle that
can take the weights (the same LRU-idle eviction), and requests go cyclically over that model's
instances. No memory headroom is kept and nothing is throttled.

**vLLM-like** (per GPU, no cross-GPU scheduler): a static deployment of the whole catalogue made
at start (one replica of every model first, largest first, each on the GPU with the most memory
left that holds its weights + its nominal batch's KV under ``GPU_MEMORY_UTILIZATION``; then the
extra replicas where room is left). Each instance preallocates a private KV pool (its share of
the GPU's memory under that cap, split by nominal KV demand) and admits and preempts inside it.
No loads after start, no evictions, no 429s: requests queue (and time out) at the model's
instances, spread round-robin.

**Ours**: placement is ``gearbox.place_model`` (memory estimate with k = 1.3, pre-OOM watermark,
concurrency cap, affinity/free-memory/utilisation score, anti-affinity); a queued decision's
eviction proposals are applied, and only those (gearbox never proposes a model with running or
queued requests): cold models, else — the requests pending at the front end for the model as
its backlog — idle ones whose expected loss that backlog outweighs (gearbox's queue rule).
Admission mirrors :meth:`runtime.serving.ServingCore.submit` without knowing any output length:
candidates least loaded first, the engine's context limit on prompt + stated ``max_tokens``, the
queue cap, then the runtime's ``check_watermark`` on the GPU's memory with the KV the request is
admitted with (its prompt's blocks under incremental admission) — ready replicas least loaded
first, the first passing takes it, else a 429 naming the rule; those rules are the runtime's own
(:mod:`runtime.admission`). A watermark refusal that is only transient (the model's weights and
the request's KV would pass on some candidate's GPU) waits at the front end for memory instead,
while it can still get its first token within ``memory_wait_s`` (half the TTFT SLO) of its
first refusal, without holding the model's later requests back (``wait_blocks``); then it is refused
``throttled_watermark``. It counts among the model's waiting requests meanwhile, and once in the
scale window's arrivals and refusals. Weights are reserved through the
runtime's ``ReservationManager`` (VMM). Every tick each resident model's replicas are scaled by
``gearbox.scaling.scale_replicas`` (the live residency round's rule) on its arrivals, capacity
429s and waiting requests over the last ``SCALE_WINDOW_S``: one more replica when its demand is
unmet (the evictions gearbox proposes for it applied: idle extra replicas, cold models, idle
ones its unmet demand outweighs), an idle extra one given back; never below the catalogue's
replica count. The baselines keep the catalogue's counts.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence

from bench.mm.core import Instance, Simulator, Wait, footprint_of
from bench.mm.scenario import ModelProfile, SimRequest
from gearbox.placement import (
    Backlog,
    PlacementDecision,
    PlacementStatus,
    ResidentModel,
    place_model,
)
from gearbox.scaling import ReplicaDemand, ScaleAction, ScaleDecision, scale_replicas
from runtime.admission import (
    default_memory_wait_s,
    first_token_s,
    memory_wait_until_s,
    screen,
    transient,
    worst_refusal,
)
from runtime.throttle import DEFAULT_WATERMARK, GpuMemory
from runtime.types import Reason
from runtime.vmm.manager import WEIGHTS_REQUEST, ReservationManager

__all__ = ["GearboxSystem", "ModelAwareRoundRobin", "NaiveRoundRobin", "VllmLikeSystem"]

MAX_QUEUE_PER_INSTANCE = 1024  # ServingSettings.max_queue_per_replica's default
SCALE_WINDOW_S = 60.0  # demand window of the scale rule: the live stream's load_window_s
_CAPACITY_REFUSALS = frozenset({Reason.THROTTLED_WATERMARK.value, Reason.QUEUE_FULL.value})
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of a GPU its processes may take


def _deploy_live(
    place: Callable[[ModelProfile, int], None], sim: Simulator, models: Sequence[ModelProfile]
) -> None:
    """Place every model live at t = 0, largest footprint first.

    NOTE: largest-first is the usual knapsack order; placed on first demand instead, small
    models spread over the 80 GB cards and leave no room for the 34B ones (in every system).
    """
    live = [m for m in models if m.traffic.active_from_s <= 0.0]
    live.sort(key=lambda m: (-footprint_of(m, sim.config).estimated_bytes(1.0), m.name))
    for profile in live:
        place(profile, profile.replicas)


def _too_long(request: SimRequest, inst: Instance) -> bool:
    """The engine's context limit, on what the client states."""
    return request.prompt_tokens + request.max_tokens > inst.kv_capacity_tokens


class ModelAwareRoundRobin:
    """Cyclic placement and per-model cyclic routing (see the module docstring)."""

    name = "model_aware_rr"

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        self._gpu_order = tuple(sim.gpus)
        self._next_gpu = 0
        self._next_instance: dict[str, int] = {}

    def deploy(self, models: Sequence[ModelProfile]) -> None:
        """Load the live models, largest first."""
        _deploy_live(self._place_cyclic, self.sim, models)

    def place(self, profile: ModelProfile, count: int) -> None:
        """Load ``count`` instances on the next GPUs in the cycle that can take the weights."""
        self._place_cyclic(profile, count)

    def _place_cyclic(self, profile: ModelProfile, count: int) -> None:
        for _ in range(count):
            if self._load_next(profile) is None:
                self.sim.metrics.placement_queued += 1
                return

    def _load_next(self, profile: ModelProfile) -> Instance | None:
        """Load the model on the next GPU in the cycle that can make room for it."""
        n = len(self._gpu_order)
        for k in range(n):
            index = (self._next_gpu + k) % n
            uuid = self._gpu_order[index]
            if self.sim.instance(profile.name, uuid) is not None:
                continue
            if self._make_room(uuid, footprint_of(profile, self.sim.config).model_bytes):
                self._next_gpu = (index + 1) % n
                return self.sim.load(profile, uuid)
        return None

    def _make_room(self, uuid: str, weight_bytes: int) -> bool:
        """Evict LRU idle instances on the GPU until the weights fit; False if they never do."""
        sim = self.sim
        if weight_bytes > sim.gpus[uuid].total_memory_bytes:
            return False
        cap = sim.placement.max_models_per_gpu
        on_gpu = sim.instances_on(uuid)
        free, count = sim.free_bytes(uuid), len(on_gpu)
        victims: list[Instance] = []
        idle = (i for i in on_gpu if not i.active and not sim.pending(i.profile.name))
        for inst in sorted(idle, key=lambda i: i.last_request_s):
            if free >= weight_bytes and count < cap:
                break
            victims.append(inst)
            free += inst.weight_bytes + inst.kv_bytes
            count -= 1
        if free < weight_bytes or count >= cap:
            return False
        for inst in victims:
            sim.evict(inst)
        return True

    def route(self, request: SimRequest) -> Instance | str | None:
        """The next ready instance in the model's cycle (any instance while none is ready)."""
        candidates = self.sim.instances_of(request.model_name)
        if not candidates:
            return None
        ready = [i for i in candidates if i.is_ready(self.sim.now_s)] or candidates
        turn = self._next_instance.get(request.model_name, 0)
        self._next_instance[request.model_name] = turn + 1
        choice = ready[turn % len(ready)]
        return Reason.TOO_LONG.value if _too_long(request, choice) else choice

    def on_loaded(self, instance: Instance) -> bool:
        """Nothing to reserve: memory is taken as it is used."""
        return True

    def on_unloaded(self, instance: Instance) -> None:
        """Nothing reserved."""

    def on_tick(self) -> None:
        """No scaling: a model keeps its catalogue's replica count."""


class NaiveRoundRobin(ModelAwareRoundRobin):
    """The article's round-robin: next GPU whatever it has loaded (see the module docstring)."""

    name = "naive_rr"

    def place(self, profile: ModelProfile, count: int) -> None:
        """Nothing ahead of demand: a request loads its model where it lands."""

    def route(self, request: SimRequest) -> Instance | str | None:
        """The next GPU in the cycle; the model is loaded there when it is not."""
        sim = self.sim
        n = len(self._gpu_order)
        for k in range(n):
            index = (self._next_gpu + k) % n
            uuid = self._gpu_order[index]
            choice = sim.instance(request.model_name, uuid)
            if choice is None:
                profile = sim.profiles[request.model_name]
                if not self._make_room(uuid, footprint_of(profile, sim.config).model_bytes):
                    continue
                choice = sim.load(profile, uuid)
                if choice is None:
                    continue
            self._next_gpu = (index + 1) % n
            return Reason.TOO_LONG.value if _too_long(request, choice) else choice
        return None


class VllmLikeSystem:
    """Static per-GPU deployment with private KV pools (see the module docstring)."""

    name = "vllm_like"

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        self._next_instance: dict[str, int] = {}

    def deploy(self, models: Sequence[ModelProfile]) -> None:
        """Plan the whole catalogue statically, then load every planned instance."""
        sim = self.sim
        budget = {
            u: int(g.total_memory_bytes * GPU_MEMORY_UTILIZATION) for u, g in sim.gpus.items()
        }
        plan: dict[str, list[ModelProfile]] = {u: [] for u in sim.gpus}
        order = sorted(
            models, key=lambda m: (-footprint_of(m, sim.config).estimated_bytes(1.0), m.name)
        )
        for wave in range(max(m.replicas for m in models)):
            for profile in order:
                if wave >= profile.replicas:
                    continue
                need = footprint_of(profile, sim.config).estimated_bytes(1.0)
                fits = [
                    u
                    for u in sim.gpus
                    if budget[u] >= need
                    and profile not in plan[u]
                    and len(plan[u]) < sim.placement.max_models_per_gpu
                ]
                if not fits:
                    sim.metrics.placement_queued += 1  # the static plan has no room for it
                    continue
                uuid = max(fits, key=lambda u: (budget[u], u))
                budget[uuid] -= need
                plan[uuid].append(profile)
        for uuid, profiles in plan.items():
            self._load_gpu(uuid, profiles)

    def _load_gpu(self, uuid: str, profiles: Sequence[ModelProfile]) -> None:
        """Load the GPU's models, each with its share of the KV memory under the cap."""
        sim = self.sim
        if not profiles:
            return
        cap = int(sim.gpus[uuid].total_memory_bytes * GPU_MEMORY_UTILIZATION)
        feet = [footprint_of(p, sim.config) for p in profiles]
        kv_room = cap - sum(f.model_bytes for f in feet)
        nominal = [f.estimated_bytes(1.0) - f.model_bytes for f in feet]
        for profile, kv in zip(profiles, nominal, strict=True):
            sim.load(profile, uuid, kv_room * kv // sum(nominal))

    def place(self, profile: ModelProfile, count: int) -> None:
        """Static: nothing is loaded after start."""

    def route(self, request: SimRequest) -> Instance | str | None:
        """Round-robin over the model's instances (None if the static plan has none)."""
        candidates = self.sim.instances_of(request.model_name)
        if not candidates:
            return None
        turn = self._next_instance.get(request.model_name, 0)
        self._next_instance[request.model_name] = turn + 1
        choice = candidates[turn % len(candidates)]
        return Reason.TOO_LONG.value if _too_long(request, choice) else choice

    def on_loaded(self, instance: Instance) -> bool:
        """Nothing beyond the allocation."""
        return True

    def on_unloaded(self, instance: Instance) -> None:
        """Never called: nothing is evicted."""

    def on_tick(self) -> None:
        """Static: no scaling."""


class GearboxSystem:
    """``place_model`` + the runtime's watermark throttle (see the module docstring)."""

    name = "gearbox"

    def __init__(
        self,
        sim: Simulator,
        watermark: float = DEFAULT_WATERMARK,
        memory_wait_s: float | None = None,
        wait_blocks: bool = False,
    ) -> None:
        self.sim = sim
        self.watermark = watermark
        # how long a transient watermark refusal waits for memory (runtime.admission); None:
        # the runtime's default for the TTFT SLO; 0: refused at once
        self.memory_wait_s = (
            default_memory_wait_s(sim.config.ttft_slo_ms / 1000.0)
            if memory_wait_s is None
            else memory_wait_s
        )
        self.wait_blocks = wait_blocks  # a waiting request holds its model's later ones back
        self._first_refused_s: dict[str, float] = {}  # request id → its first watermark refusal
        self.vmm = ReservationManager()  # host backend: real address-space reservations
        self.decisions: list[PlacementDecision] = []
        self.scale_decisions: list[ScaleDecision] = []  # every OUT, IN and NO_ROOM
        # per model: (time, refused for capacity) of each request routed, over SCALE_WINDOW_S
        self._routed: dict[str, deque[tuple[float, bool]]] = {}
        self._refused: dict[str, int] = {}  # per model: the capacity refusals in _routed
        self._changed_s: dict[str, float] = {}  # per model: its replica set last changed

    # ---- placement ----------------------------------------------------------------------------

    def deploy(self, models: Sequence[ModelProfile]) -> None:
        """Place the live models, largest first."""
        _deploy_live(self.place, self.sim, models)

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

    def _residents(self) -> list[ResidentModel]:
        """Every instance as placement sees it (a loading one is in transition)."""
        sim = self.sim
        return [
            ResidentModel(
                i.profile.name,
                i.gpu_uuid,
                i.weight_bytes + i.kv_bytes,
                len(i.running),
                i.last_request_s,
                sim.mean_gap_s(i.profile.name),
                i.timing.weight_load_s(),
                len(i.waiting) + sim.pending(i.profile.name),
                in_transition=not i.is_ready(sim.now_s),
            )
            for i in sim.instances.values()
        ]

    def _placement(self, profile: ModelProfile, count: int) -> PlacementDecision:
        sim = self.sim
        # NOTE: place_model spreads the replicas of one call; GPUs already holding the model
        # are hidden from it so a new replica never lands beside an existing one.
        holding = frozenset(i.gpu_uuid for i in sim.instances_of(profile.name))
        residents = self._residents()
        request = footprint_of(profile, sim.config, count)
        gap = sim.mean_gap_s(profile.name)  # NOTE: 0 while every arrival came at one instant
        backlog = Backlog(sim.pending(profile.name), 1.0 / gap if gap > 0 else 0.0)
        decision = place_model(request, sim.snapshot(holding), residents, sim.placement, backlog)
        self.decisions.append(decision)
        return decision

    # ---- admission ----------------------------------------------------------------------------

    def route(self, request: SimRequest) -> Instance | str | Wait | None:
        """ServingCore's admission loop: too long → queue cap → watermark; a transient watermark
        refusal waits for memory (at most ``memory_wait_s`` from the first)."""
        sim = self.sim
        candidates = sim.instances_of(request.model_name)
        if not candidates:
            return None
        now_s = sim.now_s
        order = sorted(candidates, key=lambda i: (not i.is_ready(now_s), i.active, i.iid))
        admitted, soonest_s = self._admit(request, order)
        choice: Instance | str = admitted
        if isinstance(admitted, Reason):
            first_s = self._first_refused_s.setdefault(request.request_id, now_s)
            wait_s = self.memory_wait_s
            until_s = memory_wait_until_s(admitted, soonest_s, first_s, now_s, wait_s)
            if until_s is not None:
                return Wait(until_s, self.wait_blocks)
            choice = admitted.value
        self._first_refused_s.pop(request.request_id, None)
        # NOTE: counted once, when routed or refused: a wait is in the model's pending requests
        refused = isinstance(choice, str) and choice in _CAPACITY_REFUSALS
        self._routed.setdefault(request.model_name, deque()).append((now_s, refused))
        if refused:
            self._refused[request.model_name] = self._refused.get(request.model_name, 0) + 1
        return choice

    def _admit(
        self, request: SimRequest, order: Sequence[Instance]
    ) -> tuple[Instance | Reason, float | None]:
        """The first instance in ``order`` that admits ``request``, else the refusal and the
        soonest first token on an instance where a watermark refusal is transient (None: on
        none; :mod:`runtime.admission`)."""
        sim = self.sim
        refused: set[Reason] = set()
        soonest_s: float | None = None
        for inst in order:
            uuid = inst.gpu_uuid
            memory = {uuid: GpuMemory(sim.pool.total_bytes(uuid), sim.pool.used_bytes(uuid))}
            need = {uuid: sim.reservation_tokens(request) * inst.kv_bytes_per_token}
            reason = screen(
                too_long=_too_long(request, inst),
                queue_full=len(inst.waiting) >= MAX_QUEUE_PER_INSTANCE,
                memory=memory,
                need_bytes=need,
                watermark=self.watermark,
            )
            if reason is None:
                return inst, None
            refused.add(reason)
            if reason is Reason.THROTTLED_WATERMARK and transient(
                memory, {uuid: inst.weight_bytes}, need, self.watermark
            ):
                t_s = first_token_s(inst.timing, request.prompt_tokens)
                soonest_s = t_s if soonest_s is None else min(soonest_s, t_s)
        return worst_refusal(refused), soonest_s

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
        self._changed_s[instance.profile.name] = self.sim.now_s

    # ---- replica scaling ----------------------------------------------------------------------

    def on_tick(self) -> None:
        """Scale each resident model's replicas by gearbox's rule (at most one step each)."""
        sim = self.sim
        for name in sorted({i.profile.name for i in sim.instances.values()}):
            instances = sim.instances_of(name)
            if not all(i.is_ready(sim.now_s) for i in instances):
                self._changed_s[name] = sim.now_s  # NOTE: the window restarts once all serve
                continue
            decision = self._scale(sim.profiles[name])
            if decision.action is ScaleAction.HOLD and decision.placement is not None:
                if not decision.placement.evictions:
                    continue
                for proposal in decision.placement.evictions:
                    victim = sim.instance(proposal.model_name, proposal.gpu_uuid)
                    if victim is not None:
                        sim.evict(victim)
                decision = self._scale(sim.profiles[name])
            if decision.action is ScaleAction.OUT and decision.gpu_uuid is not None:
                if sim.load(sim.profiles[name], decision.gpu_uuid) is not None:
                    sim.metrics.scale_outs += 1
            elif decision.action is ScaleAction.IN and decision.gpu_uuid is not None:
                victim = sim.instance(name, decision.gpu_uuid)
                if victim is not None:
                    sim.evict(victim)
                    sim.metrics.scale_ins += 1

    def _scale(self, profile: ModelProfile) -> ScaleDecision:
        """gearbox's scale decision for one resident model on the window's figures."""
        sim = self.sim
        routed = self._routed.setdefault(profile.name, deque())
        while routed and routed[0][0] < sim.now_s - SCALE_WINDOW_S:
            if routed.popleft()[1]:
                self._refused[profile.name] -= 1
        queued = sum(len(i.waiting) for i in sim.instances_of(profile.name))
        demand = ReplicaDemand(
            arrivals=len(routed),
            refused=self._refused.get(profile.name, 0),
            waiting_requests=sim.pending(profile.name) + queued,
            window_s=SCALE_WINDOW_S,
            steady_s=sim.now_s - self._changed_s.get(profile.name, -math.inf),
            min_replicas=profile.replicas,
        )
        request = footprint_of(profile, sim.config)
        decision = scale_replicas(request, demand, sim.snapshot(), self._residents(), sim.placement)
        if decision.action is not ScaleAction.HOLD or decision.placement is not None:
            self.scale_decisions.append(decision)
        return decision
