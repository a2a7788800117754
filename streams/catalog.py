"""Resolving the keys telemetry carries (GPU class, link class, model preset) to gearbox types.

Agents name a GPU's class and a domain's link by preset key; deployments name a model. Keys
resolve against gearbox's presets, the scenario file's own classes when one is configured, and a
few aliases the simulator's scenarios use. An unknown GPU class never stops the stream: it gets a
conservative stand-in (the weakest preset's compute and bandwidth, the sample's own memory).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TypeVar

from gearbox.model import ModelSpec
from gearbox.presets import (
    GPU_CLASSES,
    LINK_CLASSES,
    MODEL_ALIASES,
    MODELS,
)
from gearbox.types import GpuClass, LinkClass
from sim.spec import ModelSpecRef, Scenario

__all__ = ["DEFAULT_INTER_DOMAIN_LINK", "Catalog", "default_catalog", "scenario_catalog"]

V = TypeVar("V")
DEFAULT_INTER_DOMAIN_LINK = "ethernet"
UNKNOWN_LINK_LATENCY_US = 25.0  # an unknown link is treated like plain TCP over Ethernet


def _frozen(items: Mapping[str, V]) -> Mapping[str, V]:
    return MappingProxyType(dict(items))


@dataclass(frozen=True, slots=True)
class Catalog:
    """Preset lookups; immutable, so one instance is shared by the live app and the replay."""

    gpu_classes: Mapping[str, GpuClass] = field(default_factory=lambda: _frozen(GPU_CLASSES))
    links: Mapping[str, LinkClass] = field(default_factory=lambda: _frozen(LINK_CLASSES))
    models: Mapping[str, ModelSpec] = field(
        default_factory=lambda: _frozen({**MODELS, **MODEL_ALIASES})
    )

    def gpu_class(self, key: str | None, total_memory_bytes: int) -> GpuClass:
        """The class called ``key``; a conservative stand-in when unknown."""
        if key is not None and key in self.gpu_classes:
            return self.gpu_classes[key]
        return _stand_in(key or "unknown", max(1, total_memory_bytes))

    def link(self, key: str, bandwidth_gbps: float | None = None) -> LinkClass:
        """The link class ``key``, with the measured bandwidth when one was reported."""
        base = self.links.get(key) or LinkClass(key, 1.0, UNKNOWN_LINK_LATENCY_US)
        if bandwidth_gbps is not None and math.isfinite(bandwidth_gbps) and bandwidth_gbps > 0:
            return replace(base, bandwidth_gbps=bandwidth_gbps)
        return base

    def model(self, key: str) -> ModelSpec:
        """The model preset ``key``; ``KeyError`` naming the known keys otherwise."""
        try:
            return self.models[key]
        except KeyError:
            known = ", ".join(sorted(self.models))
            raise KeyError(f"unknown model preset {key!r} (known: {known})") from None


@functools.lru_cache(maxsize=256)
def _stand_in(name: str, total_memory_bytes: int) -> GpuClass:
    weakest = min(GPU_CLASSES.values(), key=lambda c: c.peak_bf16_tflops)
    return GpuClass(
        f"{name}?", weakest.peak_bf16_tflops, total_memory_bytes, weakest.memory_bandwidth_gbps
    )


def default_catalog() -> Catalog:
    """gearbox's presets plus the scenario model aliases."""
    return Catalog()


def _model_from_ref(ref: ModelSpecRef) -> ModelSpec:
    """An approximate shape from a scenario's (params, layers, KV bytes per token)."""
    head_dim, dtype_bytes = 128, 2
    kv_heads = max(1, ref.kv_bytes_per_token // (2 * ref.num_layers * head_dim * dtype_bytes))
    # NOTE: dense decoders hold ~12·layers·hidden² parameters; relative accuracy is enough.
    hidden = max(head_dim, round(math.sqrt(ref.params_b * 1e9 / (12 * ref.num_layers)) / 128) * 128)
    heads = hidden // head_dim
    kv_heads = math.gcd(heads, kv_heads)
    return ModelSpec(
        name=ref.preset,
        num_params=int(ref.params_b * 1e9),
        num_layers=ref.num_layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype_bytes=dtype_bytes,
    )


def scenario_catalog(scenario: Scenario, base: Catalog | None = None) -> Catalog:
    """``base`` extended with the scenario's GPU classes, links and deployment models."""
    base = base or default_catalog()
    classes = dict(base.gpu_classes)
    for c in scenario.gpu_classes:
        classes[c.name] = GpuClass(
            c.name, c.peak_bf16_tflops, c.memory_total_bytes, c.memory_bandwidth_gbps
        )
    links = dict(base.links)
    for link in scenario.links:
        links[link.name] = LinkClass(link.name, link.bandwidth_gbps, link.latency_us)
    models = dict(base.models)
    for dep in scenario.deployments:
        if dep.model.preset not in models:
            models[dep.model.preset] = _model_from_ref(dep.model)
    return Catalog(_frozen(classes), _frozen(links), _frozen(models))
