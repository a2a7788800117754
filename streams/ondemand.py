"""On-demand deployments as the residency rule sees them, and their decision (pure).

The live decider and the offline replay both build the view with :func:`on_demand_view` from
the same tables (every deployment's plan state and serving windows) and decide with
:func:`residency_result`, which wraps :func:`gearbox.residency.decide_residency` into the
:class:`~gearbox.decisions.DecideResult` the step publishes: a load is a switch from no plan
(or the empty plan an eviction left) to a one-replica plan, an eviction a switch to the empty
plan, a scale-out or scale-in a switch to the plan with one replica more or fewer (the others
kept as they are). All are voluntary, so the step's in-flight guard holds them like any other
switch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Protocol, TypeVar

from gearbox.config import GearboxConfig, PlacementConfig
from gearbox.decisions import DecideResult, Decision, DecisionReason, Trigger
from gearbox.history import GearState
from gearbox.model import ModelSpec
from gearbox.placement import ModelFootprint
from gearbox.plans import DeploymentPlan, ExecutionPlan
from gearbox.residency import (
    FOOTPRINT_BATCH,
    OnDemandModel,
    Residency,
    ResidencyAction,
    decide_residency,
    reload_s,
    replica_footprint,
)
from gearbox.starting import unified_stage
from gearbox.switch import SwitchCost
from gearbox.types import TopologySnapshot
from streams.deployments import Deployment
from streams.load import ServingAggregate, ServingWindows, serving_aggregate
from streams.windows import HoppingWindow


class PlanView(Protocol):
    """What the view reads of a deployment's plan state (:class:`streams.step.PlanState`, which
    imports this module)."""

    @property
    def current(self) -> DeploymentPlan | None:
        """The plan the loop assumes."""
        ...

    @property
    def confirmed(self) -> DeploymentPlan | None:
        """The plan a runtime last confirmed."""
        ...

    @property
    def in_flight(self) -> object | None:
        """The decision the runtime has not finished yet."""
        ...

    @property
    def last_demand_ms(self) -> int:
        """Event time it last had requests (-1: never)."""
        ...

    @property
    def changed_ms(self) -> int:
        """Event time a finished transition last changed its plan (-1: never)."""
        ...

    @property
    def evicting_for(self) -> str | None:
        """The deployment its last eviction by the displace rule made room for (None: none)."""
        ...


__all__ = [
    "FOOTPRINT_BATCH",
    "footprint",
    "is_on_demand",
    "on_demand_view",
    "residency_of",
    "residency_result",
    "round_plans",
]

P = TypeVar("P")


def is_on_demand(dep: Deployment) -> bool:
    """Whether ``dep`` is loaded on demand."""
    return dep.residency == "on_demand"


def residency_of(
    current: DeploymentPlan | None, confirmed: DeploymentPlan | None, in_flight: bool
) -> tuple[Residency, tuple[str, ...]]:
    """Where a deployment stands from its assumed and confirmed plans, and the GPUs either
    holds."""
    cur = current.gpu_uuids if current is not None else frozenset()
    conf = confirmed.gpu_uuids if confirmed is not None else frozenset()
    gpus = tuple(sorted(cur | conf))
    same = (current.plan_id if current else None) == (confirmed.plan_id if confirmed else None)
    if in_flight or not same:
        if cur:
            return (Residency.LOADING if cur != conf else Residency.RESIDENT), gpus
        return (Residency.EVICTING if conf else Residency.COLD), gpus
    return (Residency.RESIDENT if conf else Residency.COLD), gpus


def footprint(dep: Deployment, gearbox: GearboxConfig) -> ModelFootprint:
    """The placement footprint of ``dep``'s replica (:func:`gearbox.residency.replica_footprint`
    at its nominal prompt + output)."""
    seq = dep.nominal.prompt_tokens + dep.nominal.output_tokens
    return replica_footprint(dep.model, seq, gearbox.runtime_overhead_bytes)


def _model(
    dep: Deployment,
    state: tuple[Residency, tuple[str, ...]],
    load: ServingAggregate,
    times_ms: tuple[int, int],
    window: HoppingWindow,
    now_s: float,
    gearbox: GearboxConfig,
    evicting_for: str | None = None,
) -> OnDemandModel:
    last_demand_ms, changed_ms = times_ms
    demand = load.arrival_rate_rps > 0 or load.queue_len > 0 or load.active_sequences > 0
    last_s = now_s if demand else (last_demand_ms / 1000.0 if last_demand_ms >= 0 else -math.inf)
    return OnDemandModel(
        name=dep.name,
        footprint=footprint(dep, gearbox),
        state=state[0],
        gpu_uuids=state[1],
        active_requests=load.active_sequences,
        queued_requests=load.queue_len,
        last_demand_s=last_s,
        arrival_rps=load.arrival_rate_rps,
        reload_s=reload_s(dep.model, gearbox),
        pin_domain=dep.pin_domain,
        affinity=dep.affinity,
        anti_affinity=dep.anti_affinity,
        refused=load.num_ttft_refused,
        window_s=window.size_s,
        steady_s=now_s - changed_ms / 1000.0 if changed_ms >= 0 else math.inf,
        # NOTE: cold after that eviction too: the round gives the room it made to that model
        # first, within the load window (gearbox.residency)
        evicting_for=evicting_for if state[0] in (Residency.EVICTING, Residency.COLD) else None,
    )


def on_demand_view(
    deployments: Sequence[Deployment],
    plans: Mapping[str, PlanView],
    serving: Mapping[str, ServingWindows],
    window: HoppingWindow,
    now_s: float,
    gearbox: GearboxConfig,
) -> tuple[OnDemandModel, ...]:
    """Every on-demand deployment's state, demand and GPUs at ``now_s``.

    ``plans`` and ``serving``: each deployment's plan state and serving windows (a missing one
    is cold and idle). Empty when no deployment is on demand.
    """
    out = []
    for dep in deployments:
        if not is_on_demand(dep):
            continue
        plan = plans.get(dep.name)
        load = serving_aggregate(serving.get(dep.name, ServingWindows()), window, now_s)
        if plan is None:
            state, times, evicting_for = residency_of(None, None, False), (-1, -1), None
        else:
            in_flight = plan.in_flight is not None
            state = residency_of(plan.current, plan.confirmed, in_flight)
            times, evicting_for = (plan.last_demand_ms, plan.changed_ms), plan.evicting_for
        out.append(_model(dep, state, load, times, window, now_s, gearbox, evicting_for))
    return tuple(out)


def round_plans(
    plans: Mapping[str, P], start: Mapping[str, P], deployments: Sequence[Deployment]
) -> dict[str, P]:
    """The plans an on-demand deployment's step reads in a batch of decisions: the on-demand
    deployments' as the batch began (``start``), the others' as decided so far (``plans``).

    NOTE: each on-demand deployment decides for itself, from one round over all of them
    (:mod:`gearbox.residency`). Were a victim's eviction, decided earlier in the batch, in a
    later deployment's view, that round would hold the victim's memory (not freed until
    confirmed) and look for room elsewhere: one many-models run evicted two models for one
    waiting model, one of them from the GPU no longer meant for it.
    """
    on_demand = {d.name for d in deployments if is_on_demand(d)}
    out = {n: p for n, p in plans.items() if n not in on_demand}
    out.update((n, p) for n, p in start.items() if n in on_demand)
    return out


def _replica(model: ModelSpec, uuid: str, snapshot: TopologySnapshot) -> ExecutionPlan:
    gpu = next(g for g in snapshot.gpus if g.uuid == uuid)
    return ExecutionPlan(model.name, (unified_stage([gpu], (0, model.num_layers), snapshot),))


def residency_result(
    dep: Deployment,
    current: DeploymentPlan | None,
    view: Sequence[OnDemandModel],
    snapshot: TopologySnapshot,
    gear: GearState,
    placement: PlacementConfig,
    trigger: Trigger,
) -> tuple[DecideResult, str | None]:
    """``dep``'s residency decision as the step's result (``gear`` passes through unchanged),
    and the deployment its eviction makes room for when the displace rule evicts it (else
    None)."""
    verdict = decide_residency(dep.name, view, snapshot, placement)
    decision = None
    if verdict.action is not ResidencyAction.HOLD:
        # NOTE: a replica that stays is the same plan (same id): the transition keeps it
        # serving and loads or drains only the replicas added or removed
        kept = {r.gpu_uuids: r for r in current.replicas} if current is not None else {}
        replicas = tuple(
            kept.get((u,)) or _replica(dep.model, u, snapshot) for u in verdict.gpu_uuids
        )
        target = DeploymentPlan(dep.name, dep.model.name, replicas)
        mine = next(m for m in view if m.name == dep.name)
        added = sum(1 for r in replicas if r.gpu_uuids not in kept)
        load_s = mine.reload_s if added else 0.0
        cost = replace(
            SwitchCost.zero(),
            weights_bytes=dep.model.weight_bytes * added,
            weights_load_s=load_s,
            duration_s=load_s,
        )
        decision = Decision(
            deployment=dep.name,
            now_s=snapshot.now_s,
            trigger=trigger,
            reason=verdict.reason,
            forced=False,
            from_plan_id=current.plan_id if current is not None else None,
            to_plan_id=target.plan_id,
            to_plan=target,
            candidates=(),
            switch_cost=cost,
            explanation=verdict.explanation,
        )
    displaced = verdict.reason is DecisionReason.EVICT_DISPLACE
    result = DecideResult(
        decision=decision,
        reason=verdict.reason,
        trigger=trigger,
        current=None,
        candidates=(),
        problems=(),
        explanation=verdict.explanation,
        state=gear,
    )
    return result, verdict.for_model if displaced else None
