"""Decision types: what ``decide`` returns and what the audit topic carries.

A :class:`Decision` is the diff the runtime carries out (from one deployment plan to another);
a :class:`DecideResult` wraps it with the tick's diagnostics, so a held outcome is as visible as
a switch and always carries its reason. All are frozen and round-trip through ``to_dict``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from gearbox.history import GearState
from gearbox.plans import DeploymentPlan
from gearbox.serde import Serialisable
from gearbox.switch import SwitchCost

__all__ = [
    "CandidateSummary",
    "DecideResult",
    "Decision",
    "DecisionReason",
    "Overrides",
    "Trigger",
]


class Trigger(StrEnum):
    """Why the decision loop ran."""

    TIMER = "timer"  # the periodic tick (10–30 s)
    TOPOLOGY_CHANGE = "topology_change"  # node up/down, isolation, preemption
    LOAD_CHANGE = "load_change"  # a load shift crossed the streams' threshold
    OPERATOR = "operator"  # a control command (pin, emergency downshift)


class DecisionReason(StrEnum):
    """Machine-readable outcome of one tick, shown as-is in logs and dashboards."""

    SWITCH_GAIN = "switch_gain"  # gain > cost × hysteresis, outside the cooldown
    INITIAL_PLACEMENT = "initial_placement"  # no current plan: take the best one
    FORCED_INFEASIBLE = "forced_infeasible"  # current plan lost GPUs/memory: best feasible plan
    EMERGENCY_DOWNSHIFT = "emergency_downshift"  # operator: go to the baseline plan
    PINNED = "pinned"  # operator pinned a plan
    HELD_BY_HYSTERESIS = "held_by_hysteresis"  # some gain, but not above cost × hysteresis
    DOWNSHIFT_BLOCKED = "downshift_blocked"  # a worthwhile switch to fewer GPUs is too risky
    STABILITY_DISCOUNT = "stability_discount"  # would switch, but onto steadily shrinking blocks
    COOLDOWN = "cooldown"  # a worthwhile switch waits for the cooldown after the last one
    REVERSE_COOLDOWN = "reverse_cooldown"  # switching straight back waits longer
    NO_BETTER_CANDIDATE = "no_better_candidate"  # the current plan is the best
    NO_FEASIBLE_PLAN = "no_feasible_plan"  # nothing fits on the live GPUs
    # set by the stream's decision step (streams.inflight), which owns the runtime's progress:
    TRANSITION_IN_FLIGHT = "transition_in_flight"  # the last switch is still being carried out
    ALREADY_SERVING = "already_serving"  # the chosen target is the plan the runtime serves
    # on-demand models (gearbox.residency): load when requested, evict when cold and needed
    LOAD_ON_DEMAND = "load_on_demand"  # a cold model has requests and a GPU fits it
    EVICT_COLD = "evict_cold"  # idle, least recently used, and its GPU lets a waiting model in
    EVICT_QUEUE = "evict_queue"  # idle, not cold, but the requests it unblocks outweigh its loss
    # in use, its last replica, but the demand it unblocks is many times its own: drained
    EVICT_DISPLACE = "evict_displace"
    WAITING_FOR_ROOM = "waiting_for_room"  # a cold model has requests but no GPU fits it yet
    SCALE_OUT = "scale_out"  # a resident model's demand is unmet: one more replica
    SCALE_IN = "scale_in"  # an extra replica, idle, given back (or evicted for a waiting model)
    COLD = "cold"  # not loaded and not requested
    RESIDENT = "resident"  # loaded, and either in use or not needed elsewhere


@dataclass(frozen=True, slots=True)
class Overrides(Serialisable):
    """Operator commands, applied before any optimisation (emergency first, then pin)."""

    pinned_plan: DeploymentPlan | None = None  # run exactly this plan
    emergency_downshift: bool = False  # go to baseline_plan now
    baseline_plan: DeploymentPlan | None = None  # the known-safe plan (e.g. TP8 on block A)

    def __post_init__(self) -> None:
        if self.emergency_downshift and self.baseline_plan is None:
            raise ValueError("baseline_plan: an emergency downshift needs a baseline plan")


@dataclass(frozen=True, slots=True)
class CandidateSummary(Serialisable):
    """One candidate as the decision saw it."""

    plan_id: str
    strategy: str  # assembly strategy, or "current" / "override"
    num_gpus: int
    est_throughput_tok_s: float  # tokens/s served at the current load
    est_capacity_tok_s: float  # tokens/s at saturation
    est_ttft_p95_ms: float  # the model's figure × ttft_correction
    est_tbt_p95_ms: float
    stability: float  # discount applied to its gain (1 = stable blocks)
    gain_tokens: float  # (utility − current utility) × horizon × stability
    cost_tokens: float  # switch cost from the current plan (a forced switch's: + its outage)
    eligible: bool  # gain > cost × hysteresis, and not blocked
    blocked: str = ""  # why a voluntary downshift to it may not be taken ("" = not blocked)
    model_ttft_p95_ms: float = 0.0  # the cost model's TTFT p95, before the correction
    ttft_correction: float = 1.0  # learned factor applied to it (gearbox.correction)
    model_tbt_p95_ms: float = 0.0  # the cost model's TBT p95, before the correction
    tbt_correction: float = 1.0  # learned factor applied to it (gearbox.correction)


@dataclass(frozen=True, slots=True)
class Decision(Serialisable):
    """A gear shift for the runtime to carry out."""

    deployment: str
    now_s: float  # event time of the tick that decided
    trigger: Trigger
    reason: DecisionReason
    forced: bool  # hysteresis and cooldown were skipped (infeasible plan or operator)
    from_plan_id: str | None  # None for a first placement
    to_plan_id: str
    to_plan: DeploymentPlan
    candidates: tuple[CandidateSummary, ...]  # top-k considered, chosen one included
    switch_cost: SwitchCost
    explanation: str  # one human-readable paragraph
    # a handover: the deployment whose GPUs ``to_plan`` takes (it moves off them first) and
    # those GPUs; the runtime's prepare waits for them (gearbox.joint.Yield)
    takes_from: str | None = None
    taken_gpus: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.to_plan_id != self.to_plan.plan_id:
            raise ValueError("to_plan_id: does not match to_plan's content hash")
        if bool(self.takes_from) != bool(self.taken_gpus):
            raise ValueError("taken_gpus: a handover names its neighbour and the GPUs it takes")


@dataclass(frozen=True, slots=True)
class DecideResult(Serialisable):
    """The outcome of one tick: an optional decision plus why, and the state to carry on."""

    decision: Decision | None
    reason: DecisionReason
    trigger: Trigger
    current: CandidateSummary | None  # the current plan's estimate (None if absent/infeasible)
    candidates: tuple[CandidateSummary, ...]  # top-k by net gain
    problems: tuple[str, ...]  # why the current plan (or "target: " an override) cannot run
    explanation: str
    state: GearState  # pass to the next call
    retry_after_s: float | None = None  # event time when a cooldown ends, if one is holding
