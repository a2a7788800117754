"""Starting plans: where each deployment serves before gearbox has decided anything (pure).

A deployment may carry a *hint* — a block and a tp × pp × replicas shape. The one rule that turns
hints into GPUs: deployments are taken in their configured order; each takes the first
``replicas × tp × pp`` available GPUs of its block in natural uuid order (``gpu-2`` before
``gpu-10``), skipping GPUs an earlier hint took; a hint that does not fit takes nothing. The
stream's decision step (its current plan until a runtime confirms one, and the emergency
downshift's baseline), the runtime's transition 0 in ``flexpipe up`` and the simulated cluster's
start all follow this rule, so they agree on the starting plan id.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from gearbox.blocks import AtomicBlock
from gearbox.candidates import limiting_class
from gearbox.model import ModelSpec
from gearbox.plans import DeploymentPlan, ExecutionPlan, Stage, StageRole
from gearbox.types import Gpu, TopologySnapshot

__all__ = [
    "GpuGroups",
    "Hinted",
    "PlanHint",
    "hint_groups",
    "natural_key",
    "starting_plan",
    "starting_plans",
    "unified_stage",
]

GpuGroups = tuple[tuple[str, ...], ...]  # one tuple of GPU uuids per replica, stage by stage


@dataclass(frozen=True, slots=True)
class PlanHint:
    """Where a deployment starts: ``replicas`` groups of tp×pp GPUs taken in order from a block."""

    block: str  # domain id the GPUs come from
    tp: int = 1  # GPUs per stage
    pp: int = 1  # stages per replica
    replicas: int = 1

    @property
    def num_gpus(self) -> int:
        """GPUs the starting plan occupies."""
        return self.tp * self.pp * self.replicas


class Hinted(Protocol):
    """What the rule needs of a deployment: its name, model and optional hint."""

    @property
    def name(self) -> str: ...

    @property
    def model(self) -> ModelSpec: ...

    @property
    def hint(self) -> PlanHint | None: ...


def natural_key(text: str) -> tuple[object, ...]:
    """Sort key that orders ``node-2`` before ``node-10`` (digit runs compare as numbers)."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text))


def hint_groups(
    hints: Iterable[tuple[str, PlanHint | None]], available: Mapping[str, Sequence[str]]
) -> dict[str, GpuGroups | None]:
    """The GPUs each hint takes, by deployment name; None without a hint or when it did not fit.

    ``available`` maps a block to the uuids a deployment may start on (live, not isolated), in
    any order. Each replica's group lists its stages' GPUs one stage after the other.
    """
    taken: set[str] = set()
    out: dict[str, GpuGroups | None] = {}
    for name, hint in hints:
        out[name] = None
        if hint is None:
            continue
        free = sorted((u for u in available.get(hint.block, ()) if u not in taken), key=natural_key)
        size = hint.tp * hint.pp
        if len(free) < size * hint.replicas:
            continue  # NOTE: takes nothing, so later hints keep their GPUs
        chosen = free[: size * hint.replicas]
        taken.update(chosen)
        out[name] = tuple(tuple(chosen[r * size : (r + 1) * size]) for r in range(hint.replicas))
    return out


def _live_by_block(snapshot: TopologySnapshot) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for g in snapshot.gpus:
        if snapshot.gpu_is_live(g):
            out.setdefault(g.domain, []).append(g.uuid)
    return out


def unified_stage(
    gpus: Sequence[Gpu],
    layers: tuple[int, int],
    snap: TopologySnapshot,
    block_of: Mapping[str, str] | None = None,
) -> Stage:
    """One unified (prefill + decode) stage of ``layers`` over ``gpus`` (one TP group), in the
    first GPU's domain; its block is ``block_of``'s for that GPU, else the domain."""
    block_of = block_of or {}
    domain = gpus[0].domain
    return Stage(
        block_id=block_of.get(gpus[0].uuid, domain),
        domain_id=domain,
        gpu_uuids=tuple(g.uuid for g in gpus),
        layer_start=layers[0],
        layer_end=layers[1],
        role=StageRole.UNIFIED,
        gpu_class=limiting_class([g.gpu_class for g in gpus]),
        tp_link=snap.domain_link(domain),
    )


def _plan(
    dep: Hinted, groups: GpuGroups, snap: TopologySnapshot, blocks: Sequence[AtomicBlock]
) -> DeploymentPlan | None:
    hint, model = dep.hint, dep.model
    if hint is None or hint.tp not in model.valid_tp_sizes(hint.tp):
        return None
    by_uuid = {g.uuid: g for g in snap.gpus}
    block_of = {u: b.block_id for b in blocks for u in b.gpu_uuids}
    n = model.num_layers
    # NOTE: stage i holds layers [n·i/pp, n·(i+1)/pp): 80 layers over 3 stages → 26, 27, 27.
    bounds = [(n * i // hint.pp, n * (i + 1) // hint.pp) for i in range(hint.pp)]
    replicas = []
    try:
        for group in groups:
            gpus = [by_uuid[u] for u in group]
            stages = tuple(
                unified_stage(gpus[i * hint.tp : (i + 1) * hint.tp], bounds[i], snap, block_of)
                for i in range(hint.pp)
            )
            first, last = stages[0].domain_id, stages[-1].domain_id
            pp_link = snap.link_between(first, last) if hint.pp > 1 else None
            replicas.append(ExecutionPlan(model.name, stages, pp_link=pp_link))
        return DeploymentPlan(dep.name, model.name, tuple(replicas))
    except ValueError:  # more stages than layers: not a plan
        return None


def starting_plans(
    deployments: Sequence[Hinted], snapshot: TopologySnapshot, blocks: Sequence[AtomicBlock]
) -> dict[str, DeploymentPlan | None]:
    """Every deployment's starting plan on ``snapshot``'s live GPUs, by name.

    None without a hint, for an invalid hint (TP not dividing the heads, more stages than
    layers) or when too few live GPUs are left in the hint's block. An invalid hint that fits
    still takes its GPUs, so one bad hint never moves the others.
    """
    groups = hint_groups(((d.name, d.hint) for d in deployments), _live_by_block(snapshot))
    out: dict[str, DeploymentPlan | None] = {}
    for dep in deployments:
        chosen = groups[dep.name]
        out[dep.name] = None if chosen is None else _plan(dep, chosen, snapshot, blocks)
    return out


def starting_plan(
    deployments: Sequence[Hinted],
    name: str,
    snapshot: TopologySnapshot,
    blocks: Sequence[AtomicBlock],
) -> DeploymentPlan | None:
    """``name``'s starting plan (see :func:`starting_plans`); only that plan is built."""
    groups = hint_groups(((d.name, d.hint) for d in deployments), _live_by_block(snapshot))
    chosen = groups.get(name)
    dep = next((d for d in deployments if d.name == name), None)
    if chosen is None or dep is None:
        return None
    return _plan(dep, chosen, snapshot, blocks)
