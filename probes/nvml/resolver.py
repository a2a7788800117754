"""GPU name -> gearbox GPU class, and the interconnect domain a GPU belongs to.

A parameter of :class:`probes.nvml.NvmlSampler`; deployments with other hardware or topologies pass
their own function with the same signature.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

# (node, GPU name, active NVLink links or None) -> (gearbox GPU class key, interconnect domain)
GpuResolver = Callable[[str, str, int | None], tuple[str | None, str | None]]

# First match wins; keys are gearbox.presets.GPU_CLASSES keys (a unit test checks they exist).
_GPU_CLASS_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"H100.*(SXM|HBM3)", re.I), "h100-sxm"),
    (re.compile(r"A100.*80\s*GB", re.I), "a100-80g"),
    (re.compile(r"L40S", re.I), "l40s"),
    (re.compile(r"L40\b", re.I), "l40"),
    (re.compile(r"RTX A6000", re.I), "a6000-48g"),
)


def default_resolver(
    node: str, name: str, nvlink_active_links: int | None
) -> tuple[str | None, str]:
    """GPU class from the marketing name (None when gearbox has no preset) and the domain.

    The domain is ``<node>/nvlink`` when the GPU has an active NVLink link, else ``<node>/pcie``:
    one NVLink island per node, which holds for NVSwitch systems (bridged pairs would need more).
    """
    link = "nvlink" if nvlink_active_links else "pcie"
    return _gpu_class(name), f"{node}/{link}"


# NOTE: asked for every GPU every second with the same few names: matched once per name.
@functools.lru_cache(maxsize=256)
def _gpu_class(name: str) -> str | None:
    return next((key for pattern, key in _GPU_CLASS_PATTERNS if pattern.search(name)), None)
