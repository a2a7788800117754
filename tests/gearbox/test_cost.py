"""Cost model: formulas, monotonicity and the effects the planner relies on."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from gearbox import DEFAULT_CONFIG, MODEL_7B_MHA, MODEL_70B_GQA, cost
from gearbox.cost import (
    ReplicaShape,
    StageShape,
    allreduce_s,
    estimate_replica,
    min_tp_for_memory,
    pipeline_decode_cycle_s,
    prefill_chunk_tokens,
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


CHUNKED = DEFAULT_CONFIG  # chunked prefill is on by default
WHOLE = dataclasses.replace(DEFAULT_CONFIG, prefill_chunk_tbt_share=0.0)


@pytest.mark.unit
def test_a_prefill_chunk_fits_its_share_of_the_tbt_slo() -> None:
    shape = _unified(_stage(8, 80))
    chunk = prefill_chunk_tokens(shape, MODEL_70B_GQA, CHUNKED)
    budget_s = CHUNKED.prefill_chunk_tbt_share * CHUNKED.tbt_slo_ms / 1e3
    assert chunk % 64 == 0 and chunk >= cost.MIN_PREFILL_CHUNK_TOKENS
    assert prefill_latency_s(shape, MODEL_70B_GQA, chunk, CHUNKED)[0] <= budget_s
    assert prefill_latency_s(shape, MODEL_70B_GQA, chunk + 64, CHUNKED)[0] > budget_s
    # a looser TBT SLO gives longer chunks; a split replica and a share of 0 prefill whole
    loose = dataclasses.replace(CHUNKED, tbt_slo_ms=600.0)
    assert prefill_chunk_tokens(shape, MODEL_70B_GQA, loose) > chunk
    assert CHUNKED.prefill_chunk_tbt_share == 0.5
    assert prefill_chunk_tokens(shape, MODEL_70B_GQA, WHOLE) == 0
    split = ReplicaShape((_stage(8, 80),), (_stage(4, 80, A100, RDMA),), None, RDMA)
    assert prefill_chunk_tokens(split, MODEL_70B_GQA, CHUNKED) == 0
    # a replica too slow for the budget still prefills the floor's worth per iteration
    slow = _unified(_stage(4, 80, A100, RDMA))
    assert prefill_chunk_tokens(slow, MODEL_70B_GQA, CHUNKED) == cost.MIN_PREFILL_CHUNK_TOKENS


@pytest.mark.unit
def test_chunked_prefill_trades_a_long_prompts_ttft_for_the_batchs_tbt() -> None:
    shape = _unified(_stage(4, 80, A100, RDMA))
    cap = replica_capacity(shape, MODEL_70B_GQA, 6000, 300, DEFAULT_CONFIG)
    rate = 0.5 * cap.capacity_rps
    chunked = estimate_replica(shape, MODEL_70B_GQA, 6000, 300, rate, CHUNKED)
    whole = estimate_replica(shape, MODEL_70B_GQA, 6000, 300, rate, WHOLE)
    assert chunked.tbt_p95_ms < whole.tbt_p95_ms
    assert chunked.ttft_p95_ms > whole.ttft_p95_ms  # each chunk rides a decode iteration


@pytest.mark.unit
def test_prefills_ride_the_decode_iterations_until_short_chunks_need_more_of_them() -> None:
    """With chunks too short for the prompts a unified replica needs an iteration per chunk,
    each paying a decode step (the fused engine's throughput against this capacity is checked
    in tests/runtime/test_sim_engine.py)."""
    # the 256-token floor on a slow replica: a 6,000-token prompt spans 24 iterations
    slow = _unified(_stage(4, 80, A100, RDMA))
    floor = replica_capacity(slow, MODEL_70B_GQA, 6000, 30, CHUNKED)
    assert prefill_chunk_tokens(slow, MODEL_70B_GQA, CHUNKED) == cost.MIN_PREFILL_CHUNK_TOKENS
    assert floor.capacity_rps < replica_capacity(slow, MODEL_70B_GQA, 6000, 30, WHOLE).capacity_rps
    # a slower roofline overlap adds the shorter side back
    serial = dataclasses.replace(WHOLE, roofline_overlap=0.0)
    assert cost.fused_iteration_s(0.1, 0.02, WHOLE) == pytest.approx(0.1)
    assert cost.fused_iteration_s(0.1, 0.02, serial) == pytest.approx(0.12)


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
    assert tailed.ttft_p95_ms >= longest * 1e3 > even.ttft_p95_ms
    assert (tailed.capacity_rps, tailed.tbt_p95_ms) == (even.capacity_rps, even.tbt_p95_ms)


@pytest.mark.unit
def test_the_long_prompts_or_the_queue_set_the_ttft_p95_never_both() -> None:
    shape = _unified(_stage(1, 32, A100))
    cap = replica_capacity(shape, MODEL_7B_MHA, 800, 200, WHOLE)
    longest, _ = prefill_latency_s(shape, MODEL_7B_MHA, 4000, WHOLE)
    scv = prefill_scv(shape, MODEL_7B_MHA, 800, 4000, 1.5, WHOLE)

    def at(share: float, tail: int | None, prompt_scv: float) -> float:
        rate = share * cap.capacity_rps
        args = (shape, MODEL_7B_MHA, 800, 200, rate, WHOLE)
        return estimate_replica(*args, tail_prompt_tokens=tail, prompt_scv=prompt_scv).ttft_p95_ms

    # Light load: the p95 prompt's own prefill, no queue wait on top (only the iterations
    # around it, the same at any prompt length)
    iterations = at(0.03, None, 1.0) - cap.prefill_latency_s * 1e3
    assert at(0.03, 4000, 1.5) == pytest.approx(longest * 1e3 + iterations)
    # Near saturation the queue sets it: a mean prompt's prefill plus the wait, as without
    # a tail at the same spread — not that wait on top of the p95 prompt's prefill
    queued = at(0.95, None, scv)
    assert queued > longest * 1e3
    assert at(0.95, 4000, 1.5) == pytest.approx(queued)


@pytest.mark.unit
def test_prefill_variation_follows_the_prompts_through_the_length_slope() -> None:
    shape = _unified(_stage(1, 32, A100))
    scv = prefill_scv(shape, MODEL_7B_MHA, 800, 4000, 1.5, DEFAULT_CONFIG)
    # Prefill is near-linear in tokens with a small fixed part (quadratic attention on top)
    assert 0.5 * 1.5 < scv < 2 * 1.5
    assert prefill_scv(shape, MODEL_7B_MHA, 800, 800, 1.5, DEFAULT_CONFIG) == 1.5


def _mm1_p95_wait_s(rho: float, service_rps: float) -> float:
    """Closed form: P(W > t) = ρ·e^(−(1−ρ)μt) = 5 % at t = ln(ρ/0.05) / ((1−ρ)μ), 0 if ρ ≤ 5 %."""
    return max(0.0, math.log(rho / 0.05) / ((1 - rho) * service_rps))


@pytest.mark.unit
@pytest.mark.parametrize("rho", [0.02, 0.05, 0.06, 0.2, 0.5, 0.9, 0.99])
def test_single_server_wait_is_the_mm1_closed_form(rho: float) -> None:
    mu = 4.0
    assert cost._wait_p95_s(rho * mu, mu, 1) == pytest.approx(_mm1_p95_wait_s(rho, mu), abs=1e-12)
    # Allen–Cunneen: service times with c² = 3 double the conditional wait
    assert cost._wait_p95_s(rho * mu, mu, 1, 3.0) == pytest.approx(
        2 * _mm1_p95_wait_s(rho, mu), abs=1e-12
    )


@pytest.mark.unit
def test_an_almost_idle_single_server_has_no_phantom_wait() -> None:
    # The Halfin–Whitt limit gave P(wait) 0.23 here, a p95 wait of ln(0.23/0.05)/(0.98·μ)
    assert cost._erlang_c(1, 0.02) == pytest.approx(0.02)
    assert cost._wait_p95_s(0.02 * 10.0, 10.0, 1) == 0.0


@pytest.mark.unit
def test_erlang_c_matches_hand_computed_values() -> None:
    # C(c, a) = (a^c/c!)·c/(c−a) / (Σ_{k<c} a^k/k! + (a^c/c!)·c/(c−a))
    # c = 2, a = 1: (1/2·2) / (1 + 1 + 1) = 1/3;  c = 3, a = 2: (8/6·3) / (1 + 2 + 2 + 4) = 4/9
    assert cost._erlang_c(2, 1.0) == pytest.approx(1 / 3, rel=1e-12)
    assert cost._erlang_c(3, 2.0) == pytest.approx(4 / 9, rel=1e-12)
    # M/M/3 with one server's rate 1/s at λ = 2/s: μ = 3/s, ρ = 2/3, p95 wait ln((4/9)/0.05)/(3−2)
    assert cost._wait_p95_s(2.0, 3.0, 3) == pytest.approx(math.log((4 / 9) / 0.05), rel=1e-12)


@pytest.mark.unit
def test_erlang_c_is_continuous_and_monotone_across_the_method_switch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    switch = cost._ERLANG_RECURSION_MAX_SERVERS
    servers = range(max(1, switch - 8), switch + 9)
    for rho in (0.3, 0.7, 0.9, 0.95, 0.99):
        default = [cost._erlang_c(c, c * rho) for c in servers]
        # More servers at the same utilisation wait less: strictly, also from c0 to c0 + 1
        assert all(b < a for a, b in itertools.pairwise(default))
        # ... and the p95 wait falls too, each server keeping its rate (μ = c·μ₁)
        waits = [cost._wait_p95_s(rho * c, float(c), c) for c in servers]
        assert all(b <= a for a, b in itertools.pairwise(waits))
        # The series above the switch is the recursion's value, not an approximation of it
        monkeypatch.setattr(cost, "_ERLANG_RECURSION_MAX_SERVERS", 10**6)
        recursion = [cost._erlang_c(c, c * rho) for c in servers]
        monkeypatch.undo()
        assert default == pytest.approx(recursion, rel=1e-9)


@pytest.mark.unit
@pytest.mark.parametrize("servers", [1, 2, 8, 64, 65, 256, 4096, 100_000])
def test_tiny_load_waits_nothing(servers: int) -> None:
    assert cost._wait_p95_s(0.02 * 50.0, 50.0, servers) == 0.0
    assert cost._wait_p95_s(0.0, 50.0, servers) == 0.0


@pytest.mark.unit
def test_a_lightly_loaded_replica_has_its_unloaded_ttft() -> None:
    shape = _unified(_stage(1, 32, A100))
    cap = replica_capacity(shape, MODEL_7B_MHA, 800, 200, DEFAULT_CONFIG)
    rate = 0.04 / cap.prefill_occupancy_s  # the prefill server busy 4 % of the time
    slots = cap.max_batch  # its decode slots, 9 % busy, rarely all taken
    assert cost._erlang_c(slots, slots * rate / cap.capacity_rps) < 0.05
    light = estimate_replica(shape, MODEL_7B_MHA, 800, 200, rate, DEFAULT_CONFIG)
    # no queue wait: the iteration in progress, then the prefill in an iteration that also
    # decodes the one running sequence (fused: one decode token's compute on top)
    decoding = rate * 200 * cap.unloaded_tbt_s
    in_progress = cost._iteration_wait_p95_s(decoding, cap.unloaded_tbt_s)
    one_token, _ = prefill_latency_s(shape, MODEL_7B_MHA, 1, DEFAULT_CONFIG)
    span = cost.fused_iteration_s(
        cap.prefill_latency_s + one_token, cap.unloaded_tbt_s, DEFAULT_CONFIG
    )
    assert light.ttft_p95_ms == pytest.approx((span + in_progress) * 1e3)


@pytest.mark.unit
def test_a_prompt_waits_on_the_decode_iterations_around_its_prefill() -> None:
    """The engine starts a prefill at the end of the iteration in progress (runtime.engine.sim);
    the iteration carrying it on a unified replica is the prefill's span (fused, above)."""
    cycle = 0.020
    # nothing decoding (or the batch empty 95 % of the time): no iteration to wait on
    assert cost._iteration_wait_p95_s(0.0, cycle) == 0.0
    assert cost._iteration_wait_p95_s(0.05, cycle) == 0.0
    # always busy: the p95 residual of a uniform step is 0.95 of it
    assert cost._iteration_wait_p95_s(50.0, cycle) == pytest.approx(0.95 * cycle)
    # half the time busy: P(residual > t) = 0.5 × (1 − t / cycle) = 5 % at t = 0.9 × cycle
    half = math.log(2.0)
    assert cost._iteration_wait_p95_s(half, cycle) == pytest.approx(0.9 * cycle)


@pytest.mark.unit
def test_the_replica_estimate_memo_misses_whenever_any_input_differs() -> None:
    # estimate_replica is memoised; every input must be part of the key: a warm memo answers
    # each variation exactly as a fresh computation does.
    fresh = cost._estimate_replica.__wrapped__
    shape = _unified(_stage(1, 32, A100))
    base = (shape, MODEL_7B_MHA, 800, 200, 5.0, DEFAULT_CONFIG, None, 1.0)
    variations = [
        base,
        (_unified(_stage(2, 32, A100)), *base[1:]),
        (_unified(_stage(2, 32, A100, PCIE)), *base[1:]),
        (shape, MODEL_70B_GQA, *base[2:]),
        (*base[:2], 1600, *base[3:]),
        (*base[:3], 400, *base[4:]),
        (*base[:4], 3.0, *base[5:]),
        (*base[:5], dataclasses.replace(DEFAULT_CONFIG, mbu_decode=0.5), *base[6:]),
        (*base[:6], 4000, 1.0),
        (*base[:6], None, 1.5),
    ]
    cost.clear_caches()
    for args in variations + variations:  # the second round answers from the memo
        memo = estimate_replica(*args[:6], tail_prompt_tokens=args[6], prompt_scv=args[7])
        assert memo == fresh(*args)
    assert cost._estimate_replica.cache_info().hits == len(variations)
    assert len({fresh(*args) for args in variations}) == len(variations)


@pytest.mark.unit
def test_the_replica_estimate_memo_keeps_an_int_rate_and_minus_zero_apart() -> None:
    fresh = cost._estimate_replica.__wrapped__
    shape = _unified(_stage(1, 32, A100))
    args = (shape, MODEL_7B_MHA, 800, 200)
    cost.clear_caches()
    for rate in (2.0, 2, 0.0, -0.0, 0, -0.0):
        memo = estimate_replica(*args, rate, DEFAULT_CONFIG)
        expected = fresh(*args, rate, DEFAULT_CONFIG, None, 1.0)
        assert memo == expected
        assert [type(v) for v in dataclasses.astuple(memo)] == [
            type(v) for v in dataclasses.astuple(expected)
        ]
        assert [math.copysign(1.0, v) for v in dataclasses.astuple(memo)] == [
            math.copysign(1.0, v) for v in dataclasses.astuple(expected)
        ]
