"""Multi-model placement: filter → score → anti-affinity, else queue with eviction proposals.

* Filter (hard): the GPU is live; ``free >= estimated`` with ``estimated = model_size + overhead
  + k × batch × seq_len × kv_bytes_per_token`` (k = ``memory_k``, 1.3 by default; the overhead
  is a replica's runtime memory beside its weights, 0 unless given; weights and overhead are not
  counted again on a GPU that already holds the model); the fill after placing stays under the
  pre-OOM ``oom_watermark``; fewer than ``max_models_per_gpu`` resident models (concurrency cap).
* Score (soft): ``weight_affinity × holds-the-model + weight_free_memory × free-after / total +
  weight_utilisation × (1 − utilisation)`` (0.5 / 0.3 / 0.2 by default).
* Strategy (``PlacementConfig.strategy``): ``spread`` takes the best score; ``pack`` the best
  fit — the feasible GPU left with the least room under the watermark, so a small model fills
  a partly used or small GPU before it opens a big empty one a big model may need.
* Anti-affinity: replicas go to distinct GPUs, and to nodes not yet used while any feasible GPU
  remains on one — fault tolerance outranks score and fit.
* Nothing fits: queue, naming the rule that rejected most GPUs, and propose evictions of models
  not in transition (loading, or already promised for eviction); of models with active or
  queued requests only by the drain and displace rules, which never cut a request:

  - **extra replica** (first of all): a replica of a model that keeps another serving one, idle
    (no request routed to it) for at least ``eviction_reload_factor`` × its reload — the same
    minimum residence as the queue rule, so a scale-out is not given back at once. Its loss is
    nil: its model still serves. Never a model's last replica;
  - **cold** (the article's rule, least recently used first): idle past ``cold_after_s``, and
    the expected time to its next request exceeds its reload × ``eviction_reload_factor``;
  - **drain** (only for a model with no replica that requests wait for, when no extra replica
    or cold model makes room): an extra replica *in use*, its model keeping another serving one.
    It is given back by a drain — it takes no new request, finishes what it holds, then goes —
    so no request fails; its model loses one replica's share of its requests (its rate / its
    replicas), which the waiting model's demand rate must outweigh by
    ``eviction_reload_factor`` (below). Never a last replica;
  - **queue** (only when no cold model makes room, and only for a placement that requests are
    already waiting for, its :class:`Backlog`): an idle model may go before it is cold when
    what waits outweighs what evicting it costs, by the same margin. Over the victim's reload
    time ``R`` (the horizon its comeback is delayed by), the waiting model's demand is its
    queued requests + its arrival rate × ``R``; the victim's is the request that finds it gone
    + ``R`` / its mean gap, the ones that would wait out its reload. Several victims on one GPU:
    their costs add up, the horizon is the longest reload. A model with no replica counts its
    arrivals over its ``Backlog.wait_horizon_s`` (the load window) when that is longer: until
    it loads, every request for it waits, not only those of a reload.
    Hysteresis: a model idle for less than ``eviction_reload_factor`` × its reload is never
    evicted by this rule. It was loaded for a request, so it has been resident at least that
    long, its load paid back that many times over, and two models short of memory take turns
    at most once per that time each, spending at most 1 / (factor + 1) of the GPU on loads.

  - **displace** (last of all, ``displace_in_use``, on by default): a model's last replica *in
    use*, for a placement requests wait for. Its eviction waits for an idle moment — no request
    running, queued or held for it (the runtime's prepare waits up to ``drain_timeout_s``; it
    keeps serving meanwhile, and if it is never idle the eviction is rolled back) — so no
    request is cut; its later requests wait for its reload elsewhere. It costs its request rate
    for as long as it finds no room again, so the waiting model's arrival rate (scaling out: its
    unmet rate) must exceed the rate of every replica taken in use by ``eviction_reload_factor``,
    and its demand over the queue rule's horizon (waiting and expected) must exceed one request
    per displaced model (the one that finds it gone) by the same margin.
    With a margin above 1 two models cannot take a GPU from each other at the same rates.
    Hysteresis: a model whose replica set changed less than ``eviction_reload_factor`` × its
    reload ago is never displaced (a model just loaded, or just reloaded after a displacement).

  The next request is expected one mean gap after the last while the model is on schedule, and
  one mean gap from now once it is overdue. Among GPUs, a plan with fewer displaced models wins,
  then fewer queue evictions (cold models go first), then fewer last replicas (extra replicas
  go first), then fewer evictions, then fewer bytes freed.
* Fragmentation: "dead memory" is free memory on GPUs whose free space is below every model's
  minimum footprint — free, but of no use to any model.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from gearbox.config import PlacementConfig, PlacementStrategy
from gearbox.model import ModelSpec
from gearbox.serde import Serialisable
from gearbox.types import Gpu, TopologySnapshot

__all__ = [
    "Backlog",
    "EvictionProposal",
    "EvictionRule",
    "FragmentationReport",
    "GpuVerdict",
    "ModelFootprint",
    "PlacementDecision",
    "PlacementReason",
    "PlacementStatus",
    "ResidentModel",
    "dead_memory",
    "place_model",
]


class PlacementStatus(StrEnum):
    """Outcome of a placement request."""

    PLACED = "placed"
    QUEUED = "queued"


class PlacementReason(StrEnum):
    """Why a GPU was rejected or a request ended as it did."""

    PLACED = "placed"  # all requested replicas placed
    PLACED_PARTIAL = "placed_partial"  # fewer feasible GPUs than requested replicas
    GPU_NOT_LIVE = "gpu_not_live"  # unhealthy, unschedulable or silent
    INSUFFICIENT_MEMORY = "insufficient_memory"  # free < estimated
    OOM_WATERMARK = "oom_watermark"  # would cross the pre-OOM fill watermark
    CONCURRENCY_CAP = "concurrency_cap"  # too many resident models
    NO_LIVE_GPU = "no_live_gpu"  # nothing to place on at all


@dataclass(frozen=True, slots=True)
class ModelFootprint(Serialisable):
    """A model to place and the batch it must serve."""

    model_name: str
    model_bytes: int  # weights
    kv_bytes_per_token: int
    batch_size: int
    seq_len_tokens: int
    num_replicas: int = 1
    # held by each replica beside its weights (CUDA context, activations): counts once per model
    # on a GPU, so it matters when models share one
    overhead_bytes: int = 0

    @classmethod
    def from_spec(
        cls,
        spec: ModelSpec,
        batch_size: int,
        seq_len_tokens: int,
        num_replicas: int = 1,
        overhead_bytes: int = 0,
    ) -> ModelFootprint:
        """Footprint of a :class:`ModelSpec`."""
        return cls(
            spec.name,
            spec.weight_bytes,
            spec.kv_bytes_per_token,
            batch_size,
            seq_len_tokens,
            num_replicas,
            overhead_bytes,
        )

    def estimated_bytes(self, memory_k: float, *, resident: bool = False) -> int:
        """``model_size + overhead + k × batch × seq_len × kv_bytes_per_token`` (no weights
        or overhead if resident)."""
        kv = memory_k * self.batch_size * self.seq_len_tokens * self.kv_bytes_per_token
        return int(kv) + (0 if resident else self.model_bytes + self.overhead_bytes)


@dataclass(frozen=True, slots=True)
class ResidentModel(Serialisable):
    """A model instance loaded on one GPU."""

    model_name: str
    gpu_uuid: str
    memory_bytes: int
    active_requests: int
    last_request_s: float
    mean_interarrival_s: float  # mean gap between its requests
    reload_s: float  # time to load it again after an eviction
    queued_requests: int = 0  # requests waiting for it (its queue, or a front end holding them)
    in_transition: bool = False  # loading, or already promised for eviction: never proposed
    steady_s: float = math.inf  # since its model's replica set last changed


@dataclass(frozen=True, slots=True)
class Backlog(Serialisable):
    """Requests already waiting for a placement: what evicting an idle model before it is cold
    would unblock."""

    waiting_requests: int  # queued, or held at the front end, for the model to place
    arrival_rps: float = 0.0  # its expected arrival rate
    first_replica: bool = False  # the model has no replica: its requests wait for this one
    # a first replica's demand counts over at least this long: until it loads, every request
    # for it waits (and is refused past the front end's deadline), not only those of a reload
    wait_horizon_s: float = 0.0

    def demand_over(self, horizon_s: float) -> float:
        """Requests for the model waiting now plus those expected within ``horizon_s``."""
        return self.waiting_requests + self.arrival_rps * horizon_s


class EvictionRule(StrEnum):
    """Which rule let a model be evicted."""

    EXTRA_REPLICA = "extra_replica"  # idle, and its model keeps another replica serving
    DRAIN = "drain"  # in use, and its model keeps another replica serving: drained, not cut
    COLD = "cold"  # idle past cold_after_s and its next request is far off: worth its reload
    QUEUE = "queue"  # idle, and the requests waiting for the placement outweigh its loss
    # in use, its model's last replica, and the demand waiting for the placement outweighs its
    # own: drained, not cut (its new requests wait for its reload)
    DISPLACE = "displace"


@dataclass(frozen=True, slots=True)
class GpuVerdict(Serialisable):
    """One GPU's filter result and score."""

    gpu_uuid: str
    node: str
    reason: PlacementReason  # PLACED when it passed the filter
    estimated_bytes: int
    score: float  # 0 when filtered out
    headroom_bytes: int = 0  # room left under the watermark after placing (0 when filtered out)


@dataclass(frozen=True, slots=True)
class EvictionProposal(Serialisable):
    """Evict this cold model to make room."""

    model_name: str
    gpu_uuid: str
    freed_bytes: int
    idle_s: float
    expected_gap_s: float  # expected time to its next request
    reload_s: float
    rule: EvictionRule = EvictionRule.COLD
    # QUEUE: its requests expected to wait out its reload; DISPLACE: its requests per second,
    # each to find it gone; DRAIN: its replica's share of them
    expected_loss: float = 0.0


@dataclass(frozen=True, slots=True)
class PlacementDecision(Serialisable):
    """Where a model goes, or why it waits."""

    model_name: str
    status: PlacementStatus
    reason: PlacementReason
    gpu_uuids: tuple[str, ...]  # chosen GPUs, one replica each
    verdicts: tuple[GpuVerdict, ...]  # every GPU, best score first
    evictions: tuple[EvictionProposal, ...]  # proposals when queued
    explanation: str


@dataclass(frozen=True, slots=True)
class FragmentationReport(Serialisable):
    """How much free memory is usable by no model."""

    free_bytes: int  # free memory on live GPUs
    dead_bytes: int
    dead_share: float  # dead / free (0 when nothing is free)
    num_dead_gpus: int  # live GPUs whose free memory is all dead


def _verdict(
    gpu: Gpu,
    request: ModelFootprint,
    snapshot: TopologySnapshot,
    models_on: dict[str, set[str]],
    config: PlacementConfig,
) -> GpuVerdict:
    resident = request.model_name in models_on.get(gpu.uuid, set())
    need = request.estimated_bytes(config.memory_k, resident=resident)

    def rejected(reason: PlacementReason) -> GpuVerdict:
        return GpuVerdict(gpu.uuid, gpu.node, reason, need, 0.0)

    if not snapshot.gpu_is_live(gpu):
        return rejected(PlacementReason.GPU_NOT_LIVE)
    if gpu.free_memory_bytes < need:
        return rejected(PlacementReason.INSUFFICIENT_MEMORY)
    used_after = gpu.total_memory_bytes - gpu.free_memory_bytes + need
    if used_after > config.oom_watermark * gpu.total_memory_bytes:
        return rejected(PlacementReason.OOM_WATERMARK)
    if not resident and len(models_on.get(gpu.uuid, set())) >= config.max_models_per_gpu:
        return rejected(PlacementReason.CONCURRENCY_CAP)
    score = (
        config.weight_affinity * (1.0 if resident else 0.0)
        + config.weight_free_memory * (gpu.free_memory_bytes - need) / gpu.total_memory_bytes
        + config.weight_utilisation * (1.0 - min(1.0, max(0.0, gpu.utilisation)))
    )
    headroom = int(config.oom_watermark * gpu.total_memory_bytes) - used_after
    return GpuVerdict(gpu.uuid, gpu.node, PlacementReason.PLACED, need, score, headroom)


def _choose(
    feasible: Sequence[GpuVerdict], count: int, strategy: PlacementStrategy
) -> tuple[str, ...]:
    """Best score (spread) or least headroom (pack) first, but a node already used only once no
    unused node has a feasible GPU."""
    chosen: list[GpuVerdict] = []
    nodes: set[str] = set()
    pool = list(feasible)

    def rank(v: GpuVerdict) -> float:
        return float(v.headroom_bytes) if strategy is PlacementStrategy.PACK else -v.score

    while pool and len(chosen) < count:
        best = min(pool, key=lambda v: (v.node in nodes, rank(v), v.gpu_uuid))
        chosen.append(best)
        nodes.add(best.node)
        pool.remove(best)
    return tuple(v.gpu_uuid for v in chosen)


def _expected_gap_s(resident: ResidentModel, now_s: float) -> float:
    idle = now_s - resident.last_request_s
    gap = resident.mean_interarrival_s
    return gap - idle if idle < gap else gap


def _request_rate(resident: ResidentModel) -> float:
    """The model's requests per second (inf with no gap estimate: nothing can outweigh it)."""
    if resident.mean_interarrival_s <= 0:
        return math.inf
    return 1.0 / resident.mean_interarrival_s


def _expected_loss(resident: ResidentModel) -> float:
    """Requests that would wait out the model's reload if it went now: the one that finds it
    gone and those expected during the reload."""
    rate = _request_rate(resident)
    return math.inf if math.isinf(rate) else 1.0 + resident.reload_s * rate


def _proposal(
    resident: ResidentModel, now_s: float, config: PlacementConfig, replicas: int = 1
) -> EvictionProposal | None:
    """``resident`` as an eviction candidate, by the first rule that allows it (None: none);
    ``replicas``: its model's serving replicas, this one included.

    A QUEUE candidate still has to be outweighed by the backlog (:func:`_worth_it`), a DRAIN or
    DISPLACE one too (:func:`_displace_worth_it`).
    """
    extra = replicas > 1
    idle = now_s - resident.last_request_s
    gap = _expected_gap_s(resident, now_s)
    if resident.in_transition:  # NOTE: its memory is spoken for until the runtime confirms
        return None
    proposal = EvictionProposal(
        resident.model_name, resident.gpu_uuid, resident.memory_bytes, idle, gap, resident.reload_s
    )
    # NOTE: a queued request counts like a running one: evicting its model would fail it; an
    # extra replica's are finished by its drain while the model's others take the new ones
    if resident.active_requests != 0 or resident.queued_requests != 0:
        if extra:  # NOTE: its share of the model's requests go to the model's other replicas
            loss = _request_rate(resident) / replicas
            return replace(proposal, rule=EvictionRule.DRAIN, expected_loss=loss)
        # NOTE: hysteresis — a model displaced, reloaded elsewhere or not, is not displaced
        # again before its replica set has held that long (nor is the model it made room for)
        settled = resident.steady_s >= resident.reload_s * config.eviction_reload_factor
        if not (config.displace_in_use and settled):
            return None
        return replace(proposal, rule=EvictionRule.DISPLACE, expected_loss=_request_rate(resident))
    # NOTE: hysteresis — the minimum residence (see the module docstring)
    settled = idle >= resident.reload_s * config.eviction_reload_factor
    if extra and settled:
        return replace(proposal, rule=EvictionRule.EXTRA_REPLICA)
    if idle >= config.cold_after_s and gap > resident.reload_s * config.eviction_reload_factor:
        return proposal
    if not settled:
        return None
    return replace(proposal, rule=EvictionRule.QUEUE, expected_loss=_expected_loss(resident))


def _displace_worth_it(
    displaced: Sequence[EvictionProposal], backlog: Backlog, config: PlacementConfig
) -> bool:
    """The backlog's arrival rate outweighs the request rate the drained or displaced replicas
    carry (:attr:`EvictionProposal.expected_loss`) by ``eviction_reload_factor``, and its
    demand over the horizon of :func:`_horizon` (waiting now and expected) outweighs, by the
    same margin, the one request per displaced model that finds it gone.

    NOTE: rates, not counts over the reload: a displaced model loses its requests until it wins
    room again, however long that is, and a drained replica's share of its model's requests
    goes unserved until the model scales out again. Requests piled up waiting are no rate: a
    model displaced in its quiet minute piles up its burst's requests, and read as rate they
    took the GPU straight back (bench.multimodel fits, two 34B models at every burst). With a
    margin above 1, two models cannot take a GPU from each other at the same rates: each would
    need more than the other.
    """
    rate = sum(p.expected_loss for p in displaced)
    margin = config.eviction_reload_factor
    last = sum(1 for p in displaced if p.rule is EvictionRule.DISPLACE)
    demand = backlog.demand_over(_horizon(displaced, backlog))
    return backlog.arrival_rps > rate * margin and demand > last * margin


def _worth_it(queue: Sequence[EvictionProposal], backlog: Backlog, config: PlacementConfig) -> bool:
    """The backlog outweighs the queue evictions' loss by ``eviction_reload_factor``, over the
    longest of their reloads, or a first replica's ``wait_horizon_s`` if longer.

    NOTE: over the reload alone (5 s), a model with no replica, one request waiting and one
    more every 20 s (1.25) never outweighed a neighbour idle for a minute (3 × 1.1): its every
    request waited out the front end's deadline and was refused until the neighbour turned
    cold (``cold_after_s``). Over a 60 s window it counts 4.
    """
    loss = sum(p.expected_loss for p in queue)
    return backlog.demand_over(_horizon(queue, backlog)) > loss * config.eviction_reload_factor


def _horizon(queue: Sequence[EvictionProposal], backlog: Backlog) -> float:
    """What the backlog's demand counts over: the longest reload of the queue evictions, or a
    first replica's ``wait_horizon_s`` if longer."""
    return max(max(p.reload_s for p in queue), backlog.wait_horizon_s)


def _fits_after(gpu: Gpu, free: int, models: int, need: int, config: PlacementConfig) -> bool:
    used_after = gpu.total_memory_bytes - free + need
    return (
        free >= need
        and models < config.max_models_per_gpu
        and used_after <= config.oom_watermark * gpu.total_memory_bytes
    )


def _serving_replicas(residents: Sequence[ResidentModel]) -> Counter[str]:
    """Replicas per model that serve (not loading, not promised for eviction)."""
    return Counter(r.model_name for r in residents if not r.in_transition)


def _evictions_on(
    gpu: Gpu,
    need: int,
    on_gpu: Sequence[ResidentModel],
    now_s: float,
    config: PlacementConfig,
    backlog: Backlog | None,
    replicas: Counter[str],
) -> tuple[EvictionProposal, ...] | None:
    """Extra replicas, then cold models, least recently used first; then, if still short and
    the backlog waits for the model's first replica, extra replicas in use (drained), least
    recently used first; then, if still short and a backlog waits, idle ones by the queue rule,
    least recently used first, each only while the backlog still outweighs their loss together
    (one it would not skips to the next)."""
    free, models = gpu.free_memory_bytes, len(on_gpu)

    def take(
        pool: Sequence[EvictionProposal],
        rules: tuple[EvictionRule, ...],
        chosen: list[EvictionProposal],
        worth: Callable[[list[EvictionProposal]], bool],
    ) -> None:
        """Add ``pool``'s proposals by ``rules``, in order, to ``chosen`` until the request
        fits, each only while ``worth`` holds for ``chosen`` with it."""
        nonlocal free, models
        for proposal in pool:
            if _fits_after(gpu, free, models, need, config):
                return
            if proposal.rule in rules and worth([*chosen, proposal]):
                chosen.append(proposal)
                free, models = free + proposal.freed_bytes, models - 1

    candidates = sorted(
        (
            p
            for r in on_gpu
            if (p := _proposal(r, now_s, config, replicas[r.model_name])) is not None
        ),
        key=lambda p: (p.rule is not EvictionRule.EXTRA_REPLICA, -p.idle_s, p.model_name),
    )
    proposals: list[EvictionProposal] = []
    take(candidates, (EvictionRule.EXTRA_REPLICA, EvictionRule.COLD), proposals, lambda _: True)
    taken: list[EvictionProposal] = []
    queue: list[EvictionProposal] = []
    if backlog is not None:
        waiting = backlog

        def outweighs(ps: list[EvictionProposal]) -> bool:
            return _displace_worth_it(ps, waiting, config)

        # NOTE: replicas in use (drained or displaced) cost requests: least loss first, and
        # only while the backlog outweighs them all together
        in_use = sorted(candidates, key=lambda p: (p.expected_loss, p.model_name))
        if backlog.first_replica:
            take(in_use, (EvictionRule.DRAIN,), taken, outweighs)
        take(candidates, (EvictionRule.QUEUE,), queue, lambda ps: _worth_it(ps, waiting, config))
        take(in_use, (EvictionRule.DISPLACE,), taken, outweighs)
    if (proposals or queue or taken) and _fits_after(gpu, free, models, need, config):
        return (*proposals, *taken, *queue)
    return None


def _eviction_plan(
    request: ModelFootprint,
    snapshot: TopologySnapshot,
    residents: Sequence[ResidentModel],
    config: PlacementConfig,
    backlog: Backlog | None,
) -> tuple[EvictionProposal, ...]:
    """The evictions on one GPU that make the request fit there (empty if none does): fewest
    models displaced, then fewest queue evictions (cold models first), then fewest of any
    model's last replica (extra replicas first), then fewest evictions, then fewest bytes
    freed."""
    need = request.estimated_bytes(config.memory_k)
    replicas = _serving_replicas(residents)
    Key = tuple[int, int, int, int, int, int, str]
    best: tuple[Key, tuple[EvictionProposal, ...]] | None = None
    for gpu in snapshot.gpus:
        if not snapshot.gpu_is_live(gpu):
            continue
        on_gpu = [r for r in residents if r.gpu_uuid == gpu.uuid]
        proposals = _evictions_on(gpu, need, on_gpu, snapshot.now_s, config, backlog, replicas)
        if proposals is None:
            continue
        displaced = sum(1 for p in proposals if p.rule is EvictionRule.DISPLACE)
        queue = sum(1 for p in proposals if p.rule is EvictionRule.QUEUE)
        # NOTE: giving back an extra replica loses nothing (its model keeps serving): a plan of
        # extras alone beats one that takes any model's last replica
        extra = (EvictionRule.EXTRA_REPLICA, EvictionRule.DRAIN)
        last = sum(1 for p in proposals if p.rule not in extra)
        drains = sum(1 for p in proposals if p.rule is EvictionRule.DRAIN)
        freed = sum(p.freed_bytes for p in proposals)
        key = (displaced, queue, last, drains, len(proposals), freed, gpu.uuid)
        if best is None or key < best[0]:
            best = (key, proposals)
    return best[1] if best is not None else ()


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def _eviction_text(
    request: ModelFootprint, evictions: Sequence[EvictionProposal], backlog: Backlog | None
) -> str:
    """Each proposal with the rule that allows it, e.g. "evict X@g0 (idle 6 min, next expected
    in 9 min) for Y: 412 requests waiting"."""
    parts = []
    for e in evictions:
        where = f"{e.model_name}@{e.gpu_uuid} (idle {_minutes(e.idle_s)}, next expected in "
        where += f"{_minutes(e.expected_gap_s)}"
        if e.rule is EvictionRule.EXTRA_REPLICA:
            parts.append(f"give back {where}: an extra replica, its model keeps serving)")
        elif e.rule is EvictionRule.DRAIN:
            parts.append(
                f"drain {e.model_name}@{e.gpu_uuid} (an extra replica in use: it "
                "finishes its requests, its model's other replicas take new ones)"
            )
        elif e.rule is EvictionRule.COLD:
            parts.append(f"evict {where}, reload {_minutes(e.reload_s)}: cold)")
        elif e.rule is EvictionRule.DISPLACE:
            parts.append(
                f"drain {e.model_name}@{e.gpu_uuid} (its last replica, in use at "
                f"{e.expected_loss * 60:.1f} requests/min: it finishes its requests, its new "
                "ones wait for its reload)"
            )
        else:
            parts.append(f"evict {where}, ~{e.expected_loss:.1f} requests would wait its reload)")
    text = "; ".join(parts) + f" for {request.model_name}"
    queue = [e for e in evictions if e.rule is EvictionRule.QUEUE]
    in_use = [e for e in evictions if e.rule in (EvictionRule.DRAIN, EvictionRule.DISPLACE)]
    clauses = []
    if backlog is not None and in_use:
        rule = "displace" if any(e.rule is EvictionRule.DISPLACE for e in in_use) else "drain"
        clauses.append(
            f"asked for at {backlog.arrival_rps * 60:.1f} requests/min, against "
            f"{sum(e.expected_loss for e in in_use) * 60:.1f} of the drained ({rule} rule)"
        )
    if backlog is not None and queue:
        n = backlog.waiting_requests
        clause = f"{n} request{'' if n == 1 else 's'} waiting"
        if backlog.arrival_rps > 0:
            horizon = _horizon(queue, backlog)
            reloads = horizon == max(e.reload_s for e in queue)
            clause += f", ~{backlog.demand_over(horizon):.1f} with those expected over the "
            clause += f"{_minutes(horizon)} " + (
                "reload" if reloads else "it would wait with no replica"
            )
        clauses.append(clause + " (queue rule)")
    if clauses:
        text += ": " + "; ".join(clauses)
    return text + "."


def place_model(
    request: ModelFootprint,
    snapshot: TopologySnapshot,
    residents: Sequence[ResidentModel],
    config: PlacementConfig,
    backlog: Backlog | None = None,
) -> PlacementDecision:
    """Place ``request.num_replicas`` replicas, or queue it with eviction proposals.

    Deterministic: ties break on GPU uuid. ``residents`` lists every loaded model instance;
    ``backlog``: the requests already waiting for this placement (None: none, and only cold
    models may be evicted).
    """
    models_on: dict[str, set[str]] = {}
    for r in residents:
        models_on.setdefault(r.gpu_uuid, set()).add(r.model_name)
    verdicts = sorted(
        (_verdict(g, request, snapshot, models_on, config) for g in snapshot.gpus),
        key=lambda v: (-v.score, v.reason != PlacementReason.PLACED, v.gpu_uuid),
    )
    feasible = [v for v in verdicts if v.reason is PlacementReason.PLACED]
    if feasible:
        chosen = _choose(feasible, request.num_replicas, config.strategy)
        partial = len(chosen) < request.num_replicas
        reason = PlacementReason.PLACED_PARTIAL if partial else PlacementReason.PLACED
        explanation = (
            f"{request.model_name}: {len(chosen)}/{request.num_replicas} replicas on "
            f"{', '.join(chosen)} ({config.strategy.value}; best score {feasible[0].score:.3f})."
        )
        return PlacementDecision(
            request.model_name,
            PlacementStatus.PLACED,
            reason,
            chosen,
            tuple(verdicts),
            (),
            explanation,
        )
    rejections = Counter(v.reason for v in verdicts if v.reason != PlacementReason.GPU_NOT_LIVE)
    reason = (
        min(rejections, key=lambda r: (-rejections[r], r.value))
        if rejections
        else PlacementReason.NO_LIVE_GPU
    )
    evictions = _eviction_plan(request, snapshot, residents, config, backlog)
    counts = ", ".join(f"{r.value}={n}" for r, n in sorted(rejections.items()))
    explanation = f"{request.model_name}: queued, no feasible GPU ({counts or 'no live GPU'}); " + (
        _eviction_text(request, evictions, backlog)
        if evictions
        else "no eviction would make room (active, recently used or cheap to keep)."
    )
    return PlacementDecision(
        request.model_name,
        PlacementStatus.QUEUED,
        reason,
        (),
        tuple(verdicts),
        evictions,
        explanation,
    )


def dead_memory(
    snapshot: TopologySnapshot, footprints: Sequence[ModelFootprint], config: PlacementConfig
) -> FragmentationReport:
    """Free memory on live GPUs that is smaller than every model's footprint ("dead memory")."""
    smallest = min((f.estimated_bytes(config.memory_k) for f in footprints), default=0)
    free = dead = dead_gpus = 0
    for gpu in snapshot.gpus:
        if not snapshot.gpu_is_live(gpu):
            continue
        free += gpu.free_memory_bytes
        if 0 < gpu.free_memory_bytes < smallest:
            dead += gpu.free_memory_bytes
            dead_gpus += 1
    return FragmentationReport(free, dead, dead / free if free else 0.0, dead_gpus)
