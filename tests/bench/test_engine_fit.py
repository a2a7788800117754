"""bench.engine's measurement and fit helpers: when rounds stop, and what the fit recovers."""

from __future__ import annotations

import dataclasses

import pytest

from bench.engine.__main__ import BENCH_MODEL
from bench.engine.fidelity import fit, mape, predict_all
from bench.engine.measure import Sample, _settled
from gearbox.config import DEFAULT_CONFIG
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
