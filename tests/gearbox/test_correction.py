"""gearbox.correction: the learned TTFT factor converges, stays bounded, decays, and is used."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from gearbox import DEFAULT_CONFIG, MODEL_70B_GQA, GearboxConfig, GearState, decide
from gearbox.correction import (
    DEPLOYMENT_WIDE,
    Corrections,
    apply_correction,
    factor_for,
    observe,
    observe_demand,
    observe_prompts,
    observe_tbt,
    plan_shape,
    prompt_tail,
    tbt_factor_for,
    with_prompt_tail,
    with_smoothed_demand,
)
from gearbox.ranking import available_memory, estimate_plan
from gearbox.types import LoadSnapshot
from tests.gearbox.builders import NOW_S, article_cluster, deployment, make_load, tp_plan

pytestmark = pytest.mark.unit

# NOTE: at the default half-life the decay between 15-s ticks holds a steady factor a few per
# cent short of the ratio it learns; a week-long half-life isolates learning (decay is tested apart)
CONFIG = replace(DEFAULT_CONFIG, correction_half_life_s=7 * 86_400.0)
A4 = ("A-g00", "A-g01", "A-g02", "A-g03")
A8 = tuple(f"A-g{i:02d}" for i in range(8))
NONE = Corrections()


def _feed(
    ratio: float, ticks: int, corrections: Corrections = NONE, shape: str = "s"
) -> Corrections:
    """``ticks`` observations 15 s apart of a plan observed at ``ratio`` × its model."""
    for i in range(ticks):
        corrections = observe(corrections, shape, 100.0, 100.0 * ratio, 50, 15.0 * i, None, CONFIG)
    return corrections


def test_converges_toward_observed_over_modelled() -> None:
    # the first observations are averaged (geometric mean): 2× then 0.5× the model is the model
    both = observe(_feed(2.0, 1), "s", 100.0, 50.0, 50, 15.0, None, CONFIG)
    assert factor_for(both, "s", 15.0, CONFIG) == pytest.approx(1.0, rel=1e-4)
    assert factor_for(_feed(2.5, 30), "s", 15.0 * 29, CONFIG) == pytest.approx(2.5, rel=1e-3)
    # then the world changes: the factor follows it step by step to the new ratio
    moved = _feed(2.5, 30)
    factors = []
    for i in range(30, 90):
        moved = observe(moved, "s", 100.0, 125.0, 50, 15.0 * i, None, CONFIG)
        factors.append(factor_for(moved, "s", 15.0 * i, CONFIG))
    assert all(a > b for a, b in itertools.pairwise(factors))  # each tick moves it closer
    assert factors[0] < 2.5 and factors[-1] == pytest.approx(1.25, rel=0.02)
    low = _feed(0.5, 40)
    assert factor_for(low, "s", 15.0 * 39, CONFIG) == pytest.approx(0.5, rel=0.02)


def test_stays_within_its_bounds() -> None:
    high, low = _feed(1000.0, 50), _feed(0.0001, 50)
    assert factor_for(high, "s", 15.0 * 49, CONFIG) == CONFIG.correction_max_factor
    assert factor_for(low, "s", 15.0 * 49, CONFIG) == CONFIG.correction_min_factor
    tight = replace(CONFIG, correction_max_factor=1.5)
    one = observe(Corrections(), "s", 100.0, 10_000.0, 50, 0.0, None, tight)
    assert factor_for(one, "s", 0.0, tight) == 1.5


def test_decays_toward_one_without_data() -> None:
    learned = _feed(4.0, 60)
    last_s = 15.0 * 59
    now = factor_for(learned, "s", last_s, CONFIG)
    half = factor_for(learned, "s", last_s + CONFIG.correction_half_life_s, CONFIG)
    assert half == pytest.approx(math.sqrt(now))  # the log halves per half-life
    assert factor_for(learned, "s", last_s + 20 * CONFIG.correction_half_life_s, CONFIG) == (
        pytest.approx(1.0, abs=1e-4)
    )


def test_ignores_thin_settling_and_saturated_ticks() -> None:
    base = _feed(2.0, 5)
    t = 15.0 * 5
    few = CONFIG.correction_min_samples - 1
    assert observe(base, "s", 100.0, 900.0, few, t, None, CONFIG) == base
    assert observe(base, "s", 100.0, 900.0, 50, t, t - 10.0, CONFIG) == base  # just switched
    saturated = CONFIG.max_latency_ms
    assert observe(base, "s", saturated, 900.0, 50, t, None, CONFIG) == base
    off = replace(CONFIG, correction_gain=0.0)
    assert observe(base, "s", 100.0, 900.0, 50, t, None, off) == base
    later = t - CONFIG.correction_settle_s
    assert observe(base, "s", 100.0, 900.0, 50, t, later, CONFIG) != base


def test_a_censored_observation_teaches_only_the_direction_it_proves() -> None:
    # a lower bound of 1.5× the model: it proves a factor of 1 wrong, one of 3 right or not
    t = 15.0 * 40

    def bounded(corrections: Corrections, shape: str = "s") -> Corrections:
        return observe(corrections, shape, 100.0, 150.0, 50, t, None, CONFIG, censored=True)

    assert bounded(NONE) != NONE  # from nothing (a factor of 1): it rises
    high = _feed(3.0, 40)
    assert bounded(high) == high  # already above the bound: nothing learned, not even a count
    # below it: folded toward the bound as if exact, never past it
    low = _feed(1.2, 40)
    raised = bounded(low)
    assert raised == observe(low, "s", 100.0, 150.0, 50, t, None, CONFIG)
    for _ in range(200):
        raised = bounded(raised)
    assert factor_for(raised, "s", t, CONFIG) == pytest.approx(1.5, rel=1e-3)
    assert factor_for(raised, "s", t, CONFIG) <= 1.5
    # the deployment-wide entry is judged on its own: above the bound, it keeps its value
    mixed = _feed(3.0, 40, _feed(1.2, 40), shape="other")
    wide = mixed.get(DEPLOYMENT_WIDE)
    assert wide is not None and wide.factor > 1.5
    assert bounded(mixed).get(DEPLOYMENT_WIDE) == wide
    assert factor_for(bounded(mixed), "s", t, CONFIG) > factor_for(mixed, "s", t, CONFIG)
    # a bound below 1 with nothing learned teaches nothing: no entry at all
    assert observe(NONE, "s", 100.0, 50.0, 50, t, None, CONFIG, censored=True) == NONE


def test_unobserved_shapes_get_the_deployment_wide_factor() -> None:
    learned = _feed(3.0, 10, shape="tp8")
    learned = _feed(0.5, 3, learned, shape="tp4")
    t = 15.0 * 9
    wide = learned.get(DEPLOYMENT_WIDE)
    assert wide is not None and wide.observations == 13
    assert factor_for(learned, "tp8", t, CONFIG) > 2.0
    assert factor_for(learned, "never-seen", t, CONFIG) == factor_for(
        learned, DEPLOYMENT_WIDE, t, CONFIG
    )
    assert factor_for(Corrections(), "tp8", t, CONFIG) == 1.0


def test_plan_shape_ignores_gpu_identity_and_replica_count() -> None:
    one = deployment(tp_plan(A4, MODEL_70B_GQA))
    other_gpus = deployment(tp_plan(A8[4:], MODEL_70B_GQA))
    two = deployment(tp_plan(A4, MODEL_70B_GQA), tp_plan(A8[4:], MODEL_70B_GQA))
    wider = deployment(tp_plan(A8, MODEL_70B_GQA))
    assert plan_shape(one) == plan_shape(other_gpus) == plan_shape(two)
    assert plan_shape(wider) != plan_shape(one)


def test_apply_scales_ttft_and_rescores_utility() -> None:
    current = deployment(tp_plan(A8, MODEL_70B_GQA))
    snapshot = article_cluster()
    load = make_load(3.0)
    available = available_memory(snapshot, current.gpu_uuids)
    raw = estimate_plan(current, available, MODEL_70B_GQA, load, CONFIG)
    assert raw.ttft_p95_ms < CONFIG.ttft_slo_ms  # the model alone meets the SLO
    factor = 2 * CONFIG.ttft_slo_ms / raw.ttft_p95_ms
    worse = apply_correction(raw, factor, CONFIG)
    assert worse.ttft_p95_ms == pytest.approx(raw.ttft_p95_ms * factor)
    assert worse.utility_tok_s < raw.utility_tok_s  # over the SLO now: attainment halves
    assert (worse.tbt_p95_ms, worse.capacity_tok_s) == (raw.tbt_p95_ms, raw.capacity_tok_s)
    assert apply_correction(raw, 1.0, CONFIG) == raw


def _observed_load(model_ms: float, ratio: float, samples: int = 200) -> LoadSnapshot:
    return replace(make_load(3.0), window_ttft_p95_ms=model_ms * ratio, num_ttft_samples=samples)


def test_decide_learns_applies_and_explains_per_deployment() -> None:
    current = deployment(tp_plan(A8, MODEL_70B_GQA))
    snapshot = article_cluster()
    load = make_load(3.0)
    available = available_memory(snapshot, current.gpu_uuids)
    model_ms = estimate_plan(current, available, MODEL_70B_GQA, load, CONFIG).ttft_p95_ms

    def tick(state: GearState, i: int, ratio: float, name: str = "chat") -> tuple[GearState, str]:
        at = article_cluster(now_s=NOW_S + 15.0 * i)
        seen = replace(_observed_load(model_ms, ratio), now_s=at.now_s)
        plan = replace(current, deployment=name)
        result = decide(plan, at, seen, state, CONFIG, model=MODEL_70B_GQA)
        assert result.current is not None
        summary = result.current
        assert summary.model_ttft_p95_ms == pytest.approx(model_ms)
        assert summary.est_ttft_p95_ms == pytest.approx(model_ms * summary.ttft_correction)
        # candidates were never observed: the deployment-wide factor, the same as the current's
        assert all(c.ttft_correction == summary.ttft_correction for c in result.candidates)
        return result.state, result.explanation

    state = GearState()
    for i in range(30):
        state, explanation = tick(state, i, 3.0)
    factor = factor_for(state.corrections, plan_shape(current), NOW_S + 15.0 * 29, CONFIG)
    assert factor == pytest.approx(3.0, rel=0.05)
    assert f"× correction {factor:.2f})," in explanation
    assert f"vs observed TTFT p95 {model_ms * 3:,.0f} ms over 200 requests" in explanation
    # the state survives its serde (the gear_state table's format), factor included
    assert GearState.from_dict(state.to_dict()) == state
    # another deployment keeps its own state: nothing learned for chat leaks into it
    other, _ = tick(GearState(), 0, 0.5, name="batch")
    assert factor_for(other.corrections, plan_shape(current), NOW_S, CONFIG) < 1.0


def test_decide_reads_a_censored_window_as_a_lower_bound_and_says_so() -> None:
    current = deployment(tp_plan(A8, MODEL_70B_GQA))
    available = available_memory(article_cluster(), current.gpu_uuids)
    model_ms = estimate_plan(current, available, MODEL_70B_GQA, make_load(3.0), CONFIG).ttft_p95_ms
    state = GearState()
    for i in range(20):  # learned: the plan is 3× slower than modelled
        at = article_cluster(now_s=NOW_S + 15.0 * i)
        seen = replace(_observed_load(model_ms, 3.0), now_s=at.now_s)
        state = decide(current, at, seen, state, CONFIG, model=MODEL_70B_GQA).state
    shape, t = plan_shape(current), NOW_S + 15.0 * 20
    learned = factor_for(state.corrections, shape, t, CONFIG)
    # 20 of 220 refused for want of room: the window's p95 is past its largest sample (1.5×)
    at = article_cluster(now_s=t)
    censored = replace(
        _observed_load(model_ms, 1.5),
        now_s=t,
        num_ttft_refused=20,
        window_ttft_p95_censored=True,
    )
    result = decide(current, at, censored, state, CONFIG, model=MODEL_70B_GQA)
    assert factor_for(result.state.corrections, shape, t, CONFIG) == learned
    assert f"observed TTFT p95 ≥ {model_ms * 1.5:,.0f} ms over 220 requests (20 refused)" in (
        result.explanation
    )
    # the same figure as an exact one (refusals under 5 %) pulls the factor down
    exact = replace(censored, window_ttft_p95_censored=False)
    result = decide(current, at, exact, state, CONFIG, model=MODEL_70B_GQA)
    assert factor_for(result.state.corrections, shape, t, CONFIG) < learned
    assert f"observed TTFT p95 {model_ms * 1.5:,.0f} ms over 220 requests (20 refused)" in (
        result.explanation
    )


@pytest.mark.parametrize(
    ("slo", "learn", "modelled_ms", "blocked"),
    [
        # the TTFT SLO is tight and TTFT runs at 4× the model
        ({"ttft_slo_ms": 400.0}, observe, 100.0, "est TTFT p95"),
        # the TBT SLO is tight and the decode steps run at 4× the model
        ({"tbt_slo_ms": 40.0, "correction_tbt": True}, observe_tbt, 30.0, "est TBT p95"),
    ],
)
def test_a_corrected_estimate_can_block_a_downshift(
    slo: dict[str, Any], learn: Callable[..., Corrections], modelled_ms: float, blocked: str
) -> None:
    current = deployment(tp_plan(A8, MODEL_70B_GQA))
    snapshot = article_cluster()
    load = make_load(0.2)
    # freed GPUs pay well and the SLO is tight: a downshift is wanted on the model's figures
    config = GearboxConfig(idle_gpu_value_tok_s=500.0, **slo)
    observed = NOW_S - 600.0  # ten minutes of demand: past the downshift guard's evidence wait
    free = decide(
        current, snapshot, load, GearState(observed_since_s=observed), config, model=MODEL_70B_GQA
    )
    assert free.decision is not None and free.decision.to_plan.num_gpus < current.num_gpus
    # the same tick after learning that this deployment runs at 4× the model
    learned = Corrections()
    for i in range(40):
        t = NOW_S - 600.0 + 15.0 * i
        shape = plan_shape(current)
        learned = learn(learned, shape, modelled_ms, 4 * modelled_ms, 200, t, None, config)
    state = GearState(corrections=learned, observed_since_s=observed)
    slow = decide(current, snapshot, load, state, config, model=MODEL_70B_GQA)
    assert slow.decision is None
    smaller = [c for c in slow.candidates if c.num_gpus < current.num_gpus]
    assert smaller and all(blocked in c.blocked for c in smaller)


def test_decide_learns_the_tbt_factor_and_explains_it() -> None:
    current = deployment(tp_plan(A8, MODEL_70B_GQA))
    available = available_memory(article_cluster(), current.gpu_uuids)
    modelled = estimate_plan(current, available, MODEL_70B_GQA, make_load(3.0), CONFIG)

    def run(config: GearboxConfig) -> tuple[GearState, str, float, float]:
        state, explanation = GearState(), ""
        for i in range(30):  # TTFT as modelled, every decode step twice the model's
            at = article_cluster(now_s=NOW_S + 15.0 * i)
            seen = replace(
                _observed_load(modelled.ttft_p95_ms, 1.0),
                now_s=at.now_s,
                tbt_p95_ms=2.0 * modelled.tbt_p95_ms,
            )
            result = decide(current, at, seen, state, config, model=MODEL_70B_GQA)
            state, explanation = result.state, result.explanation
        assert result.current is not None
        return state, explanation, result.current.est_tbt_p95_ms, result.current.tbt_correction

    on = replace(CONFIG, correction_tbt=True)
    state, explanation, est_tbt, factor = run(on)
    learned = tbt_factor_for(state.corrections, plan_shape(current), NOW_S + 15.0 * 29, on)
    assert learned == pytest.approx(2.0, rel=0.05) and factor == learned
    assert est_tbt == pytest.approx(modelled.tbt_p95_ms * learned)
    assert f"(model {modelled.tbt_p95_ms:,.1f} ms × correction {learned:.2f})" in explanation
    # the TTFT factor learned only TTFT's ratio (1), not TBT's
    assert factor_for(state.corrections, plan_shape(current), NOW_S, CONFIG) == pytest.approx(1.0)
    assert GearState.from_dict(state.to_dict()) == state
    # off (the default): nothing learned, the model's figure
    state, explanation, est_tbt, factor = run(CONFIG)
    assert state.corrections.tbt == () and factor == 1.0
    assert est_tbt == pytest.approx(modelled.tbt_p95_ms)


TAIL = replace(CONFIG, ttft_prompt_tail=True)
NO_TAIL = CONFIG  # the prompt tail is off by default
CHAT, LONG = (500.0, 90), (6000.0, 10)  # (tokens, count): one prompt in ten is long


def _with_lengths(*lengths: tuple[float, int], now_s: float = NOW_S) -> LoadSnapshot:
    return replace(make_load(3.0), now_s=now_s, prompt_lengths=lengths)


def test_prompt_tail_is_read_from_the_smoothed_distribution() -> None:
    learned = NONE
    # Alternating windows: one with long prompts at 10 %, one with none. Each window's own p95
    # jumps between 6000 and 500; the smoothed distribution holds them at ~5 %, its p95 long
    # only while their share stays above 5 %.
    for i in range(40):
        window = (CHAT, LONG) if i % 2 else (CHAT,)
        learned = observe_prompts(learned, _with_lengths(*window, now_s=15.0 * i), TAIL)
    assert learned.prompt_lengths is not None and learned.prompt_lengths.observations == 40
    shares = dict(learned.prompt_lengths.shares)
    assert sum(shares.values()) == pytest.approx(1.0)
    assert shares[6000.0] == pytest.approx(0.05, abs=0.005)
    p95, scv = prompt_tail(learned.prompt_lengths)
    mean = 0.95 * 500 + 0.05 * 6000
    exact_scv = (0.95 * 500**2 + 0.05 * 6000**2) / mean**2 - 1
    assert p95 in (500.0, 6000.0)
    assert scv == pytest.approx(exact_scv, rel=0.1)
    # applied to a load with lengths; loads without lengths and a config without it keep theirs
    load = with_prompt_tail(_with_lengths(LONG), learned)
    assert (load.p95_prompt_tokens, load.prompt_tokens_scv) == (p95, scv)
    assert with_prompt_tail(make_load(3.0), learned) == make_load(3.0)
    assert observe_prompts(NONE, _with_lengths(CHAT, LONG), NO_TAIL) == NONE
    assert observe_prompts(NONE, make_load(3.0), TAIL) == NONE


def test_decide_uses_the_prompt_tail_only_when_asked() -> None:
    current = deployment(tp_plan(A8, MODEL_70B_GQA))
    load = replace(_with_lengths(CHAT, LONG), p95_prompt_tokens=6000.0, prompt_tokens_scv=2.0)
    off = decide(current, article_cluster(), load, GearState(), NO_TAIL, model=MODEL_70B_GQA)
    on = decide(current, article_cluster(), load, GearState(), TAIL, model=MODEL_70B_GQA)
    assert off.current is not None and on.current is not None
    # the long prompts' prefill sets the p95, not the mean prompt's
    assert on.current.model_ttft_p95_ms > 2 * off.current.model_ttft_p95_ms
    assert off.state.corrections.prompt_lengths is None
    assert on.state.corrections.prompt_lengths is not None
    assert GearState.from_dict(on.state.to_dict()) == on.state


def _demand(
    corrections: Corrections, load: LoadSnapshot, config: GearboxConfig = CONFIG
) -> tuple[Corrections, LoadSnapshot]:
    learned = observe_demand(corrections, load, config)
    return learned, with_smoothed_demand(load, learned)


def test_demand_is_an_exponential_mean_over_event_time() -> None:
    tau = CONFIG.demand_smoothing_s
    learned, first = _demand(NONE, make_load(4.0, now_s=0.0, prompt_tokens=1000.0))
    assert first == make_load(4.0, now_s=0.0, prompt_tokens=1000.0)  # nothing to smooth yet
    # a window at 2× the rate, with prompts 3× as long, one time constant later: the rate
    # moves 1 − 1/e of the way, the mean prompt is the token rate's over the arrival rate's
    later = make_load(8.0, now_s=tau, prompt_tokens=3000.0)
    learned, smoothed = _demand(learned, later)
    moved = 1.0 - math.exp(-1.0)
    rate = 4.0 + moved * 4.0
    assert smoothed.arrival_rate_rps == pytest.approx(rate)
    assert smoothed.mean_prompt_tokens == pytest.approx((4000.0 + moved * 20_000.0) / rate)
    assert smoothed.mean_output_tokens == pytest.approx(200.0)
    # everything else is the window's own (backlog, sequences, latencies)
    assert replace(smoothed, arrival_rate_rps=8.0, mean_prompt_tokens=3000.0) == later
    # a second window at the same instant (another trigger) is not weighed again
    again, same = _demand(learned, replace(later, arrival_rate_rps=100.0))
    assert again == learned and same.arrival_rate_rps == pytest.approx(rate)
    # a lull to zero arrivals keeps the last means while the rate decays
    learned, idle = _demand(learned, make_load(0.0, now_s=10 * tau, prompt_tokens=50.0))
    assert idle.arrival_rate_rps == pytest.approx(rate * math.exp(-9.0), rel=1e-6)
    assert idle.mean_prompt_tokens == pytest.approx(smoothed.mean_prompt_tokens)


def test_demand_smoothing_off_leaves_each_window_its_own() -> None:
    off = replace(CONFIG, demand_smoothing_s=0.0)
    learned, first = _demand(NONE, make_load(4.0, now_s=0.0), off)
    assert first == make_load(4.0, now_s=0.0)
    learned, second = _demand(learned, make_load(8.0, now_s=60.0), off)
    assert learned == NONE and second == make_load(8.0, now_s=60.0)
    # turned off after it smoothed: the old figure is dropped, not applied for ever
    on, _ = _demand(NONE, make_load(4.0, now_s=0.0))
    dropped, own = _demand(on, make_load(8.0, now_s=60.0), off)
    assert dropped.demand is None and own == make_load(8.0, now_s=60.0)


def test_decide_estimates_at_the_smoothed_demand_and_learns_at_the_window() -> None:
    # NOTE: a 70B on 4 GPUs, a burst window after a steady minute: the serving plan's TTFT
    # estimate is the smoothed demand's, below the burst's own; the factor learns from the
    # burst window's observation against the model at the burst window's rate
    current = deployment(tp_plan(A4, MODEL_70B_GQA))
    state, cluster = GearState(), article_cluster()
    steady = replace(make_load(2.0, now_s=NOW_S), window_ttft_p95_ms=400.0, num_ttft_samples=100)
    first = decide(current, cluster, steady, state, CONFIG, model=MODEL_70B_GQA)
    burst = replace(steady, now_s=NOW_S + 15.0, arrival_rate_rps=12.0)
    smoothed = decide(current, cluster, burst, first.state, CONFIG, model=MODEL_70B_GQA)
    raw = decide(
        current, cluster, burst, first.state, replace(CONFIG, demand_smoothing_s=0.0),
        model=MODEL_70B_GQA,
    )  # fmt: skip
    assert smoothed.current is not None and raw.current is not None
    assert smoothed.current.model_ttft_p95_ms < raw.current.model_ttft_p95_ms
    assert smoothed.current.est_throughput_tok_s < raw.current.est_throughput_tok_s
    # the same lesson either way: the observation is paired with the window it was served at
    assert smoothed.state.corrections.entries == raw.state.corrections.entries
