"""Assembling deployments from replica options: a few greedy strategies, not a search.

Each strategy orders the options by one preference and takes copies until the capacity covers
demand × ``capacity_headroom`` (at least one replica, each block used by one option):

* ``latency`` — lowest unloaded request latency first (latency-critical traffic);
* ``efficiency`` — most requests per second per GPU first (frees GPUs);
* ``stability`` — blocks least likely to shrink first, then efficiency;
* ``capacity`` — largest total option first (fewest blocks);
* ``incremental`` — keep the current deployment's still-feasible replicas, trimming the weakest
  when over-provisioned or topping up by efficiency when short (the cheapest switch).

The number of strategies is fixed, so assembly is linear in the number of options.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from gearbox.candidates import ReplicaOption
from gearbox.cost import ReplicaCapacity, ReplicaShape
from gearbox.plans import ExecutionPlan

__all__ = ["Assembly", "Unit", "assemble", "kept_unit", "option_units"]


@dataclass(frozen=True, slots=True)
class Unit:
    """One replica of a candidate deployment: a copy of an option, or a kept current replica."""

    key: str  # unique within one call
    shape: ReplicaShape
    capacity: ReplicaCapacity
    block_ids: tuple[str, ...]
    num_gpus: int
    option: ReplicaOption | None = None
    copy_index: int = 0
    kept: ExecutionPlan | None = None

    def plan(self, model_name: str) -> ExecutionPlan:
        """The replica as an execution plan."""
        if self.kept is not None:
            return self.kept
        assert self.option is not None
        return self.option.plan(model_name, self.copy_index)


@dataclass(frozen=True, slots=True)
class Assembly:
    """A candidate deployment before materialisation."""

    strategy: str
    units: tuple[Unit, ...]


def option_units(option: ReplicaOption) -> tuple[Unit, ...]:
    """Every copy of ``option`` as a unit, best copy first."""
    return tuple(
        Unit(
            f"{option.label}#{i}",
            copy.shape,
            copy.capacity,
            option.block_ids,
            option.gpus_per_copy,
            option=option,
            copy_index=i,
        )
        for i, copy in enumerate(option.copies)
    )


def kept_unit(
    plan: ExecutionPlan,
    shape: ReplicaShape,
    capacity: ReplicaCapacity,
    block_ids: tuple[str, ...],
) -> Unit:
    """A current replica offered for keeping."""
    return Unit(plan.plan_id, shape, capacity, block_ids, len(plan.gpu_uuids), kept=plan)


def _fill(
    ordered: Sequence[ReplicaOption],
    demand_rps: float,
    seed: Sequence[Unit] = (),
) -> tuple[Unit, ...]:
    taken = list(seed)
    used = {b for u in seed for b in u.block_ids}
    remaining = demand_rps - sum(u.capacity.capacity_rps for u in seed)
    for option in ordered:
        if taken and remaining <= 0:
            break
        if used.intersection(option.block_ids):
            continue
        used.update(option.block_ids)
        for unit in option_units(option):
            if taken and remaining <= 0:
                break
            taken.append(unit)
            remaining -= unit.capacity.capacity_rps
    return tuple(taken)


def _trim(kept: Sequence[Unit], demand_rps: float) -> tuple[Unit, ...]:
    units = sorted(kept, key=lambda u: (u.capacity.capacity_rps, u.key))
    total = sum(u.capacity.capacity_rps for u in units)
    while len(units) > 1 and total - units[0].capacity.capacity_rps >= demand_rps:
        total -= units.pop(0).capacity.capacity_rps
    return tuple(units)


class _Row(NamedTuple):
    option: ReplicaOption
    label: str
    per_gpu: float  # requests per second per GPU of the best copy
    latency_s: float  # unloaded request latency of the best copy
    steadiness: float  # the weakest block's stability factor
    total_rps: float  # capacity of all copies


def _orders(
    options: Sequence[ReplicaOption], stability: Mapping[str, float], output_tokens: int
) -> dict[str, list[ReplicaOption]]:
    """Each strategy's preference order over the options, ties broken by label.

    NOTE: each option's figures are computed once, not inside the sort keys: four strategies
    (five with ``incremental``) sort every option, and the keys called properties that add up
    the option's GPUs and copies each time.
    """
    rows = []
    for o in options:
        best = o.copies[0].capacity
        rows.append(
            _Row(
                o,
                o.label,
                best.capacity_rps / o.gpus_per_copy,
                best.prefill_latency_s + output_tokens * best.unloaded_tbt_s,
                min(stability.get(b, 1.0) for b in o.block_ids),
                o.total_rps,
            )
        )
    keys: dict[str, Callable[[_Row], tuple[float | str, ...]]] = {
        "latency": lambda r: (r.latency_s, -r.per_gpu, r.label),
        "efficiency": lambda r: (-r.per_gpu, r.latency_s, r.label),
        "stability": lambda r: (-r.steadiness, -r.per_gpu, r.label),
        "capacity": lambda r: (-r.total_rps, r.latency_s, r.label),
    }
    return {name: [r.option for r in sorted(rows, key=key)] for name, key in keys.items()}


def assemble(
    options: Sequence[ReplicaOption],
    demand_rps: float,
    output_tokens: int,
    stability: Mapping[str, float],
    kept: Sequence[Unit] = (),
) -> tuple[Assembly, ...]:
    """Candidate deployments from every strategy, duplicates removed, in strategy order.

    ``demand_rps`` should already include the headroom. ``kept`` are the current deployment's
    feasible replicas (empty for a first placement).
    """
    orders = _orders(options, stability, output_tokens)
    by_strategy = [Assembly(name, _fill(order, demand_rps)) for name, order in orders.items()]
    if kept:
        capacity = sum(u.capacity.capacity_rps for u in kept)
        if capacity >= demand_rps:
            units = _trim(kept, demand_rps)
        else:
            units = _fill(orders["efficiency"], demand_rps, seed=kept)
        by_strategy.append(Assembly("incremental", units))
    unique: dict[frozenset[str], Assembly] = {}
    for assembly in by_strategy:
        if assembly.units:
            unique.setdefault(frozenset(u.key for u in assembly.units), assembly)
    return tuple(unique.values())
