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
    residency: str = "resident"  # "on_demand": loaded when requested, evicted when cold
    pin_domain: str | None = None  # on demand: load only in this domain (config ``block``)
    affinity: tuple[str, ...] = ()  # on demand: prefer nodes holding these deployments
    anti_affinity: tuple[str, ...] = ()  # on demand: never a node holding one of these


def resolve_deployments(cfg: FlexPipeConfig) -> tuple[Catalog, tuple[Deployment, ...]]:
    """The catalog, and the configured deployments in order (the order hints take GPUs in)."""
    catalog = catalog_from_config(cfg.catalog)
    out = []
    for d in cfg.deployments:
        on_demand = d.residency == "on_demand"
        # NOTE: an on-demand deployment starts cold: its block pins where it loads, no hint
        hint = PlanHint(d.block, d.tp, d.pp, d.replicas) if d.block and not on_demand else None
        nominal = NominalLoad(d.arrival_rps, d.prompt_tokens, d.output_tokens)
        out.append(
            Deployment(
                d.name,
                d.model,
                catalog.model(d.model),
                hint,
                nominal,
                d.residency,
                d.block if on_demand else None,
                d.affinity,
                d.anti_affinity,
            )
        )
    return catalog, tuple(out)
