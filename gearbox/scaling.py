"""Replica scale-out and scale-in for a resident model (pure): one rule for the live residency
round and the multi-model benchmark.

A model is placed with as many replicas as it needs to start (one, on demand); when its demand
outgrows them it gets one more, and an extra one that sits idle is given back:

* **Out.** Over the last window the requests its replicas refused for want of room (429s:
  watermark, queue full) plus those waiting now (queued at a replica or held) — its *unmet*
  demand — reach ``scale_out_unmet_share`` of its arrivals and at least
  ``eviction_reload_factor`` requests (a stray refusal does not buy a load), up to
  :func:`max_replicas` (``max_replicas_per_model``, or ``max_replica_share`` of the GPUs the
  model may use on a fleet large enough that this is more). One replica is
  placed by :func:`gearbox.placement.place_model` (memory filter on free memory minus what is
  held, the watermark, the concurrency cap, ``strategy``) on a GPU that does not hold the model,
  a node without one of its replicas first (anti-affinity). No GPU fits: it holds, and the
  placement's eviction proposals are the caller's to apply — idle extra replicas, cold models,
  and idle models by the queue rule, its backlog being the unmet demand (the requests waiting
  now, and the unmet ones' rate over the window: what the new replica would take over the
  victim's reload), outweighing the victim's expected loss by ``eviction_reload_factor``.
* **In.** With nothing unmet, a replica beyond the model's minimum with no active and no queued
  request, idle for ``eviction_reload_factor`` × its reload (place_model's minimum residence),
  is given back, the longest idle first. An extra replica is also the first thing
  place_model evicts for another model (:class:`~gearbox.placement.EvictionRule`).
* **Hysteresis.** Nothing while a replica of the model loads or leaves; no scale-out until the
  window has been counted entirely with the current replicas (``steady_s >= window_s``: the
  refusals that asked for the last replica do not ask again); at most one replica per
  decision; out needs unmet demand, in needs none and a long idle replica, so the two never
  alternate on one window's figures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from gearbox.config import PlacementConfig
from gearbox.placement import (
    Backlog,
    ModelFootprint,
    PlacementDecision,
    PlacementStatus,
    ResidentModel,
    place_model,
)
from gearbox.serde import Serialisable
from gearbox.types import TopologySnapshot

__all__ = [
    "ReplicaDemand",
    "ScaleAction",
    "ScaleDecision",
    "ScaleReason",
    "max_replicas",
    "scale_replicas",
]


class ScaleAction(StrEnum):
    """What the rule proposes for the model's replica set."""

    OUT = "scale_out"  # one more replica, on ``gpu_uuid``
    IN = "scale_in"  # give back the replica on ``gpu_uuid``
    HOLD = "hold"


class ScaleReason(StrEnum):
    """Why — the rule that decided."""

    UNMET_DEMAND = "unmet_demand"  # OUT: refused + waiting over the threshold
    IDLE_EXTRA_REPLICA = "idle_extra_replica"  # IN: an extra replica idle past its residence
    NOT_RESIDENT = "not_resident"  # no replica: loading a cold model is placement's job
    REPLICA_IN_TRANSITION = "replica_in_transition"  # a replica loads or leaves
    WINDOW_NOT_STEADY = "window_not_steady"  # the window still counts the old replica set
    AT_MAX_REPLICAS = "at_max_replicas"  # unmet, but max_replicas reached
    NO_ROOM = "no_room"  # unmet, but no GPU fits another replica (evictions proposed, if any)
    STEADY = "steady"  # its replicas serve its demand


@dataclass(frozen=True, slots=True)
class ReplicaDemand(Serialisable):
    """A resident model's demand over the last window, against what its replicas took."""

    arrivals: int  # requests that arrived over the window
    refused: int  # of them, refused for capacity (429: watermark, queue full)
    waiting_requests: int  # queued at its replicas or held for it, now
    window_s: float  # the window's length
    steady_s: float  # time since its replica set last changed (inf: never changed)
    min_replicas: int = 1  # never scaled in below this (the catalogue's, or one on demand)

    @property
    def unmet(self) -> int:
        """Requests its replicas turned away or kept waiting."""
        return self.refused + self.waiting_requests

    def backlog(self) -> Backlog:
        """The unmet demand as a placement backlog: waiting now, and arriving at the window's
        unmet rate."""
        return Backlog(self.waiting_requests, self.unmet / self.window_s if self.window_s else 0.0)


@dataclass(frozen=True, slots=True)
class ScaleDecision(Serialisable):
    """One model's scale decision, with its reason and explanation."""

    model_name: str
    action: ScaleAction
    reason: ScaleReason
    gpu_uuid: str | None  # OUT: the new replica's GPU; IN: the replica given back
    placement: PlacementDecision | None  # OUT and NO_ROOM: place_model's decision
    explanation: str


def max_replicas(config: PlacementConfig, num_gpus: int) -> int:
    """The most replicas one model may hold on a fleet of ``num_gpus`` GPUs it may use: the
    larger of ``max_replicas_per_model`` and ``max_replica_share`` of them.

    NOTE: a fixed count alone held a large fleet's hottest model to a small one's share: on
    bench.multimodel farm (12 GPUs, Zipf popularity, the top model about a third of the load)
    models at 4 replicas refused 7.6 % of the offered tokens (seeds 7-11 pooled), long prompts
    their own replicas' KV could not hold, while half the fleet stayed with the other models.
    """
    return max(config.max_replicas_per_model, math.floor(config.max_replica_share * num_gpus))


def _hold(name: str, reason: ScaleReason, text: str) -> ScaleDecision:
    return ScaleDecision(name, ScaleAction.HOLD, reason, None, None, f"{name}: {text}.")


def _place_extra(
    request: ModelFootprint,
    snapshot: TopologySnapshot,
    residents: Sequence[ResidentModel],
    holding: set[str],
    config: PlacementConfig,
    backlog: Backlog,
) -> PlacementDecision:
    """One replica on a GPU that does not hold the model: nodes without one of its replicas
    first, then any (place_model's own anti-affinity sees a single replica only)."""
    nodes = {g.node for g in snapshot.gpus if g.uuid in holding}
    others = tuple(g for g in snapshot.gpus if g.uuid not in holding)
    one = replace(request, num_replicas=1)
    away = tuple(g for g in others if g.node not in nodes)
    if away and len(away) < len(others):
        decision = place_model(one, replace(snapshot, gpus=away), residents, config)
        if decision.status is PlacementStatus.PLACED:
            return decision
    return place_model(one, replace(snapshot, gpus=others), residents, config, backlog)


def _scale_in(
    name: str, mine: Sequence[ResidentModel], now_s: float, config: PlacementConfig
) -> ScaleDecision:
    """Give back the longest idle replica that has settled, if any."""
    idle = [
        r
        for r in mine
        if r.active_requests == 0
        and r.queued_requests == 0
        and now_s - r.last_request_s >= r.reload_s * config.eviction_reload_factor
    ]
    if not idle:
        return _hold(name, ScaleReason.STEADY, "every extra replica is in use or recently used")
    victim = min(idle, key=lambda r: (r.last_request_s, r.gpu_uuid))
    text = (
        f"{name}: give back the replica on {victim.gpu_uuid} (idle "
        f"{now_s - victim.last_request_s:.0f} s ≥ {config.eviction_reload_factor:g} × its "
        f"{victim.reload_s:.0f} s reload, no active or queued request, nothing unmet); "
        f"{len(mine) - 1} stay."
    )
    return ScaleDecision(
        name, ScaleAction.IN, ScaleReason.IDLE_EXTRA_REPLICA, victim.gpu_uuid, None, text
    )


def scale_replicas(
    request: ModelFootprint,
    demand: ReplicaDemand,
    snapshot: TopologySnapshot,
    residents: Sequence[ResidentModel],
    config: PlacementConfig,
) -> ScaleDecision:
    """Scale ``request.model_name``'s replicas by one, or hold (see the module docstring).

    ``residents``: every loaded model instance, the model's own replicas among them;
    ``snapshot``: free memory as what is held leaves it. Deterministic; never proposes giving
    back a replica with an active or queued request, nor the model's last one.
    """
    name = request.model_name
    mine = [r for r in residents if r.model_name == name]
    if not mine:
        return _hold(name, ScaleReason.NOT_RESIDENT, "no replica")
    if any(r.in_transition for r in mine):
        return _hold(name, ScaleReason.REPLICA_IN_TRANSITION, "a replica is loading or leaving")
    n, unmet = len(mine), demand.unmet
    threshold = max(config.eviction_reload_factor, config.scale_out_unmet_share * demand.arrivals)
    figures = (
        f"{demand.refused} refused + {demand.waiting_requests} waiting of {demand.arrivals} "
        f"arrivals over {demand.window_s:.0f} s on {n} replica{'' if n == 1 else 's'}"
    )
    if unmet == 0:
        if n > demand.min_replicas:
            return _scale_in(name, mine, snapshot.now_s, config)
        return _hold(name, ScaleReason.STEADY, f"nothing unmet ({figures})")
    if unmet < threshold:
        return _hold(name, ScaleReason.STEADY, f"{figures}: under {threshold:.1f}")
    if n >= max_replicas(config, len(snapshot.gpus)):
        return _hold(name, ScaleReason.AT_MAX_REPLICAS, f"{figures}; at the maximum {n}")
    if demand.steady_s < demand.window_s:
        return _hold(
            name,
            ScaleReason.WINDOW_NOT_STEADY,
            f"{figures}; its replicas changed {demand.steady_s:.0f} s ago",
        )
    holding = {r.gpu_uuid for r in mine}
    placement = _place_extra(request, snapshot, residents, holding, config, demand.backlog())
    if placement.status is not PlacementStatus.PLACED:
        text = f"{name}: {figures}, but no GPU fits another replica. {placement.explanation}"
        return ScaleDecision(name, ScaleAction.HOLD, ScaleReason.NO_ROOM, None, placement, text)
    uuid = placement.gpu_uuids[0]
    text = f"{name}: {figures} ≥ {threshold:.1f}: one more replica on {uuid}. "
    return ScaleDecision(
        name,
        ScaleAction.OUT,
        ScaleReason.UNMET_DEMAND,
        uuid,
        placement,
        text + placement.explanation,
    )
