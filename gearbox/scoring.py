"""Deployment-level estimates: capacity, served tokens, p95 latencies and a utility to compare.

Load is spread over replicas in proportion to their capacity (the router balances on queue length
and predicted response time). Deployment p95s are the arrival-weighted mean of the replicas' p95s
— an approximation that keeps relative order, which is all decisions use. Latencies are judged
at demand × ``noise_margin`` (1.1), so a plan that only just keeps up with the current demand
looks worse than one with room to spare, and load noise inside the margin cannot make a smaller
plan look better. Candidates are provisioned for demand × ``capacity_headroom`` (1.2), above the
margin. Served tokens are taken at the current demand.

Utility (tokens/s): served tokens discounted by SLO attainment, minus the value of the GPUs held:
``served × (1 − slo_weight × (1 − attainment)) − idle_gpu_value_tok_s × num_gpus`` where
attainment = min(1, TTFT SLO / TTFT p95) × min(1, TBT SLO / TBT p95). The GPU term makes a
deployment hand GPUs back at low load instead of holding replicas it does not need.

A learned service-rate factor ``s`` (:mod:`gearbox.correction`; 1 = the model) scales the
rate of the queues behind the TTFT: a queue served ``s`` times as fast at arrival rate λ waits
exactly as long as the modelled one at λ / s, divided by s (the same utilisation, every
service time ÷ s). So the TTFT p95 is the zero-load latency plus the modelled wait at the
arrivals ÷ s, divided by s; capacity (and with it the tokens served) is the model's × s; the
latency itself and TBT keep the model's figures.

Observed pressure (:func:`observed_pressure`) is the check of these estimates against what the
deployment actually sees: when its observed TTFT or TBT p95 is over the SLO, or its queue alone
takes longer than the TTFT SLO to drain at the current plan's estimated capacity, the estimates
are too optimistic to trade serving capacity for GPUs handed back, and ``decide`` neither credits
freed GPUs nor takes voluntary downshifts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gearbox.config import GearboxConfig
from gearbox.cost import ReplicaEstimate, ReplicaShape, estimate_replica, replica_capacity
from gearbox.model import ModelSpec
from gearbox.serde import Serialisable
from gearbox.types import LoadSnapshot

__all__ = [
    "DeploymentEstimate",
    "demand_rps",
    "estimate_deployment",
    "observed_pressure",
    "request_profile",
    "utility_tok_s",
]


@dataclass(frozen=True, slots=True)
class DeploymentEstimate(Serialisable):
    """A deployment's modelled steady state at the current load."""

    feasible: bool  # every replica fits in memory
    capacity_tok_s: float  # prompt + output tokens per second at saturation
    served_tok_s: float  # tokens per second served at this load
    ttft_p95_ms: float
    tbt_p95_ms: float
    num_gpus: int
    utility_tok_s: float  # see module docstring


def request_profile(load: LoadSnapshot, config: GearboxConfig) -> tuple[int, int]:
    """(prompt, output) tokens per request, rounded to ``config.profile_step_tokens`` (at least
    one step) so near-equal loads share memo entries."""
    step = config.profile_step_tokens
    prompt = max(step, round(load.mean_prompt_tokens / step) * step)
    output = max(step, round(load.mean_output_tokens / step) * step)
    return prompt, output


def _tail_prompt(load: LoadSnapshot, prompt: int, config: GearboxConfig) -> int | None:
    """The load's p95 prompt, rounded like the profile (None when the load has no lengths or
    ``ttft_prompt_tail`` is off)."""
    if not config.ttft_prompt_tail or load.p95_prompt_tokens <= 0:
        return None
    step = config.profile_step_tokens
    return max(prompt, round(load.p95_prompt_tokens / step) * step)


def demand_rps(load: LoadSnapshot, config: GearboxConfig) -> float:
    """Arrivals plus the queued backlog spread over ``backlog_drain_s``."""
    return load.arrival_rate_rps + load.queue_len / config.backlog_drain_s


def estimate_deployment(
    shapes: Sequence[ReplicaShape],
    num_gpus: int,
    model: ModelSpec,
    load: LoadSnapshot,
    config: GearboxConfig,
    *,
    service_factor: float = 1.0,
) -> DeploymentEstimate:
    """Estimate a deployment made of replicas with the given shapes; ``service_factor`` scales
    its queues' service rate (module docstring)."""
    prompt, output = request_profile(load, config)
    capacities = [replica_capacity(s, model, prompt, output, config) for s in shapes]
    if not shapes or not all(c.feasible for c in capacities):
        worst = config.max_latency_ms
        return DeploymentEstimate(False, 0.0, 0.0, worst, worst, num_gpus, 0.0)
    total_rps = sum(c.capacity_rps for c in capacities)
    demand = demand_rps(load, config)
    capacity_tok_s = served = ttft = tbt = 0.0
    design = demand * config.noise_margin
    tail = _tail_prompt(load, prompt, config)
    scv = load.prompt_tokens_scv if tail is not None else 1.0
    for shape, cap in zip(shapes, capacities, strict=True):
        share = cap.capacity_rps / total_rps

        def at(arrival_rps: float, shape: ReplicaShape = shape) -> ReplicaEstimate:
            return estimate_replica(
                shape,
                model,
                prompt,
                output,
                arrival_rps,
                config,
                tail_prompt_tokens=tail,
                prompt_scv=scv,
            )

        replica = at(design * share)
        replica_ttft = replica.ttft_p95_ms
        if service_factor != 1.0:
            idle = at(0.0).ttft_p95_ms
            queued = at(design * share / service_factor).ttft_p95_ms
            replica_ttft = idle + max(0.0, queued - idle) / service_factor
        capacity_tok_s += replica.capacity_tok_s * service_factor
        served += min(demand * share, cap.capacity_rps * service_factor) * (prompt + output)
        ttft += share * replica_ttft
        tbt += share * replica.tbt_p95_ms
    utility = utility_tok_s(served, ttft, tbt, num_gpus, config)
    return DeploymentEstimate(True, capacity_tok_s, served, ttft, tbt, num_gpus, utility)


def utility_tok_s(
    served_tok_s: float,
    ttft_p95_ms: float,
    tbt_p95_ms: float,
    num_gpus: int,
    config: GearboxConfig,
) -> float:
    """Served tokens discounted by SLO attainment, minus the GPUs' value (module docstring)."""
    attainment = min(1.0, config.ttft_slo_ms / ttft_p95_ms) * min(
        1.0, config.tbt_slo_ms / tbt_p95_ms
    )
    discount = 1 - config.slo_weight * (1 - attainment)
    return served_tok_s * discount - config.idle_gpu_value_tok_s * num_gpus


def observed_pressure(
    load: LoadSnapshot, config: GearboxConfig, capacity_tok_s: float
) -> tuple[str, ...]:
    """Why the deployment is observably under pressure now (empty when it is not).

    Pressure is any of: observed TTFT p95 over ``ttft_slo_ms``; observed TBT p95 over
    ``tbt_slo_ms`` (an observed p95 of 0 means none was observed and never counts); or a queue
    whose drain alone, at ``capacity_tok_s`` (the current plan's estimated saturation capacity),
    takes longer than the TTFT SLO — every queued request then misses it even if the estimates
    are right. With no capacity, any queue counts.
    """
    reasons = []
    if load.ttft_p95_ms > config.ttft_slo_ms:
        reasons.append(
            f"observed TTFT p95 {load.ttft_p95_ms:,.0f} ms > SLO {config.ttft_slo_ms:,.0f} ms"
        )
    if load.tbt_p95_ms > config.tbt_slo_ms:
        reasons.append(
            f"observed TBT p95 {load.tbt_p95_ms:,.1f} ms > SLO {config.tbt_slo_ms:,.1f} ms"
        )
    if load.queue_len > 0:
        prompt, output = request_profile(load, config)
        tokens = load.queue_len * (prompt + output)
        drain_ms = tokens / capacity_tok_s * 1000 if capacity_tok_s > 0 else float("inf")
        if drain_ms > config.ttft_slo_ms:
            reasons.append(
                f"queue of {load.queue_len} requests takes {min(drain_ms, 1e9):,.0f} ms to drain "
                f"at capacity > TTFT SLO {config.ttft_slo_ms:,.0f} ms"
            )
    return tuple(reasons)
