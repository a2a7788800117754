"""Estimates that learn: an online, bounded, decaying correction of the modelled TTFT p95.

The cost model (:mod:`gearbox.cost`) is a roofline plus a queueing approximation; the world it
plans for is not (other kernels, heavy-tailed lengths, jitter). Each tick, the deployment's
observed TTFT p95 over the load window is compared with the model's figure for the plan that
served it, and a multiplicative factor is learned from the ratio:

* update — in log space, ``log f ← (1 − g) · log f + g · log(observed / model)`` (an
  exponentially weighted geometric mean, so a 2× over- and a 2× under-estimate weigh the same),
  then clamped to ``[correction_min_factor, correction_max_factor]``. ``g`` is
  ``max(correction_gain, 1 / n)`` for a factor's n-th observation: a plain running mean until
  it has ``1 / correction_gain`` observations, so the first ticks do not drag the factor from an
  uninformed 1 (half of the estimates that stayed > 50 % off in bench.fragmented were those);
  an exponential mean after that, so it keeps following the world;
* refusals — a request the runtime refused for want of room counts in the window's p95 as a
  TTFT beyond every sample (:mod:`streams.load`). When over 5 % were refused, the observed p95
  is only a lower bound (``LoadSnapshot.window_ttft_p95_censored``) and teaches only the
  direction it proves: an entry whose corrected figure already reaches the bound keeps its
  value; one below it is folded toward the bound as if it were exact — the TTFT factor rises
  (the service rate falls) toward it, never past it;
* ignored ticks — fewer than ``correction_min_samples`` TTFT samples in the window, no model
  figure, or less than ``correction_settle_s`` since the last switch (the window still holds
  the old plan's requests and the hand-over's);
* decay — without data a factor relaxes toward 1 with half-life ``correction_half_life_s`` of
  event time (``log f`` halves), so an old lesson fades instead of steering for ever;
* keys — one factor per plan shape (:func:`plan_shape`: the set of distinct replica shapes —
  stage GPU classes, TP degrees, layer counts, roles and the PD split; replica counts and GPU
  identities are left out, since the model already accounts for them) and one deployment-wide
  factor learned from every observation. The state lives in each deployment's
  :class:`gearbox.history.GearState`, so nothing crosses deployments.

Prompt lengths are learned the same way (:func:`observe_prompts`): a load window holds a few
dozen prompts, so its p95 prompt — the 2nd or 3rd longest — swings several-fold tick to tick
(and jumps between the chat and summarisation modes when the long class is near 5 % of
arrivals), while the TTFT p95 it drives over the next minutes does not. The window's length
distribution (shares per length bucket) is folded into a running then exponential mean of
distributions, with the same gain and warm-up as the factors and the prior's weight decaying
with the same half-life; the p95 and spread are read from the smoothed distribution, not
averaged from each window's (a mean of two modes' p95s is neither). :func:`with_prompt_tail`
puts them into the tick's load, so every estimate of the tick (serving plan, candidates, the
factor's own model figure) uses them; a window without lengths leaves the load as it is.

Demand is smoothed too (:func:`observe_demand`, ``demand_smoothing_s``, 120 s by default): an
estimate is a forecast for the minutes a plan will serve, but a 60-s load window's arrival
rate and mean lengths swing by tens of per cent tick to tick (Poisson arrivals, heavy-tailed
lengths), and the modelled TTFT p95 swings with them, while the p95 the next five minutes
show does not. In fragmented-short (FlexPipe, seeds 7, 8, 10, 11) the serving plan's TTFT
estimate correlated 0.45-0.82 with the past minute's observed p95 but -0.22-0.71 with the
next five minutes'. So the arrival rate and the prompt and output token rates are exponential
means over event time (a burst of triggers at one instant weighs its window once), and
:func:`with_smoothed_demand` puts them into the tick's load for every estimate. The factors
still learn from the window's own rate: an observation is paired with the load it was served
at. Pressure (KV), the backlog and the demand history behind the peak lookback read the
window as it is.

Applied (:func:`factor_for`): a plan whose shape has a factor gets it; any other plan gets the
deployment-wide factor — a plan never observed is assumed to err like the deployment's plans
so far, which keeps the comparison with the serving plan neutral instead of favouring the
unobserved. The TTFT factor changes only TTFT.

TBT (when ``correction_tbt`` is on): the same fold, keys and decay on the ratio of the observed
TBT p95 (the highest of the runtime reports' p95s over every decode iteration) to the model's
(:func:`observe_tbt`, :func:`tbt_factor_for`). The model's TBT is a roofline decode step plus
one mean prefill stall; the world's decode runs at its own efficiency and stalls on the long
prompts. A downshift judged on the model's TBT alone passed the guard's margin where the
world's step was twice the model's.

Service rate (when ``correction_service_ratio`` is above 0; off by default — see its note in
:mod:`gearbox.config`): near saturation the modelled TTFT is
its queueing term, ``∝ 1 / (μ − λ)``, so a capacity error of a few per cent is a TTFT error of
a hundredfold that changes with the load from tick to tick — no single multiplicative factor
describes it. In steady-boundary (seed 9) the 2-GPU plan's model said 4.5–22 s at 12–12.5
rps where 200–270 ms were observed, while the same plan at 9 rps was observed at 1.7× its
model; folding both into one TTFT factor pinned it at the 0.25 clamp, where it then made the
same shape at lower load 4× too optimistic. So there is a second factor, on the queues'
service rate, and each tick teaches the one of the two that explains its observation with the
smaller change (:func:`teaches_service_rate`): the TTFT factor needs a log change of
``log(observed / corrected figure)``; the service rate the one at which the corrected model
meets the observation (:func:`solve_service_factor`, by bisection — the corrected TTFT falls
as the service rate rises). The service rate is trusted more (a roofline throughput errs by
tens of per cent, a TTFT p95 that misses the prompt tail by several-fold), so its change is
weighed ``1 / correction_service_ratio`` times as heavily. Near saturation a few per cent of
service rate explain a hundredfold TTFT error and the service rate learns; far from it no
plausible service rate explains a latency error and the TTFT factor learns. The taught factor
takes the value that meets the observation, the other is kept. A taught TTFT factor is folded
in as above; a taught service rate replaces the previous one: its noise is at most
``correction_service_ratio`` of the TTFT ratio's in log terms (that is what taught it), so it
is worth ``1 / ratio²`` (25) observations of the TTFT ratio, more than the whole running mean
weighs — and near saturation the service rate that fits the model's queue to the world moves
with the load (12–13 rps: 1.06 → 1.3 in the case above), which a running mean would trail by
minutes, flapping as before. Both clamp, decay and fall back to the deployment-wide entry in
the same way (:func:`service_factor_for`), and :func:`gearbox.scoring.estimate_deployment`
applies the service rate to the queueing term and to the capacity.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from gearbox.config import GearboxConfig
from gearbox.plans import DeploymentPlan, ExecutionPlan
from gearbox.scoring import DeploymentEstimate, utility_tok_s
from gearbox.serde import Serialisable
from gearbox.types import LoadSnapshot

__all__ = [
    "DEPLOYMENT_WIDE",
    "Correction",
    "Corrections",
    "PromptLengths",
    "SmoothedDemand",
    "apply_correction",
    "factor_for",
    "observe",
    "observe_demand",
    "observe_prompts",
    "observe_service",
    "observe_tbt",
    "plan_shape",
    "prompt_tail",
    "service_factor_for",
    "solve_service_factor",
    "tbt_factor_for",
    "teaches_service_rate",
    "with_prompt_tail",
    "with_smoothed_demand",
]

DEPLOYMENT_WIDE = ""  # the shape key of the factor learned from every observation
_MAX_SHAPES = 16  # per deployment, besides the deployment-wide one; the stalest are dropped
_MIN_LENGTH_SHARE = 1e-6  # smoothed prompt-length shares below it are dropped
_P95 = 0.95
_SOLVE_STEPS = 40  # bisection steps of solve_service_factor: 2⁻⁴⁰ of the bounds' log-width
# what an observation's log-factor is to the truth (_folded): the value, a floor, a ceiling
_EXACT, _AT_LEAST, _AT_MOST = 0, 1, -1


@dataclass(frozen=True, slots=True)
class Correction(Serialisable):
    """One learned factor: observed / modelled TTFT p95, as of ``updated_s``."""

    shape: str  # plan_shape(), or DEPLOYMENT_WIDE
    factor: float  # multiplies the modelled TTFT p95
    updated_s: float  # event time of the last observation folded in
    observations: int  # ticks folded in so far


@dataclass(frozen=True, slots=True)
class PromptLengths(Serialisable):
    """The load windows' prompt lengths, smoothed over ticks (module docstring)."""

    shares: tuple[tuple[float, float], ...]  # (tokens, share of prompts), ascending; sum 1
    updated_s: float  # event time of the last window folded in
    observations: int  # windows folded in so far


@dataclass(frozen=True, slots=True)
class SmoothedDemand(Serialisable):
    """The load windows' arrival rate and token rates, smoothed over event time (module
    docstring)."""

    arrival_rps: float
    prompt_tok_s: float  # arrivals × mean prompt tokens
    output_tok_s: float  # arrivals × mean output tokens
    updated_s: float  # event time of the last window folded in


@dataclass(frozen=True, slots=True)
class Corrections(Serialisable):
    """A deployment's learned factors, sorted by shape, its smoothed prompt tail and its
    smoothed demand."""

    entries: tuple[Correction, ...] = ()  # TTFT factors
    prompt_lengths: PromptLengths | None = None
    service: tuple[Correction, ...] = ()  # service-rate factors of the queueing term
    tbt: tuple[Correction, ...] = ()  # TBT factors (observed / modelled TBT p95)
    demand: SmoothedDemand | None = None

    def get(self, shape: str) -> Correction | None:
        """The TTFT entry for ``shape`` (None when never observed)."""
        return _entry(self.entries, shape)


def _entry(entries: tuple[Correction, ...], shape: str) -> Correction | None:
    for entry in entries:
        if entry.shape == shape:
            return entry
    return None


def _replica_shape(plan: ExecutionPlan) -> str:
    stages = ",".join(
        f"{s.gpu_class.name}/tp{s.tp}/{s.num_layers}L/{s.role.value}" for s in plan.stages
    )
    return f"{stages}|pd={plan.is_disaggregated}"


def plan_shape(plan: DeploymentPlan) -> str:
    """The correction's key for ``plan``: its distinct replica shapes, sorted (see module)."""
    return "+".join(sorted({_replica_shape(r) for r in plan.replicas}))


def _decayed(entry: Correction, now_s: float, config: GearboxConfig) -> float:
    elapsed_s = max(0.0, now_s - entry.updated_s)
    keep = 0.5 ** (elapsed_s / config.correction_half_life_s)
    return math.exp(math.log(entry.factor) * keep)


def _clamp(factor: float, config: GearboxConfig) -> float:
    return min(config.correction_max_factor, max(config.correction_min_factor, factor))


def factor_for(corrections: Corrections, shape: str, now_s: float, config: GearboxConfig) -> float:
    """The factor for a plan of ``shape`` at ``now_s``: its own, else the deployment-wide one,
    else 1 — decayed toward 1 since its last observation."""
    return _factor(corrections.entries, shape, now_s, config)


def tbt_factor_for(
    corrections: Corrections, shape: str, now_s: float, config: GearboxConfig
) -> float:
    """The TBT factor for a plan of ``shape`` at ``now_s``, found like :func:`factor_for` (1
    when nothing was learned or ``correction_tbt`` is off)."""
    if not config.correction_tbt:
        return 1.0
    return _factor(corrections.tbt, shape, now_s, config)


def service_factor_for(
    corrections: Corrections, shape: str, now_s: float, config: GearboxConfig
) -> float:
    """The queues' service-rate factor for a plan of ``shape`` at ``now_s``, found like
    :func:`factor_for` (1 when nothing was learned or ``correction_service_ratio`` is 0)."""
    if config.correction_service_ratio <= 0:
        return 1.0
    return _factor(corrections.service, shape, now_s, config)


def _factor(
    entries: tuple[Correction, ...], shape: str, now_s: float, config: GearboxConfig
) -> float:
    entry = _entry(entries, shape) or _entry(entries, DEPLOYMENT_WIDE)
    return 1.0 if entry is None else _decayed(entry, now_s, config)


def _ignored(
    num_samples: int, now_s: float, last_switch_s: float | None, config: GearboxConfig
) -> bool:
    """A tick to learn nothing from: learning off, a thin window, or settling after a switch."""
    settling = last_switch_s is not None and now_s - last_switch_s < config.correction_settle_s
    return config.correction_gain <= 0 or settling or num_samples < config.correction_min_samples


def observe(
    corrections: Corrections,
    shape: str,
    model_ttft_p95_ms: float,
    observed_ttft_p95_ms: float,
    num_samples: int,
    now_s: float,
    last_switch_s: float | None,
    config: GearboxConfig,
    *,
    censored: bool = False,
) -> Corrections:
    """Fold one tick's observation of the serving plan (of ``shape``) into the factors;
    ``censored``: the observed p95 is a lower bound, which only raises a factor below it.

    Returns ``corrections`` unchanged when the tick is ignored (see the module docstring).
    """
    if (
        _ignored(num_samples, now_s, last_switch_s, config)
        or model_ttft_p95_ms <= 0
        or observed_ttft_p95_ms <= 0
        or model_ttft_p95_ms >= config.max_latency_ms
    ):
        return corrections
    target = math.log(observed_ttft_p95_ms / model_ttft_p95_ms)
    bound = _AT_LEAST if censored else _EXACT
    entries = _folded(corrections.entries, shape, target, now_s, config, bound=bound)
    return replace(corrections, entries=entries)


def observe_tbt(
    corrections: Corrections,
    shape: str,
    model_tbt_p95_ms: float,
    observed_tbt_p95_ms: float,
    num_samples: int,
    now_s: float,
    last_switch_s: float | None,
    config: GearboxConfig,
) -> Corrections:
    """Fold one tick's observed TBT p95 of the serving plan (of ``shape``) into the TBT
    factors, as :func:`observe` does the TTFT's (unchanged when ``correction_tbt`` is off or the
    tick is ignored)."""
    if (
        not config.correction_tbt
        or _ignored(num_samples, now_s, last_switch_s, config)
        or model_tbt_p95_ms <= 0
        or observed_tbt_p95_ms <= 0
        or model_tbt_p95_ms >= config.max_latency_ms
    ):
        return corrections
    target = math.log(observed_tbt_p95_ms / model_tbt_p95_ms)
    return replace(corrections, tbt=_folded(corrections.tbt, shape, target, now_s, config))


def observe_service(
    corrections: Corrections,
    shape: str,
    service_factor: float,
    num_samples: int,
    now_s: float,
    last_switch_s: float | None,
    config: GearboxConfig,
    *,
    censored: bool = False,
) -> Corrections:
    """Set the service-rate factor of ``shape`` (and the deployment-wide one) to this tick's —
    the one :func:`solve_service_factor` found for the serving plan (module docstring); ignored
    ticks as in :func:`observe` (and every tick when ``correction_service_ratio`` is 0).
    ``censored``: the observed p95 was a lower bound, so ``service_factor`` is an upper one,
    which only lowers a factor above it."""
    if (
        config.correction_service_ratio <= 0
        or _ignored(num_samples, now_s, last_switch_s, config)
        or service_factor <= 0
    ):
        return corrections
    target = math.log(service_factor)
    bound = _AT_MOST if censored else _EXACT
    service = _folded(corrections.service, shape, target, now_s, config, gain=1.0, bound=bound)
    return replace(corrections, service=service)


def _folded(
    entries: tuple[Correction, ...],
    shape: str,
    target: float,
    now_s: float,
    config: GearboxConfig,
    gain: float | None = None,
    bound: int = _EXACT,
) -> tuple[Correction, ...]:
    """``entries`` with the log-factor ``target`` folded into ``shape``'s and the
    deployment-wide entry with weight ``gain`` (default: :func:`_gain`'s; module docstring),
    the stalest shapes dropped past _MAX_SHAPES. ``bound``: ``target`` is exact (_EXACT), or
    only a lower (_AT_LEAST) or upper (_AT_MOST) bound — an entry that already meets it (at or
    above a floor, at or below a ceiling) keeps its value: the bound proves it neither wrong
    nor right."""
    kept = {e.shape: e for e in entries}
    for key in (shape, DEPLOYMENT_WIDE):
        old = kept.get(key)
        prior = 0.0 if old is None else math.log(_decayed(old, now_s, config))
        if bound != _EXACT and bound * (target - prior) <= 0:
            continue  # NOTE: the entry already meets the bound, which then proves nothing
        seen = 0 if old is None else old.observations
        weight = _gain(seen, config) if gain is None else gain
        factor = _clamp(math.exp((1 - weight) * prior + weight * target), config)
        kept[key] = Correction(key, factor, now_s, seen + 1)
    if DEPLOYMENT_WIDE not in kept:
        return entries  # nothing learned yet, and a bound at or below 1 taught nothing
    shaped = sorted(
        (e for e in kept.values() if e.shape != DEPLOYMENT_WIDE),
        key=lambda e: (-e.updated_s, e.shape),
    )[:_MAX_SHAPES]
    return tuple(sorted([kept[DEPLOYMENT_WIDE], *shaped], key=lambda e: e.shape))


def teaches_service_rate(
    ttft_log_change: float, service_log_change: float, config: GearboxConfig
) -> bool:
    """Whether a tick teaches the service rate rather than the TTFT factor: the service rate's
    log change that explains it, weighed ``1 / correction_service_ratio``, is the smaller
    (module docstring). Never when the ratio is 0 or nothing needs explaining."""
    ratio = config.correction_service_ratio
    if ratio <= 0 or ttft_log_change == 0:
        return False
    return abs(service_log_change) < ratio * abs(ttft_log_change)


def solve_service_factor(
    ttft_ms_at: Callable[[float], float],
    observed_ttft_p95_ms: float,
    config: GearboxConfig,
    *,
    steps: int = _SOLVE_STEPS,
) -> float:
    """The service-rate factor within the correction's bounds at which ``ttft_ms_at`` — the
    corrected model's TTFT p95 of the serving plan as a function of that factor, falling as it
    rises — meets the observed p95: a bound when even that bound misses it. Bisection in log
    space, so the answer is as exact at 0.3 as at 3."""
    lo, hi = math.log(config.correction_min_factor), math.log(config.correction_max_factor)
    if ttft_ms_at(math.exp(hi)) >= observed_ttft_p95_ms:
        return math.exp(hi)  # slower than observed even at the fastest: as fast as allowed
    if ttft_ms_at(math.exp(lo)) <= observed_ttft_p95_ms:
        return math.exp(lo)
    for _ in range(steps):
        mid = (lo + hi) / 2
        if ttft_ms_at(math.exp(mid)) > observed_ttft_p95_ms:
            lo = mid
        else:
            hi = mid
    return math.exp((lo + hi) / 2)


def _gain(seen: int, config: GearboxConfig) -> float:
    """A new observation's weight after ``seen`` others: a plain mean for the first
    1 / ``correction_gain`` observations, an exponential one after."""
    return max(config.correction_gain, 1.0 / (seen + 1))


def _prior_weight(seen: int, updated_s: float, now_s: float, config: GearboxConfig) -> float:
    """Weight of the running figure against a new observation: the gain's complement, shrunk
    by the half-life since its last update."""
    decay = 0.5 ** (max(0.0, now_s - updated_s) / config.correction_half_life_s)
    return (1 - _gain(seen, config)) * decay


def _shares(lengths: tuple[tuple[float, int], ...]) -> dict[float, float]:
    total = sum(count for _, count in lengths if count > 0)
    return {tokens: count / total for tokens, count in lengths if count > 0}


def observe_prompts(
    corrections: Corrections, load: LoadSnapshot, config: GearboxConfig
) -> Corrections:
    """Fold the load window's prompt lengths into the smoothed distribution (module docstring).

    Unchanged when the window reported no lengths, learning is off (``correction_gain`` 0) or
    the estimate does not use the tail (``ttft_prompt_tail`` off).
    """
    if (
        not config.ttft_prompt_tail
        or config.correction_gain <= 0
        or not any(count > 0 for _, count in load.prompt_lengths)
    ):
        return corrections
    shares = _shares(load.prompt_lengths)
    old = corrections.prompt_lengths
    seen = 0 if old is None else old.observations
    if old is not None:
        keep = _prior_weight(seen, old.updated_s, load.now_s, config)
        mixed = {tokens: (1 - keep) * share for tokens, share in shares.items()}
        for tokens, share in old.shares:
            mixed[tokens] = mixed.get(tokens, 0.0) + keep * share
        # NOTE: lengths unseen for long fade below the floor and leave: the state stays small
        kept = {t: w for t, w in mixed.items() if w >= _MIN_LENGTH_SHARE}
        total = sum(kept.values())
        shares = {t: w / total for t, w in kept.items()}
    lengths = PromptLengths(tuple(sorted(shares.items())), load.now_s, seen + 1)
    return replace(corrections, prompt_lengths=lengths)


def prompt_tail(lengths: PromptLengths) -> tuple[float, float]:
    """(p95 prompt tokens by nearest rank, squared coefficient of variation) of ``lengths``."""
    p95, cumulative = lengths.shares[-1][0], 0.0
    for tokens, share in lengths.shares:
        cumulative += share
        if cumulative >= _P95 - 1e-9:
            p95 = tokens
            break
    mean = sum(t * w for t, w in lengths.shares)
    mean_sq = sum(t * t * w for t, w in lengths.shares)
    return p95, max(0.0, mean_sq / (mean * mean) - 1.0)


def with_prompt_tail(load: LoadSnapshot, corrections: Corrections) -> LoadSnapshot:
    """``load`` with the smoothed lengths' p95 and spread in place of its window's (as is when
    the window has no lengths or nothing was learned)."""
    lengths = corrections.prompt_lengths
    if lengths is None or not load.prompt_lengths:
        return load
    p95, scv = prompt_tail(lengths)
    return replace(load, p95_prompt_tokens=p95, prompt_tokens_scv=scv)


def observe_demand(
    corrections: Corrections, load: LoadSnapshot, config: GearboxConfig
) -> Corrections:
    """Fold the load window's arrival rate and token rates into their exponential means over
    event time (time constant ``demand_smoothing_s``; module docstring). With smoothing off,
    nothing is kept (a figure smoothed before it was turned off would otherwise stay)."""
    tau = config.demand_smoothing_s
    if tau <= 0:
        return corrections if corrections.demand is None else replace(corrections, demand=None)
    rate = load.arrival_rate_rps
    seen = SmoothedDemand(
        rate, rate * load.mean_prompt_tokens, rate * load.mean_output_tokens, load.now_s
    )
    old = corrections.demand
    if old is None:
        return replace(corrections, demand=seen)
    # NOTE: by event time, not per tick: a burst of triggers at one instant (a topology change
    # beside the timer) sees one window, and must not weigh it twice
    new = 1.0 - math.exp(-max(0.0, seen.updated_s - old.updated_s) / tau)

    def toward(before: float, window: float) -> float:
        return before + new * (window - before)

    smoothed = SmoothedDemand(
        toward(old.arrival_rps, seen.arrival_rps),
        toward(old.prompt_tok_s, seen.prompt_tok_s),
        toward(old.output_tok_s, seen.output_tok_s),
        max(old.updated_s, seen.updated_s),
    )
    return replace(corrections, demand=smoothed)


def with_smoothed_demand(load: LoadSnapshot, corrections: Corrections) -> LoadSnapshot:
    """``load`` with the smoothed arrival rate and mean lengths in place of its window's (as
    is when nothing was smoothed; the window's means are kept while the smoothed rate is 0)."""
    demand = corrections.demand
    if demand is None:
        return load
    rate = demand.arrival_rps
    if rate <= 0:
        return replace(load, arrival_rate_rps=0.0)
    return replace(
        load,
        arrival_rate_rps=rate,
        mean_prompt_tokens=max(1.0, demand.prompt_tok_s / rate),
        mean_output_tokens=max(1.0, demand.output_tok_s / rate),
    )


def apply_correction(
    estimate: DeploymentEstimate, factor: float, config: GearboxConfig, tbt_factor: float = 1.0
) -> DeploymentEstimate:
    """``estimate`` with its TTFT p95 × ``factor`` and its TBT p95 × ``tbt_factor`` (capped at
    ``max_latency_ms``) and its utility recomputed from them; infeasible estimates and factors
    of 1 pass unchanged."""
    if not estimate.feasible or factor == tbt_factor == 1.0:
        return estimate
    ttft = min(config.max_latency_ms, estimate.ttft_p95_ms * factor)
    tbt = min(config.max_latency_ms, estimate.tbt_p95_ms * tbt_factor)
    served, gpus = estimate.served_tok_s, estimate.num_gpus
    utility = utility_tok_s(served, ttft, tbt, gpus, config)
    return replace(estimate, ttft_p95_ms=ttft, tbt_p95_ms=tbt, utility_tok_s=utility)
