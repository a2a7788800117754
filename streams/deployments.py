"""The deployments the stream decides for (pure).

They come from the config's ``deployments`` section, their models and hardware keys from its
``catalog`` section over gearbox's presets. Until a runtime worker confirms a plan on the
transitions topic, a deployment's current plan is its *hint*'s starting plan
(:mod:`gearbox.starting`), which also serves as the baseline for emergency downshifts.
"""

from __future__ import annotations

from dataclasses import dataclass

from flexpipe.config import FlexPipeConfig
from gearbox.model import ModelSpec
from gearbox.starting import PlanHint
from streams.catalog import Catalog, catalog_from_config
from streams.snapshot import NominalLoad

__all__ = ["Deployment", "resolve_deployments"]


@dataclass(frozen=True, slots=True)
class Deployment:
    """A deployment as the decision loop needs it."""

    name: str
    model_key: str
    model: ModelSpec
    hint: PlanHint | None
    nominal: NominalLoad


def resolve_deployments(cfg: FlexPipeConfig) -> tuple[Catalog, tuple[Deployment, ...]]:
    """The catalog, and the configured deployments in order (the order hints take GPUs in)."""
    catalog = catalog_from_config(cfg.catalog)
    out = []
    for d in cfg.deployments:
        hint = PlanHint(d.block, d.tp, d.pp, d.replicas) if d.block else None
        nominal = NominalLoad(d.arrival_rps, d.prompt_tokens, d.output_tokens)
        out.append(Deployment(d.name, d.model, catalog.model(d.model), hint, nominal))
    return catalog, tuple(out)
