"""A scenario's world as FlexPipe config: its deployments and the catalog entries they need.

The product never reads a scenario file. ``flexpipe up`` (and the tests that play a scenario)
give the stream worker, the replay and the runtime worker the ``deployments`` and ``catalog``
sections this module derives from the scenario, through the run's config file.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml

from flexpipe.config import CatalogConfig, FlexPipeConfig
from sim.spec import DeploymentSpec, ModelSpecRef, Scenario

__all__ = ["scenario_config", "with_scenario", "write_config"]

# Never written to a config file: they reach a process through its environment.
SECRETS: dict[str, Any] = {"kafka": {"sasl_password"}, "runtime": {"control_token"}}


def model_shape(ref: ModelSpecRef) -> dict[str, int]:
    """An approximate ``catalog.models`` shape from a scenario's (params, layers, KV bytes per
    token), for a model that is no gearbox preset."""
    head_dim, dtype_bytes = 128, 2
    kv_heads = max(1, ref.kv_bytes_per_token // (2 * ref.num_layers * head_dim * dtype_bytes))
    # NOTE: dense decoders hold ~12·layers·hidden² parameters; relative accuracy is enough.
    hidden = max(head_dim, round(math.sqrt(ref.params_b * 1e9 / (12 * ref.num_layers)) / 128) * 128)
    heads = hidden // head_dim
    return {
        "num_params": int(ref.params_b * 1e9),
        "num_layers": ref.num_layers,
        "hidden_size": hidden,
        "num_heads": heads,
        "num_kv_heads": math.gcd(heads, kv_heads),
        "head_dim": head_dim,
        "dtype_bytes": dtype_bytes,
    }


def _mean(weights: tuple[float, float], values: tuple[float, float], default: float) -> float:
    total = sum(weights)
    return sum(w * v for w, v in zip(weights, values, strict=True)) / total if total else default


def _deployment(dep: DeploymentSpec) -> dict[str, Any]:
    """A ``deployments`` entry: the scenario's hint, and its workload at multiplier 1 as the
    nominal load (the request-weighted mean lengths of its two request classes)."""
    chat, summ = dep.workload.chat, dep.workload.summarisation
    weights = (chat.arrival_rps, summ.arrival_rps)
    if dep.on_demand:
        hint: dict[str, Any] = {
            "residency": "on_demand",
            "block": dep.pin,
            "affinity": list(dep.affinity),
            "anti_affinity": list(dep.anti_affinity),
        }
    else:
        assert dep.plan is not None  # NOTE: the loader requires a plan unless on demand
        hint = {
            "block": dep.plan.block,
            "tp": dep.plan.tp,
            "pp": dep.plan.pp,
            "replicas": dep.plan.replicas,
        }
    return {
        "name": dep.name,
        "model": dep.model.preset,
        **hint,
        "arrival_rps": chat.arrival_rps + summ.arrival_rps,
        "prompt_tokens": _mean(weights, (chat.prompt_tokens_mean, summ.prompt_tokens_mean), 512.0),
        "output_tokens": _mean(weights, (chat.output_tokens_mean, summ.output_tokens_mean), 256.0),
        # SLOs only where the scenario sets them (else gearbox's apply)
        **({"ttft_slo_ms": dep.ttft_slo_ms} if dep.ttft_slo_ms is not None else {}),
        **({"tbt_slo_ms": dep.tbt_slo_ms} if dep.tbt_slo_ms is not None else {}),
    }


def scenario_config(scenario: Scenario) -> dict[str, Any]:
    """The ``deployments`` and ``catalog`` sections that describe ``scenario`` (plain data).

    The catalog holds every GPU class and link the scenario defines (they replace same-named
    presets) and a shape for each deployment model that is no gearbox preset or alias.
    """
    known = CatalogConfig().model_specs()
    models = {
        d.model.preset: model_shape(d.model)
        for d in scenario.deployments
        if d.model.preset not in known
    }
    return {
        "deployments": [_deployment(d) for d in scenario.deployments],
        "catalog": {
            "gpu_classes": {
                c.name: {
                    "peak_bf16_tflops": c.peak_bf16_tflops,
                    "memory_bytes": c.memory_total_bytes,
                    "memory_bandwidth_gbps": c.memory_bandwidth_gbps,
                }
                for c in scenario.gpu_classes
            },
            "links": {
                link.name: {"bandwidth_gbps": link.bandwidth_gbps, "latency_us": link.latency_us}
                for link in scenario.links
            },
            "models": models,
        },
    }


def with_scenario(cfg: FlexPipeConfig, scenario: Scenario) -> FlexPipeConfig:
    """``cfg`` deciding for ``scenario``: its deployments replace the configured ones; its
    catalog entries are added to the configured ones (replacing same-named entries)."""
    data = cfg.model_dump()
    sections = scenario_config(scenario)
    data["deployments"] = sections["deployments"]
    data["placement"] = {**data["placement"], **dict(scenario.placement)}
    for part, entries in sections["catalog"].items():
        data["catalog"][part] = {**data["catalog"][part], **entries}
    return FlexPipeConfig.model_validate(data)


def write_config(cfg: FlexPipeConfig, path: Path) -> Path:
    """Write ``cfg`` as a YAML config file (``--config`` / ``$FLEXPIPE_CONFIG``), without its
    secrets; returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = cfg.model_dump(mode="json", exclude=SECRETS)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path
