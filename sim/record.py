"""The record of a `flexpipe up` run: what was served, decided, shifted and what happened to the
cluster, in simulated seconds since the scenario's epoch; with the small formatters the report,
the plot and the live view share.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from flexpipe.schemas import GearDecision, GearTransition, PhaseStatus, TransitionPhase
from gearbox.plans import DeploymentPlan
from sim.summary import SequenceFacts

BUCKET_S = 120.0  # summary table: latency quantiles per 2 simulated minutes
PHASES = (TransitionPhase.PREPARE, TransitionPhase.SWITCH, TransitionPhase.CLEANUP)
LOSSES = frozenset({"preempt", "xid", "node_down"})  # events that take GPUs from a replica


@dataclass(frozen=True, slots=True)
class Served:
    """One completed request, in simulated seconds."""

    deployment: str
    finish_s: float
    ttft_s: float
    tbt_s: float
    output_tokens: int
    request_id: str = ""


@dataclass(frozen=True, slots=True)
class SeenDecision:
    """A decision as this job read it off the decisions topic."""

    t_s: float  # the trigger's event time
    seen_s: float  # when this job read it (the shared simulated clock): event → decision delay
    decision: GearDecision
    produced_s: float | None = None  # its record's broker timestamp on the simulated clock


@dataclass(frozen=True, slots=True)
class ClusterMark:
    """A cluster event worth a marker: preemption, release, XID, node down."""

    t_s: float
    kind: str  # the ClusterEventType value
    label: str  # e.g. "preempt on node-a1 (4 GPUs)"


@dataclass(frozen=True, slots=True)
class Shift:
    """One transition as its records tell it."""

    deployment: str
    seq: int  # 0: the starting plan, loaded at start-up
    decision_id: str
    from_plan: str | None
    to_plan: str | None
    to_shape: str  # e.g. "TP4@A (4 GPUs)"
    outcome: str  # done | rolled_back | in progress
    phases_ms: dict[str, float]  # completed phases (all attempts), and "total"
    attempts: int  # the most attempts any phase needed
    start_s: float
    end_s: float
    kv_detail: str  # the switch's hand-over: migrated / replayed sequences
    failure: str  # the last failed attempt's reason, as the runtime gave it ("": none)


@dataclass
class RunRecord:
    """Everything the report needs, accumulated while the job runs."""

    decisions: list[SeenDecision] = field(default_factory=list)  # every decision, holds too
    holds: Counter[tuple[str, str]] = field(default_factory=Counter)  # (deployment, reason)
    transitions: list[tuple[float, GearTransition]] = field(default_factory=list)
    served: list[Served] = field(default_factory=list)
    admissions: Counter[tuple[str, str]] = field(default_factory=Counter)  # (deployment, reason)
    rejections: list[tuple[float, str, str]] = field(default_factory=list)  # (t, dep, reason)
    events: list[ClusterMark] = field(default_factory=list)
    gpus: list[tuple[float, str, int]] = field(default_factory=list)  # (t, dep, GPUs serving)
    serving: list[tuple[float, str, bool]] = field(default_factory=list)  # (t, dep, a live replica)
    load_start_s: float = 0.0  # the load generator started once the starting plans served
    load_end_s: float | None = None  # the load generator stopped (None: still running)
    sequences: dict[str, SequenceFacts] = field(default_factory=dict)  # when the load stopped

    def changes(self) -> list[SeenDecision]:
        """Decisions that move a plan, and forced or operator ones (the rest are holds)."""
        return [d for d in self.decisions if is_change(d.decision)]

    def shifts(self) -> list[Shift]:
        """Transitions grouped by (deployment, sequence), in the order they started."""
        groups: dict[tuple[str, int], list[tuple[float, GearTransition]]] = defaultdict(list)
        for t_s, rec in self.transitions:
            groups[(rec.deployment, rec.transition_seq)].append((t_s, rec))
        return [_shift(recs) for recs in groups.values()]

    def latency_series(
        self, deployment: str, bucket_s: float = BUCKET_S
    ) -> list[tuple[float, float, float, int]]:
        """(bucket start s, TTFT p95 ms, TBT p95 ms, requests) per bucket."""
        buckets: dict[int, list[Served]] = defaultdict(list)
        for s in self.served:
            if s.deployment == deployment:
                buckets[int(s.finish_s // bucket_s)].append(s)
        return [
            (
                b * bucket_s,
                p95([s.ttft_s for s in items]) * 1000,
                p95([s.tbt_s for s in items]) * 1000,
                len(items),
            )
            for b, items in sorted(buckets.items())
        ]

    def ttft_p95_ms(self, deployment: str, t0_s: float, t1_s: float) -> float:
        """TTFT p95 of requests finishing in [t0, t1)."""
        return 1000 * p95(
            [
                s.ttft_s
                for s in self.served
                if s.deployment == deployment and t0_s <= s.finish_s < t1_s
            ]
        )

    def decision_of(self, shift: Shift) -> SeenDecision | None:
        """The decision a shift carried out (None for the start-up transition)."""
        return next(
            (d for d in self.decisions if d.decision.decision_id == shift.decision_id), None
        )

    def cause_of(self, seen: SeenDecision) -> ClusterMark | None:
        """The cluster event a topology-triggered decision answered (the latest at its time)."""
        if seen.decision.trigger != "topology_change":
            return None
        before = [e for e in self.events if e.t_s <= seen.t_s + 1e-6]
        return before[-1] if before else None


def is_change(d: GearDecision) -> bool:
    """A decision the runtime acts on or an operator caused (printed live; holds are counted)."""
    return d.to_plan_id is not None or d.forced or d.trigger == "operator"


def plan_shape(plan: DeploymentPlan | None) -> str:
    """A plan in a few characters: ``TP8@A (8 GPUs)``, ``2×TP1@A (2 GPUs)``, ``TP4@A+TP4@B``."""
    if plan is None:
        return "no plan"
    shapes = Counter(
        "+".join(f"TP{len(st.gpu_uuids)}@{st.domain_id}" for st in r.stages) for r in plan.replicas
    )
    text = ", ".join(f"{n}×{s}" if n > 1 else s for s, n in shapes.items())
    return f"{text} ({plan.num_gpus} GPUs)"


def _shift(recs: list[tuple[float, GearTransition]]) -> Shift:
    phases: dict[str, float] = {}
    kv = failure = ""
    for _, rec in recs:
        if rec.status is not PhaseStatus.STARTED and rec.duration_ms is not None:
            key = (
                "total"
                if rec.phase in (TransitionPhase.DONE, TransitionPhase.ROLLED_BACK)
                else rec.phase.value
            )
            phases[key] = phases.get(key, 0.0) + rec.duration_ms
        if rec.phase is TransitionPhase.SWITCH and rec.status is PhaseStatus.COMPLETED:
            kv = rec.detail
        if rec.status is PhaseStatus.FAILED:
            failure = f"{rec.phase.value} attempt {rec.attempt}: {rec.detail}"
    terminal = [
        r.phase for _, r in recs if r.phase in (TransitionPhase.DONE, TransitionPhase.ROLLED_BACK)
    ]
    first = recs[0][1]
    return Shift(
        deployment=first.deployment,
        seq=first.transition_seq,
        decision_id=first.decision_id,
        from_plan=first.from_plan_id,
        to_plan=first.to_plan_id,
        to_shape=plan_shape(first.plan),
        outcome=terminal[-1].value if terminal else "in progress",
        phases_ms=phases,
        attempts=max(r.attempt for _, r in recs),
        start_s=recs[0][0],
        end_s=recs[-1][0],
        kv_detail=kv,
        failure=failure,
    )


def p95(values: list[float]) -> float:
    """The 95th percentile (nearest rank); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


def hms(t_s: float) -> str:
    """Simulated time as HH:MM:SS."""
    t = int(t_s)
    return f"{t // 3600:02d}:{t // 60 % 60:02d}:{t % 60:02d}"


def ms(value: float) -> str:
    """Milliseconds for a table cell ('–' for no data)."""
    return "–" if math.isnan(value) else f"{value:,.0f}"
