"""Execution plans for the reference engine on one host: TP, PP and PD-split layouts.

The host's "GPUs" are rank processes; ``CPU_HOST`` and ``SHM_LINK`` describe them to gearbox's
cost model (the bench replaces the figures with measured ones). Uuids carry a prefix, so two
plans of one test (old and new gear) never share a GPU.
"""

from __future__ import annotations

import itertools

from gearbox.plans import ExecutionPlan, Stage, StageRole
from gearbox.types import GpuClass, LinkClass

GIB = 1024**3
CPU_HOST = GpuClass("cpu-host", 0.1, 16 * GIB, 10.0)  # placeholder figures; the bench measures
SHM_LINK = LinkClass("shm", 5.0, 50.0)  # gloo over shared memory / loopback


def _stage(
    prefix: str,
    first_gpu: int,
    tp: int,
    layers: tuple[int, int],
    role: StageRole,
    gpu: GpuClass,
    link: LinkClass,
) -> Stage:
    uuids = tuple(f"{prefix}-gpu{first_gpu + i}" for i in range(tp))
    return Stage(f"{prefix}-blk", f"{prefix}-dom", uuids, layers[0], layers[1], role, gpu, link)


def split_layers(num_layers: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal layer ranges."""
    bounds = [round(i * num_layers / parts) for i in range(parts + 1)]
    return list(itertools.pairwise(bounds))


def make_plan(
    kind: str,
    num_layers: int,
    prefix: str,
    *,
    model_name: str = "tiny-llama",
    gpu: GpuClass = CPU_HOST,
    link: LinkClass = SHM_LINK,
) -> ExecutionPlan:
    """``tpN`` (one stage of N), ``ppN`` (N stages of 1), ``tpApB`` (B stages of A) or
    ``pdA-B`` (a TP-A prefill stage handing KV to a TP-B decode stage)."""
    if kind.startswith("pd"):
        p_tp, d_tp = (int(x) for x in kind[2:].split("-"))
        full = (0, num_layers)
        pd = (
            _stage(prefix, 0, p_tp, full, StageRole.PREFILL, gpu, link),
            _stage(prefix, p_tp, d_tp, full, StageRole.DECODE, gpu, link),
        )
        return ExecutionPlan(model_name, pd, None, link)
    if kind.startswith("tp") and "pp" in kind:
        tp, pp = (int(x) for x in kind[2:].split("pp"))
    elif kind.startswith("tp"):
        tp, pp = int(kind[2:]), 1
    elif kind.startswith("pp"):
        tp, pp = 1, int(kind[2:])
    else:
        raise ValueError(f"kind: unknown plan kind {kind!r}")
    stages = tuple(
        _stage(prefix, i * tp, tp, layers, StageRole.UNIFIED, gpu, link)
        for i, layers in enumerate(split_layers(num_layers, pp))
    )
    return ExecutionPlan(model_name, stages, link if pp > 1 else None)
