"""Windowed load: launch rates per GPU, serving load per deployment across sources."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from flexpipe.latency import histogram
from flexpipe.schemas import KernelLaunches
from streams.load import (
    LAUNCHES,
    LaunchSums,
    LaunchWindow,
    ServingWindows,
    fold_launches,
    fold_serving,
    launch_rate,
    serving_aggregate,
)
from streams.state import Dedupe, is_duplicate
from streams.windows import HoppingWindow, add
from tests.streams.builders import make_launches, make_load

pytestmark = pytest.mark.unit

GPU_WINDOW = HoppingWindow(10.0, 2.0)
LOAD_WINDOW = HoppingWindow(60.0, 10.0)


def test_launch_rate_over_the_window_and_dedupe() -> None:
    state = LaunchWindow()
    for i in range(50):  # 10 s of 0.2 s drains at 500 launches/s
        state, applied = fold_launches(
            state, GPU_WINDOW, make_launches(launches=100), "a", i, 200 * i
        )
        assert applied
    assert launch_rate(state, GPU_WINDOW, 9.8) == pytest.approx(500.0)
    again, applied = fold_launches(state, GPU_WINDOW, make_launches(launches=100), "a", 49, 9800)
    assert not applied and again == state
    assert launch_rate(state, GPU_WINDOW, 1000.0) == 0.0  # nothing in a window far ahead


def test_serving_sums_sources_and_weights_token_means() -> None:
    state = ServingWindows()
    for i in range(6):
        t = 10_000 * i
        state, _ = fold_serving(state, LOAD_WINDOW, make_load(arrivals=20), "w1", i + 1, t)
        state, _ = fold_serving(
            state,
            LOAD_WINDOW,
            make_load(arrivals=10, mean_prompt_tokens=2000.0, queue_len=7),
            "w2",
            i + 1,
            t,
        )
    agg = serving_aggregate(state, LOAD_WINDOW, 55.0)
    assert agg.arrival_rate_rps == pytest.approx(2.0 + 1.0)
    assert agg.mean_prompt_tokens == pytest.approx((20 * 500 + 10 * 2000) / 30)
    assert agg.queue_len == 3 + 7  # latest gauge of each source, summed
    assert agg.prefill_tokens_per_s == pytest.approx(2000.0)
    assert agg.ttft_p95_ms == 300.0


def test_silent_source_leaves_the_state() -> None:
    state = ServingWindows()
    state, _ = fold_serving(state, LOAD_WINDOW, make_load(), "old", 1, 0)
    for i in range(20):
        state, _ = fold_serving(state, LOAD_WINDOW, make_load(), "new", i + 1, 10_000 * (i + 1))
    assert [s.source for s in state.sources] == ["new"]
    assert serving_aggregate(state, LOAD_WINDOW, 200.0).arrival_rate_rps == pytest.approx(2.0)


def test_late_report_is_counted_not_folded() -> None:
    state, _ = fold_serving(ServingWindows(), LOAD_WINDOW, make_load(), "w", 5, 1_000_000)
    late, applied = fold_serving(state, LOAD_WINDOW, make_load(), "w", 6, 1000)
    assert not applied and late.late == 1


def test_window_ttft_p95_is_over_every_sample_not_the_highest_report() -> None:
    # Twelve 5-s reports of four requests each: 46 fast (100 ms) and 2 slow (2 s) in all.
    # Each report's own p95 of four samples is its maximum, so the highest of them is 2 s;
    # the window's 48 samples have their p95 (rank 46) at 100 ms.
    state = ServingWindows()
    for i in range(12):
        ttfts = [100.0] * 4 if i % 6 else [2000.0, 100.0, 100.0, 100.0]
        report = make_load(arrivals=4, ttft_p95_ms=max(ttfts), ttft_histogram=histogram(ttfts))
        state, _ = fold_serving(state, LOAD_WINDOW, report, "w1", i + 1, 5_000 * i)
    agg = serving_aggregate(state, LOAD_WINDOW, 59.0)
    assert agg.ttft_p95_ms == 2000.0
    assert agg.num_ttft_samples == 48
    assert agg.window_ttft_p95_ms == pytest.approx(100.0, rel=0.05)
    # a malformed report's negative counts are dropped, not subtracted
    bad = make_load(arrivals=1, ttft_histogram=((10, -5),))
    state, _ = fold_serving(state, LOAD_WINDOW, bad, "w1", 13, 59_000)
    assert serving_aggregate(state, LOAD_WINDOW, 59.0).num_ttft_samples == 48


def test_capacity_refusals_count_beyond_every_ttft_sample() -> None:
    # Two workers, 50 first tokens each: 95 at 100 ms, 5 at 400 ms. Refusals for want of room
    # are TTFTs past every bucket; other refusals (``rejected`` alone) are not counted.
    def window(refused: tuple[int, int], rejected: int = 0) -> ServingWindows:
        state = ServingWindows()
        for source, slow, n in (("w1", 0, refused[0]), ("w2", 5, refused[1])):
            ttfts = [100.0] * (50 - slow) + [400.0] * slow
            report = make_load(
                arrivals=50 + n,
                rejected=n + rejected,
                capacity_refusals=n,
                ttft_histogram=histogram(ttfts),
            )
            state, _ = fold_serving(state, LOAD_WINDOW, report, source, 1, 5_000)
        return state

    exact = serving_aggregate(window((0, 0), rejected=9), LOAD_WINDOW, 9.0)
    assert exact.window_ttft_p95_ms == pytest.approx(100.0, rel=0.05)
    assert (exact.num_ttft_refused, exact.window_ttft_p95_censored) == (0, False)
    pushed = serving_aggregate(window((1, 2)), LOAD_WINDOW, 9.0)  # 3 of 103: rank 98 is slow
    assert pushed.window_ttft_p95_ms == pytest.approx(400.0, rel=0.05)
    assert (pushed.num_ttft_samples, pushed.num_ttft_refused) == (100, 3)
    assert not pushed.window_ttft_p95_censored
    beyond = serving_aggregate(window((4, 2)), LOAD_WINDOW, 9.0)  # 6 of 106: past every sample
    assert beyond.window_ttft_p95_ms == pytest.approx(400.0, rel=0.05)  # the lower bound
    assert (beyond.num_ttft_refused, beyond.window_ttft_p95_censored) == (6, True)


def test_prompt_lengths_merge_across_sources_into_p95_and_spread() -> None:
    # Two workers: one sees only short prompts, the other one long prompt in ten. Over the
    # window, 1 prompt in 20 is long: the p95 (rank 38 of 40) is short, the maximum long.
    short, mixed = [500.0] * 20, [500.0] * 18 + [6000.0] * 2
    state = ServingWindows()
    for source, prompts in (("w1", short), ("w2", mixed)):
        report = make_load(arrivals=20, prompt_histogram=histogram(prompts))
        state, _ = fold_serving(state, LOAD_WINDOW, report, source, 1, 5_000)
    agg = serving_aggregate(state, LOAD_WINDOW, 9.0)
    lengths = short + mixed
    mean = sum(lengths) / len(lengths)
    scv = sum((x - mean) ** 2 for x in lengths) / len(lengths) / mean**2
    assert agg.p95_prompt_tokens == pytest.approx(500.0, rel=0.05)
    assert agg.prompt_tokens_scv == pytest.approx(scv, rel=0.1)
    assert serving_aggregate(ServingWindows(), LOAD_WINDOW, 9.0).p95_prompt_tokens == 0.0


def _fold_launches_reference(
    state: LaunchWindow, report: KernelLaunches, source: str, seq: int, t_ms: int
) -> tuple[LaunchWindow, bool]:
    """fold_launches as written before its newest-pane fast path: every report through add()."""
    if is_duplicate(state.dedupe, source, seq, t_ms):
        return state, False
    sums = LaunchSums(max(0, report.launches), max(0.0, report.interval_s))
    result = add(GPU_WINDOW, state.panes, t_ms / 1000.0, sums, LAUNCHES)
    dedupe = Dedupe(source, seq, t_ms)
    if result.late:
        return replace(state, dedupe=dedupe, late=state.late + 1), False
    return LaunchWindow(result.state, dedupe, state.late), True


def test_launch_fold_fast_path_matches_the_window_fold() -> None:
    """The newest-pane fast path yields what add() + combine yield: same panes, sums, dedupe and
    late count, over in-order, same-pane, late, duplicate, negative and NaN reports."""
    rng = random.Random(7)
    fast = slow = LaunchWindow()
    t_ms, seq = 1_767_225_600_000, 0
    for _ in range(3000):
        step = rng.choice([0, 0, 1, 200, 200, 999, 2000, 7000, -2500, -15000])
        t_ms += step
        seq = seq + 1 if rng.random() > 0.05 else seq  # some redeliveries
        source = rng.choice(["a", "a", "a", "b"])
        launches = rng.choice([0, 1, 100, 250, -3])
        interval_s = rng.choice([0.2, 0.0, -0.0, 1.5, -0.2, float("nan")])
        report = KernelLaunches("gpu-0", "node-0", 0.2, 100, 500.0)
        object.__setattr__(report, "launches", launches)  # values the schema would refuse too
        object.__setattr__(report, "interval_s", interval_s)
        fast, applied_fast = fold_launches(fast, GPU_WINDOW, report, source, seq, t_ms)
        slow, applied_slow = _fold_launches_reference(slow, report, source, seq, t_ms)
        assert applied_fast == applied_slow
        assert repr(fast) == repr(slow)  # repr: NaN sums compare unequal to themselves
