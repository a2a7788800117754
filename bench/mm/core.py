"""The discrete-event simulator both systems run in (simulated clock, no wall-clock reads).

Shared mechanics — identical for round-robin and ours, so only placement, routing/admission and
eviction differ:

* **Physical memory** is the runtime's :class:`runtime.engine.simgpu.SimGpuPool` (the ledger the
  SimEngine allocates against): an allocation past a GPU's memory is refused and counted as an
  OOM event. An OOM crashes that GPU's serving process: the victim and every request holding KV
  on the GPU fail, and all its models reload (weight bytes / ``weight_load_gbps``) before they
  serve again. Queued requests without KV wait in the front-end and survive.
* **Instances**: one model loaded on one GPU, holding weights + the runtime's per-process
  overhead (``GearboxConfig.runtime_overhead_bytes``, as :class:`runtime.serving.ServingCore`
  commits it). Loading takes :meth:`ReplicaTiming.weight_load_s`.
* **Service time** comes from the runtime's :class:`runtime.timing.ReplicaTiming` (gearbox's cost
  model) for the model on that GPU class: ``prefill_s(prompt) + output × decode_cycle_s(batch,
  mean context)``, the batch taken when the request starts, times the number of instances on the
  GPU that are computing then (processes sharing a GPU time-slice it). At most ``MAX_BATCH``
  requests run per instance; the rest queue FIFO.
* **KV** of a request is ``(prompt + output) × kv_bytes_per_token`` for its whole life, allocated
  when it starts (round-robin) or when admitted (ours: the VMM commit is the allocation).
* **Timeouts**: a request not started ``QUEUE_TIMEOUT_S`` after arrival gives up.
* **Replicas**: while a model has demand it wants ``ModelProfile.replicas`` instances; placement
  is retried on arrivals and ticks, at most every ``PLACE_RETRY_S`` per model.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol

from bench.mm.metrics import Metrics
from bench.mm.scenario import ModelProfile, Scenario, SimRequest
from gearbox.config import GearboxConfig, PlacementConfig
from gearbox.placement import ModelFootprint, dead_memory
from gearbox.plans import ExecutionPlan, Stage, StageRole
from gearbox.types import TopologySnapshot
from runtime.engine.simgpu import SimGpuPool
from runtime.timing import ReplicaTiming

__all__ = ["Instance", "Simulator", "System", "footprint_of"]

TICK_S = 5.0  # sampling, timeout sweep and placement-retry period
MAX_BATCH = 32  # running sequences per instance (same engine setting for both systems)
QUEUE_TIMEOUT_S = 60.0  # a request not started this long after arriving gives up
PLACE_RETRY_S = 5.0  # placement attempts per model at most this often
GAP_WINDOW = 20  # arrivals in the mean-gap estimate handed to eviction


class _Kind(IntEnum):
    """Event order at equal times: free memory first, then arrivals, then the tick."""

    FINISH = 0
    READY = 1
    ARRIVAL = 2
    TICK = 3


@dataclass
class Instance:
    """One model loaded on one GPU."""

    iid: str
    profile: ModelProfile
    gpu_uuid: str
    timing: ReplicaTiming
    weight_bytes: int  # weights + per-process runtime overhead
    ready_at_s: float
    epoch: int = 0  # bumped on restart, so stale events are ignored
    running: dict[str, tuple[SimRequest, float]] = field(default_factory=dict)  # id → (req, start)
    queue: deque[SimRequest] = field(default_factory=deque)
    kv_bytes: dict[str, int] = field(default_factory=dict)  # requests holding physical KV here
    last_request_s: float = 0.0
    ready_since_s: float | None = None  # for the weight-memory integral

    @property
    def active(self) -> int:
        """Requests running or queued here."""
        return len(self.running) + len(self.queue)

    def kv_for(self, request: SimRequest) -> int:
        """Bytes of KV the request holds."""
        return request.total_tokens * self.profile.spec.kv_bytes_per_token

    def is_ready(self, now_s: float) -> bool:
        """Loaded and serving."""
        return now_s >= self.ready_at_s


class System(Protocol):
    """What differs between the compared systems."""

    name: str
    kv_at_admission: bool  # True: KV is committed when admitted (VMM); False: when started

    def place(self, profile: ModelProfile, count: int) -> None:
        """Load up to ``count`` more instances of the model (or leave it waiting)."""
        ...

    def route(self, request: SimRequest, candidates: Sequence[Instance]) -> Instance | str:
        """The instance to queue the request at, or the rejection reason."""
        ...

    def on_loaded(self, instance: Instance) -> bool:
        """An instance's weights were allocated (ours: VMM reservation + weight commit)."""
        ...

    def on_unloaded(self, instance: Instance) -> None:
        """An instance's memory was freed (eviction or crash)."""
        ...

    def on_release(self, instance: Instance, request_id: str) -> None:
        """A request left the instance (finished, failed or timed out)."""
        ...


def footprint_of(
    profile: ModelProfile, config: GearboxConfig, num_replicas: int = 1
) -> ModelFootprint:
    """The placement footprint: weights + runtime overhead, KV for the profile's batch."""
    return ModelFootprint(
        profile.name,
        profile.spec.weight_bytes + config.runtime_overhead_bytes,
        profile.spec.kv_bytes_per_token,
        profile.batch_size,
        profile.seq_len_tokens,
        num_replicas,
    )


class Simulator:
    """One run of one system over one scenario (see the module docstring)."""

    def __init__(self, scenario: Scenario, placement: PlacementConfig) -> None:
        self.scenario = scenario
        self.placement = placement
        self.config = GearboxConfig()
        self.now_s = 0.0
        self.metrics = Metrics()
        self.pool = SimGpuPool()
        self.gpus = {g.uuid: g for g in scenario.cluster.gpus}
        for gpu in self.gpus.values():
            self.pool.ensure(gpu.uuid, gpu.total_memory_bytes)
        self.profiles = {m.name: m for m in scenario.models}
        self.instances: dict[str, Instance] = {}
        self.restart_until_s: dict[str, float] = {}
        self.system: System | None = None
        self._pending: dict[str, deque[SimRequest]] = {m: deque() for m in self.profiles}
        self._arrivals: dict[str, deque[float]] = {
            m: deque(maxlen=GAP_WINDOW) for m in self.profiles
        }
        self._last_place_s: dict[str, float] = {}
        self._timings: dict[tuple[str, str], ReplicaTiming] = {}
        self._events: list[tuple[float, int, int, tuple[str, str, int]]] = []
        self._seq = 0
        self._footprints = tuple(footprint_of(m, self.config) for m in scenario.models)

    # ---- queries systems use ------------------------------------------------------------------

    def instances_of(self, model_name: str) -> list[Instance]:
        """The model's instances, oldest first."""
        return [i for i in self.instances.values() if i.profile.name == model_name]

    def instances_on(self, gpu_uuid: str) -> list[Instance]:
        """Instances on the GPU, oldest first."""
        return [i for i in self.instances.values() if i.gpu_uuid == gpu_uuid]

    def instance(self, model_name: str, gpu_uuid: str) -> Instance | None:
        """The model's instance on the GPU, if loaded."""
        return self.instances.get(f"{model_name}@{gpu_uuid}")

    def restarting(self, gpu_uuid: str) -> bool:
        """True while the GPU's process reloads after an OOM."""
        return self.now_s < self.restart_until_s.get(gpu_uuid, 0.0)

    def free_bytes(self, gpu_uuid: str) -> int:
        """Physical memory not allocated on the GPU."""
        return self.pool.total_bytes(gpu_uuid) - self.pool.used_bytes(gpu_uuid)

    def mean_gap_s(self, model_name: str) -> float:
        """Mean gap over the last arrivals, the open gap since the last one included.

        NOTE: the open gap makes a model that fell silent look as cold as it is; an all-time
        mean would keep a once-busy model "due any second" forever and never evictable.
        """
        times = self._arrivals[model_name]
        if not times:
            return self.scenario.duration_s
        return (self.now_s - times[0]) / len(times)

    def snapshot(self, exclude: frozenset[str] = frozenset()) -> TopologySnapshot:
        """The cluster as telemetry would report it now (``exclude``: marked unschedulable)."""
        gpus = []
        for gpu in self.gpus.values():
            running = sum(len(i.running) for i in self.instances_on(gpu.uuid))
            gpus.append(
                dataclasses.replace(
                    gpu,
                    free_memory_bytes=self.free_bytes(gpu.uuid),
                    utilisation=min(1.0, running / MAX_BATCH),
                    schedulable=gpu.uuid not in exclude and not self.restarting(gpu.uuid),
                    last_seen_s=self.now_s,
                )
            )
        return dataclasses.replace(self.scenario.cluster, now_s=self.now_s, gpus=tuple(gpus))

    def timing(self, profile: ModelProfile, gpu_uuid: str) -> ReplicaTiming:
        """The runtime's timing figures for the model on the GPU's class (cached per class)."""
        gpu = self.gpus[gpu_uuid]
        key = (profile.spec.name, gpu.gpu_class.name)
        if key not in self._timings:
            link = self.scenario.cluster.domain_link(gpu.domain)
            stage = Stage(
                gpu.domain, gpu.domain, (gpu_uuid,), 0, profile.spec.num_layers,
                StageRole.UNIFIED, gpu.gpu_class, link,
            )  # fmt: skip
            plan = ExecutionPlan(profile.spec.name, (stage,))
            self._timings[key] = ReplicaTiming.build(plan, profile.spec, self.config)
        return self._timings[key]

    # ---- actions systems take -----------------------------------------------------------------

    def load(self, profile: ModelProfile, gpu_uuid: str) -> Instance | None:
        """Allocate the weights and start loading; None (an OOM event) if memory refuses."""
        assert self.system is not None
        weight_bytes = profile.spec.weight_bytes + self.config.runtime_overhead_bytes
        if not self.pool.allocate(gpu_uuid, weight_bytes):
            return None
        timing = self.timing(profile, gpu_uuid)
        iid = f"{profile.name}@{gpu_uuid}"
        inst = Instance(iid, profile, gpu_uuid, timing, weight_bytes, 0.0)
        inst.ready_at_s = self.now_s + timing.weight_load_s()
        inst.last_request_s = self.now_s
        if not self.system.on_loaded(inst):
            self.pool.free(gpu_uuid, weight_bytes)
            return None
        self.instances[iid] = inst
        self.metrics.loads += 1
        self._push(inst.ready_at_s, _Kind.READY, (iid, "", inst.epoch))
        return inst

    def evict(self, inst: Instance) -> None:
        """Unload an instance; anything it still holds fails (and is counted)."""
        assert self.system is not None
        if inst.active:
            self.metrics.evicted_with_active += 1
        self.metrics.evictions += 1
        for request, _ in list(inst.running.values()):
            self._drop(inst, request.request_id)
            self.metrics.failed_evicted += 1
        while inst.queue:
            self._drop(inst, inst.queue.popleft().request_id)
            self.metrics.failed_evicted += 1
        self._close_weights(inst)
        self.pool.free(inst.gpu_uuid, inst.weight_bytes)
        self.system.on_unloaded(inst)
        del self.instances[inst.iid]

    def allocate_kv(self, inst: Instance, request: SimRequest) -> bool:
        """Allocate the request's KV; on refusal the GPU's process crashes (False)."""
        need = inst.kv_for(request)
        if self.pool.allocate(inst.gpu_uuid, need):
            inst.kv_bytes[request.request_id] = need
            return True
        self.metrics.failed_oom += 1  # the victim
        self._crash(inst.gpu_uuid)
        return False

    # ---- the run ------------------------------------------------------------------------------

    def run(self, system: System) -> Metrics:
        """Replay the scenario's requests through ``system`` until ``duration_s``."""
        self.system = system
        self._deploy_catalogue()
        for n, request in enumerate(self.scenario.requests):
            self._push(request.arrival_s, _Kind.ARRIVAL, ("", "", n))
        ticks = int(self.scenario.duration_s // TICK_S)
        for k in range(ticks):
            self._push(k * TICK_S, _Kind.TICK, ("", "", k))
        while self._events and self._events[0][0] < self.scenario.duration_s:
            time_s, kind, _, data = heapq.heappop(self._events)
            self.now_s = time_s
            self._handle(_Kind(kind), data)
        self.now_s = self.scenario.duration_s
        for inst in self.instances.values():
            self._close_weights(inst)
        self.metrics.oom_events = self.pool.oom_events
        return self.metrics

    def _deploy_catalogue(self) -> None:
        """At t = 0 place every model live from the start, largest footprint first.

        NOTE: largest-first is the usual knapsack order; placed on first demand instead, small
        models spread over the 80 GB cards and leave no room for the 34B ones (in both systems).
        """
        assert self.system is not None
        live = [m for m in self.scenario.models if m.traffic.active_from_s <= 0.0]
        live.sort(key=lambda m: (-footprint_of(m, self.config).estimated_bytes(1.0), m.name))
        for profile in live:
            self._last_place_s[profile.name] = self.now_s
            self.system.place(profile, profile.replicas)

    def _push(self, time_s: float, kind: _Kind, data: tuple[str, str, int]) -> None:
        self._seq += 1
        heapq.heappush(self._events, (time_s, int(kind), self._seq, data))

    def _handle(self, kind: _Kind, data: tuple[str, str, int]) -> None:
        iid, request_id, number = data
        if kind is _Kind.ARRIVAL:
            self._on_arrival(self.scenario.requests[number])
        elif kind is _Kind.FINISH:
            self._on_finish(iid, request_id, number)
        elif kind is _Kind.READY:
            inst = self.instances.get(iid)
            if inst is not None and inst.epoch == number:
                inst.ready_since_s = self.now_s
                self._try_start(inst)
        else:
            self._on_tick()

    # ---- events -------------------------------------------------------------------------------

    def _on_arrival(self, request: SimRequest) -> None:
        self.metrics.arrivals += 1
        self._arrivals[request.model_name].append(request.arrival_s)
        self._ensure_replicas(request.model_name)
        if self.instances_of(request.model_name):
            self._dispatch(request)
        else:
            self._pending[request.model_name].append(request)

    def _dispatch(self, request: SimRequest) -> None:
        assert self.system is not None
        choice = self.system.route(request, self.instances_of(request.model_name))
        if isinstance(choice, str):
            self.metrics.rejected[choice] += 1
            return
        if self.system.kv_at_admission and not self.allocate_kv(choice, request):
            self.system.on_release(choice, request.request_id)
            return
        choice.queue.append(request)
        choice.last_request_s = self.now_s
        self._try_start(choice)

    def _try_start(self, inst: Instance) -> None:
        """Start queued requests while the instance is ready and has batch room."""
        while inst.queue and inst.is_ready(self.now_s) and len(inst.running) < MAX_BATCH:
            request = inst.queue.popleft()
            if self.now_s - request.arrival_s > QUEUE_TIMEOUT_S:
                self._drop(inst, request.request_id)
                self.metrics.timed_out += 1
                continue
            if request.request_id not in inst.kv_bytes and not self.allocate_kv(inst, request):
                return  # OOM: the process crashed and reloads; the queue waits for it
            finish_s = self.now_s + self._service_s(inst, request)
            inst.running[request.request_id] = (request, self.now_s)
            self._push(finish_s, _Kind.FINISH, (inst.iid, request.request_id, inst.epoch))

    def _service_s(self, inst: Instance, request: SimRequest) -> float:
        sharing = sum(1 for i in self.instances_on(inst.gpu_uuid) if i.running or i is inst)
        context = request.prompt_tokens + request.output_tokens / 2
        per_token_s = inst.timing.decode_cycle_s(len(inst.running) + 1, context)
        solo_s = inst.timing.prefill_s(request.prompt_tokens) + request.output_tokens * per_token_s
        return solo_s * sharing

    def _on_finish(self, iid: str, request_id: str, epoch: int) -> None:
        inst = self.instances.get(iid)
        if inst is None or inst.epoch != epoch or request_id not in inst.running:
            return  # the instance crashed or was evicted meanwhile
        request, start_s = inst.running[request_id]
        m = self.metrics
        m.served_requests += 1
        m.served_tokens += request.total_tokens
        m.busy.setdefault(inst.gpu_uuid, []).append((start_s, self.now_s))
        m.kv_byte_s += inst.kv_for(request) * (self.now_s - start_s)
        m.latency_s.append(self.now_s - request.arrival_s)
        m.ttft_s.append(start_s + inst.timing.prefill_s(request.prompt_tokens) - request.arrival_s)
        self._drop(inst, request_id)
        self._try_start(inst)

    def _drop(self, inst: Instance, request_id: str) -> None:
        """Forget the request on the instance and give its memory back."""
        assert self.system is not None
        inst.running.pop(request_id, None)
        held = inst.kv_bytes.pop(request_id, 0)
        if held:
            self.pool.free(inst.gpu_uuid, held)
        self.system.on_release(inst, request_id)

    def _crash(self, gpu_uuid: str) -> None:
        """OOM: the GPU's process dies; requests holding KV fail; every model reloads in turn."""
        assert self.system is not None
        self.metrics.restarts += 1
        ready_s = self.now_s
        for inst in self.instances_on(gpu_uuid):
            lost = set(inst.kv_bytes)
            inst.queue = deque(r for r in inst.queue if r.request_id not in lost)
            for request_id in sorted(lost):
                self._drop(inst, request_id)
                self.metrics.failed_oom += 1
            self._close_weights(inst)
            self.system.on_unloaded(inst)
            inst.epoch += 1
            ready_s += inst.timing.weight_load_s()
            inst.ready_at_s = ready_s
            self.metrics.loads += 1
            self.system.on_loaded(inst)
            self._push(ready_s, _Kind.READY, (inst.iid, "", inst.epoch))
        self.restart_until_s[gpu_uuid] = ready_s

    def _close_weights(self, inst: Instance) -> None:
        if inst.ready_since_s is not None:
            self.metrics.weight_byte_s += inst.weight_bytes * (self.now_s - inst.ready_since_s)
            inst.ready_since_s = None

    def _ensure_replicas(self, model_name: str) -> None:
        """Ask the system for missing replicas (rate-limited per model)."""
        assert self.system is not None
        profile = self.profiles[model_name]
        missing = profile.replicas - len(self.instances_of(model_name))
        last = self._last_place_s.get(model_name)
        if missing <= 0 or (last is not None and self.now_s - last < PLACE_RETRY_S):
            return
        self._last_place_s[model_name] = self.now_s
        self.system.place(profile, missing)
        self._drain_pending(model_name)

    def _drain_pending(self, model_name: str) -> None:
        pending = self._pending[model_name]
        while pending and self.instances_of(model_name):
            self._dispatch(pending.popleft())

    def _on_tick(self) -> None:
        for model_name, pending in self._pending.items():
            while pending and self.now_s - pending[0].arrival_s > QUEUE_TIMEOUT_S:
                pending.popleft()
                self.metrics.timed_out += 1
            if pending:
                self._ensure_replicas(model_name)
        for inst in list(self.instances.values()):
            self._expire_queue(inst)
        report = dead_memory(self.snapshot(), self._footprints, self.placement)
        capacity = sum(g.total_memory_bytes for g in self.gpus.values())
        self.metrics.dead_frac_sum += report.dead_bytes / capacity
        self.metrics.dead_share_sum += report.dead_share
        self.metrics.dead_samples += 1

    def _expire_queue(self, inst: Instance) -> None:
        keep: deque[SimRequest] = deque()
        for request in inst.queue:
            if self.now_s - request.arrival_s > QUEUE_TIMEOUT_S:
                self._drop(inst, request.request_id)
                self.metrics.timed_out += 1
            else:
                keep.append(request)
        inst.queue = keep
