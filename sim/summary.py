"""The outcome of a `flexpipe up` run as data: what it recorded, and what its checks found.

:class:`RunFacts` is what ``up`` gathers at the end of a run (decisions and transitions read back
from the run's topics, cluster events, planned outages, the stream worker's failed ticks, the
runtime's sequence accounting); :func:`sim.invariants.evaluate` turns it into a
:class:`Summary` — one :class:`Check` per :class:`Invariant` and the figures behind each — which
``up`` writes to ``summary.json``. Times are simulated seconds since the scenario's epoch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from flexpipe.schemas import GearTransition

__all__ = [
    "Check",
    "DecisionFact",
    "DeploymentFacts",
    "DeploymentOutcome",
    "EventFact",
    "EventOutcome",
    "Invariant",
    "Limits",
    "OnDemandInvariant",
    "Outage",
    "RunFacts",
    "SequenceFacts",
    "Summary",
]


class Invariant(StrEnum):
    """The invariants a run must hold; the value names it in ``summary.json`` and the exit line."""

    INFEASIBLE_ANSWERED = "infeasible_answered"  # a forced decision within the answer limit
    SERVING_AGAIN = "serving_again"  # a plan clear of the lost GPUs done within the serve limit
    UNIQUE_DECISION_IDS = "unique_decision_ids"  # no decision id on the topic twice
    NO_DECISION_TARGETS_SERVING = "no_decision_targets_serving"  # no switch to the plan serving
    NO_FAILED_TICKS = "no_failed_ticks"  # the stream worker's decision runs never raised
    TRANSITIONS_FINISHED = "transitions_finished"  # none left without done / rolled_back
    SEQUENCES_ACCOUNTED = "sequences_accounted"  # every admitted sequence done or in flight, once
    NOTHING_DEAD_LETTERED = "nothing_dead_lettered"  # the stream refused no record of the run's


class OnDemandInvariant(StrEnum):
    """The invariants a run with on-demand deployments adds (:mod:`sim.ondemand`)."""

    NO_EVICTION_WITH_ACTIVE = "no_eviction_with_active"  # never evicts a model in use
    NO_OOM = "no_oom"  # no allocation failed at a GPU's memory limit
    EVERY_REQUESTED_MODEL_SERVED = "every_requested_model_served"  # requested → served once


@dataclass(frozen=True, slots=True)
class Limits:
    """The bounds the invariants hold a run to (simulated seconds)."""

    answer_within_s: float = 40.0  # infeasible event → forced decision
    serve_within_s: float = 90.0  # infeasible event → a plan clear of the lost GPUs serves
    flap_window_s: float = 600.0  # a shift straight back within this counts as a flap


@dataclass(frozen=True, slots=True)
class DecisionFact:
    """One decision as read back from the decisions topic."""

    decision_id: str
    deployment: str
    t_s: float  # its trigger's event time
    seen_s: float  # when `up` read it live (the shared simulated clock); t_s if never seen live
    forced: bool
    reason: str
    from_plan_id: str | None
    to_plan_id: str | None  # None: a hold


@dataclass(frozen=True, slots=True)
class EventFact:
    """One cluster event as read back from the cluster-events topic."""

    t_s: float
    type: str  # ClusterEventType value
    node: str
    gpu_uuids: tuple[str, ...] = ()
    xid: int | None = None

    @property
    def label(self) -> str:
        """E.g. ``preempt on node-a1 (4 GPUs)``."""
        gpus = f" ({len(self.gpu_uuids)} GPUs)" if self.gpu_uuids else ""
        return f"{self.type} on {self.node}{gpus}"


@dataclass(frozen=True, slots=True)
class Outage:
    """A planned outage of the chaos run, in simulated seconds."""

    kind: str  # "stream_worker_killed" | "broker_stopped"
    start_s: float
    end_s: float  # recovered: the restarted worker owns its partitions / the broker answers
    detail: str = ""


@dataclass(frozen=True, slots=True)
class SequenceFacts:
    """A deployment's admitted sequences when the load stopped."""

    admitted: int = 0
    completed: int = 0
    in_flight: int = 0  # owned by a replica or waiting for one
    lost: int = 0  # admitted, not completed, not in flight
    owned_twice: int = 0  # in flight twice, or completed and still in flight
    preemptions: int = 0  # running sequences preempted for KV pages, recomputed later


@dataclass(frozen=True, slots=True)
class DeploymentFacts:
    """What the runtime and the load generator saw of one deployment."""

    name: str
    served: int  # requests completed
    rejected: Mapping[str, int]  # by admission reason
    unserved_s: float  # simulated seconds after the load started without a whole live replica
    sequences: SequenceFacts = SequenceFacts()


@dataclass(frozen=True, slots=True)
class RunFacts:
    """Everything :func:`evaluate` judges; ``up`` gathers it at the end of a run."""

    deployments: tuple[DeploymentFacts, ...]
    decisions: tuple[DecisionFact, ...]
    transitions: tuple[tuple[float, GearTransition], ...]  # (event time, record), topic order
    events: tuple[EventFact, ...]
    end_s: float  # the simulated time the run's checks ended
    gpu_nodes: Mapping[str, str] = field(default_factory=dict)  # GPU uuid → node (node_down)
    outages: tuple[Outage, ...] = ()
    failed_ticks: int | None = 0  # None: neither the metric nor the log could be read
    failed_ticks_source: str = "metric"  # "metric" | "log" | "none"
    active_at_exit: tuple[str, ...] = ()  # deployments whose runtime still ran a transition
    # the stream's refusals, "topic reason" → count: every record of the run comes from its own
    # agents and runtime, so one refused is a contract broken between them
    dead_letters: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Check:
    """One invariant's verdict."""

    invariant: Invariant | OnDemandInvariant
    ok: bool
    detail: str  # the figures when it held; what broke when not


@dataclass(frozen=True, slots=True)
class EventOutcome:
    """One (event, deployment) pair where the event made the serving plan infeasible."""

    t_s: float
    label: str
    deployment: str
    plan_id: str  # the plan serving when the event hit
    lost_gpus: int  # of that plan's GPUs
    measured_from_s: float  # the event, or the recovery from a planned outage after it
    answered_after_s: float | None
    answer_reason: str | None
    decision_id: str | None
    enough_gpus: bool  # False: the answer was no_feasible_plan
    serving_again_after_s: float | None
    serving_plan_id: str | None
    judged: bool  # False: the run ended before the limits ran out, with no answer yet
    answered_ok: bool
    serving_ok: bool


@dataclass(frozen=True, slots=True)
class DeploymentOutcome:
    """Per-deployment figures of ``summary.json``."""

    unserved_s: float
    served: int
    rejected: dict[str, int]
    shifts: int  # transitions after the starting plan
    rolled_back: int
    flaps_10min: int  # shifts straight back to the previous plan within the flap window
    sequences: SequenceFacts


@dataclass(frozen=True, slots=True)
class Summary:
    """The verdict of a run and the figures behind it."""

    checks: tuple[Check, ...]
    events: tuple[EventOutcome, ...]
    deployments: dict[str, DeploymentOutcome]
    decisions: int
    duplicate_decisions: int  # extra copies of ids seen more than once
    failed_ticks: int | None
    failed_ticks_source: str
    unfinished_transitions: tuple[str, ...]  # "deployment #seq phase"
    outages: tuple[Outage, ...]
    limits: Limits

    @property
    def invariants_ok(self) -> bool:
        """True when every invariant held."""
        return all(c.ok for c in self.checks)

    def broken(self) -> list[Check]:
        """The invariants that did not hold."""
        return [c for c in self.checks if not c.ok]

    def broken_line(self) -> str:
        """One line naming every broken invariant and why ('' when all held)."""
        broken = self.broken()
        if not broken:
            return ""
        word = "invariant" if len(broken) == 1 else "invariants"
        return f"{word} broken: " + "; ".join(f"{c.invariant}: {c.detail}" for c in broken)

    def lines(self) -> list[str]:
        """The report's first lines: which invariants held."""
        held = sum(c.ok for c in self.checks)
        verdict = "all held" if self.invariants_ok else f"{len(self.checks) - held} BROKEN"
        head = f"== invariants: {held} of {len(self.checks)} held ({verdict})"
        return [head] + [
            f"{'held  ' if c.ok else 'BROKEN'}  {c.invariant:<28} {c.detail}" for c in self.checks
        ]

    def to_dict(self) -> dict[str, Any]:
        """``summary.json``'s content."""
        return {
            "invariants_ok": self.invariants_ok,
            "broken": [str(c.invariant) for c in self.broken()],
            "invariants": {str(c.invariant): {"ok": c.ok, "detail": c.detail} for c in self.checks},
            "limits": asdict(self.limits),
            "run": {
                "invariants_ok": self.invariants_ok,
                "failed_ticks": self.failed_ticks,
                "failed_ticks_source": self.failed_ticks_source,
                "decisions": self.decisions,
                "duplicate_decisions": self.duplicate_decisions,
                "unfinished_transitions": list(self.unfinished_transitions),
                "outages": [asdict(o) for o in self.outages],
            },
            "events": [_rounded(asdict(e)) for e in self.events],
            "deployments": {d: _rounded(asdict(o)) for d, o in self.deployments.items()},
        }


def _rounded(data: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 1) if isinstance(v, float) else v for k, v in data.items()}
