"""On-demand models: load a cold model when it is requested, evict a cold one to make room.

An *on-demand* deployment has no plan until a request arrives for it. Every decision tick, each
on-demand deployment runs :func:`decide_residency` over the same view of all of them (their
state, demand and the GPUs they hold) and acts only for itself:

* **Round.** Cold models with requests (queued or held at the front end) are served in order —
  largest footprint first (big models need the big GPUs), then most requests waiting, then
  name. Each is placed by :func:`gearbox.placement.place_model` on the GPUs left to it: its pin
  domain only; no GPU on a node that holds a model it is anti-affine to; GPUs promised earlier in
  the round removed; GPUs on the nodes of its affine models tried first; then packed — the
  smallest GPU memory size it fits, since a GPU serves one model and a small model on a big GPU
  strands the memory a big model needs. Placed: its GPUs are promised to it. Queued: the
  least recently used resident whose eviction makes room (place_model's rule: never a model
  with active or queued requests, idle past ``cold_after_s``, worth its reload) is promised to
  it, GPU and all.
* **Me.** A cold model placed in the round loads there (``LOAD_ON_DEMAND``); queued, it waits
  (``WAITING_FOR_ROOM``, naming the evictions under way). A resident model proposed for eviction
  in the round — and with no active and no queued request, checked again here — is evicted
  (``EVICT_COLD``, naming the model it makes room for). Anything else holds.

NOTE: the runtime owns GPUs whole, so a resident model's GPU counts as full for the others (the
caller's topology shows it with no free memory) and evicting it frees the whole GPU. A model
loads as one TP1 replica.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from gearbox.config import PlacementConfig
from gearbox.decisions import DecisionReason
from gearbox.placement import (
    ModelFootprint,
    PlacementDecision,
    PlacementStatus,
    ResidentModel,
    place_model,
)
from gearbox.serde import Serialisable
from gearbox.types import TopologySnapshot

__all__ = [
    "OnDemandModel",
    "Residency",
    "ResidencyAction",
    "ResidencyVerdict",
    "decide_residency",
    "needs",
]


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


def _resident(model: OnDemandModel, snapshot: TopologySnapshot, now_s: float) -> ResidentModel:
    """The model as an eviction candidate on its (single) GPU; evicting frees the whole GPU."""
    uuid = model.gpu_uuids[0]
    total = next((g.total_memory_bytes for g in snapshot.gpus if g.uuid == uuid), 0)
    idle_s = now_s - model.last_demand_s if math.isfinite(model.last_demand_s) else now_s
    # NOTE: no arrival in the load window: the next request is expected no sooner than the
    # time the model has already waited for one (twice the idle time is a memoryless guess).
    gap_s = 1.0 / model.arrival_rps if model.arrival_rps > 0 else 2.0 * max(idle_s, 1.0)
    return ResidentModel(
        model.name,
        uuid,
        total,
        model.active_requests,
        model.last_demand_s if math.isfinite(model.last_demand_s) else 0.0,
        gap_s,
        model.reload_s,
        model.queued_requests,
    )


def _nodes_of(
    names: Sequence[str], models: Sequence[OnDemandModel], node_of: dict[str, str]
) -> set[str]:
    wanted = set(names)
    return {node_of[u] for m in models if m.name in wanted for u in m.gpu_uuids if u in node_of}


def _place(
    model: OnDemandModel,
    models: Sequence[OnDemandModel],
    snapshot: TopologySnapshot,
    residents: Sequence[ResidentModel],
    taken: set[str],
    config: PlacementConfig,
) -> tuple[PlacementDecision, str]:
    """Place ``model`` on the GPUs its pin and anti-affinity allow and the round left free,
    nodes of its affine models first; with a note of what was excluded."""
    node_of = {g.uuid: g.node for g in snapshot.gpus}
    avoid = _nodes_of(model.anti_affinity, models, node_of)
    gpus = tuple(
        g
        for g in snapshot.gpus
        if g.uuid not in taken
        and (model.pin_domain is None or g.domain == model.pin_domain)
        and g.node not in avoid
    )
    notes = []
    if model.pin_domain is not None:
        notes.append(f"pinned to domain {model.pin_domain}")
    if avoid:
        notes.append(f"anti-affinity avoids {', '.join(sorted(avoid))}")
    if taken:
        notes.append(f"{len(taken)} GPUs promised earlier this round")
    allowed = replace(snapshot, gpus=gpus)
    usable = [r for r in residents if r.gpu_uuid in {g.uuid for g in gpus}]
    near = _nodes_of(model.affinity, models, node_of)
    if near:
        close = replace(snapshot, gpus=tuple(g for g in gpus if g.node in near))
        first = place_model(model.footprint, close, usable, config)
        if first.status is PlacementStatus.PLACED:
            return first, "; ".join([*notes, f"affinity: near {', '.join(model.affinity)}"])
        notes.append(f"no room near {', '.join(model.affinity)}")
    for size in sorted({g.total_memory_bytes for g in gpus}):
        tier = replace(snapshot, gpus=tuple(g for g in gpus if g.total_memory_bytes == size))
        packed = place_model(model.footprint, tier, usable, config)
        if packed.status is PlacementStatus.PLACED:
            return packed, "; ".join([*notes, f"packed on {size / 2**30:.0f} GiB GPUs"])
    decision = place_model(model.footprint, allowed, usable, config)
    if decision.status is PlacementStatus.QUEUED:
        decision = _least_recently_used(model, allowed, usable, config) or decision
    return decision, "; ".join(notes)


def _least_recently_used(
    model: OnDemandModel,
    allowed: TopologySnapshot,
    residents: Sequence[ResidentModel],
    config: PlacementConfig,
) -> PlacementDecision | None:
    """The eviction of the least recently used resident that makes room for ``model`` (ties:
    name), as place_model proposes it on that resident's GPU; None when none does.

    NOTE: place_model ranks GPUs by fewest evictions, then bytes freed, then uuid; with one
    model per GPU every GPU needs one eviction, so its choice alone falls back to the uuid.
    """
    by_uuid = {g.uuid: g for g in allowed.gpus}
    for resident in sorted(residents, key=lambda r: (r.last_request_s, r.model_name)):
        gpu = by_uuid.get(resident.gpu_uuid)
        if gpu is None:
            continue
        alone = replace(allowed, gpus=(gpu,))
        decision = place_model(model.footprint, alone, [resident], config)
        if decision.evictions:
            return decision
    return None


def _round(
    models: Sequence[OnDemandModel], snapshot: TopologySnapshot, config: PlacementConfig
) -> tuple[dict[str, tuple[PlacementDecision, str]], dict[str, str]]:
    """Every requested cold model's placement in order, and the evictions promised (victim →
    the model it makes room for)."""
    taken: set[str] = set()
    victims: dict[str, str] = {}
    placements: dict[str, tuple[PlacementDecision, str]] = {}
    waiting = sorted(
        (m for m in models if needs(m)),
        key=lambda m: (-m.footprint.estimated_bytes(config.memory_k), -m.queued_requests, m.name),
    )
    for model in waiting:
        residents = [
            _resident(m, snapshot, snapshot.now_s)
            for m in models
            if m.state is Residency.RESIDENT
            and m.name not in victims
            and len(m.gpu_uuids) == 1
            and m.gpu_uuids[0] not in taken
        ]
        decision, note = _place(model, models, snapshot, residents, taken, config)
        placements[model.name] = (decision, note)
        if decision.status is PlacementStatus.PLACED:
            taken.update(decision.gpu_uuids)
            continue
        for proposal in decision.evictions:
            victims[proposal.model_name] = model.name
            taken.add(proposal.gpu_uuid)
    return placements, victims


def decide_residency(
    me: str,
    models: Sequence[OnDemandModel],
    snapshot: TopologySnapshot,
    config: PlacementConfig,
) -> ResidencyVerdict:
    """``me``'s decision from the round over ``models`` (``me`` among them) on ``snapshot``,
    whose GPUs held by any deployment show no free memory. Deterministic; see the module
    docstring."""
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
    text = (
        f"{me}: evicted from {', '.join(mine.gpu_uuids)} ({since}, no active or queued request,"
        f" least recently used) to make room for {needy}."
    )
    return ResidencyVerdict(
        ResidencyAction.EVICT, DecisionReason.EVICT_COLD, (), needy, placements[needy][0], text
    )


def _hold(reason: DecisionReason, explanation: str) -> ResidencyVerdict:
    return ResidencyVerdict(ResidencyAction.HOLD, reason, (), None, None, explanation)
