"""Copy a sequence's KV between two layouts' pools: the data path of hand-offs and migrations.

:func:`runtime.engine.torch.layout.repartition` says which (layers × KV heads) rectangle goes
from which source rank to which destination rank; this module moves the bytes, one ``copy_``
per rectangle and per run of consecutive blocks (a fresh sequence's blocks are mostly
consecutive, so a sequence costs a handful of copies, not one per block). The pools are head
major (see :mod:`runtime.engine.torch.model`), so each (layer, K/V, head) of a run is one
contiguous range of ``run × block_size × head_dim`` floats on both sides, whatever the head split.
"""

from __future__ import annotations

import mmap
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


def place_blocks(src_tables: Sequence[Sequence[int]], free: Sequence[int]) -> list[list[int]]:
    """Destination block tables for sequences whose source tables are ``src_tables``, drawn
    from ``free`` so that source blocks in ascending order land on ``free`` in ascending order:
    wherever both sides are consecutive the copy is one run, across sequence boundaries too."""
    order = sorted((b, i, j) for i, table in enumerate(src_tables) for j, b in enumerate(table))
    out = [[0] * len(table) for table in src_tables]
    for (_, i, j), d in zip(order, sorted(free), strict=True):
        out[i][j] = d
    return out


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
            part = src[sl, :, sh, s0 : s0 + n]
            dst[dl, :, dh, d0 : d0 + n].copy_(part)
            moved += part.numel() * part.element_size()
    return moved


def map_pages(pool: torch.Tensor) -> None:
    """Touch every page of a CPU pool received from a rank process (zeros: call it before any
    KV is written). NOTE: the driver maps a rank's shared-memory pool lazily; without this the
    first migration pays a page fault per 4 KiB on both sides and runs at a fifth of memcpy.
    A real engine opens its IPC handles once at load time too. CUDA pools need nothing."""
    if pool.device.type == "cpu" and pool.numel():
        pool.view(-1)[:: max(1, mmap.PAGESIZE // pool.element_size())].zero_()
