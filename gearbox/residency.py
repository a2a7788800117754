"""On-demand models: load a cold model when it is requested, evict a cold one to make room.

An *on-demand* deployment has no plan until a request arrives for it. Every decision tick, each
on-demand deployment runs :func:`decide_residency` over the same view of all of them (their
state, demand and the GPUs they hold) and acts only for itself:

* **Room.** Several models share a GPU. What a GPU offers is its free memory as telemetry shows
  it, at most its total minus the footprint (weights + the runtime's overhead + ``memory_k`` ×
  batch × seq_len × KV bytes per token) of every model resident, loading or being evicted there
  (:func:`room`): the decided plans count before telemetry shows the memory.
* **Round.** Cold models with requests (queued or held at the front end) are served in order —
  largest footprint first (big models need the big GPUs), then most requests waiting, then
  name. Each is placed by :func:`gearbox.placement.place_model` (memory filter, the
  ``oom_watermark`` fill across all models on the GPU, ``max_models_per_gpu``) on the GPUs its
  pin domain allows, none on a node that holds a model it is anti-affine to (either model
  naming the other), the nodes of its affine models tried first; among the feasible GPUs, best
  fit — the one it leaves with the least room under the watermark, so a small model fills a
  partly used or small GPU before it opens a big empty one a big model may need. Placed: its
  footprint is promised on that GPU for the rest of the round. Queued: the least recently used
  resident whose eviction makes room (with others on its GPU, least recently used first, if one
  is not enough; place_model's rules: never a model with active or queued requests; cold — idle
  past ``cold_after_s``, worth its reload — on any GPU before the queue rule — idle, and the
  model's waiting requests outweigh its expected loss — on any) is promised to it — its memory
  stays held until the runtime confirms, and the rest of the waiting model's footprint is
  promised on that GPU.
* **Me.** A cold model placed in the round loads there (``LOAD_ON_DEMAND``); queued, it waits
  (``WAITING_FOR_ROOM``, naming the evictions under way). A resident model proposed for eviction
  in the round — and with no active and no queued request, checked again here — is evicted
  (``EVICT_COLD`` or ``EVICT_QUEUE`` by the rule, naming the model it makes room for); that
  frees its share of the GPU only. Anything else holds.

NOTE: a model loads as one TP1 replica. The runtime's VMM ledger is per GPU across every
model's engine, so its watermark and 429s hold whatever share placement estimated, and each
on-demand replica's footprint (weights, overhead, :func:`kv_floor_tokens` of KV) is a floor the
others' admissions see as held; past it a model's KV competes with its neighbours'. Measured
with ``flexpipe up --scenario many-models`` (24 models, 12 GPUs, up to four per GPU): serving
GPUs held two or more models 44 % of the time, at most four; 27 loads, 6 evictions, none with a
request in flight, no OOM, 28 requests refused ``throttled_watermark``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from gearbox.config import PlacementConfig
from gearbox.decisions import DecisionReason
from gearbox.placement import (
    Backlog,
    EvictionRule,
    GpuVerdict,
    ModelFootprint,
    PlacementDecision,
    PlacementReason,
    PlacementStatus,
    ResidentModel,
    place_model,
)
from gearbox.serde import Serialisable
from gearbox.types import TopologySnapshot

__all__ = [
    "FOOTPRINT_BATCH",
    "OnDemandModel",
    "Residency",
    "ResidencyAction",
    "ResidencyVerdict",
    "decide_residency",
    "held_bytes",
    "kv_floor_tokens",
    "needs",
    "room",
]

# NOTE: the batch a replica must hold at its nominal sequence length for the placement's memory
# filter (model_size + k × batch × seq_len × kv_bytes_per_token): enough for a burst's running
# sequences; KV beyond it is the runtime's admission's to refuse (429), not the placement's.
FOOTPRINT_BATCH = 8


def kv_floor_tokens(seq_len_tokens: float, config: PlacementConfig) -> int:
    """The KV tokens an on-demand model's footprint counts at its nominal sequence length
    (``memory_k`` × ``FOOTPRINT_BATCH`` × seq_len): what the runtime guarantees it on a shared
    GPU."""
    return math.ceil(config.memory_k * FOOTPRINT_BATCH * max(1, round(seq_len_tokens)))


class Residency(StrEnum):
    """Where an on-demand model stands, from its assumed and confirmed plans."""

    COLD = "cold"  # no replica, none coming
    LOADING = "loading"  # a load decided, not confirmed yet
    RESIDENT = "resident"  # confirmed replicas, nothing in flight
    EVICTING = "evicting"  # an eviction decided, not confirmed yet


class ResidencyAction(StrEnum):
    """What the deployment's decision does."""

    LOAD = "load"
    EVICT = "evict"
    HOLD = "hold"


@dataclass(frozen=True, slots=True)
class OnDemandModel(Serialisable):
    """One on-demand deployment as the round sees it."""

    name: str  # the deployment
    footprint: ModelFootprint  # weights and the batch a replica must hold
    state: Residency
    gpu_uuids: tuple[str, ...]  # GPUs it holds or is moving to (assumed and confirmed plans)
    active_requests: int  # sequences its replicas run
    queued_requests: int  # queued at a replica or held by the front end for a load
    last_demand_s: float  # event time it last had requests (-inf: never)
    arrival_rps: float  # over the load window
    reload_s: float  # time to load it again after an eviction
    pin_domain: str | None = None  # load only in this domain
    affinity: tuple[str, ...] = ()  # prefer nodes holding these deployments
    anti_affinity: tuple[str, ...] = ()  # never a node holding one of these

    @property
    def wanted(self) -> bool:
        """Requests wait for it."""
        return self.active_requests + self.queued_requests > 0


@dataclass(frozen=True, slots=True)
class ResidencyVerdict(Serialisable):
    """One deployment's residency decision."""

    action: ResidencyAction
    reason: DecisionReason
    gpu_uuids: tuple[str, ...]  # LOAD: where its replica goes
    for_model: str | None  # EVICT: the model it makes room for
    placement: PlacementDecision | None  # the round's placement of this model, when it ran
    explanation: str


def needs(model: OnDemandModel) -> bool:
    """Whether ``model`` takes part in the round as a model to place: cold and requested."""
    return model.state is Residency.COLD and model.wanted


def held_bytes(model: OnDemandModel, config: PlacementConfig) -> int:
    """What ``model`` holds or reserves on each GPU it is on: its placement footprint (weights,
    overhead and its batch's KV at ``memory_k``), whether resident, loading or being evicted."""
    return model.footprint.estimated_bytes(config.memory_k)


def room(
    snapshot: TopologySnapshot, models: Sequence[OnDemandModel], config: PlacementConfig
) -> TopologySnapshot:
    """``snapshot`` with each GPU's free memory at most its total minus what the models on it
    hold or reserve (:func:`held_bytes`).

    NOTE: telemetry shows a model's memory only once its load allocated it and a sample went
    out, and shows its KV as used, not as the batch it must be able to hold; the decided plans
    show it at once. The lower of the two is what a new model may count on.
    """
    held: dict[str, int] = {}
    for m in models:
        for uuid in m.gpu_uuids:
            held[uuid] = held.get(uuid, 0) + held_bytes(m, config)
    gpus = tuple(
        replace(g, free_memory_bytes=max(0, min(g.free_memory_bytes, g.total_memory_bytes - h)))
        if (h := held.get(g.uuid, 0))
        else g
        for g in snapshot.gpus
    )
    return replace(snapshot, gpus=gpus)


def _resident(
    model: OnDemandModel, uuid: str, now_s: float, config: PlacementConfig
) -> ResidentModel:
    """The model on one of its GPUs as placement sees it: an eviction candidate when resident
    on that GPU alone (evicting frees its share only), else memory spoken for."""
    idle_s = now_s - model.last_demand_s if math.isfinite(model.last_demand_s) else now_s
    # NOTE: no arrival in the load window: the next request is expected no sooner than the
    # time the model has already waited for one (twice the idle time is a memoryless guess).
    gap_s = 1.0 / model.arrival_rps if model.arrival_rps > 0 else 2.0 * max(idle_s, 1.0)
    return ResidentModel(
        model.name,
        uuid,
        held_bytes(model, config),
        model.active_requests,
        model.last_demand_s if math.isfinite(model.last_demand_s) else 0.0,
        gap_s,
        model.reload_s,
        model.queued_requests,
        in_transition=model.state is not Residency.RESIDENT or len(model.gpu_uuids) != 1,
    )


def _nodes_of(
    names: Sequence[str], models: Sequence[OnDemandModel], node_of: dict[str, str]
) -> set[str]:
    wanted = set(names)
    return {node_of[u] for m in models if m.name in wanted for u in m.gpu_uuids if u in node_of}


def _best_fit(
    model: OnDemandModel,
    snapshot: TopologySnapshot,
    residents: Sequence[ResidentModel],
    config: PlacementConfig,
) -> PlacementDecision:
    """place_model's decision, on the feasible GPU that the model leaves with the least room
    under the watermark (ties: uuid) — packing: a small model fills a partly used or small GPU
    before it opens a big empty one that a big model may need."""
    decision = place_model(model.footprint, snapshot, residents, config, _backlog(model))
    if decision.status is not PlacementStatus.PLACED:
        return decision
    by_uuid = {g.uuid: g for g in snapshot.gpus}

    def headroom(v: GpuVerdict) -> int:
        gpu = by_uuid[v.gpu_uuid]
        used = gpu.total_memory_bytes - gpu.free_memory_bytes
        return int(config.oom_watermark * gpu.total_memory_bytes) - used - v.estimated_bytes

    feasible = [v for v in decision.verdicts if v.reason is PlacementReason.PLACED]
    best = min(feasible, key=lambda v: (headroom(v), v.gpu_uuid))
    others = sum(1 for r in residents if r.gpu_uuid == best.gpu_uuid)
    text = (
        f"{model.name}: best fit on {best.gpu_uuid} of {len(feasible)} feasible GPUs, "
        f"{others} other models there, {headroom(best) / 2**30:.1f} GiB left under the "
        f"{config.oom_watermark:.0%} watermark."
    )
    return replace(decision, gpu_uuids=(best.gpu_uuid,), explanation=text)


def _place(
    model: OnDemandModel,
    models: Sequence[OnDemandModel],
    snapshot: TopologySnapshot,
    residents: Sequence[ResidentModel],
    config: PlacementConfig,
) -> tuple[PlacementDecision, str]:
    """Place ``model`` on the GPUs its pin and anti-affinity allow, nodes of its affine models
    first, best fit; with a note of what was excluded. ``snapshot`` shows what the round left
    free on each GPU."""
    node_of = {g.uuid: g.node for g in snapshot.gpus}
    # NOTE: anti-affinity binds both ways: a model also keeps off the nodes of models that
    # named it (with GPUs shared, the other one may be placed first)
    averse = {m.name for m in models if model.name in m.anti_affinity}
    avoid = _nodes_of((*model.anti_affinity, *sorted(averse)), models, node_of)
    gpus = tuple(
        g
        for g in snapshot.gpus
        if (model.pin_domain is None or g.domain == model.pin_domain) and g.node not in avoid
    )
    notes = []
    if model.pin_domain is not None:
        notes.append(f"pinned to domain {model.pin_domain}")
    if avoid:
        notes.append(f"anti-affinity avoids {', '.join(sorted(avoid))}")
    allowed = replace(snapshot, gpus=gpus)
    usable = [r for r in residents if r.gpu_uuid in {g.uuid for g in gpus}]
    near = _nodes_of(model.affinity, models, node_of)
    if near:
        close = replace(snapshot, gpus=tuple(g for g in gpus if g.node in near))
        first = _best_fit(model, close, usable, config)
        if first.status is PlacementStatus.PLACED:
            return first, "; ".join([*notes, f"affinity: near {', '.join(model.affinity)}"])
        notes.append(f"no room near {', '.join(model.affinity)}")
    decision = _best_fit(model, allowed, usable, config)
    if decision.status is PlacementStatus.QUEUED:
        decision = _least_recently_used(model, allowed, usable, config) or decision
    return decision, "; ".join(notes)


def _backlog(model: OnDemandModel) -> Backlog:
    """The requests waiting for ``model``'s load, and its arrival rate."""
    return Backlog(model.queued_requests, model.arrival_rps)


def _least_recently_used(
    model: OnDemandModel,
    allowed: TopologySnapshot,
    residents: Sequence[ResidentModel],
    config: PlacementConfig,
) -> PlacementDecision | None:
    """The evictions that make room for ``model`` on the GPU of the least recently used
    resident that can go (ties: name), as place_model proposes them on that GPU (least recently
    used first there, only as many as it takes); None when no GPU gets room. A GPU where cold
    models alone make room comes before any that needs the queue rule (cold models first).

    NOTE: place_model alone ranks GPUs by fewest queue evictions, fewest evictions, then bytes
    freed, then uuid; the rule here is least recently used first, so each GPU is asked on its
    own.
    """
    by_uuid = {g.uuid: g for g in allowed.gpus}
    asked: set[str] = set()
    first_queue: PlacementDecision | None = None
    for resident in sorted(residents, key=lambda r: (r.last_request_s, r.model_name)):
        gpu = by_uuid.get(resident.gpu_uuid)
        if gpu is None or gpu.uuid in asked or resident.in_transition:
            continue
        asked.add(gpu.uuid)
        alone = replace(allowed, gpus=(gpu,))
        there = [r for r in residents if r.gpu_uuid == gpu.uuid]
        decision = place_model(model.footprint, alone, there, config, _backlog(model))
        if not decision.evictions:
            continue
        if all(e.rule is EvictionRule.COLD for e in decision.evictions):
            return decision
        first_queue = first_queue or decision
    return first_queue


def _take(snapshot: TopologySnapshot, uuid: str, num_bytes: int) -> TopologySnapshot:
    """``snapshot`` with ``num_bytes`` less free on GPU ``uuid`` (promised in the round)."""
    gpus = tuple(
        replace(g, free_memory_bytes=max(0, g.free_memory_bytes - num_bytes))
        if g.uuid == uuid
        else g
        for g in snapshot.gpus
    )
    return replace(snapshot, gpus=gpus)


def _round(
    models: Sequence[OnDemandModel], snapshot: TopologySnapshot, config: PlacementConfig
) -> tuple[dict[str, tuple[PlacementDecision, str]], dict[str, str]]:
    """Every requested cold model's placement in order, and the evictions promised (victim →
    the model it makes room for).

    A placed model's footprint is promised on its GPU (it counts there for the models after it,
    like a loading one); a proposed eviction keeps its victim's memory held (it is not freed
    until the runtime confirms) and promises the rest of the waiting model's footprint.
    """
    free = room(snapshot, models, config)
    residents = [_resident(m, u, snapshot.now_s, config) for m in models for u in m.gpu_uuids]
    victims: dict[str, str] = {}
    placements: dict[str, tuple[PlacementDecision, str]] = {}
    waiting = sorted(
        (m for m in models if needs(m)),
        key=lambda m: (-held_bytes(m, config), -m.queued_requests, m.name),
    )
    for model in waiting:
        decision, note = _place(model, models, free, residents, config)
        placements[model.name] = (decision, note)
        need = held_bytes(model, config)
        if decision.status is PlacementStatus.PLACED:
            for uuid in decision.gpu_uuids:
                free = _take(free, uuid, need)
                promised = ResidentModel(
                    model.name, uuid, need, 0, snapshot.now_s, 0.0, 0.0, in_transition=True
                )
                residents.append(promised)
            continue
        for proposal in decision.evictions:
            victims[proposal.model_name] = model.name
            residents = [
                replace(r, in_transition=True) if r.model_name == proposal.model_name else r
                for r in residents
            ]
        if decision.evictions:
            uuid = decision.evictions[0].gpu_uuid
            freed = sum(p.freed_bytes for p in decision.evictions)
            free = _take(free, uuid, max(0, need - freed))
    return placements, victims


def decide_residency(
    me: str,
    models: Sequence[OnDemandModel],
    snapshot: TopologySnapshot,
    config: PlacementConfig,
) -> ResidencyVerdict:
    """``me``'s decision from the round over ``models`` (``me`` among them) on ``snapshot``:
    its GPUs' free memory as telemetry shows it (a GPU another, not on-demand, deployment holds
    shows none); what the models hold or reserve is taken off it here (:func:`room`).
    Deterministic; see the module docstring."""
    mine = next(m for m in models if m.name == me)
    if mine.state in (Residency.LOADING, Residency.EVICTING):
        return _hold(DecisionReason.TRANSITION_IN_FLIGHT, f"{me}: {mine.state.value}.")
    placements, victims = _round(models, snapshot, config)
    if mine.state is Residency.COLD:
        if me not in placements:
            return _hold(DecisionReason.COLD, f"{me}: cold, no request waits for it.")
        decision, note = placements[me]
        why = f" ({note})" if note else ""
        if decision.status is PlacementStatus.PLACED:
            text = (
                f"{me}: {mine.queued_requests} requests wait for it; loading on "
                f"{', '.join(decision.gpu_uuids)}{why}. {decision.explanation}"
            )
            return ResidencyVerdict(
                ResidencyAction.LOAD,
                DecisionReason.LOAD_ON_DEMAND,
                decision.gpu_uuids,
                None,
                decision,
                text,
            )
        text = f"{me}: {mine.queued_requests} requests wait, no GPU fits it yet{why}. " + (
            decision.explanation
        )
        return ResidencyVerdict(
            ResidencyAction.HOLD, DecisionReason.WAITING_FOR_ROOM, (), None, decision, text
        )
    needy = victims.get(me)
    if needy is None:
        state = "in use" if mine.wanted else "idle, but no waiting model needs its GPU"
        return _hold(DecisionReason.RESIDENT, f"{me}: resident, {state}.")
    if mine.wanted:  # NOTE: place_model never proposes it; this keeps the rule local and sure
        return _hold(DecisionReason.RESIDENT, f"{me}: resident with requests: never evicted.")
    idle = snapshot.now_s - mine.last_demand_s if math.isfinite(mine.last_demand_s) else None
    since = f"idle {idle:.0f} s" if idle is not None else "never requested"
    decision = placements[needy][0]
    rule = next(e.rule for e in decision.evictions if e.model_name == me)
    why = "cold, least recently used" if rule is EvictionRule.COLD else "queue rule"
    text = (
        f"{me}: evicted from {', '.join(mine.gpu_uuids)} ({since}, no active or queued request,"
        f" {why}) to make room for {needy}. {decision.explanation}"
    )
    reason = DecisionReason.EVICT_COLD if rule is EvictionRule.COLD else DecisionReason.EVICT_QUEUE
    return ResidencyVerdict(ResidencyAction.EVICT, reason, (), needy, decision, text)


def _hold(reason: DecisionReason, explanation: str) -> ResidencyVerdict:
    return ResidencyVerdict(ResidencyAction.HOLD, reason, (), None, None, explanation)
