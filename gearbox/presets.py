"""Datasheet presets: GPU classes, link classes and two reference models.

Sources (figures are dense, no sparsity; bandwidths in GB/s per GPU per direction):

* H100 SXM5 — NVIDIA H100 Tensor Core GPU datasheet (2023): 989 TFLOPS bf16, 80 GB HBM3,
  3.35 TB/s; NVLink 4 900 GB/s bidirectional (450 GB/s per direction).
* A100 80GB SXM4 — NVIDIA A100 datasheet (2021): 312 TFLOPS bf16, 80 GB HBM2e, 2,039 GB/s;
  NVLink 3 600 GB/s bidirectional (300 GB/s per direction).
* L40S — NVIDIA L40S datasheet (2023): 362 TFLOPS bf16, 48 GB GDDR6, 864 GB/s.
* L40 — NVIDIA L40 datasheet (2022): 181 TFLOPS bf16, 48 GB GDDR6, 864 GB/s.
* RTX A6000 — NVIDIA RTX A6000 datasheet (2021): 155 TFLOPS bf16 tensor, 48 GB GDDR6, 768 GB/s.
* RDMA — 200 Gb/s HDR InfiniBand / RoCE NIC per GPU (ConnectX-6 product brief) = 25 GB/s;
  ~5 µs end-to-end small-message latency as reported by nccl-tests on such fabrics.
* PCIe — Gen4 x16 is 32 GB/s raw per direction, ~25 GB/s achieved (``pcie-local``); a PCIe
  group spanning hosts goes through host NICs and staging copies, ~12 GB/s effective (``pcie``).
* Ethernet — 100 GbE = 12.5 GB/s line rate, ~20 µs kernel TCP latency.
* Latencies for NVLink (~2 µs) follow the small-message all-reduce latencies in nccl-tests.

Model shapes come from the published Hugging Face ``config.json`` of Llama-2-7B (multi-head
attention) and Llama-2-70B (grouped-query attention, 8 KV heads).
"""

from __future__ import annotations

from types import MappingProxyType

from gearbox.model import ModelSpec
from gearbox.types import GpuClass, LinkClass

__all__ = ["GIB", "GPU_CLASSES", "LINK_CLASSES", "MODELS", "MODEL_7B_MHA", "MODEL_70B_GQA"]

GIB = 1024**3

GPU_CLASSES: MappingProxyType[str, GpuClass] = MappingProxyType(
    {
        "h100-sxm": GpuClass("h100-sxm", 989.0, 80 * GIB, 3350.0),
        "a100-80g": GpuClass("a100-80g", 312.0, 80 * GIB, 2039.0),
        "l40s": GpuClass("l40s", 362.0, 48 * GIB, 864.0),
        "l40": GpuClass("l40", 181.0, 48 * GIB, 864.0),
        "a6000-48g": GpuClass("a6000-48g", 155.0, 48 * GIB, 768.0),
    }
)

LINK_CLASSES: MappingProxyType[str, LinkClass] = MappingProxyType(
    {
        "nvlink": LinkClass("nvlink", 450.0, 2.0),
        "nvlink-a100": LinkClass("nvlink-a100", 300.0, 2.0),
        "rdma": LinkClass("rdma", 25.0, 5.0),
        "pcie-local": LinkClass("pcie-local", 25.0, 5.0),
        "pcie": LinkClass("pcie", 12.0, 10.0),
        "ethernet": LinkClass("ethernet", 12.5, 20.0),
    }
)

# Llama-2-13B's published config.json (multi-head attention).
MODEL_13B_MHA = ModelSpec(
    name="llama-2-13b",
    num_params=13_015_864_320,
    num_layers=40,
    hidden_size=5120,
    num_heads=40,
    num_kv_heads=40,
    head_dim=128,
    dtype_bytes=2,
)

MODEL_7B_MHA = ModelSpec(
    name="llama-2-7b",
    num_params=6_738_415_616,
    num_layers=32,
    hidden_size=4096,
    num_heads=32,
    num_kv_heads=32,
    head_dim=128,
    dtype_bytes=2,
)

MODEL_70B_GQA = ModelSpec(
    name="llama-2-70b",
    num_params=68_976_648_192,
    num_layers=80,
    hidden_size=8192,
    num_heads=64,
    num_kv_heads=8,
    head_dim=128,
    dtype_bytes=2,
)

MODELS: MappingProxyType[str, ModelSpec] = MappingProxyType(
    {m.name: m for m in (MODEL_7B_MHA, MODEL_13B_MHA, MODEL_70B_GQA)}
)

# Model classes that scenario files and configs may name instead of a checkpoint.
MODEL_ALIASES: MappingProxyType[str, ModelSpec] = MappingProxyType(
    {
        "llama-7b-class": MODEL_7B_MHA,
        "llama-13b-class": MODEL_13B_MHA,
        "llama-70b-class": MODEL_70B_GQA,
    }
)
