"""The deployments the stream decides for, and their starting plans (pure).

Deployments come from the scenario file (``streams.scenario``) and/or the config's
``streams.deployments`` (the config wins on a name clash). Until a runtime worker confirms a plan
on the transitions topic, a deployment's current plan is its *hint* — ``replicas`` groups of
tp×pp GPUs taken in order from the hint's domain, skipping GPUs earlier deployments' hints took,
the way the simulator places them — which also serves as the baseline for emergency downshifts.
"""

from __future__ import annotations

from dataclasses import dataclass

from flexpipe.config import StreamsConfig
from gearbox.model import ModelSpec
from gearbox.starting import PlanHint
from sim.spec import Scenario
from streams.catalog import Catalog
from streams.snapshot import NominalLoad

__all__ = ["Deployment", "deployments_from_config"]


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
