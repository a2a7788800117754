"""The gear decision: ``decide(current, snapshot, load, state, config)`` → :class:`DecideResult`.

Small pure steps, in order of precedence:

1. Operator overrides: an emergency downshift to the baseline plan, then a pinned plan. They
   override everything (also feasibility — the operator owns that call; the explanation names
   any problem).
2. No current plan: take the best candidate (first placement).
3. Current plan infeasible (GPUs lost, TP now spanning blocks, memory): forced switch — no
   hysteresis, no cooldown — to the feasible candidate with the best gain − cost, where the cost
   also counts the candidate's outage: its whole transition (the shadow weight load included,
   :attr:`gearbox.switch.SwitchCost.transition_s`) × its utility above what the surviving
   replicas serve, the gain forgone until it is up. So the plan that restores service soonest
   wins unless a slower one's steady gain outweighs its longer outage. Among candidates whose
   estimate restores the SLOs with the downshift guard's margin (``downshift_slo_margin`` × the
   SLOs, at this window's demand and at the lookback's peak) it is decided jointly: the best by
   gain − cost − the standby loss its GPUs cost the other deployments sharing the cluster (what
   they could restore on the spare GPUs it leaves, :mod:`gearbox.joint`), with no blanket
   freed-GPU credit (:func:`_joint_choice`); when none restores them, the best by gain − cost.
   Beside them it weighs **handovers** (:func:`_handovers`): plans taking GPUs a settled
   neighbour holds, the neighbour moving first to its best plan on what is left; each is charged
   what the neighbour loses and its switch cost, and its outage counts the neighbour's move
   (:func:`gearbox.joint.yield_cost`). The decision names the neighbour and the GPUs
   (``takes_from``, ``taken_gpus``): the stream forces the neighbour off them, the runtime's
   prepare waits for them.
4. Otherwise propose → clamp → debounce: gain = (utility − current utility) × horizon, discounted
   by the candidate's block stability; keep candidates with gain > cost × hysteresis; hold while
   the cooldown since the last switch runs (``reverse_cooldown_factor`` longer to switch straight
   back); switch to the best remaining by gain − cost − the standby loss its GPUs cost the
   other deployments, as a forced switch weighs it but keeping the freed-GPU credit the gain
   was judged with: no deployment takes GPUs whose loss costs another more than it gains
   (:func:`_joint_choice`).

Downshift guard, when ``downshift_guard`` is on (the default — see its note in
:mod:`gearbox.config`; voluntary switches only, forced switches and overrides are unaffected): a
downshift — a candidate with fewer GPUs AND less estimated capacity than the current plan — is
blocked unless its estimated TTFT and TBT p95 are at most ``downshift_slo_margin`` × the SLOs —
at this window's demand and at the highest demand of the last ``downshift_lookback_s``
(:func:`gearbox.history.record_demand`: a plan the planner would itself undo at a load it has
just served only earns its freed GPUs' credit until that load returns, then pays a second
switch and the SLO misses before it; see its note in :mod:`gearbox.config`) — and again with
the current plan's learned TTFT factor, when above 1, read as a slower service instead
(:func:`_risk_speed`): both readings fit the plan it was learned on, but a downshift runs its
replicas hotter, where a slower service costs far more than a latency factor says;
every downshift is blocked until the deployment's demand has been observed for
``downshift_min_evidence_s`` (its first tick starts the count: a start-up plan is not given up
on an empty window), and while the deployment is under observed pressure
(:func:`gearbox.scoring.observed_pressure`), and so is one back to a plan a voluntary switch left
under observed pressure within the lookback (:func:`gearbox.history.record_pressured`: what was
observed beats what is estimated — in sim/scenarios/mixed-failures.yaml the 7B, moved onto two
A100s by a handover, was observed at 268 ms TBT p95 there against 65 estimated, scaled out, and
went straight back at the next dip, twice an hour). A candidate with fewer GPUs but more
capacity (say TP4 on NVLink instead of a PP/PD plan over slow links) is an upgrade, not a
downshift: blocking it kept a 14-GPU plan at 6–8 s observed TTFT p95 in the fragmented
benchmark. Under that pressure freed GPUs also earn no ``idle_gpu_value_tok_s`` credit, in any
step: the estimates have just been shown too optimistic to trade capacity for GPUs handed back.
A worthwhile switch held only by the guard reports ``DOWNSHIFT_BLOCKED``; each blocked
candidate says why.

Targets whose transition rolled back within ``failed_target_quarantine_s`` (the caller records
them with :func:`gearbox.history.record_failed_target`) are not proposed in step 4, and in step 3
only when no other candidate is feasible.

Every outcome carries a :class:`DecisionReason`; the new :class:`GearState` comes back with it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from gearbox.blocks import AtomicBlock, build_blocks
from gearbox.config import GearboxConfig, without_gpu_credit
from gearbox.correction import (
    Corrections,
    apply_correction,
    factor_for,
    observe,
    observe_demand,
    observe_prompts,
    observe_service,
    observe_tbt,
    plan_shape,
    service_factor_for,
    solve_service_factor,
    tbt_factor_for,
    teaches_service_rate,
    with_prompt_tail,
    with_smoothed_demand,
)
from gearbox.decisions import (
    CandidateSummary,
    DecideResult,
    Decision,
    DecisionReason,
    Overrides,
    Trigger,
)
from gearbox.history import (
    GearState,
    peak_demand_rps,
    pressured_since,
    quarantined_plan_ids,
    record_blocks,
    record_demand,
    record_pressured,
    stability_factors,
)
from gearbox.joint import (
    Neighbour,
    StandbyLoss,
    Yield,
    handover_blocks,
    has_spare_twin,
    standby_meter,
    yield_cost,
)
from gearbox.model import ModelSpec
from gearbox.plans import DeploymentPlan
from gearbox.ranking import (
    RankedCandidate,
    available_memory,
    current_units,
    estimate_plan,
    plan_problems,
    rank_candidates,
)
from gearbox.scoring import (
    DeploymentEstimate,
    demand_rps,
    estimate_deployment,
    observed_pressure,
)
from gearbox.switch import SwitchCost, switch_cost
from gearbox.types import LoadSnapshot, TopologySnapshot

__all__ = ["NO_OVERRIDES", "decide"]

NO_OVERRIDES = Overrides()
# bisection steps of the risk reading's service rate: 2⁻¹² of the bounds' log-width (0.03 %)
_RISK_SOLVE_STEPS = 12


@dataclass(frozen=True, slots=True)
class _Tick:
    deployment: str
    current: DeploymentPlan | None
    snapshot: TopologySnapshot
    load: LoadSnapshot
    config: GearboxConfig
    model: ModelSpec
    trigger: Trigger
    blocks: tuple[AtomicBlock, ...]
    state: GearState  # already updated with this tick's blocks and history
    available: Mapping[str, int]
    quarantined: frozenset[str]  # recently rolled-back targets, not proposed voluntarily
    pressure: tuple[str, ...]  # observed pressure (empty = none): no GPU credit, no downshift
    # the cost model's figures for the current plan, at its learned service rate
    current_model: DeploymentEstimate | None
    # the service-rate factor that would explain the current plan's learned TTFT error as a
    # slower service (1: none to explain); a voluntary downshift must hold at it too. Cached on
    # first call: its bisection is about half a decision's CPU time (mixed-failures: 4.4 of
    # 9 ms), and most ticks weigh no downshift that reaches it.
    risk_speed: Callable[[], float]
    # the load at the lookback's peak demand, when above this window's (the downshift guard)
    peak_load: LoadSnapshot | None = None
    # the other deployments sharing the cluster: a switch charges their standby loss
    neighbours: tuple[Neighbour, ...] = ()


@dataclass(frozen=True, slots=True)
class _Scored:
    plan: DeploymentPlan
    summary: CandidateSummary
    cost: SwitchCost
    raw_gain_tokens: float  # before the stability discount
    worthwhile: bool  # gain > cost × hysteresis, before the downshift guard
    outage_tokens: float = 0.0  # in the summary's cost: a forced switch's gain forgone
    # a switch's joint choice, weighing the other deployments (_joint_choice)
    joint: _Joint | None = None
    # a handover (forced only): the neighbour whose GPUs the plan takes, and what it loses
    handover: Yield | None = None


@dataclass(frozen=True, slots=True)
class _Joint:
    """What a switch's target and the plan it passed over cost the other deployments."""

    standby: StandbyLoss  # the target's standby loss (gearbox.joint)
    net_tokens: float  # gain − cost − standby loss (and a handover's neighbour's loss)
    # the plan best by gain − cost alone, when the standby loss passed it over
    passed_over: tuple[str, StandbyLoss] | None = None


@dataclass(frozen=True, slots=True)
class _Estimate:
    """A plan's estimate after the TTFT correction, with what it was made of."""

    corrected: DeploymentEstimate
    model_ttft_p95_ms: float  # the cost model's own figure
    factor: float  # the learned factor applied to it
    model_tbt_p95_ms: float  # the same for TBT
    tbt_factor: float


def decide(
    current: DeploymentPlan | None,
    snapshot: TopologySnapshot,
    load: LoadSnapshot,
    state: GearState,
    config: GearboxConfig,
    *,
    model: ModelSpec,
    deployment: str | None = None,
    trigger: Trigger = Trigger.TIMER,
    overrides: Overrides = NO_OVERRIDES,
    neighbours: Sequence[Neighbour] = (),
    handed_over: frozenset[str] = frozenset(),
) -> DecideResult:
    """Decide whether ``deployment`` should shift gear now. Pure and deterministic.

    ``deployment`` defaults to ``current.deployment`` and is required when there is no current
    plan; ``model`` must be the model the current plan serves (``ValueError`` otherwise — these
    are caller bugs, not outcomes). ``neighbours``: the other deployments sharing the cluster,
    whose standby a switch weighs (:mod:`gearbox.joint`); ``handed_over``: GPUs of the current
    plan another deployment's handover takes (they count as its own no longer, so the plan
    must move off them). Pass the returned ``state`` to the next call.
    """
    name = deployment or (current.deployment if current is not None else None)
    if name is None:
        raise ValueError("deployment: required when there is no current plan")
    if current is not None and current.model_name != model.name:
        raise ValueError(
            f"model: {model.name} does not match the current plan's {current.model_name}"
        )
    learned = observe_demand(observe_prompts(state.corrections, load, config), load, config)
    # NOTE: every estimate of the tick uses the smoothed prompt tail and the smoothed demand, a
    # forecast for the minutes a plan serves (gearbox.correction); the window's own rate is what
    # its observed TTFT p95 was served at (what the factors learn from) and what its pressure
    # and demand history read
    window = with_prompt_tail(load, learned)
    load = with_smoothed_demand(window, learned)
    blocks = build_blocks(snapshot, config, state.blocks)
    history = record_blocks(state.history, blocks, snapshot.now_s, config)
    own = current.gpu_uuids - handed_over if current is not None else frozenset()
    available = available_memory(snapshot, own)
    pressure = _pressure(current, available, model, window, config)
    if pressure:
        config = without_gpu_credit(config)
    quarantined = quarantined_plan_ids(state, snapshot.now_s, config)
    demand = record_demand(state.demand, load.now_s, demand_rps(window, config), config)
    failed = tuple(f for f in state.failed if f.plan_id in quarantined)
    # NOTE: estimated once: the learning and every use of the current plan's figures share it
    corrections, modelled = _learn(
        current, available, model, window, load, replace(state, corrections=learned), config
    )
    tick = _Tick(
        name,
        current,
        snapshot,
        load,
        config,
        model,
        trigger,
        blocks,
        replace(
            state,
            blocks=blocks,
            history=history,
            failed=failed,
            corrections=corrections,
            demand=demand,
            observed_since_s=(
                load.now_s if state.observed_since_s is None else state.observed_since_s
            ),
        ),
        available,
        quarantined,
        pressure,
        modelled,
        functools.cache(
            lambda: _risk_speed(current, available, model, load, corrections, modelled, config)
        ),
        _peak_load(load, peak_demand_rps(demand), config),
        tuple(neighbours),
    )
    if overrides.emergency_downshift and overrides.baseline_plan is not None:
        return _override(tick, overrides.baseline_plan, DecisionReason.EMERGENCY_DOWNSHIFT)
    if overrides.pinned_plan is not None:
        return _override(tick, overrides.pinned_plan, DecisionReason.PINNED)
    factors = stability_factors(history, blocks, config)
    ranked = rank_candidates(
        snapshot,
        blocks,
        model,
        load,
        config,
        deployment=name,
        current=current,
        stability=factors,
        available=available,
    )
    problems = (
        plan_problems(current, blocks, tick.available, model, load, config) if current else ()
    )
    # NOTE: a plan infeasible only for GPUs a handover takes still serves until its switch:
    # moving off them costs no outage, so none is charged (it would favour the plans fastest
    # to load over the ones that leave the most to others)
    yielding = bool(handed_over) and not (
        current is not None
        and plan_problems(
            current, blocks, available_memory(snapshot, current.gpu_uuids), model, load, config
        )
    )
    forced = current is not None and bool(problems) and not yielding
    scored = _score_all(tick, ranked, _current_utility(tick, problems), forced=forced)
    untried = tuple(s for s in scored if s.plan.plan_id not in quarantined)
    if current is None or problems:
        # a forced switch retries a rolled-back target only when nothing else is feasible
        base = _current_utility(tick, problems)
        handovers = None
        if current is not None and tick.neighbours:

            def handovers(bound: float) -> tuple[_Scored, ...]:
                return _handovers(tick, factors, base, bound)

        return _take_best(tick, untried or scored, problems, handovers)
    return _voluntary(tick, untried)


def _pressure(
    current: DeploymentPlan | None,
    available: Mapping[str, int],
    model: ModelSpec,
    load: LoadSnapshot,
    config: GearboxConfig,
) -> tuple[str, ...]:
    """Observed pressure on the current plan; none without one (first placement)."""
    if current is None or not config.downshift_guard:
        return ()
    capacity = estimate_plan(current, available, model, load, config).capacity_tok_s
    return observed_pressure(load, config, capacity)


def _peak_load(load: LoadSnapshot, peak_rps: float, config: GearboxConfig) -> LoadSnapshot | None:
    """``load`` with the lookback's peak demand as its arrivals (no backlog: the peak counts it
    already), or None when this window's demand is the peak."""
    if peak_rps <= demand_rps(load, config):
        return None
    return replace(load, arrival_rate_rps=peak_rps, queue_len=0)


def _learn(
    current: DeploymentPlan | None,
    available: Mapping[str, int],
    model: ModelSpec,
    load: LoadSnapshot,
    estimate_load: LoadSnapshot,
    state: GearState,
    config: GearboxConfig,
) -> tuple[Corrections, DeploymentEstimate | None]:
    """The factors with this tick's observation of the current plan (served at the window's
    ``load``) folded in — into the queues' service rate or the TTFT factor, whichever explains
    it with the smaller change (gearbox.correction) — and the cost model's estimate of the plan
    at ``estimate_load`` and its learned service rate (None without a current plan)."""
    if current is None:
        return state.corrections, None
    shape, now_s, corrections = plan_shape(current), load.now_s, state.corrections
    speed = service_factor_for(corrections, shape, now_s, config)
    modelled = estimate_plan(current, available, model, load, config, service_factor=speed)

    def estimated(service_factor: float) -> DeploymentEstimate:
        # NOTE: identity, not equality: with smoothing off the load is the window itself
        if service_factor == speed and estimate_load is load:
            return modelled
        return estimate_plan(
            current, available, model, estimate_load, config, service_factor=service_factor
        )

    observed, censored = load.window_ttft_p95_ms, load.window_ttft_p95_censored
    if load.num_ttft_samples == 0 or not modelled.feasible or observed <= 0:
        return corrections, estimated(speed)
    # NOTE: the refusals are samples of the window's distribution too (beyond every TTFT)
    args = (load.num_ttft_samples + load.num_ttft_refused, now_s, state.last_switch_s, config)
    factor = factor_for(corrections, shape, now_s, config)

    def ttft_ms_at(service_factor: float) -> float:
        at = estimate_plan(current, available, model, load, config, service_factor=service_factor)
        return factor * at.ttft_p95_ms

    learned = None
    if config.correction_service_ratio > 0:
        solved = solve_service_factor(ttft_ms_at, observed, config)
        # NOTE: ttft_ms_at(speed), which ``modelled`` already holds
        ttft_change = math.log(observed / (factor * modelled.ttft_p95_ms))
        if teaches_service_rate(ttft_change, math.log(solved / speed), config):
            learned = observe_service(corrections, shape, solved, *args, censored=censored)
    if learned is None:
        model_ms = modelled.ttft_p95_ms
        learned = observe(corrections, shape, model_ms, observed, *args, censored=censored)
    if load.tbt_p95_ms > 0:
        learned = observe_tbt(learned, shape, modelled.tbt_p95_ms, load.tbt_p95_ms, *args)
    return learned, estimated(service_factor_for(learned, shape, now_s, config))


def _risk_speed(
    current: DeploymentPlan | None,
    available: Mapping[str, int],
    model: ModelSpec,
    load: LoadSnapshot,
    corrections: Corrections,
    modelled: DeploymentEstimate | None,
    config: GearboxConfig,
) -> float:
    """The service-rate factor at which the cost model, uncorrected, meets the current plan's
    corrected TTFT p95: its learned error read as a slower service instead of a latency
    factor. 1 when there is nothing to read: no guard, no current plan, no factor learned on
    the current plan's own shape, a factor of at most 1, or one no service rate within the
    correction's bounds explains.

    NOTE: both readings fit the current plan; they part on a plan that runs its replicas
    hotter. A latency factor scales the smaller plan's p95 by the same ×1.98; a slower service
    moves it up the queueing curve. In sim/scenarios/mixed-failures.yaml (seed 7) the 7B's
    2-GPU plan was observed at 1.98× its model; its 1-GPU plan, estimated at 449 ms with that
    factor, was observed at 750-1,050 ms and undone 120 s later.
    """
    if not config.downshift_guard or current is None or modelled is None:
        return 1.0
    shape = plan_shape(current)
    if corrections.get(shape) is None or not modelled.feasible:
        return 1.0
    factor = factor_for(corrections, shape, load.now_s, config)
    if factor <= 1.0:
        return 1.0
    speed = service_factor_for(corrections, shape, load.now_s, config)
    target_ms = factor * modelled.ttft_p95_ms

    # NOTE: cached: the solver evaluates the slowest bound again after the check below
    @functools.cache
    def ttft_ms_at(slower: float) -> float:
        at = estimate_plan(current, available, model, load, config, service_factor=speed * slower)
        return at.ttft_p95_ms

    if ttft_ms_at(config.correction_min_factor) < target_ms:
        return 1.0  # no plausible service rate explains it: a latency error, not a slow queue
    return min(1.0, solve_service_factor(ttft_ms_at, target_ms, config, steps=_RISK_SOLVE_STEPS))


def _service_factor(tick: _Tick, plan: DeploymentPlan) -> float:
    """The learned service-rate factor for ``plan``'s queues (gearbox.correction)."""
    shape = plan_shape(plan)
    return service_factor_for(tick.state.corrections, shape, tick.snapshot.now_s, tick.config)


def _at_service_rate(
    tick: _Tick, plan: DeploymentPlan, estimate: DeploymentEstimate
) -> DeploymentEstimate:
    """``estimate`` of ``plan`` (the cost model's) again at ``plan``'s learned service rate."""
    speed = _service_factor(tick, plan)
    if speed == 1.0 or not estimate.feasible:
        return estimate
    args = (tick.available, tick.model, tick.load, tick.config)
    return estimate_plan(plan, *args, service_factor=speed)


def _corrected(tick: _Tick, plan: DeploymentPlan, estimate: DeploymentEstimate) -> _Estimate:
    """``estimate`` of ``plan`` (at its learned service rate) with the learned TTFT and TBT
    factors applied (gearbox.correction; the TBT factor is 1 unless ``correction_tbt``)."""
    learned, shape, now_s = tick.state.corrections, plan_shape(plan), tick.snapshot.now_s
    factor = factor_for(learned, shape, now_s, tick.config)
    tbt = tbt_factor_for(learned, shape, now_s, tick.config)
    corrected = apply_correction(estimate, factor, tick.config, tbt)
    return _Estimate(corrected, estimate.ttft_p95_ms, factor, estimate.tbt_p95_ms, tbt)


def _estimate(tick: _Tick, plan: DeploymentPlan) -> _Estimate:
    """The corrected estimate of an arbitrary plan (an override target)."""
    args = (tick.available, tick.model, tick.load, tick.config)
    speed = _service_factor(tick, plan)
    return _corrected(tick, plan, estimate_plan(plan, *args, service_factor=speed))


def _current_estimate(tick: _Tick, current: DeploymentPlan) -> _Estimate:
    """The corrected estimate of the current plan, from the tick's one model estimate."""
    assert tick.current_model is not None, "set whenever there is a current plan"
    return _corrected(tick, current, tick.current_model)


def _downshift_block(
    tick: _Tick,
    plan: DeploymentPlan,
    estimate: DeploymentEstimate,
    current: DeploymentEstimate | None,
) -> str:
    """Why a voluntary switch to ``plan`` with this estimate is blocked ("" when it is not)."""
    if not tick.config.downshift_guard or tick.current is None or current is None:
        return ""
    if estimate.num_gpus >= tick.current.num_gpus:
        return ""
    if estimate.capacity_tok_s >= current.capacity_tok_s:
        return ""  # fewer GPUs, but no less capacity: not a downshift
    gpus = f"downshift blocked ({tick.current.num_gpus} → {estimate.num_gpus} GPUs)"
    if tick.pressure:
        return f"{gpus}: {'; '.join(tick.pressure)}"
    over = _over_margin(estimate, tick.config)
    if over:
        return f"{gpus}: {'; '.join(over)}"
    since_s = tick.state.observed_since_s
    assert since_s is not None, "decide sets it on every tick"
    observed_s = tick.load.now_s - since_s
    if observed_s < tick.config.downshift_min_evidence_s:
        return (
            f"{gpus}: demand observed for {observed_s:,.0f} s, under the "
            f"{tick.config.downshift_min_evidence_s:,.0f} s a downshift needs"
        )
    left_s = pressured_since(tick.state, plan.plan_id, tick.snapshot.now_s, tick.config)
    if left_s is not None:
        return (
            f"{gpus}: left at t={left_s:,.0f} s while observed over its SLOs, within the "
            f"last {tick.config.downshift_lookback_s:,.0f} s"
        )
    slow = _slow_service_block(tick, plan, tick.load)
    if slow:
        return f"{gpus}: {slow}"
    if tick.peak_load is None:
        return ""
    # NOTE: the same estimate at the lookback's peak demand (config downshift_lookback_s)
    args = (tick.available, tick.model, tick.peak_load, tick.config)
    at_peak = estimate_plan(plan, *args, service_factor=_service_factor(tick, plan))
    over = _over_margin(_corrected(tick, plan, at_peak).corrected, tick.config)
    peak = (
        f"at the peak demand of the last {tick.config.downshift_lookback_s:,.0f} s "
        f"({tick.peak_load.arrival_rate_rps:.2f} rps, now "
        f"{demand_rps(tick.load, tick.config):.2f})"
    )
    if over:
        return f"{gpus} {peak}: {'; '.join(over)}"
    slow = _slow_service_block(tick, plan, tick.peak_load)
    return f"{gpus} {peak}: {slow}" if slow else ""


def _slow_service_block(tick: _Tick, plan: DeploymentPlan, load: LoadSnapshot) -> str:
    """Why a downshift to ``plan`` at ``load`` fails the guard's margin with the current plan's
    learned TTFT error read as a slower service (``_Tick.risk_speed``; "" when it holds, or
    there is nothing to read). Read so, the error grows with the load a replica carries, and a
    downshift runs fewer replicas hotter."""
    risk_speed = tick.risk_speed()
    if risk_speed >= 1.0:
        return ""
    speed = _service_factor(tick, plan) * risk_speed
    estimate = estimate_plan(
        plan, tick.available, tick.model, load, tick.config, service_factor=speed
    )
    over = _over_margin(estimate, tick.config)
    if not over:
        return ""
    return (
        f"if the current plan's learned TTFT error is a slower service "
        f"(service rate × {risk_speed:.2f}): {'; '.join(over)}"
    )


def _over_margin(estimate: DeploymentEstimate, config: GearboxConfig) -> list[str]:
    """Which estimated p95s exceed ``downshift_slo_margin`` × their SLO."""
    margin = config.downshift_slo_margin
    ttft_limit, tbt_limit = margin * config.ttft_slo_ms, margin * config.tbt_slo_ms
    over = []
    if estimate.ttft_p95_ms > ttft_limit:
        over.append(
            f"est TTFT p95 {estimate.ttft_p95_ms:,.0f} ms > {margin:g} × SLO = {ttft_limit:,.0f} ms"
        )
    if estimate.tbt_p95_ms > tbt_limit:
        over.append(
            f"est TBT p95 {estimate.tbt_p95_ms:,.1f} ms > {margin:g} × SLO = {tbt_limit:,.1f} ms"
        )
    return over


def _current_utility(tick: _Tick, problems: Sequence[str]) -> float:
    if tick.current is None:
        return 0.0
    args = (tick.available, tick.model, tick.load, tick.config)
    if not problems:
        return _current_estimate(tick, tick.current).corrected.utility_tok_s
    units = current_units(tick.current, tick.blocks, *args)
    if not units:
        return 0.0
    gpus = sum(u.num_gpus for u in units)
    shapes = [u.shape for u in units]
    speed = _service_factor(tick, tick.current)
    surviving = estimate_deployment(
        shapes, gpus, tick.model, tick.load, tick.config, service_factor=speed
    )
    # NOTE: the surviving replicas are the serving plan's: they keep its factors
    return _corrected(tick, tick.current, surviving).corrected.utility_tok_s


def _summary(plan_id: str, strategy: str, made: _Estimate, stability: float) -> CandidateSummary:
    estimate = made.corrected
    return CandidateSummary(
        plan_id=plan_id,
        strategy=strategy,
        num_gpus=estimate.num_gpus,
        est_throughput_tok_s=estimate.served_tok_s,
        est_capacity_tok_s=estimate.capacity_tok_s,
        est_ttft_p95_ms=estimate.ttft_p95_ms,
        est_tbt_p95_ms=estimate.tbt_p95_ms,
        stability=stability,
        gain_tokens=0.0,
        cost_tokens=0.0,
        eligible=False,
        model_ttft_p95_ms=made.model_ttft_p95_ms,
        ttft_correction=made.factor,
        model_tbt_p95_ms=made.model_tbt_p95_ms,
        tbt_correction=made.tbt_factor,
    )


def _outage_tokens(cost: SwitchCost, gain_tok_s: float) -> float:
    """The gain a forced switch forgoes until its target serves: ``gain_tok_s`` (the target's
    utility above the surviving replicas') over the whole transition.

    NOTE: ``cost.total_tokens`` counts only what the switch takes from replicas that still
    serve; with the serving plan broken the deployment runs on its survivors (often nothing)
    for the whole transition, the shadow weight load included, so a plan that loads for 14 s
    would otherwise rank as if it were up as soon as one that loads for 2 s.
    """
    return max(0.0, gain_tok_s) * cost.transition_s


def _score(
    tick: _Tick,
    candidate: RankedCandidate,
    base_utility: float,
    current: DeploymentEstimate | None,
    *,
    forced: bool,
    handover: Yield | None = None,
) -> _Scored:
    config = tick.config
    cost = switch_cost(
        tick.current, candidate.plan, tick.snapshot, tick.model, tick.load, config, tick.available
    )
    if handover is not None:
        cost = replace(cost, handover_wait_s=handover.vacate_s)
    estimate = _at_service_rate(tick, candidate.plan, candidate.estimate)
    made = _corrected(tick, candidate.plan, estimate)
    gain_tok_s = made.corrected.utility_tok_s - base_utility
    raw = gain_tok_s * config.gain_horizon_s
    gain = raw * candidate.stability if raw > 0 else raw
    # NOTE: voluntary switches keep the old plan serving while the new one loads in its
    # shadow, so only a forced switch pays for its transition's length (module docstring)
    outage = _outage_tokens(cost, gain_tok_s) if forced else 0.0
    cost_tokens = cost.total_tokens + outage
    worthwhile = gain > cost_tokens * config.hysteresis
    blocked = _downshift_block(tick, candidate.plan, made.corrected, current)
    summary = replace(
        _summary(candidate.plan.plan_id, candidate.strategy, made, candidate.stability),
        gain_tokens=gain,
        cost_tokens=cost_tokens,
        eligible=worthwhile and not blocked,
        blocked=blocked,
    )
    return _Scored(candidate.plan, summary, cost, raw, worthwhile, outage, handover=handover)


def _score_all(
    tick: _Tick, ranked: Sequence[RankedCandidate], base_utility: float, *, forced: bool
) -> tuple[_Scored, ...]:
    """Every candidate but the current plan scored, best gain − cost first; ``forced`` (the
    current plan is broken) charges each its outage (:func:`_outage_tokens`)."""
    current_id = tick.current.plan_id if tick.current is not None else None
    current = None
    if tick.current is not None:
        current = _current_estimate(tick, tick.current).corrected
    scored = [
        _score(tick, c, base_utility, current, forced=forced)
        for c in ranked
        if c.plan.plan_id != current_id
    ]
    return tuple(sorted(scored, key=_net_order))


def _net_order(s: _Scored) -> tuple[float, str]:
    return (-(s.summary.gain_tokens - s.summary.cost_tokens), s.summary.plan_id)


def _current_summary(tick: _Tick) -> CandidateSummary | None:
    if tick.current is None:
        return None
    made = _current_estimate(tick, tick.current)
    if not made.corrected.feasible:
        return None
    return _summary(tick.current.plan_id, "current", made, 1.0)


def _top(scored: Sequence[_Scored], k: int, chosen: _Scored | None) -> tuple[CandidateSummary, ...]:
    top = list(scored[:k])
    # NOTE: by plan id: a joint choice is its scored entry with the standby figures attached
    if chosen is not None and all(s.plan.plan_id != chosen.plan.plan_id for s in top):
        top.append(chosen)
    return tuple(s.summary for s in top)


def _result(
    tick: _Tick,
    reason: DecisionReason,
    scored: Sequence[_Scored],
    *,
    chosen: _Scored | None = None,
    forced: bool = False,
    problems: Sequence[str] = (),
    retry_after_s: float | None = None,
) -> DecideResult:
    candidates = _top(scored, tick.config.top_k_candidates, chosen)
    current = _current_summary(tick)
    explanation = _explain(tick, reason, chosen, current, candidates, problems, retry_after_s)
    state = tick.state
    decision = None
    if chosen is not None:
        moved = chosen.handover
        decision = Decision(
            deployment=tick.deployment,
            now_s=tick.snapshot.now_s,
            trigger=tick.trigger,
            reason=reason,
            forced=forced,
            from_plan_id=tick.current.plan_id if tick.current is not None else None,
            to_plan_id=chosen.plan.plan_id,
            to_plan=chosen.plan,
            candidates=candidates,
            switch_cost=chosen.cost,
            explanation=explanation,
            takes_from=moved.deployment if moved is not None else None,
            taken_gpus=tuple(sorted(moved.taken)) if moved is not None else (),
        )
        state = replace(
            state,
            last_switch_s=tick.snapshot.now_s,
            last_from_plan_id=decision.from_plan_id,
            last_to_plan_id=decision.to_plan_id,
        )
        if tick.pressure and not forced and tick.current is not None:
            state = record_pressured(state, tick.current.plan_id, tick.snapshot.now_s, tick.config)
    return DecideResult(
        decision,
        reason,
        tick.trigger,
        current,
        candidates,
        tuple(problems),
        explanation,
        state,
        retry_after_s,
    )


def _override(tick: _Tick, plan: DeploymentPlan, reason: DecisionReason) -> DecideResult:
    args = (tick.available, tick.model, tick.load, tick.config)
    problems = tuple(f"target: {p}" for p in plan_problems(plan, tick.blocks, *args))
    if tick.current is not None and tick.current.plan_id == plan.plan_id:
        return _result(tick, reason, (), problems=problems)
    cost = switch_cost(
        tick.current, plan, tick.snapshot, tick.model, tick.load, tick.config, tick.available
    )
    summary = replace(
        _summary(plan.plan_id, "override", _estimate(tick, plan), 1.0),
        cost_tokens=cost.total_tokens,
    )
    chosen = _Scored(plan, summary, cost, 0.0, True)
    return _result(tick, reason, (chosen,), chosen=chosen, forced=True, problems=problems)


def _take_best(
    tick: _Tick,
    scored: Sequence[_Scored],
    problems: Sequence[str],
    handovers: Callable[[float], Sequence[_Scored]] | None = None,
) -> DecideResult:
    """First placement or a forced switch; ``handovers``: the forced switch's handover
    candidates whose net could beat a bound (:func:`_handovers`)."""
    if not scored and handovers is None:
        return _result(tick, DecisionReason.NO_FEASIBLE_PLAN, scored, problems=problems)
    if tick.current is None:
        return _result(tick, DecisionReason.INITIAL_PLACEMENT, scored, chosen=scored[0])
    chosen = _joint_choice(tick, scored, forced=True) if scored else None
    if handovers is not None:
        bound = chosen.joint.net_tokens if chosen is not None and chosen.joint else -math.inf
        found = handovers(bound)
        if found:
            chosen = _joint_choice(tick, scored, forced=True, handovers=found)
    if chosen is None:
        return _result(tick, DecisionReason.NO_FEASIBLE_PLAN, scored, problems=problems)
    return _result(
        tick,
        DecisionReason.FORCED_INFEASIBLE,
        scored,
        chosen=chosen,
        forced=True,
        problems=problems,
    )


def _handovers(
    tick: _Tick, stability: Mapping[str, float], base_utility: float, bound: float
) -> tuple[_Scored, ...]:
    """A forced switch's handover candidates: per settled neighbour, the best
    ``handover_candidates`` plans (by the ranking's utility) that take some of its GPUs and
    restore the SLOs with the margin (:func:`_restores_slos`), each scored with its outage
    counting the neighbour's move off them first (:func:`gearbox.joint.yield_cost`). Only plans
    whose net before the neighbour's loss and wait (:func:`_net_before_loss`) beats ``bound``
    (the net of the plan chosen without handovers) are priced: the rest cannot win.

    NOTE: only neighbours with a settled plan are asked (one whose switch is in flight — e.g.
    moving off GPUs a handover took — cannot be moved again), and not one whose blocks all
    have spare twins (:func:`gearbox.joint.has_spare_twin`); a neighbour that has nowhere left
    to serve is never moved. Plans are enumerated on the neighbour's blocks and the
    :data:`gearbox.joint.PROBE_BLOCKS` roomiest others only: a forced decision waits for this
    (the whole pool is 10–30 ms per ranking on 1,000 GPUs, per neighbour).
    """
    limit = tick.config.handover_candidates
    out: list[_Scored] = []
    if limit <= 0:
        return ()
    for n in tick.neighbours:
        if n.plan is None or has_spare_twin(tick.blocks, n, tick.snapshot, tick.available):
            continue
        # the neighbour's GPUs at their whole memory, as a plan counts its own
        theirs = available_memory(tick.snapshot, n.gpu_uuids)
        pool = dict(tick.available) | {u: theirs[u] for u in n.gpu_uuids if u in theirs}
        ranked = rank_candidates(
            tick.snapshot,
            handover_blocks(tick.blocks, n, pool),
            tick.model,
            tick.load,
            tick.config,
            deployment=tick.deployment,
            current=tick.current,
            stability=stability,
            available=pool,
        )
        taking = [
            c
            for c in ranked
            if c.plan.gpu_uuids & n.gpu_uuids and c.plan.plan_id not in tick.quarantined
        ]
        with_pool = replace(tick, available=pool)
        for c in taking[:limit]:
            best_case = _score(with_pool, c, base_utility, None, forced=True)
            if _net_before_loss(tick, best_case) <= bound:
                continue
            if not _restores_slos(with_pool, best_case):
                continue
            moved = yield_cost(n, c.plan.gpu_uuids, tick.snapshot, tick.blocks, pool, tick.config)
            if moved is not None:
                out.append(_score(with_pool, c, base_utility, None, forced=True, handover=moved))
    return tuple(out)


def _net_before_loss(tick: _Tick, s: _Scored) -> float:
    """A forced switch's gain − cost (a handover's neighbour's loss included) without the
    freed-GPU credit, before the standby loss (:func:`_joint_choice`)."""
    config = tick.config
    # NOTE: the credit the gain holds for GPUs handed back is taken out again (the current
    # plan's, common to every candidate, cancels out of the comparison); 0 under pressure
    credit_s = config.idle_gpu_value_tok_s * config.gain_horizon_s
    discount = s.summary.stability if s.raw_gain_tokens > 0 else 1.0
    held = credit_s * s.summary.num_gpus * discount
    moved = s.handover.loss_tokens if s.handover is not None else 0.0
    return s.summary.gain_tokens + held - s.summary.cost_tokens - moved


def _joint_choice(
    tick: _Tick, scored: Sequence[_Scored], *, forced: bool, handovers: Sequence[_Scored] = ()
) -> _Scored:
    """A switch's target: the best of ``scored`` (best gain − cost first) by gain − cost − the
    standby loss its GPUs cost the other deployments (:mod:`gearbox.joint`), then the shorter
    transition. A ``forced`` switch weighs only the plans whose estimate restores the SLOs with
    the margin (:func:`_restores_slos`; when none does, ``scored[0]``) and counts no freed-GPU
    credit; a voluntary one weighs every worthwhile plan and keeps the credit its gain was
    judged with (a downshift's reason to be): only the standby loss is added. A forced switch
    weighs its ``handovers`` (:func:`_handovers`) beside them, each also charged what the
    neighbour it moves loses (:class:`gearbox.joint.Yield`); their standby loss counts the other
    neighbours.

    NOTE: restoring plans serve the same demand within the SLOs, so what tells them apart is
    their outage (in the cost: the gain forgone over the whole transition, so the plan up
    soonest nets most) and the GPUs they take. The blanket ``idle_gpu_value_tok_s`` credit priced
    every GPU alike: counted, it took fragmented-short's 70B to TP4 on the 4 GPUs it kept (up in
    7.4 s) over TP8 on block A's 8 (3.95 s), which nobody else wanted (goodput 0.9947 → 0.9907,
    5 seeds); not counted (under observed pressure, the usual case), mixed-failures seed 8's 7B
    took all four spare hoppers, 0.7 s sooner than two, and the 70B preempted later found none
    (0.973 → 0.871). The standby loss charges the hoppers at what the 70B could restore on them
    and block A's GPUs at nothing (bench/HISTORY.md, 2026-12-02).
    """
    # NOTE: a voluntary switch's candidates are all worthwhile already: preferring the ones
    # restoring the SLOs at the lookback's peak would overrule the downshift guard's own test
    if not forced and not tick.neighbours:
        return scored[0]
    weighed = [s for s in scored if _restores_slos(tick, s)] if forced else list(scored)
    weighed += handovers
    if not weighed:
        return scored[0]
    config = tick.config
    meters: dict[str | None, Callable[[frozenset[str]], StandbyLoss]] = {}

    def loss_of(s: _Scored) -> StandbyLoss:
        moved = s.handover.deployment if s.handover is not None else None
        if moved not in meters:
            others = [n for n in tick.neighbours if n.deployment != moved]
            meters[moved] = standby_meter(
                others, tick.snapshot, tick.blocks, tick.available, config
            )
        return meters[moved](s.plan.gpu_uuids)

    def before_loss(s: _Scored) -> float:
        if forced:
            return _net_before_loss(tick, s)
        # a voluntary switch keeps the credit its gain was judged with
        return s.summary.gain_tokens - s.summary.cost_tokens

    def order(s: _Scored, net: float) -> tuple[float, float, int, str]:
        # NOTE: on a tie the fewer GPUs: whoever needs GPUs next finds the rest
        return (-net, s.cost.transition_s, s.plan.num_gpus, s.summary.plan_id)

    # NOTE: a standby loss is >= 0, so once a plan's net before it cannot beat the best net
    # so far no later one can: the neighbours are ranked only for the sets that could win
    best, best_key = weighed[0], (math.inf, math.inf, 0, "")
    for s in sorted(weighed, key=lambda s: order(s, before_loss(s))):
        if order(s, before_loss(s)) > best_key:
            break
        key = order(s, before_loss(s) - loss_of(s).tokens)
        if key < best_key:
            best, best_key = s, key
    first = weighed[0]
    passed = None
    if first is not best:
        passed = (first.summary.plan_id, loss_of(first))
    return replace(best, joint=_Joint(loss_of(best), -best_key[0], passed))


def _restores_slos(tick: _Tick, scored: _Scored) -> bool:
    """Whether ``scored``'s corrected estimate is within ``downshift_slo_margin`` × the SLOs,
    at this window's demand and at the lookback's peak (config ``downshift_lookback_s``)."""
    summary = scored.summary
    margin = tick.config.downshift_slo_margin
    if summary.est_ttft_p95_ms > margin * tick.config.ttft_slo_ms:
        return False
    if summary.est_tbt_p95_ms > margin * tick.config.tbt_slo_ms:
        return False
    if tick.peak_load is None:
        return True
    args = (tick.available, tick.model, tick.peak_load, tick.config)
    plan = scored.plan
    at_peak = estimate_plan(plan, *args, service_factor=_service_factor(tick, plan))
    corrected = _corrected(tick, plan, at_peak).corrected
    return at_peak.feasible and not _over_margin(corrected, tick.config)


def _cooldown_s(tick: _Tick, candidate: _Scored) -> float:
    reverse = candidate.plan.plan_id == tick.state.last_from_plan_id
    factor = tick.config.reverse_cooldown_factor if reverse else 1.0
    return tick.config.cooldown_s * factor


def _voluntary(tick: _Tick, scored: Sequence[_Scored]) -> DecideResult:
    eligible = [s for s in scored if s.summary.eligible]
    if not eligible:
        hysteresis = tick.config.hysteresis
        if any(s.worthwhile for s in scored):  # all of them blocked by the downshift guard
            reason = DecisionReason.DOWNSHIFT_BLOCKED
        elif any(s.raw_gain_tokens > s.cost.total_tokens * hysteresis for s in scored):
            reason = DecisionReason.STABILITY_DISCOUNT
        elif any(s.summary.gain_tokens > 0 for s in scored):
            reason = DecisionReason.HELD_BY_HYSTERESIS
        else:
            reason = DecisionReason.NO_BETTER_CANDIDATE
        return _result(tick, reason, scored)
    last = tick.state.last_switch_s
    if last is not None:
        elapsed = tick.snapshot.now_s - last
        allowed = [s for s in eligible if elapsed >= _cooldown_s(tick, s)]
        if not allowed:
            reverse = eligible[0].plan.plan_id == tick.state.last_from_plan_id
            reason = DecisionReason.REVERSE_COOLDOWN if reverse else DecisionReason.COOLDOWN
            retry = last + min(_cooldown_s(tick, s) for s in eligible)
            return _result(tick, reason, scored, retry_after_s=retry)
        eligible = allowed
    chosen = _joint_choice(tick, eligible, forced=False)
    return _result(tick, DecisionReason.SWITCH_GAIN, scored, chosen=chosen)


def _describe(summary: CandidateSummary) -> str:
    return (
        f"{summary.plan_id} on {summary.num_gpus} GPUs: "
        f"{summary.est_throughput_tok_s:,.0f} tok/s served "
        f"(capacity {summary.est_capacity_tok_s:,.0f}), "
        f"TTFT p95 est {summary.est_ttft_p95_ms:,.0f} ms "
        f"(model {summary.model_ttft_p95_ms:,.0f} ms × correction {summary.ttft_correction:.2f}), "
        f"TBT p95 {summary.est_tbt_p95_ms:,.1f} ms{_tbt_model(summary)}"
    )


def _tbt_model(summary: CandidateSummary) -> str:
    if summary.tbt_correction == 1.0:
        return ""
    return f" (model {summary.model_tbt_p95_ms:,.1f} ms × correction {summary.tbt_correction:.2f})"


def _observed(load: LoadSnapshot) -> str:
    """What the load window observed, for the current plan's line."""
    refused = load.num_ttft_refused
    if load.num_ttft_samples == 0:
        ttft = f"no TTFT samples ({refused} refused)" if refused else "no TTFT samples"
    elif refused:
        bound = "≥ " if load.window_ttft_p95_censored else ""
        ttft = (
            f"{bound}{load.window_ttft_p95_ms:,.0f} ms over "
            f"{load.num_ttft_samples + refused} requests ({refused} refused)"
        )
    else:
        ttft = f"{load.window_ttft_p95_ms:,.0f} ms over {load.num_ttft_samples} requests"
    return (
        f"observed TTFT p95 {ttft} (highest report p95 {load.ttft_p95_ms:,.0f} ms), "
        f"TBT p95 {load.tbt_p95_ms:,.1f} ms"
    )


def _standby_text(loss: StandbyLoss) -> str:
    if loss.worst is None:
        return "none"
    name, whole, left = loss.worst
    return (
        f"{loss.tokens:,.0f} tok ({name} could restore {left:,.0f} tok/s of SLO goodput on the "
        f"spare GPUs it leaves, {whole:,.0f} on all of them)"
    )


def _joint_line(joint: _Joint, *, forced: bool) -> str:
    """The joint choice's rule and figures, as its explanation names them."""
    if forced:
        rule = "Forced choice (joint): among the plans restoring the SLOs with the margin"
        credit = ", no freed-GPU credit"
    else:
        rule = "Joint choice: among the worthwhile plans"
        credit = ""
    text = (
        f"{rule}, the best by gain − cost − the standby loss its GPUs cost the other "
        f"deployments{credit}; its standby loss: {_standby_text(joint.standby)}"
    )
    if joint.passed_over is not None:
        plan_id, loss = joint.passed_over
        text += f"; {plan_id}, best by gain − cost alone: {_standby_text(loss)}"
    return text + "."


def _handover_line(moved: Yield) -> str:
    """A handover's neighbour, what it gives up and what it is charged."""
    gpus = ", ".join(sorted(moved.taken))
    return (
        f"Handover: takes {len(moved.taken)} GPU(s) of {moved.deployment} ({gpus}); it moves "
        f"first to {moved.to_plan.plan_id} on {len(moved.to_plan.gpu_uuids)} GPUs (SLO goodput "
        f"est {moved.utility_now_tok_s:,.0f} → {moved.utility_after_tok_s:,.0f} tok/s, its "
        f"transition ≈ {moved.vacate_s:.1f} s, waited for in the outage); charged "
        f"{moved.loss_tokens:,.0f} tok."
    )


def _explain(
    tick: _Tick,
    reason: DecisionReason,
    chosen: _Scored | None,
    current: CandidateSummary | None,
    candidates: Sequence[CandidateSummary],
    problems: Sequence[str],
    retry_after_s: float | None,
) -> str:
    h = tick.config.hysteresis
    parts = [f"{tick.deployment}: {reason.value} (trigger {tick.trigger.value})."]
    if current is not None:
        parts.append(f"Current {_describe(current)} vs {_observed(tick.load)}.")
        assert tick.current is not None, "a current summary comes from the current plan"
        speed = _service_factor(tick, tick.current)
        if speed != 1.0:
            parts.append(f"Its shape's queues run at service rate × {speed:.2f} of the model.")
    if problems:
        parts.append(f"Problems: {'; '.join(problems)}.")
    if chosen is not None:
        s, cost = chosen.summary, chosen.cost
        parts.append(f"Switch to {_describe(s)}.")
        parts.append(
            f"Gain {s.gain_tokens:,.0f} tok vs cost {s.cost_tokens:,.0f} tok "
            f"(× hysteresis {h} = {s.cost_tokens * h:,.0f}); shift ≈ {cost.duration_s:.1f} s, "
            f"KV {cost.kv_choice.value} ({cost.kv_sequences_migrated} migrated, "
            f"{cost.kv_sequences_replayed} replayed), weights {cost.weights_load_s:.1f} s."
        )
        if chosen.outage_tokens > 0:
            parts.append(
                f"The cost includes {chosen.outage_tokens:,.0f} tok of outage: the gain "
                f"forgone over the whole transition ≈ {cost.transition_s:.1f} s."
            )
        if chosen.joint is not None:
            forced = reason is DecisionReason.FORCED_INFEASIBLE
            parts.append(_joint_line(chosen.joint, forced=forced))
        if chosen.handover is not None:
            parts.append(_handover_line(chosen.handover))
    elif candidates:
        best = candidates[0]
        parts.append(
            f"Best alternative {_describe(best)}: gain {best.gain_tokens:,.0f} tok vs cost "
            f"{best.cost_tokens:,.0f} tok × hysteresis {h} (stability {best.stability:.2f})."
        )
    if tick.pressure:
        parts.append(
            f"Observed pressure ({'; '.join(tick.pressure)}): freed GPUs earn no credit "
            "and voluntary downshifts are blocked."
        )
    if chosen is None or not chosen.summary.blocked:  # a forced switch ignores the guard
        worthwhile = [c for c in candidates if c.blocked and c.gain_tokens > c.cost_tokens * h]
        blocked = worthwhile or [c for c in candidates if c.blocked]
        if blocked:
            parts.append(f"{blocked[0].plan_id}: {blocked[0].blocked}.")
    if retry_after_s is not None:
        parts.append(f"Cooldown holds until t={retry_after_s:.1f} s.")
    if tick.quarantined:
        parts.append(
            f"{len(tick.quarantined)} target(s) rolled back in the last "
            f"{tick.config.failed_target_quarantine_s:.0f} s are not proposed."
        )
    return " ".join(parts)
