"""Copy a sequence's KV between two layouts' pools: the data path of hand-offs and migrations.

:func:`runtime.engine.torch.layout.repartition` says which (layers × KV heads) rectangle goes
from which source rank to which destination rank; this module moves the bytes, one strided
``copy_`` per rectangle and per run of consecutive blocks (a fresh sequence's blocks are mostly
consecutive, so a sequence costs a handful of copies, not one per block).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from runtime.engine.torch.layout import CopyOp, RankSpec


def block_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, length)`` runs where both block lists are consecutive."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def copy_kv(
    ops: Sequence[CopyOp],
    src_pools: Mapping[int, torch.Tensor],
    src_specs: Mapping[int, RankSpec],
    src_blocks: Sequence[int],
    dst_pools: Mapping[int, torch.Tensor],
    dst_specs: Mapping[int, RankSpec],
    dst_blocks: Sequence[int],
) -> int:
    """Move the blocks' KV along ``ops``; returns the bytes copied."""
    runs = block_runs(src_blocks, dst_blocks)
    moved = 0
    for op in ops:
        s, d = src_specs[op.src_rank], dst_specs[op.dst_rank]
        sl = slice(op.layer_start - s.layer_start, op.layer_end - s.layer_start)
        dl = slice(op.layer_start - d.layer_start, op.layer_end - d.layer_start)
        sh = slice(op.kv_head_start - s.kv_head_start, op.kv_head_end - s.kv_head_start)
        dh = slice(op.kv_head_start - d.kv_head_start, op.kv_head_end - d.kv_head_start)
        src, dst = src_pools[op.src_rank], dst_pools[op.dst_rank]
        for s0, d0, n in runs:
            part = src[sl, :, s0 : s0 + n, :, sh]
            dst[dl, :, d0 : d0 + n, :, dh].copy_(part, non_blocking=False)
            moved += part.numel() * part.element_size()
    return moved
