"""Unit: SLO goodput per request, the seeds' aggregate and issue 12's targets."""

from __future__ import annotations

from typing import Any

import pytest

from bench.sim.des import DecisionLog
from bench.sim.metrics import DeploymentMetrics
from bench.sim.report import aggregate, p95_of, targets
from bench.sim.summary import tick_reason, window_ttft_p95
from flexpipe.config import FlexPipeConfig
from runtime.types import Completion, RequestKind
from sim.catalog import with_scenario
from sim.scenario import SEED_FRAGMENTED, load_scenario

pytestmark = pytest.mark.unit


def _done(rid: str, ttft_s: float, tbt_s: float, output: int = 11) -> Completion:
    first = 10.0 + ttft_s
    return Completion(rid, "r", None, 100, output, 10.0, first, first + tbt_s * (output - 1))


def test_a_request_is_goodput_only_within_both_slos() -> None:
    m = DeploymentMetrics(ttft_slo_s=2.0, tbt_slo_s=0.15)
    m.on_completion(_done("ok", 1.0, 0.1), RequestKind.CHAT)
    m.on_completion(_done("slow-first", 2.5, 0.1), RequestKind.CHAT)
    m.on_completion(_done("slow-gaps", 1.0, 0.2), RequestKind.CHAT)
    m.on_completion(_done("one-token", 1.0, 0.0, output=1), RequestKind.CHAT)
    assert m.good_requests == 2
    assert m.goodput_tokens == (100 + 11) + (100 + 1)
    assert (m.missed_ttft, m.missed_tbt) == (1, 1)
    assert sum(m.tokens.values()) == 3 * 111 + 101  # raw tokens count them all


def test_deployment_slos_come_from_config_with_gearbox_defaults() -> None:
    cfg = with_scenario(FlexPipeConfig(), load_scenario(SEED_FRAGMENTED))
    dep = cfg.deployments[0]
    assert dep.slo_ms(cfg.gearbox) == (cfg.gearbox.ttft_slo_ms, cfg.gearbox.tbt_slo_ms)
    own = dep.model_copy(update={"ttft_slo_ms": 500.0})
    assert own.slo_ms(cfg.gearbox) == (500.0, cfg.gearbox.tbt_slo_ms)


def _system(goodput: float, flaps: int, totals: list[float]) -> dict[str, Any]:
    return {
        "shifts": [
            {"deployment": "big", "outcome": "done", "total_s": t, "switch_s": 1.0} for t in totals
        ],
        "deployments": {"big": {"preemptions": []}},
        "flaps": {"flaps": flaps},
        "goodput_of_offered": goodput,
    }


def test_aggregate_takes_medians_worst_seed_and_pools_shifts() -> None:
    heads = [
        {"goodput_of_offered": g, "goodput_ratio_vs_fixed": r, "flaps_flexpipe": 0}
        for g, r in ((0.9, 1.1), (0.8, 0.95), (0.95, 1.2))
    ]
    runs = [(h, {"flexpipe": _system(0.9, 0, [float(i), 20.0])}) for i, h in enumerate(heads)]
    out = aggregate(runs, "big", None, 0.3)
    assert out["goodput_of_offered"] == 0.9 and out["goodput_of_offered_min"] == 0.8
    assert out["goodput_ratio_vs_fixed_min"] == 0.95
    assert out["shift_s_70b_p95"] == 20.0
    assert p95_of([1.0, 2.0, 3.0]) == 3.0 and p95_of([]) is None
    met = {t["target"]: t["met"] for t in targets(out)}
    assert met["goodput_ratio_vs_fixed_min"] is False
    assert met["goodput_vs_oracle"] is None  # not measured is not met


def test_no_flaps_anywhere_does_not_show_hysteresis_working() -> None:
    rows = targets({"flaps_flexpipe": 0, "flaps_no_hysteresis": 0})
    flap_row = next(t for t in rows if t["target"].startswith("flaps_no_hysteresis"))
    assert flap_row["met"] is False
    rows = targets({"flaps_flexpipe": 1, "flaps_no_hysteresis": 2})
    assert next(t for t in rows if t["target"].startswith("flaps_no_h"))["met"] is True


def test_held_by_hysteresis_is_split_from_gain_below_cost() -> None:
    def tick(reason: str, over: bool) -> DecisionLog:
        return DecisionLog(
            0.0, "d", "timer", reason, None, False, None, None, 0, 0.0, 0, "", gain_over_cost=over
        )

    assert tick_reason(tick("held_by_hysteresis", True)) == "held_by_hysteresis"
    assert tick_reason(tick("held_by_hysteresis", False)) == "gain_below_cost"
    assert tick_reason(tick("cooldown", False)) == "cooldown"


def test_capacity_refusals_count_as_ttfts_beyond_every_sample() -> None:
    """A window's TTFT p95 counts the requests refused for want of room (as the streams do): a
    few move it up among the samples, more than 5 % make it a lower bound; other refusals (no
    plan) say nothing about the plan's TTFT."""
    m = DeploymentMetrics(ttft_slo_s=2.0, tbt_slo_s=0.15)
    for i in range(100):  # first tokens 0.1-1.0 s, all in minute 0
        m.on_completion(_done(f"r{i}", 0.1 + 0.9 * i / 99, 0.01), RequestKind.CHAT)
    served_only = window_ttft_p95(m, 0.0, 60.0)
    assert served_only[1] is False and served_only[0] == pytest.approx(955, rel=0.03)
    for _ in range(3):
        m.on_refused("ttft_deadline", 30.0)
    m.on_refused("no_serving_plan", 30.0)
    few = window_ttft_p95(m, 0.0, 60.0)
    assert few[1] is False and (few[0] or 0.0) > (served_only[0] or 0.0)  # rank 98 of 100
    assert m.rejections == {"ttft_deadline": 3, "no_serving_plan": 1}
    for _ in range(5):
        m.on_refused("throttled_watermark", 30.0)
    many = window_ttft_p95(m, 0.0, 60.0)
    assert many[1] is True and many[0] == pytest.approx(1000, rel=0.03)  # the largest sample
    assert window_ttft_p95(m, 60.0, 120.0) == (None, False)
