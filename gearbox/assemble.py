"""Assembling deployments from replica options: a few greedy strategies, not a search.

Each strategy orders the options by one preference and takes copies until the capacity covers
demand × ``capacity_headroom`` (at least one replica, each block used by one option):

* ``latency`` — lowest unloaded request latency first (latency-critical traffic);
* ``efficiency`` — most requests per second per GPU first (frees GPUs);
* ``stability`` — blocks least likely to shrink first, then efficiency;
* ``capacity`` — largest total option first (fewest blocks);
* ``frugal`` — copies of one option covering demand on the fewest GPUs, at the three smallest
  GPU counts (most requests per GPU among equals): at low load a small replica, where
  ``efficiency``, ranking by capacity per GPU at a full batch, can take a bigger one it does
  not need — and the next sizes, as the smallest may cover demand but miss the SLOs;
* ``incremental`` — keep the current deployment's still-feasible replicas, trimming the weakest
  when over-provisioned or topping up by efficiency when short (the cheapest switch).

The number of strategies is fixed, so assembly is linear in the number of options.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Mapping, Sequence
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
    ordered: Iterable[ReplicaOption],
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


def _frugal(options: Sequence[ReplicaOption], demand_rps: float) -> list[tuple[Unit, ...]]:
    """Copies of one option covering demand, on the fewest GPUs: the ``_FRUGAL_SIZES``
    smallest GPU counts any option reaches, each by its most requests per GPU.

    Capacity alone does not say which of them keeps the SLOs (the ranking's estimate does), so
    a few sizes are offered, not only the smallest."""
    best: dict[int, tuple[float, str, ReplicaOption, int]] = {}
    for option in options:
        covered, count = 0.0, 0
        for copy in option.copies:
            count += 1
            covered += copy.capacity.capacity_rps
            if covered >= demand_rps:
                break
        if covered < demand_rps:
            continue
        gpus = count * option.gpus_per_copy
        key = (-covered / gpus, option.label, option, count)
        if gpus not in best or key[:2] < best[gpus][:2]:
            best[gpus] = key
    sizes = sorted(best)[:_FRUGAL_SIZES]
    return [option_units(best[g][2])[: best[g][3]] for g in sizes]


def _trim(kept: Sequence[Unit], demand_rps: float) -> tuple[Unit, ...]:
    units = sorted(kept, key=lambda u: (u.capacity.capacity_rps, u.key))
    total = sum(u.capacity.capacity_rps for u in units)
    while len(units) > 1 and total - units[0].capacity.capacity_rps >= demand_rps:
        total -= units.pop(0).capacity.capacity_rps
    return tuple(units)


_STRATEGIES = ("latency", "efficiency", "stability", "capacity")
_FRUGAL_SIZES = 3  # smallest deployments offered by ``frugal``
_FIXED_KEYS_MAX = 16_384  # NOTE: a few decisions' worth of options for many models

# Each option's sort keys that do not depend on the decision's stability factors, by the
# option's id (the entry holds the option, so the id is not reused while it is there): the
# options come from the candidate cache, the same objects decision after decision.
_fixed_keys: dict[int, _FixedKeys] = {}


class _FixedKeys(NamedTuple):
    option: ReplicaOption
    output_tokens: int
    latency: tuple[float, float, str]
    efficiency: tuple[float, float, str]
    capacity: tuple[float, float, str]


def _keys_of(option: ReplicaOption, output_tokens: int) -> _FixedKeys:
    known = _fixed_keys.get(id(option))
    if known is not None and known.option is option and known.output_tokens == output_tokens:
        return known
    best = option.copies[0].capacity
    per_gpu = best.capacity_rps / option.gpus_per_copy
    latency_s = best.prefill_latency_s + output_tokens * best.unloaded_tbt_s
    label = option.label
    keys = _FixedKeys(
        option,
        output_tokens,
        (latency_s, -per_gpu, label),
        (-per_gpu, latency_s, label),
        (-option.total_rps, latency_s, label),
    )
    if len(_fixed_keys) >= _FIXED_KEYS_MAX:
        _fixed_keys.clear()  # NOTE: only an optimisation: start again
    _fixed_keys[id(option)] = keys
    return keys


class _Order:
    """One strategy's preference order, taken from a heap as far as it is read (and kept, so
    it can be read again): filling a deployment's demand reads a few options of several
    hundred, and sorting all of them four times was a fifth of a forced decision's CPU."""

    __slots__ = ("_heap", "_taken")

    def __init__(self, rows: list[tuple[tuple[float, float, str], int, ReplicaOption]]) -> None:
        heapq.heapify(rows)
        self._heap = rows
        self._taken: list[ReplicaOption] = []

    def __iter__(self) -> Iterator[ReplicaOption]:
        taken, heap = self._taken, self._heap
        i = 0
        while True:
            if i == len(taken):
                if not heap:
                    return
                taken.append(heapq.heappop(heap)[2])
            yield taken[i]
            i += 1


def _orders(
    options: Sequence[ReplicaOption], stability: Mapping[str, float], output_tokens: int
) -> dict[str, _Order]:
    """Each strategy's preference order over the options, ties broken by label (then by the
    options' order)."""
    # NOTE: a block whose factor is 1 (most of them) changes no option's steadiness
    moved = {b for b, f in stability.items() if f != 1.0}
    rows: tuple[list[tuple[tuple[float, float, str], int, ReplicaOption]], ...] = (
        [],
        [],
        [],
        [],
    )
    latency, efficiency, steadiest, capacity = rows
    for i, o in enumerate(options):
        keys = _keys_of(o, output_tokens)
        latency.append((keys.latency, i, o))
        efficiency.append((keys.efficiency, i, o))
        capacity.append((keys.capacity, i, o))
        steadiness = 1.0  # the weakest block's stability factor
        if moved and not moved.isdisjoint(o.block_ids):
            steadiness = min(stability.get(b, 1.0) for b in o.block_ids)
        steadiest.append(((-steadiness, keys.efficiency[0], o.label), i, o))
    return {name: _Order(r) for name, r in zip(_STRATEGIES, rows, strict=True)}


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
    by_strategy += [Assembly("frugal", units) for units in _frugal(options, demand_rps)]
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
