"""gearbox.correction's service-rate factor: near saturation the observation teaches the queues'
service rate, not the TTFT factor, and the plan is judged on what it was seen to do."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest

from gearbox import DEFAULT_CONFIG, MODEL_70B_GQA, GearState, decide
from gearbox.correction import (
    DEPLOYMENT_WIDE,
    Corrections,
    factor_for,
    observe_service,
    plan_shape,
    service_factor_for,
    solve_service_factor,
    teaches_service_rate,
)
from gearbox.plans import DeploymentPlan
from gearbox.ranking import available_memory, estimate_plan
from gearbox.scoring import DeploymentEstimate
from gearbox.types import LoadSnapshot
from tests.gearbox.builders import NOW_S, article_cluster, deployment, make_load, tp_plan

pytestmark = pytest.mark.unit

# NOTE: off by default (see its note in gearbox.config); these tests turn it on
CONFIG = replace(DEFAULT_CONFIG, correction_service_ratio=0.2)

A4 = ("A-g00", "A-g01", "A-g02", "A-g03")
KNEE_RPS = 8.5  # TP4 of the 70B on H100: modelled capacity ≈ 9.4 rps, judged at 1.1 × demand
OBSERVED_MS = 500.0  # what the world shows there: far from saturated


def _tp4() -> tuple[DeploymentPlan, dict[str, int]]:
    current = deployment(tp_plan(A4, MODEL_70B_GQA))
    return current, available_memory(article_cluster(), current.gpu_uuids)


def _seen(rps: float, ttft_ms: float, now_s: float = NOW_S) -> LoadSnapshot:
    load = make_load(rps, now_s=now_s)
    return replace(load, window_ttft_p95_ms=ttft_ms, num_ttft_samples=200)


def test_the_service_factor_scales_the_queues_not_the_latency() -> None:
    current, available = _tp4()
    load = make_load(KNEE_RPS)

    def at(service_factor: float, rps: float = KNEE_RPS) -> DeploymentEstimate:
        seen = make_load(rps)
        return estimate_plan(
            current, available, MODEL_70B_GQA, seen, CONFIG, service_factor=service_factor
        )

    model, idle = at(1.0), at(1.0, 0.0)
    assert model == estimate_plan(current, available, MODEL_70B_GQA, load, CONFIG)
    faster = at(1.5)
    # a queue served 1.5× as fast waits as the modelled one at 1/1.5 of the arrivals, ÷ 1.5
    slower_arrivals = at(1.0, KNEE_RPS / 1.5)
    wait_ms = slower_arrivals.ttft_p95_ms - idle.ttft_p95_ms
    assert faster.ttft_p95_ms == pytest.approx(idle.ttft_p95_ms + wait_ms / 1.5)
    assert faster.capacity_tok_s == pytest.approx(model.capacity_tok_s * 1.5)
    assert faster.tbt_p95_ms == model.tbt_p95_ms  # TBT keeps the model's figure
    figures = [at(s).ttft_p95_ms for s in (0.5, 0.8, 1.0, 1.2, 2.0, 4.0)]
    assert all(a > b for a, b in itertools.pairwise(figures))
    assert figures[-1] > idle.ttft_p95_ms  # the zero-load latency is a floor


def test_solve_meets_the_observation_or_stops_at_a_bound() -> None:
    def ttft_ms(service_factor: float) -> float:
        return 100.0 + 900.0 / service_factor**3

    solved = solve_service_factor(ttft_ms, 300.0, CONFIG)
    assert ttft_ms(solved) == pytest.approx(300.0, rel=1e-6)
    assert solve_service_factor(ttft_ms, 50.0, CONFIG) == pytest.approx(
        CONFIG.correction_max_factor
    )  # below the latency floor: no service rate meets it
    assert solve_service_factor(ttft_ms, 1e9, CONFIG) == pytest.approx(CONFIG.correction_min_factor)


def test_the_smaller_explanation_is_taught() -> None:
    # a 25× TTFT error that 10 % of service rate explains is a service-rate error
    assert teaches_service_rate(math.log(1 / 25), math.log(1.1), CONFIG)
    # a 1.7× error that needs the service rate 30 % lower is a latency error
    assert not teaches_service_rate(math.log(1.7), math.log(0.7), CONFIG)
    off = replace(CONFIG, correction_service_ratio=0.0)
    assert not teaches_service_rate(math.log(1 / 25), math.log(1.1), off)
    assert not teaches_service_rate(0.0, 0.0, CONFIG)


def test_a_taught_service_rate_replaces_the_last_and_is_inherited() -> None:
    learned = observe_service(Corrections(), "tp4", 1.3, 200, 0.0, None, CONFIG)
    learned = observe_service(learned, "tp4", 1.1, 200, 15.0, None, CONFIG)
    assert service_factor_for(learned, "tp4", 15.0, CONFIG) == pytest.approx(1.1)
    # a shape never served inherits the deployment-wide factor, and both decay toward 1
    assert service_factor_for(learned, "tp8", 15.0, CONFIG) == pytest.approx(1.1)
    later = 15.0 + CONFIG.correction_half_life_s
    assert service_factor_for(learned, DEPLOYMENT_WIDE, later, CONFIG) == pytest.approx(
        math.sqrt(1.1)
    )
    assert learned.entries == ()  # the TTFT factors are untouched
    # thin windows and settling ticks teach nothing; the ratio 0 turns it off
    thin = CONFIG.correction_min_samples - 1
    assert observe_service(learned, "tp4", 2.0, thin, 30.0, None, CONFIG) == learned
    assert observe_service(learned, "tp4", 2.0, 200, 30.0, 0.0, CONFIG) == learned
    off = replace(CONFIG, correction_service_ratio=0.0)
    assert service_factor_for(learned, "tp4", 15.0, off) == 1.0


def test_at_its_modelled_knee_a_plan_is_judged_on_what_it_was_seen_to_do() -> None:
    # steady-boundary in small: the model puts the serving plan past its knee (12 s), the
    # world serves it at 500 ms. One TTFT factor would be dragged to its 0.25 clamp (12 s ×
    # 0.25 = 3 s, over the SLO) and buy GPUs the plan does not need.
    current, _ = _tp4()
    shape = plan_shape(current)
    snapshot = article_cluster()
    seen = _seen(KNEE_RPS, OBSERVED_MS)
    result = decide(current, snapshot, seen, GearState(), CONFIG, model=MODEL_70B_GQA)
    assert result.current is not None
    assert result.current.est_ttft_p95_ms == pytest.approx(OBSERVED_MS, rel=1e-3)
    assert result.current.ttft_correction == 1.0  # the TTFT factor learned nothing
    speed = service_factor_for(result.state.corrections, shape, NOW_S, CONFIG)
    # the learned rate is the one at which the model meets the observation
    _, available = _tp4()
    fitted = estimate_plan(current, available, MODEL_70B_GQA, seen, CONFIG, service_factor=speed)
    assert fitted.ttft_p95_ms == pytest.approx(OBSERVED_MS, rel=1e-3)
    slower = estimate_plan(current, available, MODEL_70B_GQA, seen, CONFIG, service_factor=1.0)
    assert slower.ttft_p95_ms > 2 * OBSERVED_MS  # the model alone is past its knee
    assert result.decision is None
    assert f"service rate × {speed:.2f}" in result.explanation
    # the same tick with the service rate off: the old behaviour, which buys GPUs
    off = replace(CONFIG, correction_service_ratio=0.0)
    old = decide(current, snapshot, seen, GearState(), off, model=MODEL_70B_GQA)
    assert old.decision is not None and old.decision.to_plan.num_gpus > current.num_gpus
    # then the load falls: far from the knee the TTFT factor learns, the service rate is kept
    _, available = _tp4()
    low = make_load(2.0)
    args = (available, MODEL_70B_GQA, low, CONFIG)
    model_ms = estimate_plan(current, *args, service_factor=speed).ttft_p95_ms
    at_low = _seen(2.0, 1.5 * model_ms, now_s=NOW_S + 15.0)
    later = decide(current, snapshot, at_low, result.state, CONFIG, model=MODEL_70B_GQA)
    corrections = later.state.corrections
    assert factor_for(corrections, shape, NOW_S + 15.0, CONFIG) == pytest.approx(1.5, rel=0.01)
    assert service_factor_for(corrections, shape, NOW_S + 15.0, CONFIG) == pytest.approx(
        speed, rel=0.01
    )


def test_a_censored_observation_only_lowers_the_service_rate() -> None:
    # a lower bound on the TTFT is an upper bound on the service rate that meets it
    t = NOW_S

    def bounded(corrections: Corrections, factor: float) -> Corrections:
        return observe_service(corrections, "s", factor, 200, t, None, CONFIG, censored=True)

    fast = observe_service(Corrections(), "s", 1.3, 200, t - 15.0, None, CONFIG)
    assert bounded(fast, 1.5) == fast  # at most 1.5: 1.3 is not proven wrong
    slowed = bounded(fast, 1.1)
    assert service_factor_for(slowed, "s", t, CONFIG) == pytest.approx(1.1)
    assert bounded(Corrections(), 1.2) == Corrections()  # 1 (nothing learned) meets it
