"""bench.engine's measurement and fit helpers: when rounds stop, what the fit recovers, the
measured collective and the engine's corrections of gearbox's parameter count."""

from __future__ import annotations

import dataclasses

import pytest

from bench.engine.__main__ import BENCH_MODEL
from bench.engine.fidelity import (
    _SEQ_LAYER_OVERHEAD_S,
    engine_spec,
    fit,
    mape,
    measured_collective,
    predict_all,
)
from bench.engine.measure import Sample, _settled
from gearbox.config import DEFAULT_CONFIG, GearboxConfig
from gearbox.cost import allreduce_s
from gearbox.types import GpuClass, LinkClass
from runtime.engine.torch.plans import GIB

_POINT = ("tp1", "decode", 4, 66)


@pytest.mark.unit
def test_rounds_settle_only_when_the_last_rounds_found_nothing_faster() -> None:
    flat = {_POINT: [(0.010, 0.011)] * 6}
    assert _settled(flat, 3, 0.02)
    late = {_POINT: [(0.010, 0.011)] * 5 + [(0.009, 0.010)]}  # 10 % faster in the last round
    assert not _settled(late, 3, 0.02)
    tiny = {_POINT: [(0.010, 0.011)] * 5 + [(0.0099, 0.010)]}  # 1 %: within the settle share
    assert _settled(tiny, 3, 0.02)


@pytest.mark.unit
def test_fit_reproduces_steps_made_by_the_cost_model() -> None:
    """Steps made by the cost model with known constants (a one-sequence read speed-up among
    them) are fitted back within the grids' resolution, far closer than gearbox's defaults."""
    cfg = BENCH_MODEL
    gpu = GpuClass("cpu-host", 0.09, 16 * GIB, 20.0)
    link = LinkClass("shm", 9.0, 50.0)
    truth = dataclasses.replace(
        DEFAULT_CONFIG,
        pp_microbatching=False,
        mfu_prefill=0.6,
        mbu_decode=0.3,
        mfu_decode=0.2,
        step_overhead_s=7.6e-4,
        roofline_overlap=0.5,
        single_seq_read_speedup=1.521,
    )
    points = [
        Sample(plan, "decode", batch, 66, 0.0, 0.0)
        for plan in ("tp1", "tp2")
        for batch in (1, 2, 16)
    ] + [Sample(plan, "prefill", 1, n, 0.0, 0.0) for plan in ("tp1", "tp2") for n in (32, 256)]
    measured = predict_all(points, cfg, gpu, link, truth)
    samples = [dataclasses.replace(s, step_s=t) for s, t in zip(points, measured, strict=True)]
    base = dataclasses.replace(DEFAULT_CONFIG, pp_microbatching=False)
    config, fitted_link = fit(samples, cfg, gpu, link, base)
    fitted = mape(predict_all(samples, cfg, gpu, fitted_link, config), measured)
    # NOTE: coarse grids (25 % steps) on purpose: finer ones overfit the noisy measured points
    assert fitted < 0.08
    assert mape(predict_all(samples, cfg, gpu, link, base), measured) > 4 * fitted


def _made_by(truth: GearboxConfig, link: LinkClass, points: list[Sample]) -> list[Sample]:
    gpu = GpuClass("cpu-host", 0.093, 16 * GIB, 22.0)
    times = predict_all(points, BENCH_MODEL, gpu, link, truth)
    return [dataclasses.replace(s, step_s=t) for s, t in zip(points, times, strict=True)]


def _points(batches: tuple[int, ...], lens: tuple[int, ...]) -> list[Sample]:
    plans = ("tp1", "tp2", "pp2")
    decode = [Sample(p, "decode", b, 66, 0.0, 0.0) for p in plans for b in batches]
    return decode + [Sample(p, "prefill", 1, n, 0.0, 0.0) for p in plans for n in lens]


@pytest.mark.unit
def test_fit_finds_a_per_sequence_cost_that_tp_does_not_divide() -> None:
    """Steps whose per-sequence cost is mostly dispatch (the same on every TP rank) are fitted
    back exactly, held-out points included; from a per-sequence overhead of 0 alone the descent
    stayed on decode compute (which TP divides) and predicted TP2's slope half its size."""
    gpu = GpuClass("cpu-host", 0.093, 16 * GIB, 22.0)
    link = LinkClass("shm", 9.0, 256.3)
    base = dataclasses.replace(DEFAULT_CONFIG, pp_microbatching=False, collective_efficiency=0.23)
    truth = dataclasses.replace(
        base,
        mfu_prefill=0.7105,
        mbu_decode=0.291,
        mfu_decode=0.7105,
        step_overhead_s=2.25e-4,
        seq_layer_overhead_s=_SEQ_LAYER_OVERHEAD_S[10],  # ~0.19 ms, as fitted on this host
        roofline_overlap=0.0,
        single_seq_read_speedup=1.521,
    )
    calib = _made_by(truth, link, _points((1, 2, 16), (32, 256)))
    held = _made_by(truth, link, _points((4, 8, 12), (64, 128)))
    measured = [s.step_s for s in held]
    config, fitted = fit(calib, BENCH_MODEL, gpu, link, base, fit_collective=False)
    assert config.seq_layer_overhead_s == truth.seq_layer_overhead_s
    assert mape(predict_all(held, BENCH_MODEL, gpu, fitted, config), measured) < 0.005
    stuck, stuck_link = fit(
        calib, BENCH_MODEL, gpu, link, base, fit_collective=False, seq_starts=(0.0,)
    )
    assert mape(predict_all(held, BENCH_MODEL, gpu, stuck_link, stuck), measured) > 0.02


@pytest.mark.unit
def test_measured_collective_reproduces_gearbox_ring_allreduce() -> None:
    """Probes timed as gearbox's ring all-reduce would take them give back its latency and
    efficiency; a large message probed no slower than a small one reads as efficiency 1."""
    link = LinkClass("shm", 9.0, 120.0)
    hidden_bytes = BENCH_MODEL.hidden_size * 4
    probes = [
        Sample("tp2", "allreduce", 8, rows, 8 * allreduce_s(rows * hidden_bytes, 2, link, 0.3), 0)
        for rows in (1, 256)
    ]
    coll = measured_collective(probes, BENCH_MODEL, dataclasses.replace(link, latency_us=0), 2)
    assert coll.latency_us == pytest.approx(120.0)
    assert coll.efficiency == pytest.approx(0.3)
    assert (coll.calls, coll.small_rows, coll.large_rows) == (8, 1, 256)
    flat = [dataclasses.replace(p, step_s=probes[0].step_s) for p in probes]
    assert measured_collective(flat, BENCH_MODEL, link, 2).efficiency == 1.0


@pytest.mark.unit
def test_engine_spec_counts_the_replicated_lm_head_whole_on_the_tp_leader() -> None:
    """Gearbox divides every parameter by TP; the engine's head is not vocab-parallel, so a
    decode step on TP p counts it p times (1/p of that is the whole head); prefill, which runs
    the head on one row per sequence, counts none of it."""
    head = BENCH_MODEL.vocab_size * BENCH_MODEL.hidden_size
    one = engine_spec(BENCH_MODEL, "decode")
    assert engine_spec(BENCH_MODEL, "decode", 2).num_params == one.num_params + head
    assert engine_spec(BENCH_MODEL, "prefill", 2) == engine_spec(BENCH_MODEL, "prefill")
