"""The discrete-event simulator every system runs in (simulated clock, no wall-clock reads).

Shared mechanics — identical for every system, so only placement, routing/admission, eviction
and the KV pool layout differ:

* **Physical memory** is the runtime's :class:`runtime.engine.simgpu.SimGpuPool` (the ledger the
  SimEngine allocates against). The engine below checks free memory before it takes any, so a
  refused allocation (an OOM event, counted by the pool) can only come from a model load that
  does not fit; such a load fails.
* **Instances**: one model loaded on one GPU, holding weights + the runtime's per-process
  overhead (``GearboxConfig.runtime_overhead_bytes``, as :class:`runtime.serving.ServingCore`
  commits it) and, for a system that preallocates one (vLLM-like), a private KV pool. Loading
  takes :meth:`ReplicaTiming.weight_load_s`.
* **The engine** (one per instance) is continuous batching with paged KV, as vLLM runs it:
  sequences wait FIFO; one is admitted (at most ``MAX_BATCH`` running) when its first KV blocks
  can be allocated and its prefill fits the step's token budget (``PREFILL_BUDGET_TOKENS``, as
  vLLM's scheduler caps a step's tokens; the step's first one whatever its length); each engine
  step decodes up to ``CHUNK_TOKENS`` tokens for every running sequence (fewer when one finishes
  sooner, so finishes are exact). **Admission knows nothing of the future** — it is the
  runtime's paging rule (:mod:`runtime.engine.paging`), the one the live engine applies: with
  ``KvAdmission.INCREMENTAL`` a sequence holds KV pages (``PAGE_TOKENS`` each) for the tokens it
  has so far plus one page and grows them before each step; with ``KvAdmission.MAX_TOKENS`` it
  reserves prompt + the client's stated ``max_tokens``. When a page cannot be had, the engine
  **preempts the youngest running sequence** (latest arrival; recompute: its KV is freed and it
  goes back to the head of the queue, keeping its generated tokens, and is prefilled again when
  resumed) until the page fits — never an OOM.
* **Step time** comes from the runtime's :class:`runtime.timing.ReplicaTiming` (gearbox's cost
  model) for the model on that GPU class: the prefill of newly admitted or resumed sequences
  (prompt + generated so far) plus ``tokens × decode_cycle_s(batch, mean context)``, times the
  number of instances on the GPU computing then (processes sharing a GPU time-slice it). A
  sequence arriving mid-step cuts the step at its next token, so it joins the batch then.
* **Telemetry**: the snapshot a system reads gives each GPU's free memory and its utilisation as
  NVML's busy fraction — the share of the last ``BUSY_WINDOW_S`` in which an engine step ran
  there, as the live stream reads it — so engines time-slicing a GPU read it busy.
* **Timeouts**: a sequence waiting (never admitted, or preempted and not resumed) longer than
  ``QUEUE_TIMEOUT_S`` gives up, as does a request no instance took for that long. A system may
  also give a queued request a deadline (:meth:`System.deadline_s`; ours: the runtime's TTFT
  deadline): with no first token by then it is refused ``ttft_deadline``, its KV freed.
* **Memory waits**: a system may answer a request with :class:`Wait` (ours, for a transient
  watermark refusal): it stays at the front end — holding back the model's later requests when
  ``Wait.blocks``, else letting them past — and is routed again whenever a sequence finishes
  (memory came free), on the model's arrivals and ticks, and at ``Wait.until_s``.
* **Replicas**: while a model has demand it wants ``ModelProfile.replicas`` instances; a system
  that places on demand is asked on arrivals and ticks, at most every ``PLACE_RETRY_S`` per model.
  Each tick the system may also scale a resident model's replicas (``System.on_tick``).
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
from runtime.admission import too_late_to_prefill
from runtime.engine.paging import KvAdmission, admission_tokens, paged, preemption_victim
from runtime.engine.simgpu import SimGpuPool
from runtime.timing import ReplicaTiming
from runtime.types import Reason

__all__ = ["Instance", "Seq", "Simulator", "System", "Wait", "footprint_of"]

TICK_S = 5.0  # sampling, timeout sweep and placement-retry period
MAX_BATCH = 32  # running sequences per instance (same engine setting for every system)
CHUNK_TOKENS = 32  # decode tokens per simulated engine step at most
QUEUE_TIMEOUT_S = 60.0  # a sequence waiting this long (unadmitted or preempted) gives up
# Prompt tokens one step prefills at most (vLLM's scheduler token budget,
# ``max_num_batched_tokens``: 8,192 by default for its OpenAI server on 80 GB-class GPUs). The
# step's first sequence is taken whatever its length: prompts are not chunked here.
PREFILL_BUDGET_TOKENS = 8192
PLACE_RETRY_S = 5.0  # placement attempts per model at most this often
GAP_WINDOW = 20  # arrivals in the mean-gap estimate handed to eviction
# NOTE: the live stream reads a GPU's utilisation as NVML's busy fraction (time a kernel ran over
# its last sample period, at most 1 s), so a GPU time-sliced by several engines reads busy
BUSY_WINDOW_S = 1.0


class _Kind(IntEnum):
    """Event order at equal times: free memory first, then loads, arrivals, the tick, the end of
    a memory wait, a TTFT deadline."""

    STEP_END = 0
    READY = 1
    ARRIVAL = 2
    TICK = 3
    WAIT_END = 4
    DEADLINE = 5


@dataclass(frozen=True, slots=True)
class Wait:
    """A system's answer to a request that waits at the front end for memory."""

    until_s: float  # it is routed again then at the latest (and refused, if still no room)
    blocks: bool  # the model's later requests wait behind it (else they are routed past it)


@dataclass
class Seq:
    """One request inside an engine."""

    request: SimRequest
    waiting_since_s: float  # arrival at the engine, or the last preemption
    generated: int = 0
    kv_tokens: int = 0  # tokens with KV blocks held (a multiple of PAGE_TOKENS)
    prefilled: bool = False  # False when (re)admitted: its context is computed again
    first_token_s: float | None = None
    preemptions: int = 0
    spans: list[tuple[float, float]] = field(default_factory=list)  # engine steps it ran in
    kv_byte_s: float = 0.0  # ∫ KV bytes held while running
    computed: bool = False  # ran a step: a later prefill of it recomputes thrown-away KV
    useful_gpu_s: float = 0.0  # its first prefill + its share of the decode cycles it ran in
    deadline_s: float | None = None  # refused if it has no first token by then (None: never)

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self.request.request_id

    @property
    def context(self) -> int:
        """Tokens whose KV the sequence needs now (prompt + generated)."""
        return self.request.prompt_tokens + self.generated

    @property
    def remaining(self) -> int:
        """Tokens still to generate (known to the simulator only, never to admission)."""
        return self.request.output_tokens - self.generated


def _age(seq: Seq) -> tuple[float, str]:
    return (seq.request.arrival_s, seq.request_id)


@dataclass
class _Step:
    """One engine step: prefill of (re)admitted sequences, then ``tokens`` decode cycles."""

    start_s: float
    tokens: int
    prefill_s: float  # of the whole step, before sharing
    cycle_s: float  # one decode cycle, before sharing
    sharing: int  # instances time-slicing the GPU when it started
    end_s: float
    first_prefill_s: dict[str, float] = field(default_factory=dict)  # seq → its first prefill
    recompute_s: float = 0.0  # prefill of preempted sequences' context, computed before

    def token_end_s(self, k: int) -> float:
        """When the step's ``k``-th decode token is out."""
        return self.start_s + (self.prefill_s + k * self.cycle_s) * self.sharing


@dataclass
class Instance:
    """One model loaded on one GPU, with its engine."""

    iid: str
    serial: int  # unique per load, so events of an evicted instance are ignored
    profile: ModelProfile
    gpu_uuid: str
    timing: ReplicaTiming
    weight_bytes: int  # weights + per-process runtime overhead
    ready_at_s: float
    kv_pool_bytes: int | None = None  # a private, preallocated KV pool; None: the GPU's free memory
    running: dict[str, Seq] = field(default_factory=dict)
    waiting: deque[Seq] = field(default_factory=deque)
    kv_bytes: int = 0  # KV blocks held by running sequences
    step: _Step | None = None  # the engine step in flight
    last_request_s: float = 0.0
    ready_since_s: float | None = None  # for the weight-memory integral

    @property
    def active(self) -> int:
        """Requests running or waiting here."""
        return len(self.running) + len(self.waiting)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token of context takes."""
        return self.profile.spec.kv_bytes_per_token

    @property
    def kv_capacity_tokens(self) -> int:
        """The most context one sequence can ever hold here (the engine's max model length)."""
        if self.kv_pool_bytes is not None:
            return self.kv_pool_bytes // self.kv_bytes_per_token
        return self.timing.kv_capacity_tokens

    def is_ready(self, now_s: float) -> bool:
        """Loaded and serving."""
        return now_s >= self.ready_at_s


class System(Protocol):
    """What differs between the compared systems."""

    name: str

    def deploy(self, models: Sequence[ModelProfile]) -> None:
        """At t = 0: load what the system starts with (``models``: the whole catalogue)."""
        ...

    def place(self, profile: ModelProfile, count: int) -> None:
        """A model with demand lacks ``count`` instances: load some, or leave it waiting."""
        ...

    def route(self, request: SimRequest) -> Instance | str | Wait | None:
        """The instance to queue the request at, a rejection reason, a wait for memory, or None
        (no instance yet)."""
        ...

    def deadline_s(self, request: SimRequest, instance: Instance) -> float | None:
        """When the request, just queued at ``instance``, is refused if it has no first token
        yet (None: never)."""
        ...

    def on_refused(self, request: SimRequest, reason: str) -> None:
        """A request queued at an instance was refused there later (its deadline passed)."""
        ...

    def on_finished(self, request: SimRequest) -> None:
        """A request completed (its answer's length is known now)."""
        ...

    def on_loaded(self, instance: Instance) -> bool:
        """An instance's memory was allocated; False refuses the load."""
        ...

    def on_unloaded(self, instance: Instance) -> None:
        """An instance's memory was freed (eviction)."""
        ...

    def on_tick(self) -> None:
        """Every ``TICK_S``, after the timeouts and before the engines step: scale replicas."""
        ...

    def on_idle(self, instance: Instance) -> None:
        """The instance's last sequence finished and nothing waits there (it may be unloaded)."""
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
    """One run of one system over a scenario."""

    def __init__(
        self,
        scenario: Scenario,
        placement: PlacementConfig,
        admission: KvAdmission = KvAdmission.INCREMENTAL,
        config: GearboxConfig | None = None,
    ) -> None:
        self.scenario = scenario
        self.placement = placement
        self.admission = admission
        self.config = config or GearboxConfig()
        self.metrics = Metrics()
        self.now_s = 0.0
        self.pool = SimGpuPool()
        self.gpus = {g.uuid: g for g in scenario.cluster.gpus}
        for gpu in scenario.cluster.gpus:
            self.pool.ensure(gpu.uuid, gpu.total_memory_bytes)
        self.profiles = {m.name: m for m in scenario.models}
        self.instances: dict[str, Instance] = {}
        self.system: System | None = None
        self._pending: dict[str, deque[SimRequest]] = {m: deque() for m in self.profiles}
        self._arrivals: dict[str, deque[float]] = {
            m: deque(maxlen=GAP_WINDOW) for m in self.profiles
        }
        self._window_arrivals: dict[str, deque[float]] = {m: deque() for m in self.profiles}
        self._last_place_s: dict[str, float] = {}
        self._timings: dict[tuple[str, str], ReplicaTiming] = {}
        self._events: list[tuple[float, int, int, tuple[str, int]]] = []
        self._seq = 0
        self._serial = 0
        self._footprints = tuple(footprint_of(m, self.config) for m in scenario.models)
        self._memory_waits: set[str] = set()  # models with a request waiting for memory
        self._wait_ends: set[tuple[str, float]] = set()  # (model, until_s) events pushed
        # per GPU, the spans of engine steps that ended within the last BUSY_WINDOW_S
        self._busy_spans: dict[str, deque[tuple[float, float]]] = {g: deque() for g in self.gpus}

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

    def pending(self, model_name: str) -> int:
        """Requests for the model that no instance has taken yet."""
        return len(self._pending[model_name])

    def free_bytes(self, gpu_uuid: str) -> int:
        """Physical memory not allocated on the GPU."""
        return self.pool.total_bytes(gpu_uuid) - self.pool.used_bytes(gpu_uuid)

    def reservation_tokens(self, request: SimRequest) -> int:
        """Tokens of KV a request is admitted with, from what the client states only."""
        return admission_tokens(self.admission, request.prompt_tokens, 0, request.max_tokens)

    def mean_gap_s(self, model_name: str) -> float:
        """Mean gap over the last arrivals, the open gap since the last one included.

        NOTE: the open gap makes a model that fell silent look as cold as it is; an all-time
        mean would keep a once-busy model "due any second" forever and never evictable.
        """
        times = self._arrivals[model_name]
        if not times:
            return self.scenario.duration_s
        return (self.now_s - times[0]) / len(times)

    def arrivals_since(self, model_name: str, since_s: float) -> int:
        """Requests for the model that arrived since ``since_s``, whatever became of them (as
        the runtime's serving window counts a request held for a load). Forgets older ones:
        ``since_s`` must not go back."""
        times = self._window_arrivals[model_name]
        while times and times[0] < since_s:
            times.popleft()
        return len(times)

    def snapshot(self, exclude: frozenset[str] = frozenset()) -> TopologySnapshot:
        """The cluster as telemetry would report it now (``exclude``: marked unschedulable)."""
        gpus = []
        for gpu in self.gpus.values():
            gpus.append(
                dataclasses.replace(
                    gpu,
                    free_memory_bytes=self.free_bytes(gpu.uuid),
                    utilisation=self.busy_fraction(gpu.uuid),
                    schedulable=gpu.uuid not in exclude,
                    last_seen_s=self.now_s,
                )
            )
        return dataclasses.replace(self.scenario.cluster, now_s=self.now_s, gpus=tuple(gpus))

    def busy_fraction(self, gpu_uuid: str) -> float:
        """Share of the last ``BUSY_WINDOW_S`` in which an engine step ran on the GPU (NVML's
        utilisation, as the live stream reads it; time-sliced engines count once)."""
        low_s = self.now_s - BUSY_WINDOW_S
        running = [(i.step.start_s, self.now_s) for i in self.instances_on(gpu_uuid) if i.step]
        busy_s, reach_s = 0.0, low_s
        for start_s, end_s in sorted([*self._recent_spans(gpu_uuid), *running]):
            start_s = max(start_s, reach_s)
            if end_s > start_s:
                busy_s += end_s - start_s
                reach_s = end_s
        return min(1.0, busy_s / BUSY_WINDOW_S)

    def _recent_spans(self, gpu_uuid: str) -> deque[tuple[float, float]]:
        """The GPU's ended step spans that reach into the last ``BUSY_WINDOW_S``: older ones are
        dropped here, on every step's end too, so a system that never reads a snapshot (the
        baselines) does not keep every step of the run."""
        spans = self._busy_spans[gpu_uuid]
        while spans and spans[0][1] <= self.now_s - BUSY_WINDOW_S:
            spans.popleft()
        return spans

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

    def load(
        self, profile: ModelProfile, gpu_uuid: str, kv_pool_bytes: int | None = None
    ) -> Instance | None:
        """Allocate weights (+ a private KV pool) and start loading; None if memory refuses."""
        assert self.system is not None
        weight_bytes = profile.spec.weight_bytes + self.config.runtime_overhead_bytes
        if not self.pool.allocate(gpu_uuid, weight_bytes + (kv_pool_bytes or 0)):
            self.metrics.failed_loads += 1  # an OOM at start-up: the pool counted the event
            return None
        timing = self.timing(profile, gpu_uuid)
        self._serial += 1
        iid = f"{profile.name}@{gpu_uuid}"
        ready_s = self.now_s + timing.weight_load_s()
        self.metrics.load_gpu_s += timing.weight_load_s()
        inst = Instance(iid, self._serial, profile, gpu_uuid, timing, weight_bytes, ready_s)
        inst.kv_pool_bytes = kv_pool_bytes
        inst.last_request_s = self.now_s
        if not self.system.on_loaded(inst):
            self.pool.free(gpu_uuid, weight_bytes + (kv_pool_bytes or 0))
            return None
        self.instances[iid] = inst
        self.metrics.loads += 1
        self._push(ready_s, _Kind.READY, (iid, inst.serial))
        return inst

    def evict(self, inst: Instance) -> None:
        """Unload an instance; anything it still holds fails (and is counted)."""
        assert self.system is not None
        last_of_model = len(self.instances_of(inst.profile.name)) == 1
        if inst.active or (last_of_model and self._pending[inst.profile.name]):
            self.metrics.evicted_with_active += 1
        self.metrics.evictions += 1
        for seq in [*inst.running.values(), *inst.waiting]:
            self._free_kv(inst, seq)
            self.metrics.failed_evicted += 1
        inst.running.clear()
        inst.waiting.clear()
        self._close_weights(inst)
        self.pool.free(inst.gpu_uuid, inst.weight_bytes + (inst.kv_pool_bytes or 0))
        self.system.on_unloaded(inst)
        del self.instances[inst.iid]
        # NOTE: no kick here: an eviction makes room for a load that follows at once, and
        # engines growing KV into the room first would make that load fail (the tick kicks).

    # ---- the run ------------------------------------------------------------------------------

    def run(self, system: System) -> Metrics:
        """Replay the scenario's requests through ``system`` until ``duration_s``."""
        self.system = system
        for profile in self.scenario.models:
            self._last_place_s[profile.name] = 0.0
        system.deploy(self.scenario.models)
        for n, request in enumerate(self.scenario.requests):
            self._push(request.arrival_s, _Kind.ARRIVAL, ("", n))
        ticks = int(self.scenario.duration_s // TICK_S)
        for k in range(ticks):
            self._push(k * TICK_S, _Kind.TICK, ("", k))
        while self._events and self._events[0][0] < self.scenario.duration_s:
            time_s, kind, _, data = heapq.heappop(self._events)
            self.now_s = time_s
            self._handle(_Kind(kind), data)
        self.now_s = self.scenario.duration_s
        for inst in self.instances.values():
            self._close_weights(inst)
            self.metrics.unfinished += inst.active
        self.metrics.unfinished += sum(len(p) for p in self._pending.values())
        self.metrics.oom_events = self.pool.oom_events
        return self.metrics

    def _push(self, time_s: float, kind: _Kind, data: tuple[str, int]) -> None:
        self._seq += 1
        heapq.heappush(self._events, (time_s, int(kind), self._seq, data))

    def _handle(self, kind: _Kind, data: tuple[str, int]) -> None:
        iid, number = data
        if kind is _Kind.ARRIVAL:
            self._on_arrival(self.scenario.requests[number])
            return
        if kind is _Kind.TICK:
            self._on_tick()
            return
        if kind is _Kind.WAIT_END:
            self._wait_ends.discard((iid, self.now_s))
            self._drain_pending(iid)
            return
        inst = self.instances.get(iid)
        if inst is None or inst.serial != number:
            return  # evicted meanwhile
        if kind is _Kind.READY:
            inst.ready_since_s = self.now_s
            self._step(inst)
        elif kind is _Kind.DEADLINE:
            self._refuse_late(inst)
        elif inst.step is not None and inst.step.end_s == self.now_s:
            self._on_step_end(inst)  # (a step cut short left its first end event stale)

    # ---- front end ----------------------------------------------------------------------------

    def _on_arrival(self, request: SimRequest) -> None:
        self.metrics.arrivals += 1
        self._arrivals[request.model_name].append(request.arrival_s)
        self._window_arrivals[request.model_name].append(request.arrival_s)
        self._pending[request.model_name].append(request)
        self._ensure_replicas(request.model_name)
        self._drain_pending(request.model_name)

    def _drain_pending(self, model_name: str) -> None:
        assert self.system is not None
        pending = self._pending[model_name]
        passed: list[SimRequest] = []  # waiting for memory, not holding the others back
        waited = False
        while pending:
            choice = self.system.route(pending[0])
            if choice is None:
                break  # no instance to take it yet: it waits in the front end
            if isinstance(choice, Wait):
                waited = True
                self._wait(model_name, choice.until_s)
                if choice.blocks:
                    break
                passed.append(pending.popleft())
                continue
            request = pending.popleft()
            if isinstance(choice, str):
                self.metrics.rejected[choice] += 1
                continue
            deadline_s = self.system.deadline_s(request, choice)
            choice.waiting.append(Seq(request, self.now_s, deadline_s=deadline_s))
            if deadline_s is not None:
                self._push(max(deadline_s, self.now_s), _Kind.DEADLINE, (choice.iid, choice.serial))
            choice.last_request_s = self.now_s
            self._cut_step(choice)
            self._step(choice)
        pending.extendleft(reversed(passed))
        if waited:
            self._memory_waits.add(model_name)
        else:
            self._memory_waits.discard(model_name)

    def _wait(self, model_name: str, until_s: float) -> None:
        """A request of the model waits for memory until ``until_s``: route it again then."""
        if (model_name, until_s) not in self._wait_ends:
            self._wait_ends.add((model_name, until_s))
            self._push(until_s, _Kind.WAIT_END, (model_name, 0))

    def _retry_waits(self) -> None:
        """Memory came free: route the requests waiting for it again."""
        for model_name in sorted(self._memory_waits):
            self._drain_pending(model_name)

    def _ensure_replicas(self, model_name: str) -> None:
        """Ask the system for missing replicas (rate-limited per model)."""
        assert self.system is not None
        profile = self.profiles[model_name]
        missing = profile.replicas - len(self.instances_of(model_name))
        if missing <= 0 or self.now_s - self._last_place_s[model_name] < PLACE_RETRY_S:
            return
        self._last_place_s[model_name] = self.now_s
        self.system.place(profile, missing)

    def _on_tick(self) -> None:
        assert self.system is not None
        for model_name, pending in self._pending.items():
            while pending and self.now_s - pending[0].arrival_s > QUEUE_TIMEOUT_S:
                pending.popleft()
                self.metrics.timed_out += 1
            if pending:
                self._ensure_replicas(model_name)
                self._drain_pending(model_name)
        self.system.on_tick()
        for inst in list(self.instances.values()):
            self._expire_waiting(inst)
            self._step(inst)
        report = dead_memory(self.snapshot(), self._footprints, self.placement)
        capacity = sum(g.total_memory_bytes for g in self.gpus.values())
        self.metrics.dead_frac_sum += report.dead_bytes / capacity
        self.metrics.dead_share_sum += report.dead_share
        self.metrics.dead_samples += 1

    def _expire_waiting(self, inst: Instance) -> None:
        keep: deque[Seq] = deque()
        for seq in inst.waiting:
            if self.now_s - seq.waiting_since_s > QUEUE_TIMEOUT_S:
                self.metrics.timed_out += 1
            else:
                keep.append(seq)
        inst.waiting = keep

    # ---- the engine ---------------------------------------------------------------------------

    def _grow(self, inst: Instance, seq: Seq, tokens: int) -> bool:
        """Hold KV blocks for ``tokens`` tokens of the sequence; False when memory has none."""
        blocks = paged(tokens)
        need = (blocks - seq.kv_tokens) * inst.kv_bytes_per_token
        if need <= 0:
            return True
        if inst.kv_pool_bytes is not None:
            if inst.kv_bytes + need > inst.kv_pool_bytes:
                return False
        elif self.free_bytes(inst.gpu_uuid) < need or not self.pool.allocate(inst.gpu_uuid, need):
            return False
        seq.kv_tokens = blocks
        inst.kv_bytes += need
        return True

    def _free_kv(self, inst: Instance, seq: Seq) -> None:
        held = seq.kv_tokens * inst.kv_bytes_per_token
        seq.kv_tokens = 0
        inst.kv_bytes -= held
        if inst.kv_pool_bytes is None and held:
            self.pool.free(inst.gpu_uuid, held)

    def _preempt(self, inst: Instance, seq: Seq) -> None:
        """Recompute preemption: free the sequence's KV and queue it first to resume."""
        self._free_kv(inst, seq)
        del inst.running[seq.request_id]
        seq.prefilled = False
        seq.preemptions += 1
        seq.waiting_since_s = self.now_s
        self.metrics.preemptions += 1
        inst.waiting.appendleft(seq)

    def _admit(self, inst: Instance) -> None:
        """Admit waiting sequences, FIFO, while their first blocks can be had and their
        prefills fit the step's token budget (``PREFILL_BUDGET_TOKENS``; one at least). A new
        sequence whose first token the step could not give by its deadline is refused
        unprefilled, as the runtime's engine drops it (``runtime.admission.too_late_to_prefill``
        after the step's earlier prefills)."""
        unfilled = [s.context for s in inst.running.values() if not s.prefilled]
        prefill = sum(unfilled)
        start_s = self.now_s + sum(inst.timing.prefill_s(n) for n in unfilled)
        while inst.waiting and len(inst.running) < MAX_BATCH:
            seq = inst.waiting[0]
            if self.now_s - seq.waiting_since_s > QUEUE_TIMEOUT_S:
                inst.waiting.popleft()
                self.metrics.timed_out += 1
                continue
            if prefill and prefill + seq.context > PREFILL_BUDGET_TOKENS:
                return  # the next step takes it: a step's prefill delays every first token
            request = seq.request
            if seq.first_token_s is None and too_late_to_prefill(
                start_s, seq.deadline_s, inst.timing, seq.context
            ):
                inst.waiting.popleft()  # the runtime's engine drops it unprefilled (expired)
                self._refused_deadline([seq])
                continue
            target = admission_tokens(
                self.admission, request.prompt_tokens, seq.generated, request.max_tokens
            )
            if not self._grow(inst, seq, target):
                return  # head-of-line waits for memory, as vLLM's FCFS scheduler does
            inst.waiting.popleft()
            inst.running[seq.request_id] = seq
            prefill += seq.context
            start_s += inst.timing.prefill_s(seq.context)

    def _step(self, inst: Instance) -> None:
        """Start an engine step if the instance is idle, ready and has work."""
        if inst.step is not None or not inst.is_ready(self.now_s):
            return
        had_work = inst.active > 0
        self._admit(inst)
        if not inst.running:
            if had_work and not inst.active and self.system is not None:
                self.system.on_idle(inst)  # its queue was refused or timed out unprefilled
            return
        tokens = min(CHUNK_TOKENS, min(s.remaining for s in inst.running.values()))
        for seq in sorted(inst.running.values(), key=_age):
            if seq.request_id not in inst.running:
                continue  # preempted for an older sequence in this loop
            while not self._grow(inst, seq, seq.context + tokens):
                victim = preemption_victim(inst.running.values(), _age)
                self._preempt(inst, victim)
                if victim is seq:
                    break
        if not inst.running:
            return  # everything preempted: it resumes when memory frees on the GPU
        batch = list(inst.running.values())
        prefills = {
            s.request_id: inst.timing.prefill_s(s.context) for s in batch if not s.prefilled
        }
        prefill_s = sum(prefills.values())
        mean_context = sum(s.context for s in batch) / len(batch) + tokens / 2
        cycle_s = inst.timing.decode_cycle_s(len(batch), mean_context)
        sharing = sum(1 for i in self.instances_on(inst.gpu_uuid) if i.step or i is inst)
        for seq in batch:
            if seq.first_token_s is None:
                seq.first_token_s = self.now_s + (prefill_s + cycle_s) * sharing
        step = _Step(self.now_s, tokens, prefill_s, cycle_s, sharing, 0.0)
        for seq in batch:
            if seq.request_id in prefills:
                if seq.computed:
                    step.recompute_s += prefills[seq.request_id]
                else:
                    step.first_prefill_s[seq.request_id] = prefills[seq.request_id]
        step.end_s = step.token_end_s(tokens)
        inst.step = step
        self._push(step.end_s, _Kind.STEP_END, (inst.iid, inst.serial))

    def _cut_step(self, inst: Instance) -> None:
        """End the step in flight at its next token, so a new sequence joins the batch then.

        NOTE: a real engine schedules every decode iteration; simulating ``CHUNK_TOKENS`` per
        event would otherwise hold a new arrival back for up to a whole chunk.
        """
        step = inst.step
        if step is None or step.cycle_s <= 0:
            return
        elapsed = (self.now_s - step.start_s) / step.sharing - step.prefill_s
        k = max(1, -int(-elapsed // step.cycle_s))  # the first token out at or after now
        if k >= step.tokens:
            return
        step.tokens = k
        step.end_s = max(self.now_s, step.token_end_s(k))  # never before now (rounding)
        self._push(step.end_s, _Kind.STEP_END, (inst.iid, inst.serial))

    def _on_step_end(self, inst: Instance) -> None:
        step = inst.step
        assert step is not None
        start_s, tokens = step.start_s, step.tokens
        inst.step = None
        self._recent_spans(inst.gpu_uuid).append((start_s, self.now_s))
        finished = False
        decode_gpu_s = tokens * step.cycle_s  # GPU time, before time-slicing stretched it
        self.metrics.step_gpu_s += step.prefill_s + decode_gpu_s
        self.metrics.recompute_gpu_s += step.recompute_s
        share_s = decode_gpu_s / max(1, len(inst.running))
        for seq in list(inst.running.values()):
            seq.useful_gpu_s += step.first_prefill_s.get(seq.request_id, 0.0) + share_s
            seq.computed = True
            seq.kv_byte_s += seq.kv_tokens * inst.kv_bytes_per_token * (self.now_s - start_s)
            seq.generated += tokens
            seq.prefilled = True
            seq.spans.append((start_s, self.now_s))
            if seq.remaining <= 0:
                self._finish(inst, seq)
                finished = True
        self._step(inst)
        if finished and not inst.active and self.system is not None:
            self.system.on_idle(inst)
        if finished:
            self._kick(inst.gpu_uuid)
            if self._memory_waits:
                self._retry_waits()

    def _finish(self, inst: Instance, seq: Seq) -> None:
        request = seq.request
        m = self.metrics
        m.served_requests += 1
        m.served_tokens += request.prompt_tokens + request.output_tokens
        m.busy.setdefault(inst.gpu_uuid, []).extend(seq.spans)
        m.useful_gpu_s += seq.useful_gpu_s
        m.kv_byte_s += seq.kv_byte_s
        assert seq.first_token_s is not None
        ttft_s = seq.first_token_s - request.arrival_s
        tbt_s = (self.now_s - seq.first_token_s) / max(1, request.output_tokens - 1)
        m.latency_s.append(self.now_s - request.arrival_s)
        m.ttft_s.append(ttft_s)
        m.tbt_s.append(tbt_s)
        if ttft_s * 1000 <= self.config.ttft_slo_ms and tbt_s * 1000 <= self.config.tbt_slo_ms:
            m.goodput_requests += 1
            m.goodput_tokens += request.prompt_tokens + request.output_tokens
        self._free_kv(inst, seq)
        del inst.running[seq.request_id]
        assert self.system is not None
        self.system.on_finished(request)

    def _refuse_late(self, inst: Instance) -> None:
        """Refuse (``ttft_deadline``) the instance's sequences past their deadline without a
        first token, waiting or in the step in flight, as the runtime's serving core does; their
        KV goes back at once (the step in flight keeps its length)."""
        now_s = self.now_s

        def late(seq: Seq) -> bool:
            return (
                seq.deadline_s is not None
                and seq.deadline_s <= now_s
                and (seq.first_token_s is None or seq.first_token_s > now_s)
            )

        gone = [s for s in inst.waiting if late(s)]
        if gone:
            inst.waiting = deque(s for s in inst.waiting if not late(s))
        for seq in [s for s in inst.running.values() if late(s)]:
            self._free_kv(inst, seq)
            del inst.running[seq.request_id]
            gone.append(seq)
        if not gone:
            return
        self._refused_deadline(gone)
        self._kick(inst.gpu_uuid)
        if not inst.active and self.system is not None:
            self.system.on_idle(inst)
        if self._memory_waits:
            self._retry_waits()

    def _refused_deadline(self, gone: list[Seq]) -> None:
        assert self.system is not None
        self.metrics.rejected[Reason.TTFT_DEADLINE.value] += len(gone)
        for seq in gone:
            self.system.on_refused(seq.request, Reason.TTFT_DEADLINE.value)

    def _kick(self, gpu_uuid: str) -> None:
        """Memory came free on the GPU: idle engines with waiting sequences try again."""
        for inst in self.instances_on(gpu_uuid):
            if inst.step is None and inst.waiting:
                self._step(inst)

    def _close_weights(self, inst: Instance) -> None:
        if inst.ready_since_s is not None:
            self.metrics.weight_byte_s += inst.weight_bytes * (self.now_s - inst.ready_since_s)
            inst.ready_since_s = None
