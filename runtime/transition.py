"""The transition state machine: three phases, retries, fencing, and resume-or-rollback.

Pure: ``handle(state, event, policy) -> (state, effects)``. Effects name what the executor and the
log writer must do; nothing here touches an engine, a clock or Kafka. A phase's STARTED record is
persisted (acknowledged through a :class:`Persisted` event) before the phase runs, and its
COMPLETED record before the next phase starts, so the transitions log is always at least as far
along as the world.

* Fencing: a decision whose sequence is not newer than the last one accepted is ignored; a newer
  one arriving mid-transition waits, superseding any older waiting one.
* Retries: a failed or timed-out phase is compensated (:class:`AbortPhase`), retried after a
  back-off, up to ``max_retries`` times; then prepare/switch roll back (old plan keeps serving)
  and cleanup — past the atomic swap, so rolling back would be another switch — is forced.
* Start-up: :func:`adopt` loads a deployment's configured starting plan as transition 0 (decisions
  start at sequence 1, so fencing is unchanged), through the same three persisted phases.
* Recovery: :func:`recover` folds a transitions log (the last record per sequence) into the
  serving plan and resumes the in-flight transition: before the swap committed it rolls back,
  after it resumes cleanup.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from enum import StrEnum

from flexpipe.schemas import GearTransition, PhaseStatus, TransitionPhase
from gearbox.plans import DeploymentPlan

P, S, C = TransitionPhase.PREPARE, TransitionPhase.SWITCH, TransitionPhase.CLEANUP
DONE, ROLLED_BACK = TransitionPhase.DONE, TransitionPhase.ROLLED_BACK
STARTED, COMPLETED, FAILED = PhaseStatus.STARTED, PhaseStatus.COMPLETED, PhaseStatus.FAILED
_NEXT = {P: S, S: C, C: DONE}
START_SEQ = 0  # the starting plan's transition: below every decision's sequence (from 1)


class Outcome(StrEnum):
    """What became of a decision."""

    STARTED = "started"
    QUEUED = "queued"  # waits for the running transition
    SUPERSEDED = "superseded"  # a newer decision replaced it before it started
    IGNORED_STALE = "ignored_stale"  # sequence not newer than the last accepted (fencing)
    IGNORED_NO_CHANGE = "ignored_no_change"  # its target already serves
    REJECTED_INVALID = "rejected_invalid"  # unreadable, another deployment's, or unknown model
    DONE = "done"
    ROLLED_BACK = "rolled_back"


class Wait(StrEnum):
    """What the active transition waits for."""

    PERSIST_START = "persist_start"  # the phase's STARTED record
    RUNNING = "running"  # the executor's result
    PERSIST_END = "persist_end"  # the phase's COMPLETED/FAILED or the terminal record
    BACKOFF = "backoff"  # the pause before a retry


@dataclass(frozen=True, slots=True)
class TransitionPolicy:
    """Timeouts and retries, in the caller's clock (simulated or wall seconds)."""

    prepare_timeout_s: float = 120.0
    switch_timeout_s: float = 120.0
    cleanup_timeout_s: float = 120.0
    max_retries: int = 2  # retries after the first attempt (the article: twice)
    retry_backoff_s: float = 1.0

    def timeout_s(self, phase: TransitionPhase) -> float:
        """The phase's time limit."""
        return {P: self.prepare_timeout_s, S: self.switch_timeout_s}.get(
            phase, self.cleanup_timeout_s
        )


@dataclass(frozen=True, slots=True)
class DecisionIn:
    """A gear decision to carry out (already parsed from the decisions topic)."""

    seq: int  # the decision's sequence number becomes the transition's
    decision_id: str
    to_plan: DeploymentPlan
    now_s: float
    ref: int | None = None  # opaque token the worker uses to commit the consumer offset


@dataclass(frozen=True, slots=True)
class Persisted:
    """The log acknowledged a record."""

    record: GearTransition
    now_s: float


@dataclass(frozen=True, slots=True)
class PhaseDone:
    """The executor finished a phase attempt."""

    seq: int
    phase: TransitionPhase
    attempt: int
    now_s: float
    detail: str = ""


@dataclass(frozen=True, slots=True)
class PhaseFailed:
    """The executor gave up on a phase attempt."""

    seq: int
    phase: TransitionPhase
    attempt: int
    now_s: float
    detail: str


@dataclass(frozen=True, slots=True)
class Tick:
    """Time passed: timeouts and back-offs are checked."""

    now_s: float


Event = DecisionIn | Persisted | PhaseDone | PhaseFailed | Tick


@dataclass(frozen=True, slots=True)
class Persist:
    """Write this record to the transitions log, then report :class:`Persisted`."""

    record: GearTransition


@dataclass(frozen=True, slots=True)
class RunPhase:
    """Start the phase's work; report :class:`PhaseDone` or :class:`PhaseFailed`."""

    seq: int
    phase: TransitionPhase
    attempt: int
    from_plan: DeploymentPlan | None
    to_plan: DeploymentPlan
    force: bool = False  # cleanup after its retries ran out: finish by force, never fail


@dataclass(frozen=True, slots=True)
class AbortPhase:
    """Undo a failed attempt's partial work so the phase can be retried from its start."""

    seq: int
    phase: TransitionPhase
    attempt: int


@dataclass(frozen=True, slots=True)
class RollBack:
    """Undo the transition (switch, then prepare): the old plan keeps serving."""

    seq: int
    from_plan: DeploymentPlan | None
    to_plan: DeploymentPlan
    phase: TransitionPhase  # where it stopped


@dataclass(frozen=True, slots=True)
class Resolved:
    """A decision reached its outcome (offsets may be committed, metrics counted)."""

    ref: int | None
    seq: int
    outcome: Outcome


Effect = Persist | RunPhase | AbortPhase | RollBack | Resolved


@dataclass(frozen=True, slots=True)
class Active:
    """The transition in flight."""

    seq: int
    decision_id: str
    ref: int | None
    from_plan: DeploymentPlan | None
    to_plan: DeploymentPlan
    phase: TransitionPhase
    attempt: int
    wait: Wait
    phase_started_s: float
    started_s: float  # the transition's start, for the terminal record's duration
    deadline_s: float = float("inf")
    retry_at_s: float = 0.0
    force: bool = False


@dataclass(frozen=True, slots=True)
class MachineState:
    """One deployment's transition state."""

    deployment: str
    last_seq: int = 0  # fencing: highest sequence accepted
    serving: DeploymentPlan | None = None  # the plan in the route table
    active: Active | None = None
    pending: DecisionIn | None = None

    @property
    def serving_plan_id(self) -> str | None:
        """Id of the serving plan."""
        return self.serving.plan_id if self.serving is not None else None


Result = tuple[MachineState, tuple[Effect, ...]]


def _record(
    state: MachineState,
    a: Active,
    phase: TransitionPhase,
    status: PhaseStatus,
    *,
    now_s: float,
    detail: str = "",
    since_s: float | None = None,
) -> GearTransition:
    return GearTransition(
        deployment=state.deployment,
        transition_seq=a.seq,
        decision_id=a.decision_id,
        phase=phase,
        status=status,
        from_plan_id=a.from_plan.plan_id if a.from_plan is not None else None,
        to_plan_id=a.to_plan.plan_id,
        attempt=a.attempt,
        duration_ms=None if since_s is None else round((now_s - since_s) * 1000.0, 3),
        detail=detail,
        plan=a.to_plan,
    )


def handle(state: MachineState, event: Event, policy: TransitionPolicy) -> Result:
    """Advance the machine by one event."""
    if isinstance(event, DecisionIn):
        return _on_decision(state, event)
    if isinstance(event, Persisted):
        return _on_persisted(state, event, policy)
    if isinstance(event, PhaseDone | PhaseFailed):
        return _on_result(state, event)
    return _on_tick(state, event, policy)


def _start(state: MachineState, d: DecisionIn) -> Result:
    if d.to_plan.plan_id == state.serving_plan_id:
        return replace(state, last_seq=d.seq), (Resolved(d.ref, d.seq, Outcome.IGNORED_NO_CHANGE),)
    a = Active(
        d.seq,
        d.decision_id,
        d.ref,
        state.serving,
        d.to_plan,
        P,
        1,
        Wait.PERSIST_START,
        d.now_s,
        d.now_s,
    )
    state = replace(state, last_seq=d.seq, active=a)
    record = _record(state, a, P, STARTED, now_s=d.now_s, detail="decision accepted")
    return state, (Resolved(d.ref, d.seq, Outcome.STARTED), Persist(record))


def adopt(state: MachineState, plan: DeploymentPlan, decision_id: str, now_s: float) -> Result:
    """Start-up: carry out the configured starting plan as transition :data:`START_SEQ`.

    Only for a deployment with nothing serving, nothing in flight and no decision accepted yet
    (a fresh log, or a start-up whose adoption rolled back); otherwise a no-op. NOTE: a normal,
    persisted transition rather than a silent load, so the transitions log — which the stream
    folds into its current plan — says what serves from the first second on.
    """
    if state.last_seq > START_SEQ or state.serving is not None or state.active is not None:
        return state, ()
    return _start(state, DecisionIn(START_SEQ, decision_id, plan, now_s))


def _on_decision(state: MachineState, d: DecisionIn) -> Result:
    newest = max(state.last_seq, state.pending.seq if state.pending else 0)
    if d.seq <= newest:
        return state, (Resolved(d.ref, d.seq, Outcome.IGNORED_STALE),)
    if state.active is None:
        return _start(state, d)
    effects: list[Effect] = [Resolved(d.ref, d.seq, Outcome.QUEUED)]
    if state.pending is not None:
        effects.append(Resolved(state.pending.ref, state.pending.seq, Outcome.SUPERSEDED))
    return replace(state, pending=d), tuple(effects)


def _matches(a: Active | None, record: GearTransition) -> bool:
    expected = Wait.PERSIST_START if record.status is STARTED else Wait.PERSIST_END
    return (
        a is not None
        and a.wait is expected
        and record.transition_seq == a.seq
        and record.phase == a.phase
        and record.attempt == a.attempt
    )


def _on_persisted(state: MachineState, ev: Persisted, policy: TransitionPolicy) -> Result:
    a, rec = state.active, ev.record
    if a is None or not _matches(a, rec):
        return state, ()
    if rec.phase in (DONE, ROLLED_BACK):
        outcome = Outcome.DONE if rec.phase is DONE else Outcome.ROLLED_BACK
        done = replace(state, active=None, pending=None)
        effects: tuple[Effect, ...] = (Resolved(a.ref, a.seq, outcome),)
        if state.pending is not None:
            done, more = _start(done, replace(state.pending, now_s=ev.now_s))
            effects += more
        return done, effects
    if rec.status is STARTED:
        deadline = ev.now_s + policy.timeout_s(a.phase)
        running = replace(a, wait=Wait.RUNNING, phase_started_s=ev.now_s, deadline_s=deadline)
        run = RunPhase(a.seq, a.phase, a.attempt, a.from_plan, a.to_plan, a.force)
        return replace(state, active=running), (run,)
    if rec.status is COMPLETED:
        return _next_phase(state, a, ev.now_s)
    return _after_failure(state, a, ev.now_s, policy)


def _next_phase(state: MachineState, a: Active, now_s: float) -> Result:
    nxt = _NEXT[a.phase]
    if a.phase is S:  # the route table now points at the new plan
        state = replace(state, serving=a.to_plan)
    moved = replace(
        a, phase=nxt, attempt=1, wait=Wait.PERSIST_START, phase_started_s=now_s, force=False
    )
    state = replace(state, active=moved)
    if nxt is DONE:
        moved = replace(moved, wait=Wait.PERSIST_END)
        state = replace(state, active=moved)
        record = _record(state, moved, DONE, COMPLETED, now_s=now_s, since_s=a.started_s)
        return state, (Persist(record),)
    return state, (Persist(_record(state, moved, nxt, STARTED, now_s=now_s)),)


def _after_failure(
    state: MachineState, a: Active, now_s: float, policy: TransitionPolicy
) -> Result:
    if a.attempt <= policy.max_retries:
        waiting = replace(a, wait=Wait.BACKOFF, retry_at_s=now_s + policy.retry_backoff_s)
        return replace(state, active=waiting), ()
    if a.phase is C:  # past the swap there is nothing to roll back to: finish by force
        forced = replace(a, attempt=a.attempt + 1, wait=Wait.PERSIST_START, force=True)
        record = _record(state, forced, C, STARTED, now_s=now_s, detail="retries exhausted: forced")
        return replace(state, active=forced), (Persist(record),)
    return _roll_back(state, a, now_s, f"{a.phase} failed {a.attempt} times")


def _roll_back(state: MachineState, a: Active, now_s: float, detail: str) -> Result:
    ending = replace(a, phase=ROLLED_BACK, wait=Wait.PERSIST_END)
    record = _record(
        state, ending, ROLLED_BACK, COMPLETED, now_s=now_s, detail=detail, since_s=a.started_s
    )
    rollback = RollBack(a.seq, a.from_plan, a.to_plan, a.phase)
    return replace(state, active=ending, serving=a.from_plan), (rollback, Persist(record))


def _on_result(state: MachineState, ev: PhaseDone | PhaseFailed) -> Result:
    a = state.active
    if (
        a is None
        or a.wait is not Wait.RUNNING
        or (ev.seq, ev.phase, ev.attempt)
        != (
            a.seq,
            a.phase,
            a.attempt,
        )
    ):
        return state, ()
    ending = replace(a, wait=Wait.PERSIST_END)
    state = replace(state, active=ending)
    if isinstance(ev, PhaseDone):
        record = _record(
            state,
            a,
            a.phase,
            COMPLETED,
            now_s=ev.now_s,
            detail=ev.detail,
            since_s=a.phase_started_s,
        )
        return state, (Persist(record),)
    record = _record(
        state, a, a.phase, FAILED, now_s=ev.now_s, detail=ev.detail, since_s=a.phase_started_s
    )
    return state, (AbortPhase(a.seq, a.phase, a.attempt), Persist(record))


def _on_tick(state: MachineState, ev: Tick, policy: TransitionPolicy) -> Result:
    a = state.active
    if a is None:
        return state, ()
    if a.wait is Wait.RUNNING and ev.now_s > a.deadline_s and not a.force:
        limit = policy.timeout_s(a.phase)
        return _on_result(
            state, PhaseFailed(a.seq, a.phase, a.attempt, ev.now_s, f"timed out after {limit:g} s")
        )
    if a.wait is Wait.BACKOFF and ev.now_s >= a.retry_at_s:
        retry = replace(a, attempt=a.attempt + 1, wait=Wait.PERSIST_START)
        record = _record(
            state,
            retry,
            a.phase,
            STARTED,
            now_s=ev.now_s,
            detail=f"retry {a.attempt} of {policy.max_retries}",
        )
        return replace(state, active=retry), (Persist(record),)
    return state, ()


# ---- recovery ------------------------------------------------------------------------------------


def last_per_seq(records: Iterable[GearTransition]) -> dict[int, GearTransition]:
    """The latest record of each transition (what log compaction keeps), by sequence."""
    out: dict[int, GearTransition] = {}
    for rec in records:
        out[rec.transition_seq] = rec
    return dict(sorted(out.items()))


def recover(deployment: str, records: Iterable[GearTransition], now_s: float) -> Result:
    """Rebuild the machine from a transitions log and resume or roll back what was in flight.

    Records of other deployments are skipped. A transition stopped before its switch committed
    rolls back; one whose switch committed resumes cleanup (a new attempt).
    """
    last = last_per_seq(r for r in records if r.deployment == deployment)
    serving: DeploymentPlan | None = None
    state = MachineState(deployment)
    for seq, rec in last.items():
        plan = rec.plan
        if plan is None:
            raise ValueError(f"{deployment} #{seq}: a transition record without its plan")
        state = replace(state, last_seq=seq)
        if rec.phase is DONE:
            serving = plan
            continue
        if rec.phase is ROLLED_BACK:
            continue
        a = Active(
            seq,
            rec.decision_id,
            None,
            serving,
            plan,
            rec.phase,
            rec.attempt,
            Wait.PERSIST_END,
            now_s,
            now_s,
        )
        committed = rec.phase is C or (rec.phase is S and rec.status is COMPLETED)
        if not committed:
            state = replace(state, serving=serving)
            return _roll_back(state, a, now_s, f"recovered after restart in {rec.phase}")
        state = replace(state, serving=plan)
        if rec.phase is C and rec.status is COMPLETED:  # only the DONE record was missing
            return _next_phase(replace(state, active=a), a, now_s)
        resumed = replace(
            a, phase=C, attempt=rec.attempt + 1 if rec.phase is C else 1, wait=Wait.PERSIST_START
        )
        state = replace(state, active=resumed)
        record = _record(state, resumed, C, STARTED, now_s=now_s, detail="resumed after restart")
        return state, (Persist(record),)
    return replace(state, serving=serving), ()
