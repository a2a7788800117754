"""Candidate deployments for one tick: blocks → options → assemblies → estimates, ranked.

This is the planner's entry point (what ``bench/planner.py`` times). It also checks whether the
current deployment is still feasible on the snapshot, which decides forced switches.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gearbox.assemble import Unit, assemble, kept_unit
from gearbox.blocks import AtomicBlock
from gearbox.candidates import enumerate_options
from gearbox.config import GearboxConfig
from gearbox.cost import replica_capacity, replica_shape
from gearbox.model import ModelSpec
from gearbox.plans import DeploymentPlan
from gearbox.scoring import DeploymentEstimate, demand_rps, estimate_deployment, request_profile
from gearbox.types import LoadSnapshot, TopologySnapshot

__all__ = [
    "RankedCandidate",
    "available_memory",
    "current_units",
    "deployment_stability",
    "estimate_plan",
    "held_gpus",
    "plan_problems",
    "rank_candidates",
]


@dataclass(frozen=True, slots=True)
class RankedCandidate:
    """A candidate deployment with its estimate, ranked by utility."""

    plan: DeploymentPlan
    estimate: DeploymentEstimate
    stability: float  # capacity-weighted stability factor of its blocks (1 = stable)
    strategy: str  # assembly strategy that produced it


def available_memory(snapshot: TopologySnapshot, own_gpus: frozenset[str]) -> dict[str, int]:
    """Bytes a plan may use on each live GPU: free memory, or all of it on the deployment's own.

    NOTE: the deployment's own GPUs report its weights and KV as used; a new plan for the same
    deployment reuses that memory, so those GPUs count at total memory.
    """
    return {
        g.uuid: g.total_memory_bytes if g.uuid in own_gpus else g.free_memory_bytes
        for g in snapshot.gpus
        if snapshot.gpu_is_live(g)
    }


def _block_of(blocks: Sequence[AtomicBlock]) -> dict[str, str]:
    return {u: b.block_id for b in blocks for u in b.gpu_uuids}


def plan_problems(
    plan: DeploymentPlan,
    blocks: Sequence[AtomicBlock],
    available: Mapping[str, int],
    model: ModelSpec,
    load: LoadSnapshot,
    config: GearboxConfig,
) -> tuple[str, ...]:
    """Why ``plan`` cannot run on this snapshot (empty when it can), sorted."""
    block_of = _block_of(blocks)
    prompt, output = request_profile(load, config)
    problems: set[str] = set()
    for replica in plan.replicas:
        for stage in replica.stages:
            lost = [u for u in stage.gpu_uuids if u not in block_of]
            problems.update(f"gpu {u} is not live" for u in lost)
            if not lost and len({block_of[u] for u in stage.gpu_uuids}) > 1:
                problems.add(f"stage on {stage.block_id} now spans several blocks")
        if any(u not in block_of for u in replica.gpu_uuids):
            continue
        shape = replica_shape(replica, available)
        if not replica_capacity(shape, model, prompt, output, config).feasible:
            problems.add(f"replica {replica.plan_id} no longer fits in memory")
    return tuple(sorted(problems))


def current_units(
    plan: DeploymentPlan,
    blocks: Sequence[AtomicBlock],
    available: Mapping[str, int],
    model: ModelSpec,
    load: LoadSnapshot,
    config: GearboxConfig,
) -> tuple[Unit, ...]:
    """The current replicas that still run: live GPUs, TP inside one block, memory fits."""
    block_of = _block_of(blocks)
    prompt, output = request_profile(load, config)
    units = []
    for replica in plan.replicas:
        stage_blocks = [{block_of.get(u) for u in s.gpu_uuids} for s in replica.stages]
        if any(None in ids or len(ids) != 1 for ids in stage_blocks):
            continue
        shape = replica_shape(replica, available)
        capacity = replica_capacity(shape, model, prompt, output, config)
        if capacity.feasible:
            block_ids = tuple(sorted({i for ids in stage_blocks for i in ids if i is not None}))
            units.append(kept_unit(replica, shape, capacity, block_ids))
    return tuple(units)


def estimate_plan(
    plan: DeploymentPlan,
    available: Mapping[str, int],
    model: ModelSpec,
    load: LoadSnapshot,
    config: GearboxConfig,
    *,
    service_factor: float = 1.0,
) -> DeploymentEstimate:
    """Estimate an arbitrary deployment plan (e.g. the current one) on this snapshot, its
    queues' service rate × ``service_factor`` (:func:`gearbox.scoring.estimate_deployment`)."""
    shapes = [replica_shape(r, available) for r in plan.replicas]
    return estimate_deployment(
        shapes, plan.num_gpus, model, load, config, service_factor=service_factor
    )


def deployment_stability(units: Sequence[Unit], stability: Mapping[str, float]) -> float:
    """Capacity-weighted mean of each replica's weakest block stability."""
    total = sum(u.capacity.capacity_rps for u in units)
    if total <= 0:
        return 1.0
    weighted = sum(
        u.capacity.capacity_rps * min(stability.get(b, 1.0) for b in u.block_ids) for u in units
    )
    return weighted / total


def _materialise(deployment: str, model: ModelSpec, units: Sequence[Unit]) -> DeploymentPlan:
    return DeploymentPlan(deployment, model.name, tuple(u.plan(model.name) for u in units))


def held_gpus(current: DeploymentPlan | None, blocks: Sequence[AtomicBlock]) -> frozenset[str]:
    """GPUs a new replica may not use: those of the current replicas that still run.

    The executor loads a target's new replicas before it releases the current plan's (prepare
    → switch → cleanup), so a current replica's memory is still taken while new replicas load;
    reusing its GPUs in place would not fit. A current replica that lost a GPU is dead and its
    memory is gone (the runtime fails it and releases its reservations), so its surviving GPUs
    are free. Replicas kept unchanged in a target are untouched by the transition.
    """
    if current is None:
        return frozenset()
    live = {u for b in blocks for u in b.gpu_uuids}
    return frozenset(
        u for r in current.replicas if live.issuperset(r.gpu_uuids) for u in r.gpu_uuids
    )


def rank_candidates(
    snapshot: TopologySnapshot,
    blocks: Sequence[AtomicBlock],
    model: ModelSpec,
    load: LoadSnapshot,
    config: GearboxConfig,
    *,
    deployment: str,
    current: DeploymentPlan | None = None,
    stability: Mapping[str, float] | None = None,
    available: Mapping[str, int] | None = None,
) -> tuple[RankedCandidate, ...]:
    """Feasible candidate deployments, best utility first (ties broken by plan id).

    A candidate keeps current replicas unchanged or adds new replicas on GPUs no running current
    replica holds (:func:`held_gpus`): the runtime loads new replicas before it releases old
    ones, so reusing such a GPU in place would not fit. Deterministic for equal inputs.
    ``stability`` maps block id → factor (default: all 1); ``available`` is
    :func:`available_memory` for ``current``'s GPUs, when the caller has it already.
    """
    factors = stability or {}
    if available is None:
        own = current.gpu_uuids if current is not None else frozenset()
        available = available_memory(snapshot, own)
    prompt, output = request_profile(load, config)
    held = held_gpus(current, blocks)
    fresh = {u: b for u, b in available.items() if u not in held}
    options = enumerate_options(blocks, snapshot, model, prompt, output, fresh, config)
    kept = current_units(current, blocks, available, model, load, config) if current else ()
    demand = max(demand_rps(load, config) * config.capacity_headroom, math.ulp(1.0))
    ranked: dict[str, RankedCandidate] = {}
    for assembly in assemble(options, demand, output, factors, kept):
        plan = _materialise(deployment, model, assembly.units)
        if plan.plan_id in ranked:
            continue
        shapes = [u.shape for u in assembly.units]
        estimate = estimate_deployment(shapes, plan.num_gpus, model, load, config)
        if estimate.feasible:
            steadiness = deployment_stability(assembly.units, factors)
            ranked[plan.plan_id] = RankedCandidate(plan, estimate, steadiness, assembly.strategy)
    return tuple(sorted(ranked.values(), key=lambda c: (-c.estimate.utility_tok_s, c.plan.plan_id)))
