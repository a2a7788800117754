"""NVML backend: the node's GPUs through ``nvidia-ml-py`` (imported as ``pynvml``)."""

from probes.nvml.resolver import GpuResolver, default_resolver
from probes.nvml.sampler import NvmlSampler, NvmlUnavailable, open_nvml_sampler

__all__ = ["GpuResolver", "NvmlSampler", "NvmlUnavailable", "default_resolver", "open_nvml_sampler"]
