"""The deployments the stream decides for, and their starting plans (pure).

Deployments come from the scenario file (``streams.scenario``) and/or the config's
``streams.deployments`` (the config wins on a name clash). Until a runtime worker confirms a plan
on the transitions topic, a deployment's current plan is its *hint* — ``replicas`` groups of
tp×pp GPUs taken in order from the hint's domain, skipping GPUs earlier deployments' hints took,
the way the simulator places them — which also serves as the baseline for emergency downshifts.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from flexpipe.config import StreamsConfig
from gearbox.blocks import AtomicBlock
from gearbox.candidates import limiting_class
from gearbox.model import ModelSpec
from gearbox.plans import DeploymentPlan, ExecutionPlan, Stage, StageRole
from gearbox.types import Gpu, TopologySnapshot
from sim.spec import PlanHint, Scenario
from streams.catalog import Catalog
from streams.snapshot import NominalLoad

__all__ = ["Deployment", "PlanHint", "deployments_from_config", "hint_plan", "natural_key"]


@dataclass(frozen=True, slots=True)
class Deployment:
    """A deployment as the decision loop needs it."""

    name: str
    model_key: str
    model: ModelSpec
    hint: PlanHint | None
    nominal: NominalLoad


def _mean(weights: tuple[float, float], values: tuple[float, float], default: float) -> float:
    total = sum(weights)
    return sum(w * v for w, v in zip(weights, values, strict=True)) / total if total else default


def _from_scenario(scenario: Scenario, catalog: Catalog) -> list[Deployment]:
    out = []
    for dep in scenario.deployments:
        chat, summ = dep.workload.chat, dep.workload.summarisation
        rps = chat.arrival_rps + summ.arrival_rps
        prompt = (chat.prompt_tokens_mean, summ.prompt_tokens_mean)
        output = (chat.output_tokens_mean, summ.output_tokens_mean)
        weights = (chat.arrival_rps, summ.arrival_rps)
        nominal = NominalLoad(rps, _mean(weights, prompt, 512.0), _mean(weights, output, 256.0))
        hint = dep.plan
        model = catalog.model(dep.model.preset)
        out.append(Deployment(dep.name, dep.model.preset, model, hint, nominal))
    return out


def deployments_from_config(
    cfg: StreamsConfig, catalog: Catalog, scenario: Scenario | None = None
) -> tuple[Deployment, ...]:
    """Scenario deployments, then config deployments (replacing same-named ones), in order."""
    by_name = {d.name: d for d in (_from_scenario(scenario, catalog) if scenario else [])}
    for d in cfg.deployments:
        hint = PlanHint(d.block, d.tp, d.pp, d.replicas) if d.block else None
        nominal = NominalLoad(d.arrival_rps, d.prompt_tokens, d.output_tokens)
        by_name[d.name] = Deployment(d.name, d.model, catalog.model(d.model), hint, nominal)
    return tuple(by_name.values())


def natural_key(text: str) -> tuple[object, ...]:
    """Sort key that orders ``node-2`` before ``node-10`` (digit runs compare as numbers)."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text))


def _stage(
    gpus: Sequence[Gpu], layers: tuple[int, int], snap: TopologySnapshot, block_of: dict[str, str]
) -> Stage:
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


def _replica(
    gpus: Sequence[Gpu],
    hint: PlanHint,
    model: ModelSpec,
    snap: TopologySnapshot,
    block_of: dict[str, str],
) -> ExecutionPlan:
    n = model.num_layers
    bounds = [(n * i // hint.pp, n * (i + 1) // hint.pp) for i in range(hint.pp)]
    stages = tuple(
        _stage(gpus[i * hint.tp : (i + 1) * hint.tp], bounds[i], snap, block_of)
        for i in range(hint.pp)
    )
    pp_link = snap.link_between(stages[0].domain_id, stages[-1].domain_id) if hint.pp > 1 else None
    return ExecutionPlan(model.name, stages, pp_link=pp_link)


def hint_plan(
    deployments: Sequence[Deployment],
    name: str,
    snapshot: TopologySnapshot,
    blocks: Sequence[AtomicBlock],
) -> DeploymentPlan | None:
    """``name``'s hint plan on ``snapshot``; None without a hint, an invalid hint (TP not
    dividing the heads, too many stages), or too few live GPUs left in the hint's domain."""
    block_of = {u: b.block_id for b in blocks for u in b.gpu_uuids}
    taken: set[str] = set()
    for dep in deployments:
        if dep.hint is None:
            continue
        hint = dep.hint
        live = sorted(
            (g for g in snapshot.gpus if g.domain == hint.block and snapshot.gpu_is_live(g)),
            key=lambda g: natural_key(g.uuid),
        )
        free = [g for g in live if g.uuid not in taken]
        size = hint.tp * hint.pp
        if len(free) < size * hint.replicas:
            if dep.name == name:
                return None
            continue
        chosen = free[: size * hint.replicas]
        taken.update(g.uuid for g in chosen)
        if dep.name != name:
            continue
        if hint.tp not in dep.model.valid_tp_sizes(hint.tp):
            return None
        try:
            replicas = tuple(
                _replica(chosen[r * size : (r + 1) * size], hint, dep.model, snapshot, block_of)
                for r in range(hint.replicas)
            )
            return DeploymentPlan(dep.name, dep.model.name, replicas)
        except ValueError:
            return None
    return None
