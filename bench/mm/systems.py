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

The three baselines' engines are vLLM as shipped: an engine's context limit (its max model
length) is what one sequence's KV can take under vLLM's default ``gpu_memory_utilization``
(``GPU_MEMORY_UTILIZATION``; ``bench.multimodel.ENGINE_CONFIGS``). Ours runs the runtime's engine,
whose limit is set by the share it admits KV to (``GearboxConfig.memory_utilisation``).

**vLLM-like** (per GPU, no cross-GPU scheduler): a static deployment of the whole catalogue made
at start (one replica of every model first, largest first, each on the GPU with the most memory
left that holds its weights + its nominal batch's KV under ``GPU_MEMORY_UTILIZATION``; then the
extra replicas where room is left). Each instance preallocates a private KV pool (its share of
the GPU's memory under that cap, split by nominal KV demand) and admits and preempts inside it.
No loads after start, no evictions, no 429s: requests queue (and time out) at the model's
instances, spread round-robin.

**Ours** runs the live loop's own rules. Residency is ``gearbox.residency.residency_round`` —
the round each on-demand deployment of the live stream decides by (:mod:`streams.ondemand`) — on
the models as the stream's view shows them (state, GPUs, active and queued requests, last
demand, arrivals — a request waiting for a load included, as the runtime's serving window counts
it — and capacity 429s over ``SCALE_WINDOW_S``) and the GPUs' physical free memory, every tick
and whenever a request waits for a model short of replicas; every verdict is carried out: a cold
model with requests loads as one replica (at start the live models count as requested), resident
ones scale out or in by one, cold or idle ones are evicted for a waiting model — an eviction
here is instant, so the round runs once more for the model it made room for — an extra replica
in use given back for a model with no replica is drained as the runtime drains a removed
replica: it takes no new request and is unloaded when its last request ends; and a model
displaced in use (gearbox's displace rule) keeps serving and is unloaded when its last request
ends with none waiting for its model (or at a tick that finds it so), as the runtime's eviction
waits for an idle moment, checked every executor tick (20 ms), or stays if none comes within the
runtime's ``drain_timeout_s``. No rule unloads a request. Each model's footprint is the live one
(:func:`gearbox.residency.replica_footprint`: weights, overhead and ``FOOTPRINT_BATCH``
sequences of its mean prompt + output), and each replica gets the VMM floor the runtime's
serving core gives an on-demand replica (weights + :func:`gearbox.residency.kv_floor_tokens` of
KV — none by default, ``placement.kv_floor_batch`` — at most the watermark's share of the GPU).
Admission mirrors :meth:`runtime.serving.ServingCore.submit` without knowing any output length:
candidates in the router's order (below), the engine's context limit on prompt + stated
``max_tokens``, the queue cap, then the runtime's ``check_watermark`` on the GPU as the VMM
ledger shows it with floors (:func:`runtime.vmm.manager.floored_memory`) and the KV the request
is admitted with (its prompt's blocks under incremental admission) — the first ready replica
passing takes it, else a 429 naming the rule; those rules are the runtime's own
(:mod:`runtime.admission`). A watermark refusal that is only transient (the model's weights and
the request's KV would pass on some candidate's GPU) waits at the front end for memory instead,
while it can still get its first token within ``memory_wait_s`` (half the TTFT SLO) of its first
refusal, without holding the model's later requests back (``wait_blocks``); then it is refused
``throttled_watermark``. It counts among the model's waiting requests meanwhile, and once in the
window's routed requests and refusals. Candidates are ranked as the runtime's router ranks them
(:func:`runtime.router.predicted_completion_s`: the queue's prefills, its own, the recent
answers' mean length of decode steps, stretched by the other replicas with work on the GPU, as
:class:`runtime.host.RuntimeHost` counts them for on-demand deployments). A request admitted at
a serving replica is refused ``ttft_deadline`` if it has no first token a TTFT SLO after its
arrival (the runtime's deadline; its KV goes back; one held for a load is exempt), and that
refusal counts in the model's window as a capacity refusal, as the runtime's serving window
counts it. Weights are reserved through the runtime's ``ReservationManager`` (VMM). The
baselines keep the catalogue's replica counts; ours does not read them."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence

from bench.mm.core import Instance, Simulator, Wait, footprint_of
from bench.mm.scenario import ModelProfile, SimRequest
from gearbox.decisions import DecisionReason
from gearbox.residency import (
    OnDemandModel,
    Residency,
    ResidencyAction,
    ResidencyVerdict,
    kv_floor_tokens,
    reload_s,
    replica_footprint,
    residency_round,
)
from runtime.admission import (
    default_memory_wait_s,
    first_token_s,
    memory_wait_until_s,
    screen,
    transient,
    ttft_deadline_s,
    worst_refusal,
)
from runtime.executor import ExecutorSettings
from runtime.router import answer_mean_after, expected_output_tokens, predicted_completion_s
from runtime.throttle import DEFAULT_WATERMARK, GpuMemory
from runtime.types import CAPACITY_REFUSALS, Reason
from runtime.vmm.manager import (
    WEIGHTS_REQUEST,
    ReservationManager,
    floored_memory,
    replica_floor,
)

__all__ = ["GearboxSystem", "ModelAwareRoundRobin", "NaiveRoundRobin", "VllmLikeSystem"]

MAX_QUEUE_PER_INSTANCE = 1024  # ServingSettings.max_queue_per_replica's default
SCALE_WINDOW_S = 60.0  # demand window of the scale rule: the live stream's load_window_s
_CAPACITY_REFUSALS = frozenset(r.value for r in CAPACITY_REFUSALS)
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


def _nominal_tokens(profile: ModelProfile) -> int:
    """A model's nominal sequence (mean prompt + mean output): what its live footprint and VMM
    floor count, as the live catalogue's nominal prompt + output."""
    return profile.traffic.mean_prompt_tokens + profile.traffic.mean_output_tokens


def _too_long(request: SimRequest, inst: Instance) -> bool:
    """The engine's context limit, on what the client states."""
    return request.prompt_tokens + request.max_tokens > inst.kv_capacity_tokens


class _VllmFrontEnd:
    """What the baselines share with vLLM's front end: no deadline on a first token, and
    routing that learns nothing from completions."""

    def deadline_s(self, request: SimRequest, instance: Instance) -> float | None:
        """None: a request waits for its first token as long as the engine keeps it."""
        return None

    def on_refused(self, request: SimRequest, reason: str) -> None:
        """Never called: no deadline."""

    def on_finished(self, request: SimRequest) -> None:
        """Nothing learnt: routing does not predict."""


class ModelAwareRoundRobin(_VllmFrontEnd):
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

    def on_idle(self, instance: Instance) -> None:
        """Nothing is given back."""


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


class VllmLikeSystem(_VllmFrontEnd):
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

    def on_idle(self, instance: Instance) -> None:
        """Nothing is given back."""


class GearboxSystem:
    """The live residency round + the runtime's admission (see the module docstring)."""

    name = "gearbox"

    def __init__(
        self,
        sim: Simulator,
        watermark: float = DEFAULT_WATERMARK,
        memory_wait_s: float | None = None,
        wait_blocks: bool = False,
        ttft_deadline: float | None = None,
    ) -> None:
        self.sim = sim
        self.watermark = watermark
        # how long a request queued at a serving replica may go without a first token
        # (runtime.admission.ttft_deadline_s: None, the TTFT SLO; 0, never refused)
        self.ttft_deadline_s = ttft_deadline_s(ttft_deadline, sim.config.ttft_slo_ms / 1000.0)
        # per model: the last time it had no replica to route to; its requests queued before
        # then were held for a load, which the deadline exempts (the runtime's serving core)
        self._no_replica_s: dict[str, float] = {}
        # per model: answers completed and their mean length (the runtime router's estimate)
        self._answers: dict[str, tuple[int, float]] = {}
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
        self.verdicts: list[ResidencyVerdict] = []  # every verdict that acted (not a hold)
        # per model: (time, refused for capacity) of each request routed, over SCALE_WINDOW_S
        self._routed: dict[str, deque[tuple[float, bool]]] = {}
        self._refused: dict[str, int] = {}  # per model: the capacity refusals in _routed
        self._changed_s: dict[str, float] = {}  # per model: its replica set last changed
        self._last_demand_s: dict[str, float] = {}  # per model: the last round it had demand
        # instance id → bytes its VMM floor guarantees it (the ledger holds weights only: KV
        # lives in the simulator's pool, so admission reads floors here, not from the ledger)
        self._floors: dict[str, int] = {}
        self._draining: set[str] = set()  # instances given back in use: no new request
        # instances displaced (gearbox's displace rule) → until when they may still go, and the
        # model they make room for: each is unloaded at its first moment with no request and
        # none waiting for its model (on_idle, on_tick), as the runtime's eviction waits for one
        # (``ExecutorSettings.drain_timeout_s``)
        self._displacing: dict[str, tuple[float, str | None]] = {}
        # per model unloaded by the displace rule: the model it made room for, until it loads
        # again (the live plan state keeps its last decision's, :mod:`streams.ondemand`)
        self._made_room: dict[str, str] = {}

    # ---- residency ----------------------------------------------------------------------------

    def deploy(self, models: Sequence[ModelProfile]) -> None:
        """At start the catalogue's live models are wanted: one round loads them (largest
        footprint first, the round's own order)."""
        self._decide(frozenset(m.name for m in models if m.traffic.active_from_s <= 0.0))

    def place(self, profile: ModelProfile, count: int) -> None:
        """A request waits for a model short of replicas: the round decides for every model."""
        self._decide()

    def on_tick(self) -> None:
        """The periodic round: loads, evictions and replica scaling for every model, after the
        drained replicas that finished their requests are unloaded."""
        for iid in sorted(self._draining):
            inst = self.sim.instances.get(iid)
            if inst is not None and not inst.active:
                self.sim.evict(inst)
        for iid, (until_s, _) in sorted(self._displacing.items()):
            inst = self.sim.instances.get(iid)
            if inst is not None and self._idle(inst):
                self.sim.evict(inst)
            elif inst is None or self.sim.now_s >= until_s:
                del self._displacing[iid]
        self._decide()

    def on_idle(self, instance: Instance) -> None:
        """Its last request finished: a drained replica goes now, and a displaced one if no
        request waits for its model — the runtime's executor checks every ``tick_s`` (20 ms),
        not at the round's ticks."""
        until_s, _ = self._displacing.get(instance.iid, (-math.inf, None))
        displaced = self.sim.now_s < until_s and self._idle(instance)
        if instance.iid in self._draining or displaced:
            self.sim.evict(instance)

    def _idle(self, inst: Instance) -> bool:
        """No request runs or queues on the instance, and none waits for its model."""
        return not inst.active and not self.sim.pending(inst.profile.name)

    def _decide(self, wanted: frozenset[str] = frozenset()) -> None:
        """Run ``gearbox.residency``'s round on the models' view and act on every verdict; an
        eviction here is instant, so the round runs once more for the models it made room for.
        ``wanted``: models counted as requested (the start)."""
        sim = self.sim
        for _ in range(2):
            views = [self._view(p, p.name in wanted) for p in sim.profiles.values()]
            verdicts = residency_round(views, sim.snapshot(), sim.placement)
            evicted = False
            for name, verdict in verdicts.items():
                evicted |= self._act(sim.profiles[name], verdict)
            if not evicted:
                return

    def _view(self, profile: ModelProfile, wanted: bool) -> OnDemandModel:
        """The model as the live stream's on-demand view shows it (:mod:`streams.ondemand`)."""
        sim, name, now_s = self.sim, profile.name, self.sim.now_s
        instances = sim.instances_of(name)
        making_room = (self._displacing.get(i.iid, (0.0, None))[1] for i in instances)
        evicting_for = next((m for m in making_room if m is not None), None)
        if not instances:
            state = Residency.COLD
            evicting_for = self._made_room.get(name)
        elif any(i.iid in self._displacing for i in instances):
            state = Residency.EVICTING
        elif all(i.is_ready(now_s) and i.iid not in self._draining for i in instances):
            state = Residency.RESIDENT
        else:
            state = Residency.LOADING
            self._changed_s[name] = now_s  # NOTE: the scale window restarts once all serve
        routed = self._window(name)
        active = sum(len(i.running) for i in instances)
        queued = sum(len(i.waiting) for i in instances) + sim.pending(name) + int(wanted)
        if routed or active or queued:
            self._last_demand_s[name] = now_s
        seq = _nominal_tokens(profile)
        return OnDemandModel(
            name=name,
            footprint=replica_footprint(profile.spec, seq, sim.config.runtime_overhead_bytes),
            state=state,
            gpu_uuids=tuple(sorted(i.gpu_uuid for i in instances)),
            active_requests=active,
            queued_requests=queued,
            last_demand_s=self._last_demand_s.get(name, -math.inf),
            arrival_rps=sim.arrivals_since(name, now_s - SCALE_WINDOW_S) / SCALE_WINDOW_S,
            reload_s=reload_s(profile.spec, sim.config),
            refused=self._refused.get(name, 0),
            window_s=SCALE_WINDOW_S,
            steady_s=now_s - self._changed_s.get(name, -math.inf),
            evicting_for=evicting_for,
        )

    def _window(self, name: str) -> deque[tuple[float, bool]]:
        """The model's routed requests over the last ``SCALE_WINDOW_S``."""
        routed = self._routed.setdefault(name, deque())
        while routed and routed[0][0] < self.sim.now_s - SCALE_WINDOW_S:
            if routed.popleft()[1]:
                self._refused[name] -= 1
        return routed

    def _act(self, profile: ModelProfile, verdict: ResidencyVerdict) -> bool:
        """Carry out one verdict; True when it evicted something."""
        sim = self.sim
        action = verdict.action
        if verdict.reason is DecisionReason.WAITING_FOR_ROOM:
            sim.metrics.placement_queued += 1
        if action is ResidencyAction.HOLD:
            return False
        self.verdicts.append(verdict)
        held = {i.gpu_uuid: i for i in sim.instances_of(profile.name)}
        if action in (ResidencyAction.LOAD, ResidencyAction.SCALE_OUT):
            for uuid in verdict.gpu_uuids:
                loaded = uuid not in held and sim.load(profile, uuid) is not None
                sim.metrics.scale_outs += int(loaded and action is ResidencyAction.SCALE_OUT)
            return False
        gone = [i for u, i in held.items() if u not in verdict.gpu_uuids]
        if verdict.reason is DecisionReason.EVICT_DISPLACE:
            until_s = sim.now_s + ExecutorSettings().drain_timeout_s
            for inst in gone:
                if self._idle(inst):
                    sim.evict(inst)
                else:
                    self._displacing[inst.iid] = (until_s, verdict.for_model)
            return any(i.iid not in self._displacing for i in gone)
        for inst in gone:
            if inst.active:  # NOTE: a drain (the runtime's scale-in): unloaded once it is empty
                self._draining.add(inst.iid)
            else:
                sim.evict(inst)
        if action is ResidencyAction.SCALE_IN and verdict.for_model is None:
            sim.metrics.scale_ins += len(gone)
        return any(not i.active for i in gone)

    # ---- admission ----------------------------------------------------------------------------

    def route(self, request: SimRequest) -> Instance | str | Wait | None:
        """ServingCore's admission loop: too long → queue cap → watermark; a transient watermark
        refusal waits for memory (at most ``memory_wait_s`` from the first)."""
        sim = self.sim
        candidates = [
            i for i in sim.instances_of(request.model_name) if i.iid not in self._draining
        ]
        if not candidates:
            self._no_replica_s[request.model_name] = sim.now_s
            return None
        now_s = sim.now_s
        answers, mean = self._answers.get(request.model_name, (0, 0.0))
        output = expected_output_tokens(answers, mean, request.max_tokens)

        def completion_s(inst: Instance) -> float:
            queued_s = sum(inst.timing.prefill_s(s.request.prompt_tokens) for s in inst.waiting)
            batch = len(inst.running) + len(inst.waiting) + 1
            # the runtime host's count of other replicas with work on the GPU (time-sliced)
            beside = sim.instances_on(inst.gpu_uuid)
            sharing = 1 + sum(1 for other in beside if other is not inst and other.active)
            return predicted_completion_s(
                now_s, inst.timing, queued_s, batch, request.prompt_tokens, output, sharing
            )

        # NOTE: the runtime's router ranks serving replicas by predicted completion; a loading
        # one is no candidate there (its requests are held for the load), so it comes last here
        order = sorted(candidates, key=lambda i: (not i.is_ready(now_s), completion_s(i), i.iid))
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

    def deadline_s(self, request: SimRequest, instance: Instance) -> float | None:
        """The runtime's TTFT deadline (:meth:`runtime.serving.ServingCore.submit`): a request
        admitted at a serving replica is refused if it has no first token ``ttft_deadline_s``
        after its arrival; one held for a load (its model had no replica, or only a loading
        one) is exempt, its client waiting for the load by design."""
        held = request.arrival_s <= self._no_replica_s.get(request.model_name, -math.inf)
        if self.ttft_deadline_s <= 0.0 or held or not instance.is_ready(self.sim.now_s):
            return None
        return request.arrival_s + self.ttft_deadline_s

    def on_finished(self, request: SimRequest) -> None:
        """The answer's length joins the model's mean, as the runtime's router learns it."""
        answers, mean = self._answers.get(request.model_name, (0, 0.0))
        answers += 1
        mean = answer_mean_after(answers, mean, request.output_tokens)
        self._answers[request.model_name] = (answers, mean)

    def on_refused(self, request: SimRequest, reason: str) -> None:
        """A refusal after admission counts in the model's window as the runtime's serving
        window counts it (a capacity refusal: :data:`runtime.types.CAPACITY_REFUSALS`)."""
        if reason in _CAPACITY_REFUSALS:
            self._routed.setdefault(request.model_name, deque()).append((self.sim.now_s, True))
            self._refused[request.model_name] = self._refused.get(request.model_name, 0) + 1

    def _memory(self, inst: Instance, need_bytes: int) -> GpuMemory:
        """The instance's GPU as the runtime's VMM ledger shows it to an admission of
        ``need_bytes`` there: every replica on the GPU has its floor
        (:func:`runtime.vmm.manager.floored_memory`)."""
        sim, uuid = self.sim, inst.gpu_uuid
        used = {i.iid: i.weight_bytes + i.kv_bytes for i in sim.instances_on(uuid)}
        floors = {i: self._floors[i] for i in used}
        return floored_memory(sim.pool.total_bytes(uuid), used, floors, inst.iid, need_bytes)

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
            need = {uuid: sim.reservation_tokens(request) * inst.kv_bytes_per_token}
            memory = {uuid: self._memory(inst, need[uuid])}
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
        """Reserve the GPU's address space for the instance, commit its weights and keep its
        floor (:func:`runtime.vmm.manager.replica_floor` of weights +
        :func:`gearbox.residency.kv_floor_tokens` of KV), as the runtime's serving core
        installs an on-demand replica."""
        sim = self.sim
        capacity = sim.gpus[instance.gpu_uuid].total_memory_bytes
        uuid = instance.gpu_uuid
        if not self.vmm.reserve_replica(instance.iid, {uuid: (capacity, capacity)}):
            return False
        if not self.vmm.commit(instance.iid, WEIGHTS_REQUEST, {uuid: instance.weight_bytes}):
            self.vmm.unreserve_replica(instance.iid)
            return False
        kv = kv_floor_tokens(_nominal_tokens(instance.profile), sim.placement)
        kv *= instance.kv_bytes_per_token
        self._floors[instance.iid] = replica_floor(
            instance.weight_bytes, kv, capacity, self.watermark
        )
        self._changed_s[instance.profile.name] = sim.now_s
        self._made_room.pop(instance.profile.name, None)
        return True

    def on_unloaded(self, instance: Instance) -> None:
        """Release the reservation and every commit under it; forget its floor."""
        self.vmm.unreserve_replica(instance.iid)
        self._floors.pop(instance.iid, None)
        self._draining.discard(instance.iid)
        _, made_for = self._displacing.pop(instance.iid, (0.0, None))
        if made_for is not None:
            self._made_room[instance.profile.name] = made_for
        self._changed_s[instance.profile.name] = self.sim.now_s
