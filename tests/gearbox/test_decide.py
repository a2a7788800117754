"""decide(): precedence of overrides, forced switches, hysteresis, cooldowns, explanations."""

from __future__ import annotations

import json

import pytest

from gearbox import (
    DEFAULT_CONFIG,
    MODEL_7B_MHA,
    MODEL_70B_GQA,
    DecideResult,
    Decision,
    DecisionReason,
    DeploymentPlan,
    GearboxConfig,
    GearState,
    LoadSnapshot,
    Overrides,
    TopologySnapshot,
    Trigger,
    build_blocks,
    decide,
    record_blocks,
)
from tests.gearbox.builders import (
    NOW_S,
    DomainSpec,
    article_cluster,
    deployment,
    make_cluster,
    make_load,
    tp_plan,
    with_gpus,
)

C4 = ("C-g00", "C-g01", "C-g02", "C-g03")
A8 = tuple(f"A-g{i:02d}" for i in range(8))


def _on_c() -> DeploymentPlan:
    """A poor plan: 70B at TP4 over PCIe on the 48 GB block."""
    plan = tp_plan(
        C4, MODEL_70B_GQA, block_id="C", domain_id="C", gpu_class="a6000-48g", link="pcie"
    )
    return deployment(plan)


def _state(
    snapshot: TopologySnapshot,
    last_switch_s: float | None = None,
    last_from_plan_id: str | None = None,
) -> GearState:
    """State after one earlier tick on ``snapshot``, optionally after a switch, with an hour of
    demand observed (past the downshift guard's evidence wait)."""
    blocks = build_blocks(snapshot, DEFAULT_CONFIG)
    history = record_blocks(GearState().history, blocks, snapshot.now_s - 30, DEFAULT_CONFIG)
    return GearState(
        blocks, history, last_switch_s, last_from_plan_id, observed_since_s=snapshot.now_s - 3600
    )


def _decide(
    current: DeploymentPlan | None,
    snapshot: TopologySnapshot | None = None,
    load: LoadSnapshot | None = None,
    state: GearState | None = None,
    config: GearboxConfig = DEFAULT_CONFIG,
    *,
    trigger: Trigger = Trigger.TIMER,
    overrides: Overrides | None = None,
) -> DecideResult:
    snapshot = snapshot or article_cluster()
    return decide(
        current,
        snapshot,
        load or make_load(3.0, now_s=snapshot.now_s),
        state or _state(snapshot),
        config,
        model=MODEL_70B_GQA,
        deployment="chat",
        trigger=trigger,
        overrides=overrides or Overrides(),
    )


@pytest.mark.unit
def test_first_placement_takes_the_best_plan() -> None:
    result = _decide(None)
    assert result.reason is DecisionReason.INITIAL_PLACEMENT
    assert result.decision is not None and not result.decision.forced
    assert result.decision.from_plan_id is None
    assert result.state.last_to_plan_id == result.decision.to_plan_id
    assert result.state.last_switch_s == NOW_S


@pytest.mark.unit
def test_no_switch_when_already_on_the_best_plan() -> None:
    first = _decide(None)
    assert first.decision is not None
    later = article_cluster(now_s=NOW_S + 600)
    result = _decide(first.decision.to_plan, later, state=first.state)
    assert result.decision is None
    assert result.reason in (DecisionReason.NO_BETTER_CANDIDATE, DecisionReason.HELD_BY_HYSTERESIS)
    assert result.current is not None and result.current.plan_id == first.decision.to_plan_id


@pytest.mark.unit
def test_clear_gain_switches_with_the_breakdown() -> None:
    result = _decide(_on_c())
    decision = result.decision
    assert result.reason is DecisionReason.SWITCH_GAIN and decision is not None
    chosen = next(c for c in decision.candidates if c.plan_id == decision.to_plan_id)
    assert chosen.gain_tokens > chosen.cost_tokens * DEFAULT_CONFIG.hysteresis
    assert decision.switch_cost.total_tokens == pytest.approx(chosen.cost_tokens)
    assert "switch_gain" in decision.explanation and decision.to_plan_id in decision.explanation
    assert not decision.forced


@pytest.mark.unit
def test_hysteresis_holds_a_small_gain() -> None:
    short = GearboxConfig(gain_horizon_s=1.0)
    result = _decide(_on_c(), config=short)
    assert result.decision is None
    assert result.reason is DecisionReason.HELD_BY_HYSTERESIS
    assert result.candidates[0].gain_tokens > 0 and not result.candidates[0].eligible


@pytest.mark.unit
def test_cooldown_holds_a_worthwhile_switch() -> None:
    snapshot = article_cluster()
    state = _state(snapshot, last_switch_s=NOW_S - 30.0, last_from_plan_id="dp-older")
    result = _decide(_on_c(), state=state)
    assert result.decision is None and result.reason is DecisionReason.COOLDOWN
    assert result.retry_after_s == NOW_S - 30.0 + DEFAULT_CONFIG.cooldown_s
    gone = NOW_S - DEFAULT_CONFIG.cooldown_s - 1.0
    after = _state(snapshot, last_switch_s=gone, last_from_plan_id="dp-older")
    assert _decide(_on_c(), state=after).reason is DecisionReason.SWITCH_GAIN


@pytest.mark.unit
def test_reverse_switch_waits_longer() -> None:
    best = _decide(_on_c()).decision
    assert best is not None
    snapshot = article_cluster()
    cooldown = DEFAULT_CONFIG.cooldown_s
    state = _state(
        snapshot, last_switch_s=NOW_S - cooldown - 1.0, last_from_plan_id=best.to_plan_id
    )
    held = _decide(_on_c(), state=state)
    # the best candidate is the plan we just left: only a non-reverse candidate may go now
    if held.decision is None:
        assert held.reason is DecisionReason.REVERSE_COOLDOWN
    else:
        assert held.decision.to_plan_id != best.to_plan_id
    reverse = cooldown * DEFAULT_CONFIG.reverse_cooldown_factor
    late = _state(snapshot, last_switch_s=NOW_S - reverse - 1.0, last_from_plan_id=best.to_plan_id)
    again = _decide(_on_c(), state=late).decision
    assert again is not None and again.to_plan_id == best.to_plan_id


@pytest.mark.unit
def test_lost_gpus_force_a_switch_inside_the_cooldown() -> None:
    first = _decide(None).decision
    assert first is not None
    lost = [u for u in first.to_plan.gpu_uuids][:2]
    broken = with_gpus(article_cluster(now_s=NOW_S + 5), lost, healthy=False)
    state = _state(broken, last_switch_s=NOW_S, last_from_plan_id=None)
    result = _decide(first.to_plan, broken, state=state, trigger=Trigger.TOPOLOGY_CHANGE)
    assert result.reason is DecisionReason.FORCED_INFEASIBLE
    assert result.decision is not None and result.decision.forced
    assert result.decision.trigger is Trigger.TOPOLOGY_CHANGE
    assert set(lost).isdisjoint(result.decision.to_plan.gpu_uuids)
    assert any("not live" in p for p in result.problems)


X4 = ("X-g00", "X-g01", "X-g02", "X-g03")


def _forced_onto_b(
    weight_load_gbps: float, tbt_slo_ms: float = 150.0, margin: float = 0.7
) -> DecideResult:
    """The 70B's only island X (4 H100) is gone; block B (8 A100-80G, NVLink) is all that is
    left. At 1 rps gearbox offers TP4 (35 GB a GPU to load, more utility: 4 GPUs handed back)
    and TP8 (17.5 GB a GPU: half the load, and a shorter replay of the lost sequences)."""
    domains = (
        DomainSpec("X", "nvlink", ("h100-sxm",) * 4),
        DomainSpec("B", "nvlink", ("a100-80g",) * 8),
    )
    broken = with_gpus(make_cluster(domains, now_s=NOW_S + 5), X4, healthy=False)
    current = deployment(tp_plan(X4, MODEL_70B_GQA, block_id="X", domain_id="X"))
    config = GearboxConfig(
        weight_load_gbps=weight_load_gbps,
        tbt_slo_ms=tbt_slo_ms,
        downshift_slo_margin=margin,
    )
    blocks = build_blocks(broken, config)
    history = record_blocks(GearState().history, blocks, NOW_S - 30, config)
    return decide(
        current,
        broken,
        make_load(1.0, now_s=broken.now_s),
        GearState(blocks, history, NOW_S, None),
        config,
        model=MODEL_70B_GQA,
        deployment="chat",
        trigger=Trigger.TOPOLOGY_CHANGE,
    )


@pytest.mark.unit
@pytest.mark.parametrize(("weight_load_gbps", "slow_wins"), [(5.0, True), (0.25, False)])
def test_a_forced_switch_counts_its_outage(weight_load_gbps: float, slow_wins: bool) -> None:
    """Of two feasible targets, the one with the far longer transition but more steady utility
    wins while its gain outweighs the longer outage (5 GB/s loads: modelled transitions of 33 s
    against 18 s), and loses once the outage outweighs it (0.25 GB/s: TP8's 84 s, TP4's about
    twice that) — when neither restores the SLOs with the margin (0.01: none does;
    gearbox.decide._joint_choice)."""
    result = _forced_onto_b(weight_load_gbps, margin=0.01)
    assert result.reason is DecisionReason.FORCED_INFEASIBLE and result.decision is not None
    by_gpus = {c.num_gpus: c for c in result.candidates}
    slow, quick = by_gpus[4], by_gpus[8]
    assert slow.gain_tokens > quick.gain_tokens  # more steady utility
    chosen = slow if slow_wins else quick
    assert result.decision.to_plan_id == chosen.plan_id
    switch = result.decision.switch_cost
    # the chosen plan's cost is its switch cost plus its gain rate over the whole transition
    rate = chosen.gain_tokens / DEFAULT_CONFIG.gain_horizon_s  # stable block: no discount
    outage = rate * switch.transition_s
    assert chosen.cost_tokens == pytest.approx(switch.total_tokens + outage)
    assert f"{outage:,.0f} tok of outage" in result.explanation


@pytest.mark.unit
def test_a_forced_switch_prefers_the_plan_that_restores_the_slos() -> None:
    """At a 60 ms TBT SLO only TP8 restores the SLOs with the 0.7 margin (TP4 ≈ 49 ms, over
    42 ms): it is taken though TP4 scores more steady utility net of its cost
    (gearbox.decide._joint_choice)."""
    result = _forced_onto_b(5.0, tbt_slo_ms=60.0)
    assert result.decision is not None
    by_gpus = {c.num_gpus: c for c in result.candidates}
    slow, quick = by_gpus[4], by_gpus[8]
    assert slow.gain_tokens - slow.cost_tokens > quick.gain_tokens - quick.cost_tokens
    assert slow.est_tbt_p95_ms > 0.7 * 60.0 > quick.est_tbt_p95_ms
    assert result.decision.to_plan_id == quick.plan_id
    # at a 250 ms TBT SLO both restore the SLOs: TP4 nets more only by the credit for the 4
    # GPUs it hands back, which a forced choice does not count (no other deployment here to
    # want them: gearbox.joint), so TP8, up in 18 s against 33 s, is taken
    both = _forced_onto_b(5.0, tbt_slo_ms=250.0)
    assert both.decision is not None and both.decision.to_plan_id == quick.plan_id
    by_gpus = {c.num_gpus: c for c in both.candidates}
    assert by_gpus[4].gain_tokens - by_gpus[4].cost_tokens > (
        by_gpus[8].gain_tokens - by_gpus[8].cost_tokens
    )


@pytest.mark.unit
def test_the_outage_changes_no_voluntary_decision() -> None:
    """A voluntary switch keeps the old plan serving while the new one loads in its shadow:
    slower weight loads change neither its target nor its cost."""
    fast = _decide(_on_c()).decision
    slow = _decide(_on_c(), config=GearboxConfig(weight_load_gbps=0.5)).decision
    assert fast is not None and slow is not None and not slow.forced
    assert slow.to_plan_id == fast.to_plan_id
    chosen = next(c for c in slow.candidates if c.plan_id == slow.to_plan_id)
    assert chosen.cost_tokens == pytest.approx(slow.switch_cost.total_tokens)
    assert "outage" not in slow.explanation


@pytest.mark.unit
def test_nothing_fits_means_no_feasible_plan() -> None:
    snapshot = article_cluster()
    dead = with_gpus(snapshot, [g.uuid for g in snapshot.gpus], healthy=False)
    result = _decide(_on_c(), dead)
    assert result.decision is None and result.reason is DecisionReason.NO_FEASIBLE_PLAN


def _shrinking_a(live: int) -> TopologySnapshot:
    """Article cluster with block B out and only ``live`` GPUs left in block A."""
    snapshot = article_cluster()
    gone = [f"A-g{j:02d}" for j in range(12 - live)] + [f"B-g{j:02d}" for j in range(9)]
    return with_gpus(snapshot, gone, healthy=False)


@pytest.mark.unit
def test_stability_discount_holds_a_switch_onto_a_shrinking_block() -> None:
    config = GearboxConfig(min_stability_factor=0.0)
    state = GearState()
    for i, live in enumerate((12, 11, 10, 9)):  # one GPU lost every 10 s
        blocks = build_blocks(_shrinking_a(live), config, state.blocks)
        history = record_blocks(state.history, blocks, NOW_S - 40 + 10 * i, config)
        state = GearState(blocks=blocks, history=history)
    result = _decide(_on_c(), snapshot=_shrinking_a(8), state=state, config=config)
    assert result.decision is None
    assert result.reason is DecisionReason.STABILITY_DISCOUNT
    assert all(c.stability < 0.5 for c in result.candidates)
    # the same switch goes through when block A has been stable
    steady = _decide(_on_c(), snapshot=_shrinking_a(8), config=config)
    assert steady.reason is DecisionReason.SWITCH_GAIN


@pytest.mark.unit
def test_emergency_downshift_overrides_everything() -> None:
    baseline = deployment(tp_plan(A8, MODEL_70B_GQA))
    state = _state(article_cluster(), last_switch_s=NOW_S - 1.0)
    overrides = Overrides(emergency_downshift=True, baseline_plan=baseline)
    result = _decide(_on_c(), state=state, overrides=overrides, trigger=Trigger.OPERATOR)
    assert result.reason is DecisionReason.EMERGENCY_DOWNSHIFT
    assert result.decision is not None and result.decision.forced
    assert result.decision.to_plan == baseline
    held = _decide(baseline, state=state, overrides=overrides)
    assert held.decision is None and held.reason is DecisionReason.EMERGENCY_DOWNSHIFT


@pytest.mark.unit
def test_pinned_plan_wins_over_optimisation() -> None:
    pinned = _on_c()
    result = _decide(pinned, overrides=Overrides(pinned_plan=pinned))
    assert result.decision is None and result.reason is DecisionReason.PINNED
    moved = _decide(deployment(tp_plan(A8, MODEL_70B_GQA)), overrides=Overrides(pinned_plan=pinned))
    assert moved.decision is not None and moved.decision.to_plan_id == pinned.plan_id


@pytest.mark.unit
def test_override_validation() -> None:
    with pytest.raises(ValueError, match="baseline_plan"):
        Overrides(emergency_downshift=True)
    with pytest.raises(ValueError, match="deployment"):
        decide(
            None, article_cluster(), make_load(), GearState(), DEFAULT_CONFIG, model=MODEL_70B_GQA
        )


@pytest.mark.unit
def test_same_input_same_output() -> None:
    assert _decide(_on_c()) == _decide(_on_c())


@pytest.mark.unit
def test_results_round_trip_through_json() -> None:
    result = _decide(_on_c())
    assert result.decision is not None
    wire = json.loads(json.dumps(result.decision.to_dict()))
    assert Decision.from_dict(wire) == result.decision
    assert DecideResult.from_dict(json.loads(json.dumps(result.to_dict()))) == result


@pytest.mark.unit
def test_low_load_scales_down() -> None:
    big = deployment(
        tp_plan(A8[:4], MODEL_70B_GQA),
        tp_plan(A8[4:], MODEL_70B_GQA),
        tp_plan(tuple(f"A-g{i:02d}" for i in range(8, 12)), MODEL_70B_GQA),
    )
    result = _decide(big, load=make_load(0.2, active_sequences=10))
    assert result.decision is not None and result.reason is DecisionReason.SWITCH_GAIN
    assert result.decision.to_plan.num_gpus < big.num_gpus


@pytest.mark.unit
def test_model_must_match_the_current_plan() -> None:
    with pytest.raises(ValueError, match="model"):
        decide(
            _on_c(), article_cluster(), make_load(), GearState(), DEFAULT_CONFIG, model=MODEL_7B_MHA
        )
