"""Pure parts of the torch engine: rank layout, KV re-partition, block allocation with VMM."""

from __future__ import annotations

import itertools

import pytest

from runtime.engine.torch.kvmove import block_runs, place_blocks
from runtime.engine.torch.kvpool import BlockAllocator
from runtime.engine.torch.layout import Pipeline, kv_holders, plan_ranks, repartition
from runtime.engine.torch.plans import make_plan
from runtime.vmm.host import HostReservationBackend
from runtime.vmm.manager import ReservationManager
from tests.runtime.torch_engine.builders import CFG

pytestmark = pytest.mark.unit
KINDS = ["tp1", "tp2", "pp2", "pp4", "tp2pp2", "pd1-1", "pd2-1", "pd1-2"]


def _holders(kind: str) -> tuple:
    ranks = plan_ranks(make_plan(kind, CFG.num_layers, kind), CFG)
    pipe = Pipeline.DECODE if kind.startswith("pd") else Pipeline.UNIFIED
    return kv_holders(ranks, pipe)


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(KINDS, KINDS)))
def test_repartition_covers_every_layer_and_head_once(src: str, dst: str) -> None:
    ops = repartition(_holders(src), _holders(dst))
    cells: list[tuple[int, int, int]] = []
    for op in ops:
        for layer in range(op.layer_start, op.layer_end):
            for head in range(op.kv_head_start, op.kv_head_end):
                cells.append((op.dst_rank, layer, head))
    want = [
        (r.rank, layer, head)
        for r in _holders(dst)
        for layer in range(r.layer_start, r.layer_end)
        for head in range(r.kv_head_start, r.kv_head_end)
    ]
    assert sorted(cells) == sorted(want)


def test_pd_ranks_form_two_pipelines_with_activation_routes() -> None:
    ranks = plan_ranks(make_plan("tp2pp2", CFG.num_layers, "x"), CFG)
    assert [r.rank for r in ranks] == [0, 1, 2, 3]
    assert ranks[0].next_stage == (2, 3) and ranks[2].prev_leader == 0
    assert ranks[1].kv_head_start == 1 and ranks[3].layer_start == 2
    pd = plan_ranks(make_plan("pd1-2", CFG.num_layers, "y"), CFG)
    assert [r.pipeline for r in pd] == [Pipeline.PREFILL, Pipeline.DECODE, Pipeline.DECODE]
    assert all(r.is_first and r.is_last for r in pd)


def test_block_runs_merge_consecutive_pairs() -> None:
    assert block_runs([3, 4, 5, 9], [0, 1, 2, 3]) == [(3, 0, 3), (9, 3, 1)]


def test_placed_blocks_follow_source_order_into_one_run() -> None:
    # two prefilled-together sequences, each grown by one decode block later
    src = [[0, 1, 2, 8], [3, 4, 5, 9]]
    tables = place_blocks(src, [10, 11, 12, 13, 14, 15, 16, 17])
    assert tables == [[10, 11, 12, 16], [13, 14, 15, 17]]
    pairs = sorted(
        (s, d) for st, dt in zip(src, tables, strict=True) for s, d in zip(st, dt, strict=True)
    )
    runs = block_runs([s for s, _ in pairs], [d for _, d in pairs])
    assert runs == [(0, 10, 6), (8, 16, 2)]  # placed per sequence it would be 4 runs


def test_allocator_commits_pages_and_refuses_past_capacity() -> None:
    granule = 4096
    vmm = ReservationManager(
        lambda u, c: HostReservationBackend(u, 3 * granule, granularity_bytes=granule)
    )
    assert vmm.reserve_replica("r", {"g": (8 * granule, 3 * granule)})
    alloc = BlockAllocator(16, 4, {"g": 1024}, vmm, "r", "unified", granularity_bytes=granule)
    assert alloc.blocks_per_page == 4
    first = alloc.allocate(8)
    assert first == list(range(8)) and vmm.memory()["g"].committed_bytes == 2 * granule
    assert alloc.allocate(8) is None  # a third and fourth page would pass 3 granules
    assert alloc.free_blocks == 8 and vmm.memory()["g"].committed_bytes == 2 * granule
    alloc.free(first[:4])
    assert vmm.memory()["g"].committed_bytes == granule
