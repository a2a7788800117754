"""flexpipe.latency: wire histograms merge by adding counts and give quantiles within a bucket."""

from __future__ import annotations

import random

import pytest

from flexpipe.latency import (
    censored_quantile_ms,
    histogram,
    merge,
    moments,
    quantile_ms,
    total,
)

pytestmark = pytest.mark.unit


def test_quantiles_within_half_a_bucket_and_merging_is_exact() -> None:
    rng = random.Random(5)
    values = [rng.lognormvariate(5.0, 1.2) for _ in range(5000)]
    ordered = sorted(values)
    exact_p95 = ordered[int(0.95 * len(ordered)) - 1]
    h = histogram(values)
    assert total(h) == len(values)
    assert quantile_ms(h, 0.95) == pytest.approx(exact_p95, rel=0.05)
    halves = merge(histogram(values[:1234]), histogram(values[1234:]))
    assert halves == h  # merging is adding counts: the order and split do not matter
    assert quantile_ms((), 0.95) is None
    assert histogram([0.0, -3.0]) == histogram([0.0005, 0.001])  # at or below the floor: one bucket


def test_moments_give_mean_and_squared_variation_within_the_bucket_width() -> None:
    rng = random.Random(6)
    values = [rng.lognormvariate(6.5, 0.8) for _ in range(20_000)]
    mean = sum(values) / len(values)
    scv = sum((v - mean) ** 2 for v in values) / len(values) / mean**2
    got = moments(histogram(values))
    assert got is not None
    assert got[0] == pytest.approx(mean, rel=0.01)
    assert got[1] == pytest.approx(scv, rel=0.02)
    assert moments(histogram([500.0] * 10)) == (pytest.approx(500.0, rel=0.05), 0.0)
    assert moments(()) is None


def test_refused_samples_count_beyond_every_bucket_and_censor_the_quantile() -> None:
    # 95 fast (100 ms) and 5 slow (400 ms) first tokens: the p95 (rank 95 of 100) is fast
    h = histogram([100.0] * 95 + [400.0] * 5)
    assert censored_quantile_ms(h, 0.95, 0) == (quantile_ms(h, 0.95), False)
    assert censored_quantile_ms(h, 0.95, 0)[0] == pytest.approx(100.0, rel=0.05)
    # 3 refused: 103 samples, rank 98 is a slow one, still a sample: exact
    value, censored = censored_quantile_ms(h, 0.95, 3)
    assert value == pytest.approx(400.0, rel=0.05) and not censored
    # 6 refused (> 5 %): rank 101 of 106 is a refusal; only "past the largest sample" is known
    value, censored = censored_quantile_ms(h, 0.95, 6)
    assert value == pytest.approx(400.0, rel=0.05) and censored
    assert censored_quantile_ms((), 0.95, 4) == (None, True)  # refusals only: no bound at all
    assert censored_quantile_ms((), 0.95, 0) == (None, False)
