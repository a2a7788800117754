"""Resolving the keys telemetry carries (GPU class, link class, model preset) to gearbox types.

Agents name a GPU's class and a domain's link by preset key; deployments name a model. Keys
resolve against gearbox's presets and model aliases, extended by the config's ``catalog`` section
(:func:`catalog_from_config`). An unknown GPU class never stops the stream: it gets a
conservative stand-in (the weakest preset's compute and bandwidth, the sample's own memory).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TypeVar

from flexpipe.config import CatalogConfig
from gearbox.model import ModelSpec
from gearbox.presets import (
    GPU_CLASSES,
    LINK_CLASSES,
    MODEL_ALIASES,
    MODELS,
)
from gearbox.types import GpuClass, LinkClass

__all__ = ["DEFAULT_INTER_DOMAIN_LINK", "Catalog", "catalog_from_config", "default_catalog"]

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
    """gearbox's presets plus their model aliases."""
    return Catalog()


def catalog_from_config(section: CatalogConfig) -> Catalog:
    """gearbox's presets and aliases extended (and on a clash replaced) by the config's
    ``catalog`` section."""
    return Catalog(
        _frozen(section.gpu_class_specs()),
        _frozen(section.link_specs()),
        _frozen(section.model_specs()),
    )
