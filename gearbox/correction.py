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

Applied (:func:`factor_for`): a plan whose shape has a factor gets it; any other plan gets the
deployment-wide factor — a plan never observed is assumed to err like the deployment's plans
so far, which keeps the comparison with the serving plan neutral instead of favouring the
unobserved. Only TTFT is corrected; TBT, capacity and served tokens keep the model's figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from gearbox.config import GearboxConfig
from gearbox.plans import DeploymentPlan, ExecutionPlan
from gearbox.scoring import DeploymentEstimate, utility_tok_s
from gearbox.serde import Serialisable

__all__ = [
    "DEPLOYMENT_WIDE",
    "Correction",
    "Corrections",
    "apply_correction",
    "factor_for",
    "observe",
    "plan_shape",
]

DEPLOYMENT_WIDE = ""  # the shape key of the factor learned from every observation
_MAX_SHAPES = 16  # per deployment, besides the deployment-wide one; the stalest are dropped


@dataclass(frozen=True, slots=True)
class Correction(Serialisable):
    """One learned factor: observed / modelled TTFT p95, as of ``updated_s``."""

    shape: str  # plan_shape(), or DEPLOYMENT_WIDE
    factor: float  # multiplies the modelled TTFT p95
    updated_s: float  # event time of the last observation folded in
    observations: int  # ticks folded in so far


@dataclass(frozen=True, slots=True)
class Corrections(Serialisable):
    """A deployment's learned factors, sorted by shape."""

    entries: tuple[Correction, ...] = ()

    def get(self, shape: str) -> Correction | None:
        """The entry for ``shape`` (None when never observed)."""
        for entry in self.entries:
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
    entry = corrections.get(shape) or corrections.get(DEPLOYMENT_WIDE)
    return 1.0 if entry is None else _decayed(entry, now_s, config)


def observe(
    corrections: Corrections,
    shape: str,
    model_ttft_p95_ms: float,
    observed_ttft_p95_ms: float,
    num_samples: int,
    now_s: float,
    last_switch_s: float | None,
    config: GearboxConfig,
) -> Corrections:
    """Fold one tick's observation of the serving plan (of ``shape``) into the factors.

    Returns ``corrections`` unchanged when the tick is ignored (see the module docstring).
    """
    settling = last_switch_s is not None and now_s - last_switch_s < config.correction_settle_s
    if (
        config.correction_gain <= 0
        or settling
        or num_samples < config.correction_min_samples
        or model_ttft_p95_ms <= 0
        or observed_ttft_p95_ms <= 0
        or model_ttft_p95_ms >= config.max_latency_ms
    ):
        return corrections
    target = math.log(observed_ttft_p95_ms / model_ttft_p95_ms)
    kept = {e.shape: e for e in corrections.entries}
    for key in (shape, DEPLOYMENT_WIDE):
        old = kept.get(key)
        prior = 0.0 if old is None else math.log(_decayed(old, now_s, config))
        seen = 0 if old is None else old.observations
        gain = max(config.correction_gain, 1.0 / (seen + 1))
        factor = _clamp(math.exp((1 - gain) * prior + gain * target), config)
        kept[key] = Correction(key, factor, now_s, seen + 1)
    shaped = sorted(
        (e for e in kept.values() if e.shape != DEPLOYMENT_WIDE),
        key=lambda e: (-e.updated_s, e.shape),
    )[:_MAX_SHAPES]
    entries = sorted([kept[DEPLOYMENT_WIDE], *shaped], key=lambda e: e.shape)
    return Corrections(tuple(entries))


def apply_correction(
    estimate: DeploymentEstimate, factor: float, config: GearboxConfig
) -> DeploymentEstimate:
    """``estimate`` with its TTFT p95 × ``factor`` (capped at ``max_latency_ms``) and its
    utility recomputed from it; infeasible estimates and a factor of 1 pass unchanged."""
    if not estimate.feasible or factor == 1.0:
        return estimate
    ttft = min(config.max_latency_ms, estimate.ttft_p95_ms * factor)
    served, gpus = estimate.served_tok_s, estimate.num_gpus
    utility = utility_tok_s(served, ttft, estimate.tbt_p95_ms, gpus, config)
    return replace(estimate, ttft_p95_ms=ttft, utility_tok_s=utility)
