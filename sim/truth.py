"""The SIMULATED world's ground-truth step timing, which gearbox's estimator cannot see.

Gearbox ranks plans with its own cost formulas (:mod:`gearbox.cost`, through
:class:`runtime.timing.ReplicaTiming`). If the simulated engines were timed by the same formulas,
the planner would grade its own homework: the only error it could make would be queueing. Here
each simulated engine's prefill and decode step times are the estimator's figure times factors
drawn from the seed, which nothing in the product reads:

* an efficiency factor per GPU class and one per plan shape (the stages' GPU classes, TP degrees,
  layer counts and roles, and whether prefill and decode are split), separately for prefill and
  decode; their mean lies within ``± spread`` of 1 (a class and a shape each contribute half);
* a per-step jitter: each decode batch size and each 64-token prefill length bucket of a
  replica gets its own factor within ``± spread / 2`` of 1. The event-stepped engine advances
  runs of identical iterations at once, so the jitter is keyed by the step's shape, not drawn
  anew per iteration: the same shape costs the same on one replica, and neighbouring shapes
  differ as a real engine's kernels do. Decode jitter is not keyed by the context: the engine's
  laziness bound needs a step's time to never shrink as the context grows.

Spread 0 reproduces the estimator exactly (the world the planner assumes). Every draw comes from
a ``random.Random`` seeded with a string (hashed with SHA-512: the same in every process), so
the same seed gives the same world.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from gearbox.plans import ExecutionPlan
from runtime.timing import ReplicaTiming

DEFAULT_SPREAD = 0.3  # the default: the simulated world is off the planner's model by ±30 %
JITTER_SHARE = 0.5  # per-step jitter spans this share of the spread


def _uniform(seed: int, spread: float, *key: object) -> float:
    """A draw in ``[-spread, spread]`` fixed by the seed and the key."""
    if spread <= 0.0:
        return 0.0
    text = ":".join(str(k) for k in (seed, *key))
    return random.Random(text).uniform(-spread, spread)


def plan_shape(plan: ExecutionPlan) -> str:
    """What makes two plans the same shape: stage classes, TP, layers and roles, PD split."""
    stages = ",".join(
        f"{s.gpu_class.name}/tp{s.tp}/{s.num_layers}L/{s.role.value}" for s in plan.stages
    )
    return f"{plan.model_name}|{stages}|pd={plan.is_disaggregated}"


@dataclass(frozen=True, slots=True)
class GroundTruth:
    """The simulated world's timing model for one seed (see the module docstring)."""

    seed: int
    spread: float = DEFAULT_SPREAD

    def __post_init__(self) -> None:
        if not 0.0 <= self.spread < 1.0:
            raise ValueError(f"spread: must be within [0, 1), got {self.spread}")

    def efficiency(self, plan: ExecutionPlan, phase: str) -> float:
        """The slowdown factor of ``plan`` in ``phase`` ("prefill" or "decode"), jitter aside."""
        half = self.spread / 2.0
        classes = sorted({s.gpu_class.name for s in plan.stages})
        by_class = sum(_uniform(self.seed, half, "class", c, phase) for c in classes) / len(classes)
        by_shape = _uniform(self.seed, half, "shape", plan_shape(plan), phase)
        return 1.0 + by_class + by_shape

    def replica(self, timing: ReplicaTiming) -> TrueReplicaTiming:
        """The true step times of the replica ``timing`` estimates."""
        return TrueReplicaTiming(
            estimate=timing,
            seed=self.seed,
            jitter=self.spread * JITTER_SHARE,
            prefill_factor=self.efficiency(timing.plan, "prefill"),
            decode_factor=self.efficiency(timing.plan, "decode"),
        )


@dataclass(frozen=True, slots=True)
class TrueReplicaTiming:
    """One simulated replica's true step times: the estimate × efficiency × per-step jitter.

    Satisfies :class:`runtime.engine.batch.StepTiming`, which is all the engine reads.
    """

    estimate: ReplicaTiming
    seed: int
    jitter: float
    prefill_factor: float
    decode_factor: float
    _memo: dict[tuple[object, ...], float] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )

    def _step_jitter(self, *key: object) -> float:
        value = self._memo.get(key)
        if value is None:
            value = 1.0 + _uniform(self.seed, self.jitter, "step", self.estimate.replica_id, *key)
            self._memo[key] = value
        return value

    def prefill_s(self, num_tokens: int) -> float:
        """True latency of one prompt through the prefill pipeline."""
        # NOTE: the jitter is keyed by the estimator's 64-token bucket, so one draw per bucket.
        bucket = -(-max(num_tokens, 1) // 64)
        jitter = self._step_jitter("prefill", bucket)
        return self.estimate.prefill_s(num_tokens) * self.prefill_factor * jitter

    def decode_cycle_s(self, batch: int, context_tokens: float) -> float:
        """True duration of one decode step (the engine passes bucketed contexts)."""
        if batch <= 0:
            return 0.0
        jitter = self._step_jitter("decode", batch)
        return self.estimate.decode_cycle_s(batch, context_tokens) * self.decode_factor * jitter


__all__ = ["DEFAULT_SPREAD", "GroundTruth", "TrueReplicaTiming", "plan_shape"]
