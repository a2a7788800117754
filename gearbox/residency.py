"""On-demand models: load a cold model when it is requested, evict a cold one to make room.

An *on-demand* deployment has no plan until a request arrives for it. Every decision tick, each
on-demand deployment runs :func:`decide_residency` over the same view of all of them (their
state, demand and the GPUs they hold) and acts only for itself:

* **Room.** Several models share a GPU. What a GPU offers is its free memory as telemetry shows
  it, at most its total minus the footprint (weights + the runtime's overhead + ``memory_k`` ×
  batch × seq_len × KV bytes per token) of every model resident, loading or being evicted there
  (:func:`room`): the decided plans count before telemetry shows the memory. A footprint whose
  whole batch fits no GPU the model may use under ``oom_watermark`` has its batch cut to what
  fits the largest (at least one sequence; the explanation says so): the batch is a floor for
  KV, and a model whose weights nearly fill its card still serves with what is left.
* **Round.** Cold models with requests (queued or held at the front end) are served in order —
  largest footprint first (big models need the big GPUs), then most requests waiting, then
  name — except that a model the displace rule just made room for (a victim's eviction ended
  within the victim's load window) goes before every other model, cold or scaling out. Each
  is placed by :func:`gearbox.placement.place_model` (memory filter, the ``oom_watermark``
  fill across all models on the GPU, ``max_models_per_gpu``) on the GPUs its
  pin domain allows, none on a node that holds a model it is anti-affine to (either model
  naming the other), the nodes of its affine models tried first, by ``config.strategy`` (spread:
  best score; pack: best fit, least room left under the watermark). Placed: its
  footprint is promised on that GPU for the rest of the round. Queued: the least recently used
  resident whose eviction makes room (with others on its GPU, least recently used first, if one
  is not enough; place_model's rules: never a model with active or queued requests; an idle
  extra replica of a model that keeps another, then cold — idle past ``cold_after_s``, worth
  its reload — then an extra replica in use, drained — it takes no new request and finishes
  its own, the model keeps another — on any GPU before the queue rule — idle, and the model's
  waiting requests outweigh its expected loss — on any) is promised to it — its memory stays
  held until the runtime confirms, and the rest of the waiting model's footprint is promised
  on that GPU.
  Then every other resident model not evicted, most unmet demand first, is scaled by
  :func:`gearbox.scaling.scale_replicas` on what is left (its 429s for capacity and waiting
  requests over the load window against its arrivals): one more replica on a GPU without one
  (promised like a load; extra replicas, cold models and — its unmet demand as the backlog —
  idle ones by the queue rule evicted for it), or an idle extra one given back.
* **Me.** A cold model placed in the round loads there (``LOAD_ON_DEMAND``); queued, it waits
  (``WAITING_FOR_ROOM``, naming the evictions under way). A resident model proposed for eviction
  in the round — and with no active and no queued request, checked again here, unless the
  displace rule took it — is evicted (``EVICT_COLD``, ``EVICT_QUEUE`` or ``EVICT_DISPLACE`` by
  the rule, naming the model it makes room for; a displaced model goes at its first idle
  moment, see :mod:`gearbox.placement`; while it waits for that moment, the model it makes
  room for displaces nothing else, see :func:`_round`), or, when
  only some of its replicas go, keeps the others (``SCALE_IN``); that frees those replicas'
  share only. A resident model the scale rule grows gets one more replica (``SCALE_OUT``) or
  gives one back (``SCALE_IN``). Anything else holds.

NOTE: a model loads as one TP1 replica and grows by TP1 replicas, each on its own GPU; the
router spreads its requests over them (predicted completion). The view's active and queued
counts are the deployment's, so a replica is only given back when the whole model has none.
The runtime's VMM ledger is per GPU across every model's engine, so its watermark and 429s
hold whatever share placement estimated, and each on-demand replica's weights, overhead and
:func:`kv_floor_tokens` of KV (none by default, ``kv_floor_batch``) are a floor the others'
admissions see as held; past it a model's KV competes with its neighbours'.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from gearbox.config import GearboxConfig, PlacementConfig
from gearbox.decisions import DecisionReason
from gearbox.model import ModelSpec
from gearbox.placement import (
    Backlog,
    EvictionRule,
    ModelFootprint,
    PlacementDecision,
    PlacementStatus,
    ResidentModel,
    place_model,
)
from gearbox.scaling import ReplicaDemand, ScaleAction, ScaleDecision, scale_replicas
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
    "reload_s",
    "replica_footprint",
    "residency_round",
    "room",
]

# NOTE: the batch a replica must hold at its nominal sequence length for the placement's memory
# filter (model_size + k × batch × seq_len × kv_bytes_per_token): enough for a burst's running
# sequences; KV beyond it is the runtime's admission's to refuse (429), not the placement's.
FOOTPRINT_BATCH = 8


def kv_floor_tokens(seq_len_tokens: float, config: PlacementConfig) -> int:
    """The KV tokens an on-demand replica's VMM floor guarantees it on a shared GPU beyond its
    weights: ``memory_k`` × ``config.kv_floor_batch`` × its nominal sequence length (0 by
    default: its KV competes with its neighbours' under the watermark).

    NOTE: the footprint's whole batch (:data:`FOOTPRINT_BATCH`) as a floor held a neighbour's
    unused KV against every other model's long prompt: on bench.multimodel fits about 40 % of
    the 429s, and without it as many requests met the SLOs and more tokens did.
    """
    return math.ceil(config.memory_k * config.kv_floor_batch * max(1, round(seq_len_tokens)))


def replica_footprint(
    spec: ModelSpec, seq_len_tokens: float, overhead_bytes: int, batch: int = FOOTPRINT_BATCH
) -> ModelFootprint:
    """The placement footprint of one on-demand replica of ``spec``: its weights, the runtime's
    overhead beside them (which every model on a shared GPU holds once), and ``batch``
    sequences of its nominal length ``seq_len_tokens`` (prompt + output)."""
    return ModelFootprint.from_spec(
        spec, batch, max(1, round(seq_len_tokens)), overhead_bytes=overhead_bytes
    )


def reload_s(spec: ModelSpec, config: GearboxConfig) -> float:
    """Time to load ``spec``'s weights again after an eviction (one TP1 replica)."""
    return spec.weight_bytes / (config.weight_load_gbps * 1e9)


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
    SCALE_OUT = "scale_out"  # one more replica of a resident model
    SCALE_IN = "scale_in"  # one replica of a resident model given back, the others stay
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
    refused: int = 0  # capacity refusals (429: watermark, queue full) over the load window
    window_s: float = 60.0  # the load window
    steady_s: float = math.inf  # since its replica set last changed (inf: never changed)
    # EVICTING by the displace rule: the deployment it makes room for; COLD: the one its last
    # eviction by that rule made room for (None: none, or not so)
    evicting_for: str | None = None

    @property
    def wanted(self) -> bool:
        """Requests wait for it."""
        return self.active_requests + self.queued_requests > 0


@dataclass(frozen=True, slots=True)
class ResidencyVerdict(Serialisable):
    """One deployment's residency decision."""

    action: ResidencyAction
    reason: DecisionReason
    gpu_uuids: tuple[str, ...]  # the GPUs its target plan holds, one replica each (EVICT: none)
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
    """The model's replica on one of its GPUs as placement sees it: an eviction candidate when
    resident (evicting frees that replica's share only), else memory spoken for. The
    deployment's active and queued requests count on every replica: the view has no finer
    figures, so no replica of a model in use is ever given back."""
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
        in_transition=model.state is not Residency.RESIDENT,
        steady_s=model.steady_s,
    )


def _nodes_of(
    names: Sequence[str], models: Sequence[OnDemandModel], node_of: dict[str, str]
) -> set[str]:
    wanted = set(names)
    return {node_of[u] for m in models if m.name in wanted for u in m.gpu_uuids if u in node_of}


def _allowed(
    model: OnDemandModel, models: Sequence[OnDemandModel], snapshot: TopologySnapshot
) -> tuple[TopologySnapshot, list[str]]:
    """``snapshot`` cut to the GPUs ``model``'s pin and anti-affinity allow; notes of what was
    excluded."""
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
    return replace(snapshot, gpus=gpus), notes


def _place(
    model: OnDemandModel,
    models: Sequence[OnDemandModel],
    snapshot: TopologySnapshot,
    residents: Sequence[ResidentModel],
    config: PlacementConfig,
) -> tuple[PlacementDecision, str]:
    """Place ``model`` on the GPUs its pin and anti-affinity allow, nodes of its affine models
    first, by ``config.strategy``; with a note of what was excluded. ``snapshot`` shows what
    the round left free on each GPU."""
    allowed, notes = _allowed(model, models, snapshot)
    gpus = {g.uuid for g in allowed.gpus}
    usable = [r for r in residents if r.gpu_uuid in gpus]
    near = _nodes_of(model.affinity, models, {g.uuid: g.node for g in snapshot.gpus})
    if near:
        close = replace(snapshot, gpus=tuple(g for g in allowed.gpus if g.node in near))
        first = place_model(model.footprint, close, usable, config, _backlog(model))
        if first.status is PlacementStatus.PLACED:
            return first, "; ".join([*notes, f"affinity: near {', '.join(model.affinity)}"])
        notes.append(f"no room near {', '.join(model.affinity)}")
    decision = place_model(model.footprint, allowed, usable, config, _backlog(model))
    if decision.status is PlacementStatus.QUEUED:
        decision = _least_recently_used(model, allowed, usable, config) or decision
    return decision, "; ".join(notes)


def _demand(model: OnDemandModel) -> ReplicaDemand:
    """A resident model's demand over the load window, as the scale rule reads it."""
    return ReplicaDemand(
        arrivals=round(model.arrival_rps * model.window_s),
        refused=model.refused,
        waiting_requests=model.queued_requests,
        window_s=model.window_s,
        steady_s=model.steady_s,
    )


def _backlog(model: OnDemandModel) -> Backlog:
    """The requests waiting for ``model``'s load (its first replica), and its arrival rate."""
    return Backlog(
        model.queued_requests, model.arrival_rps, first_replica=True, wait_horizon_s=model.window_s
    )


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


@dataclass(frozen=True, slots=True)
class _Round:
    """What one round decided for every on-demand model."""

    placements: dict[str, tuple[PlacementDecision, str]]  # cold, requested: placement, note
    victims: dict[str, tuple[str, PlacementDecision]]  # evicted: (for whom, its placement)
    scales: dict[str, ScaleDecision]  # resident, not a victim: its scale decision


def _promise(
    name: str,
    decision: PlacementDecision,
    need: int,
    free: TopologySnapshot,
    residents: list[ResidentModel],
    victims: dict[str, tuple[str, PlacementDecision]],
    now_s: float,
) -> tuple[TopologySnapshot, list[ResidentModel]]:
    """Hold in the round what ``decision`` takes: a placed replica's footprint on its GPU, or
    the victims proposed (their memory stays held until confirmed) and the rest of ``need``."""
    if decision.status is PlacementStatus.PLACED:
        for uuid in decision.gpu_uuids:
            free = _take(free, uuid, need)
            promised = ResidentModel(name, uuid, need, 0, now_s, 0.0, 0.0, in_transition=True)
            residents.append(promised)
        return free, residents
    for proposal in decision.evictions:
        victims[proposal.model_name] = (name, decision)
        residents = [
            replace(r, in_transition=True) if r.model_name == proposal.model_name else r
            for r in residents
        ]
    if decision.evictions:
        uuid = decision.evictions[0].gpu_uuid
        freed = sum(p.freed_bytes for p in decision.evictions)
        free = _take(free, uuid, max(0, need - freed))
    return free, residents


def _fitted(
    model: OnDemandModel, snapshot: TopologySnapshot, config: PlacementConfig
) -> OnDemandModel:
    """``model`` with its footprint's batch cut to the most sequences that fit the largest GPU
    it may use under ``oom_watermark`` (at least one), when its whole batch fits none.

    NOTE: the footprint's batch is a floor for KV, not a limit: a model whose weights nearly
    fill the largest card (a 70B in FP8 on 80 GB) would otherwise never be placed, though it
    serves with what is left (the runtime's admission throttles it).
    """
    fp = model.footprint
    totals = [
        g.total_memory_bytes
        for g in snapshot.gpus
        if model.pin_domain is None or g.domain == model.pin_domain
    ]
    if not totals:
        return model
    cap = config.oom_watermark * max(totals)
    if fp.estimated_bytes(config.memory_k) <= cap:
        return model
    per_seq = config.memory_k * fp.seq_len_tokens * fp.kv_bytes_per_token
    batch = int((cap - fp.model_bytes - fp.overhead_bytes) // per_seq) if per_seq > 0 else 0
    if batch < 1:
        return model  # its weights alone fill the largest card: place_model says so
    return replace(model, footprint=replace(fp, batch_size=batch))


def _made_room(models: Sequence[OnDemandModel]) -> dict[str, list[str]]:
    """Model → the models the displace rule evicted for it within their load window (each
    victim cold since, its replica set changed less than ``window_s`` ago)."""
    made: dict[str, list[str]] = {}
    for m in models:
        if m.state is Residency.COLD and m.evicting_for is not None and m.steady_s < m.window_s:
            made.setdefault(m.evicting_for, []).append(m.name)
    return made


def _round(
    models: Sequence[OnDemandModel], snapshot: TopologySnapshot, config: PlacementConfig
) -> _Round:
    """Every requested cold model's placement in order, the evictions promised, then every
    other resident model's scale decision (most unmet demand first) on what is left.

    A placed model's footprint is promised on its GPU (it counts there for the models after it,
    like a loading one); a proposed eviction keeps its victim's memory held (it is not freed
    until the runtime confirms) and promises the rest of the waiting model's footprint. A
    scale-out is promised the same way, and its evictions likewise. Cold models come first: a
    model with no replica waits longer than one with one.

    NOTE: a model that a displaced model is still making room for (its eviction waits for an
    idle moment) displaces nothing else until that eviction ends: the victim's memory shows
    as held meanwhile, so the next round would take a second model in use on another GPU for
    the same replica, and a third (bench.multimodel farm seed 10: for one scale-out of
    chat-13b, models in use on five GPUs displaced within 25 s; it took one GPU, and qa-7b and
    sql-7b, evicted at their idle moment after that, were loaded again at once).

    NOTE: a model the displace rule made room for goes first once its victims are gone: the
    room was bought with a model in use, and cold models are placed before scale-outs, so
    another model took it first (bench.multimodel farm, seeds 7-11: of each seed's 12-30
    displacements that ended in an eviction, 7-22 had their GPU loaded with another model
    first; the model they were for then displaced again, or went without).
    """
    asked = {m.name: m.footprint.batch_size for m in models}
    models = [_fitted(m, snapshot, config) for m in models]
    free = room(snapshot, models, config)
    residents = [_resident(m, u, snapshot.now_s, config) for m in models for u in m.gpu_uuids]
    victims: dict[str, tuple[str, PlacementDecision]] = {}
    placements: dict[str, tuple[PlacementDecision, str]] = {}
    made = _made_room(models)
    waiting = sorted(
        (m for m in models if needs(m)),
        key=lambda m: (m.name not in made, -held_bytes(m, config), -m.queued_requests, m.name),
    )
    now_s = snapshot.now_s
    pending: dict[str, list[str]] = {}  # model → the displaced models making room for it
    for m in models:
        if m.state is Residency.EVICTING and m.evicting_for is not None:
            pending.setdefault(m.evicting_for, []).append(m.name)
    calm = replace(config, displace_in_use=False)
    scales: dict[str, ScaleDecision] = {}
    resident = sorted(
        (m for m in models if m.state is Residency.RESIDENT),
        key=lambda m: (-_demand(m).unmet, m.name),
    )

    def scale(model: OnDemandModel) -> None:
        """``model``'s scale decision on what the round left; a new replica is promised."""
        nonlocal free, residents
        allowed, _ = _allowed(model, models, free)
        # NOTE: the round's residents go by deployment name (two may serve one model)
        mine = replace(model.footprint, model_name=model.name)
        rules = calm if model.name in pending else config
        decision = scale_replicas(mine, _demand(model), allowed, residents, rules)
        scales[model.name] = decision
        if decision.placement is not None and decision.action is not ScaleAction.IN:
            need = held_bytes(model, config)
            free, residents = _promise(
                model.name, decision.placement, need, free, residents, victims, now_s
            )

    for model in resident:
        if model.name in made:
            scale(model)
    for model in waiting:
        rules = calm if model.name in pending else config
        decision, note = _place(model, models, free, residents, rules)
        if model.name in pending:
            making = f"{', '.join(pending[model.name])} making room for it: no other displaced"
            note = "; ".join(n for n in (note, making) if n)
        if model.name in made:
            first = f"first in the round: {', '.join(made[model.name])} displaced for it"
            note = "; ".join(n for n in (note, first) if n)
        if (cut := model.footprint.batch_size) < asked[model.name]:
            fits = f"batch cut to {cut} of {asked[model.name]} sequences to fit under the watermark"
            note = "; ".join(n for n in (note, fits) if n)
        placements[model.name] = (decision, note)
        need = held_bytes(model, config)
        free, residents = _promise(model.name, decision, need, free, residents, victims, now_s)
    for model in resident:
        if model.name not in made and model.name not in victims:
            scale(model)
    return _Round(placements, victims, scales)


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
        return _in_flight(mine)
    return _verdict(mine, _round(models, snapshot, config), snapshot.now_s)


def residency_round(
    models: Sequence[OnDemandModel], snapshot: TopologySnapshot, config: PlacementConfig
) -> dict[str, ResidencyVerdict]:
    """Every model's :func:`decide_residency` from one round: what each deployment decides
    for itself, computed once for all of them (the benchmark acts for every model at once)."""
    decided = _round(models, snapshot, config)
    return {
        m.name: _in_flight(m)
        if m.state in (Residency.LOADING, Residency.EVICTING)
        else _verdict(m, decided, snapshot.now_s)
        for m in models
    }


def _in_flight(mine: OnDemandModel) -> ResidencyVerdict:
    return _hold(DecisionReason.TRANSITION_IN_FLIGHT, f"{mine.name}: {mine.state.value}.")


def _verdict(mine: OnDemandModel, decided: _Round, now_s: float) -> ResidencyVerdict:
    """A cold or resident model's decision from the round."""
    me = mine.name
    placements = decided.placements
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
    if me in decided.victims:
        return _evicted(mine, decided.victims[me], now_s)
    return _scaled(mine, decided.scales.get(me))


def _evicted(
    mine: OnDemandModel, victim: tuple[str, PlacementDecision], now_s: float
) -> ResidencyVerdict:
    """A resident model proposed for eviction in the round: all its replicas go (EVICT), or an
    extra one of several (SCALE_IN)."""
    me, (needy, decision) = mine.name, victim
    mine_gone = [e for e in decision.evictions if e.model_name == me]
    gone = {e.gpu_uuid for e in mine_gone}
    keep = tuple(u for u in mine.gpu_uuids if u not in gone)
    # NOTE: place_model never proposes it; this keeps the rule local and sure. Giving back
    # some replicas of a model in use is a drain: the runtime finishes their requests there.
    rule = mine_gone[0].rule
    if mine.wanted and not keep and rule is not EvictionRule.DISPLACE:
        return _hold(DecisionReason.RESIDENT, f"{me}: resident with requests: never evicted.")
    idle = now_s - mine.last_demand_s if math.isfinite(mine.last_demand_s) else None
    since = f"idle {idle:.0f} s" if idle is not None else "never requested"
    why = {
        EvictionRule.EXTRA_REPLICA: f"{since}, no active or queued request, an extra replica",
        EvictionRule.DRAIN: "in use, an extra replica: drained, its requests finish there",
        EvictionRule.COLD: f"{since}, no active or queued request, cold, least recently used",
        EvictionRule.QUEUE: f"{since}, no active or queued request, queue rule",
        EvictionRule.DISPLACE: "in use, its last replica: drained, its requests finish there, "
        "its new ones wait for a reload",
    }[rule]
    text = (
        f"{me}: evicted from {', '.join(sorted(gone))} ({why}) to make room for {needy}"
        + (f"; {len(keep)} replicas stay. " if keep else ". ")
        + decision.explanation
    )
    if keep:
        return ResidencyVerdict(
            ResidencyAction.SCALE_IN, DecisionReason.SCALE_IN, keep, needy, decision, text
        )
    reason = {
        EvictionRule.COLD: DecisionReason.EVICT_COLD,
        EvictionRule.DISPLACE: DecisionReason.EVICT_DISPLACE,
    }.get(rule, DecisionReason.EVICT_QUEUE)
    return ResidencyVerdict(ResidencyAction.EVICT, reason, (), needy, decision, text)


def _scaled(mine: OnDemandModel, scale: ScaleDecision | None) -> ResidencyVerdict:
    """A resident model not evicted: one more replica, one fewer, or it holds."""
    me = mine.name
    if scale is None or scale.action is ScaleAction.HOLD or scale.gpu_uuid is None:
        state = "in use" if mine.wanted else "idle, but no waiting model needs its GPU"
        more = f" {scale.explanation}" if scale is not None else ""
        return _hold(DecisionReason.RESIDENT, f"{me}: resident, {state}.{more}")
    if scale.action is ScaleAction.OUT:
        gpus = tuple(sorted((*mine.gpu_uuids, scale.gpu_uuid)))
        return ResidencyVerdict(
            ResidencyAction.SCALE_OUT,
            DecisionReason.SCALE_OUT,
            gpus,
            None,
            scale.placement,
            scale.explanation,
        )
    keep = tuple(u for u in mine.gpu_uuids if u != scale.gpu_uuid)
    return ResidencyVerdict(
        ResidencyAction.SCALE_IN, DecisionReason.SCALE_IN, keep, None, None, scale.explanation
    )


def _hold(reason: DecisionReason, explanation: str) -> ResidencyVerdict:
    return ResidencyVerdict(ResidencyAction.HOLD, reason, (), None, None, explanation)
