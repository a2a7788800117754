"""Consistency check of a transitions log: phase order, retries, restarts, terminal states.

Used by tests and by anyone auditing a deployment's log (e.g. after a crash): each sequence's
records must follow the machine's rules in :mod:`runtime.transition` and end in DONE or
ROLLED_BACK.
"""

from __future__ import annotations

from collections.abc import Iterable

from flexpipe.schemas import GearTransition, PhaseStatus, TransitionPhase

P, S, C = TransitionPhase.PREPARE, TransitionPhase.SWITCH, TransitionPhase.CLEANUP
DONE, ROLLED_BACK = TransitionPhase.DONE, TransitionPhase.ROLLED_BACK
STARTED, COMPLETED, FAILED = PhaseStatus.STARTED, PhaseStatus.COMPLETED, PhaseStatus.FAILED
_NEXT = {P: S, S: C, C: DONE}

_State = tuple[TransitionPhase, PhaseStatus]


def _allowed(prev: GearTransition | None, rec: GearTransition) -> bool:
    if prev is None:
        return (rec.phase, rec.status, rec.attempt) == (P, STARTED, 1)
    here: _State = (prev.phase, prev.status)
    if prev.phase in (DONE, ROLLED_BACK):
        return False
    if rec.phase is ROLLED_BACK:
        return prev.phase in (P, S) and here != (S, COMPLETED)
    same = rec.phase == prev.phase
    if here[1] is STARTED:  # the attempt ends, or (cleanup only) a restart resumes it
        ends = same and rec.attempt == prev.attempt and rec.status in (COMPLETED, FAILED)
        resumed = prev.phase is C and same and rec.status is STARTED
        return ends or (resumed and rec.attempt == prev.attempt + 1)
    if here[1] is FAILED:
        return same and rec.status is STARTED and rec.attempt == prev.attempt + 1
    nxt = _NEXT[prev.phase]
    if nxt is DONE:
        return rec.phase is DONE
    return rec.phase is nxt and rec.status is STARTED and rec.attempt == 1


def validate_log(records: Iterable[GearTransition], *, require_terminal: bool = True) -> list[str]:
    """Problems with a transitions log of one deployment, in per-sequence record order.

    Each sequence's records must follow the phase order (retries and restarts included) and end
    in DONE or ROLLED_BACK; with ``require_terminal`` False the newest sequence may be in flight.
    """
    by_seq: dict[int, list[GearTransition]] = {}
    for rec in records:
        by_seq.setdefault(rec.transition_seq, []).append(rec)
    problems = []
    newest = max(by_seq, default=0)
    for seq, recs in sorted(by_seq.items()):
        prev: GearTransition | None = None
        for rec in recs:
            if not _allowed(prev, rec):
                was = f"{prev.phase}/{prev.status}#{prev.attempt}" if prev else "nothing"
                problems.append(
                    f"seq {seq}: {rec.phase}/{rec.status}#{rec.attempt} may not follow {was}"
                )
            prev = rec
        terminal = prev is not None and prev.phase in (DONE, ROLLED_BACK)
        if not terminal and (require_terminal or seq != newest):
            problems.append(f"seq {seq}: ends in {prev.phase if prev else None}, not terminal")
    return problems
