"""Cost model: formulas, monotonicity and the effects the planner relies on."""

from __future__ import annotations

import dataclasses

import pytest

from gearbox import DEFAULT_CONFIG, MODEL_7B_MHA, MODEL_70B_GQA
from gearbox.cost import (
    ReplicaShape,
    StageShape,
    allreduce_s,
    estimate_replica,
    min_tp_for_memory,
    pipeline_decode_cycle_s,
    prefill_latency_s,
    prefill_scv,
    replica_capacity,
    stage_decode_s,
    stage_kv_capacity_tokens,
    stage_prefill_s,
)
from gearbox.presets import GIB, GPU_CLASSES, LINK_CLASSES
from gearbox.types import GpuClass, LinkClass

H100, A100 = GPU_CLASSES["h100-sxm"], GPU_CLASSES["a100-80g"]
NVLINK, PCIE, RDMA = LINK_CLASSES["nvlink"], LINK_CLASSES["pcie"], LINK_CLASSES["rdma"]


def _stage(tp: int, layers: int, cls: GpuClass = H100, link: LinkClass = NVLINK) -> StageShape:
    return StageShape(cls, tp, layers, link, cls.memory_bytes)


def _unified(*stages: StageShape, pp_link: LinkClass | None = None) -> ReplicaShape:
    return ReplicaShape(tuple(stages), (), pp_link, None)


@pytest.mark.unit
def test_ring_allreduce_formula() -> None:
    # 2(p−1)/p × bytes / (bw × eff) + 2(p−1) × latency
    expected = 2 * 3 / 4 * 1e9 / (25e9 * 0.8) + 6 * 5e-6
    assert allreduce_s(1e9, 4, RDMA, 0.8) == pytest.approx(expected)
    assert allreduce_s(1e9, 1, RDMA, 0.8) == 0.0


@pytest.mark.unit
def test_decode_at_batch_one_is_weights_over_bandwidth() -> None:
    step = stage_decode_s(_stage(1, 32), MODEL_7B_MHA, 1, 1, DEFAULT_CONFIG)
    floor = MODEL_7B_MHA.weight_bytes / (H100.memory_bandwidth_gbps * 1e9 * 0.7)
    assert step == pytest.approx(floor, rel=0.01)


@pytest.mark.unit
def test_single_sequence_read_speedup_touches_only_a_batch_of_one() -> None:
    fast = dataclasses.replace(DEFAULT_CONFIG, single_seq_read_speedup=2.0)
    one = stage_decode_s(_stage(1, 32), MODEL_7B_MHA, 1, 1, fast)
    floor = MODEL_7B_MHA.weight_bytes / 2 / (H100.memory_bandwidth_gbps * 1e9 * 0.7)
    assert one == pytest.approx(floor, rel=0.01)
    for batch in (2, 16):
        assert stage_decode_s(_stage(1, 32), MODEL_7B_MHA, batch, 512, fast) == (
            stage_decode_s(_stage(1, 32), MODEL_7B_MHA, batch, 512, DEFAULT_CONFIG)
        )


@pytest.mark.unit
def test_prefill_scales_with_tp_and_suffers_on_slow_links() -> None:
    one = stage_prefill_s(_stage(1, 80), MODEL_70B_GQA, 2048, DEFAULT_CONFIG)
    eight = stage_prefill_s(_stage(8, 80), MODEL_70B_GQA, 2048, DEFAULT_CONFIG)
    eight_pcie = stage_prefill_s(_stage(8, 80, link=PCIE), MODEL_70B_GQA, 2048, DEFAULT_CONFIG)
    assert one / 8 < eight < one / 4  # near-linear: all-reduces over NVLink cost ~30 %
    assert eight_pcie > eight * 1.5  # two all-reduces per layer over 12 GB/s hurt


@pytest.mark.unit
def test_batch_capacity_follows_memory() -> None:
    full = _stage(8, 80)
    tight = StageShape(H100, 8, 80, NVLINK, 30 * GIB)
    assert stage_kv_capacity_tokens(full, MODEL_70B_GQA, DEFAULT_CONFIG) > 0
    assert stage_kv_capacity_tokens(tight, MODEL_70B_GQA, DEFAULT_CONFIG) < (
        stage_kv_capacity_tokens(full, MODEL_70B_GQA, DEFAULT_CONFIG)
    )
    assert not replica_capacity(
        _unified(_stage(1, 80)), MODEL_70B_GQA, 1000, 200, DEFAULT_CONFIG
    ).feasible


@pytest.mark.unit
def test_min_tp_from_memory() -> None:
    assert min_tp_for_memory(80 * GIB, MODEL_70B_GQA, DEFAULT_CONFIG) == 2
    assert min_tp_for_memory(48 * GIB, MODEL_70B_GQA, DEFAULT_CONFIG) == 4
    assert min_tp_for_memory(80 * GIB, MODEL_7B_MHA, DEFAULT_CONFIG) == 1


@pytest.mark.unit
def test_pipeline_bubble_at_small_batch() -> None:
    stages = (_stage(4, 40, A100, RDMA), _stage(4, 40, A100, RDMA))
    single = stage_decode_s(stages[0], MODEL_70B_GQA, 1, 1000, DEFAULT_CONFIG)
    cycle_1 = pipeline_decode_cycle_s(stages, RDMA, MODEL_70B_GQA, 1, 1000, DEFAULT_CONFIG)
    cycle_64 = pipeline_decode_cycle_s(stages, RDMA, MODEL_70B_GQA, 64, 1000, DEFAULT_CONFIG)
    assert cycle_1 >= 2 * single  # one sequence walks both stages: half the pipeline idles
    assert 64 / cycle_64 > 20 / cycle_1  # larger batches fill the pipeline


@pytest.mark.unit
def test_latency_grows_with_load_and_caps_when_saturated() -> None:
    shape = _unified(_stage(8, 80))
    cap = replica_capacity(shape, MODEL_70B_GQA, 1000, 200, DEFAULT_CONFIG)
    light = estimate_replica(
        shape, MODEL_70B_GQA, 1000, 200, 0.1 * cap.capacity_rps, DEFAULT_CONFIG
    )
    heavy = estimate_replica(
        shape, MODEL_70B_GQA, 1000, 200, 0.9 * cap.capacity_rps, DEFAULT_CONFIG
    )
    over = estimate_replica(shape, MODEL_70B_GQA, 1000, 200, 5 * cap.capacity_rps, DEFAULT_CONFIG)
    assert light.ttft_p95_ms < heavy.ttft_p95_ms and light.tbt_p95_ms < heavy.tbt_p95_ms
    assert over.served_tok_s == pytest.approx(cap.capacity_rps * 1200)
    assert over.ttft_p95_ms <= DEFAULT_CONFIG.max_latency_ms


@pytest.mark.unit
def test_disaggregated_decode_has_no_prefill_stall() -> None:
    prefill, decode = _stage(8, 80), _stage(8, 80, A100, RDMA)
    unified = _unified(decode)
    split = ReplicaShape((prefill,), (decode,), None, RDMA)
    rate = 1.0
    tbt_unified = estimate_replica(unified, MODEL_70B_GQA, 4000, 100, rate, DEFAULT_CONFIG)
    tbt_split = estimate_replica(split, MODEL_70B_GQA, 4000, 100, rate, DEFAULT_CONFIG)
    assert tbt_split.tbt_p95_ms < tbt_unified.tbt_p95_ms


@pytest.mark.unit
def test_heavy_tailed_prompts_lengthen_the_ttft_p95_not_the_capacity() -> None:
    shape = _unified(_stage(1, 32, A100))
    cap = replica_capacity(shape, MODEL_7B_MHA, 800, 200, DEFAULT_CONFIG)
    rate = 0.5 * cap.capacity_rps
    even = estimate_replica(shape, MODEL_7B_MHA, 800, 200, rate, DEFAULT_CONFIG)
    same = estimate_replica(
        shape, MODEL_7B_MHA, 800, 200, rate, DEFAULT_CONFIG, tail_prompt_tokens=800
    )
    tailed = estimate_replica(
        shape,
        MODEL_7B_MHA,
        800,
        200,
        rate,
        DEFAULT_CONFIG,
        tail_prompt_tokens=4000,
        prompt_scv=1.5,
    )
    # A tail equal to the mean with exponential-like spread is the old estimate
    assert same.ttft_p95_ms == pytest.approx(even.ttft_p95_ms)
    longest, _ = prefill_latency_s(shape, MODEL_7B_MHA, 4000, DEFAULT_CONFIG)
    assert tailed.ttft_p95_ms > longest * 1e3 > even.ttft_p95_ms
    assert (tailed.capacity_rps, tailed.tbt_p95_ms) == (even.capacity_rps, even.tbt_p95_ms)


@pytest.mark.unit
def test_prefill_variation_follows_the_prompts_through_the_length_slope() -> None:
    shape = _unified(_stage(1, 32, A100))
    scv = prefill_scv(shape, MODEL_7B_MHA, 800, 4000, 1.5, DEFAULT_CONFIG)
    # Prefill is near-linear in tokens with a small fixed part (quadratic attention on top)
    assert 0.5 * 1.5 < scv < 2 * 1.5
    assert prefill_scv(shape, MODEL_7B_MHA, 800, 800, 1.5, DEFAULT_CONFIG) == 1.5
