"""runtime.stats: a serving report carries its window's TTFTs as a mergeable histogram."""

from __future__ import annotations

import pytest

from flexpipe.latency import quantile_ms, total
from runtime.stats import ServingWindow
from runtime.types import Completion, Reason, Request, RequestKind

pytestmark = pytest.mark.unit


def test_report_carries_every_ttft_sample() -> None:
    window = ServingWindow(start_s=0.0)
    for i in range(20):
        ttft_s = 2.0 if i == 0 else 0.1
        window.on_completion(Completion(f"r{i}", "rep", None, 100, 10, 0.0, ttft_s, 3.0))
    report = window.report(
        "chat", "m", 5.0, queue_len=0, active_sequences=0, kv_bytes=0, plan_id=None
    )
    assert report.ttft_p95_ms == 100.0  # rank 19 of 20
    assert total(report.ttft_histogram) == 20
    assert quantile_ms(report.ttft_histogram, 1.0) == pytest.approx(2000.0, rel=0.05)


def test_report_carries_every_arrivals_prompt_length() -> None:
    window = ServingWindow(start_s=0.0)
    for i in range(20):
        prompt = 6000 if i == 0 else 500
        window.on_arrival(Request(f"r{i}", prompt, 10, 0.0, RequestKind.CHAT), Reason.ADMITTED)
    window.on_arrival(Request("x", 500, 10, 0.0, RequestKind.CHAT), Reason.QUEUE_FULL)
    report = window.report(
        "chat", "m", 5.0, queue_len=0, active_sequences=0, kv_bytes=0, plan_id=None
    )
    assert total(report.prompt_histogram) == 21  # refused arrivals too, like the mean
    assert quantile_ms(report.prompt_histogram, 1.0) == pytest.approx(6000.0, rel=0.05)
    assert quantile_ms(report.prompt_histogram, 0.9) == pytest.approx(500.0, rel=0.05)


def test_report_counts_capacity_refusals_apart_from_bad_requests() -> None:
    window = ServingWindow(start_s=0.0)
    reasons = [
        Reason.ADMITTED,
        Reason.THROTTLED_WATERMARK,
        Reason.REJECTED_OOM_RISK,
        Reason.QUEUE_FULL,
        Reason.TOO_LONG,
        Reason.DUPLICATE_REQUEST,
        Reason.NO_SERVING_PLAN,
    ]
    for i, reason in enumerate(reasons):
        window.on_arrival(Request(f"r{i}", 500, 10, 0.0, RequestKind.CHAT), reason)
    window.on_refused(Reason.MODEL_LOADING)  # a held request given up on: no plan to blame
    window.on_refused(Reason.THROTTLED_WATERMARK)  # a held request a full replica refused
    report = window.report(
        "chat", "m", 5.0, queue_len=0, active_sequences=0, kv_bytes=0, plan_id=None
    )
    assert report.rejected == 8
    assert report.capacity_refusals == 4  # watermark ×2, OOM risk, queue full


def test_tbt_p95_counts_each_iteration_a_run_stands_for() -> None:
    """An engine reporting a run of identical decode iterations as one entry (SimEngine) gives
    the same TBT p95 as one reporting each iteration: one stalled step among 200 is no p95."""
    runs = ServingWindow(start_s=0.0)
    runs.on_step(0, 1_000, (0.010, 0.300, 0.010), (100, 1, 99))
    each = ServingWindow(start_s=0.0)
    each.on_step(0, 1_000, (0.010,) * 100 + (0.300,) + (0.010,) * 99)

    def tbt_p95(window: ServingWindow) -> float | None:
        report = window.report(
            "chat", "m", 5.0, queue_len=0, active_sequences=0, kv_bytes=0, plan_id=None
        )
        return report.tbt_p95_ms

    assert tbt_p95(runs) == tbt_p95(each) == 10.0
    stalled = ServingWindow(start_s=0.0)
    stalled.on_step(0, 1_000, (0.010, 0.300), (10, 1))
    assert tbt_p95(stalled) == 300.0  # 1 in 11 iterations
