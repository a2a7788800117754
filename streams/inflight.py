"""One decision in flight per deployment: the marker the decision step keeps, and its rules.

A switch decision is *in flight* from the moment the step emits it until the transitions topic
reports its transition terminal — phase DONE or ROLLED_BACK (a FAILED phase status is not
terminal: the runtime retries the phase, then rolls back or, past the swap, forces cleanup) —
or until ``streams.transition_timeout_s`` of event time passed. The runtime numbers a transition
after its decision (``transition_seq`` is the decision's ``seq``) and carries decisions out in
sequence order, so a record of a later sequence also means it is done with this one (finished,
superseded while queued, or ignored because its target already served).

Pure: no I/O; times are event-time inputs.
"""

from __future__ import annotations

from dataclasses import replace

from flexpipe.schemas import GearDecision, InFlight
from gearbox.decisions import DecideResult, DecisionReason
from gearbox.history import GearState

__all__ = ["InFlight", "guard", "logged_marker", "unsettled"]


def unsettled(
    marker: InFlight | None, *, transition_seq: int, settled_seq: int, serving_plan_id: str | None
) -> InFlight | None:
    """``marker`` while the runtime may still carry it out, else None: its transition reached
    DONE or ROLLED_BACK (``settled_seq``), a later transition started (``transition_seq``), or
    its target serves already (the runtime ignores a decision whose target serves)."""
    if marker is None or settled_seq >= marker.seq or transition_seq > marker.seq:
        return None
    return None if serving_plan_id == marker.to_plan_id else marker


def guard(
    result: DecideResult,
    gear: GearState,
    marker: InFlight | None,
    serving_plan_id: str | None,
    timeout_s: float,
) -> DecideResult:
    """Turn gearbox's switch into a hold when the runtime must not get it now.

    ``gear`` is the state gearbox was given: a held switch leaves the last-switch bookkeeping
    (cooldown, reverse detection) as it was, and keeps this tick's block history.

    NOTE: the rule while a transition is in flight. A voluntary switch waits
    (``TRANSITION_IN_FLIGHT``) until the runtime reports the transition DONE or ROLLED_BACK, or
    ``timeout_s`` passed. A forced one — the plan the loop assumes (the in-flight target) lost
    GPUs or memory, or an operator override — does not wait: every infeasibility is answered by
    a forced decision at once (the main job allows 40 simulated s), and the runtime queues it
    behind the running transition (which fails on the lost GPUs and rolls back), the newest
    queued decision superseding older ones; it becomes the decision in flight. No decision,
    forced or not, targets the plan that serves (``ALREADY_SERVING``: when the in-flight target
    is lost, the runtime's rollback restores that plan by itself) or the target already in
    flight (``TRANSITION_IN_FLIGHT``).
    """
    d = result.decision
    if d is None:
        return result
    if marker is not None and d.to_plan_id == marker.to_plan_id:
        why = f"{d.to_plan_id} is the target of {marker.decision_id}, already in flight"
        return _hold(result, gear, DecisionReason.TRANSITION_IN_FLIGHT, why)
    if d.to_plan_id == serving_plan_id:
        why = f"{d.to_plan_id} is the plan the runtime serves"
        if marker is not None:
            why += f" (and serves on if {marker.describe()}, in flight, rolls back)"
        return _hold(result, gear, DecisionReason.ALREADY_SERVING, why)
    if marker is not None and not d.forced:
        deadline_s = marker.deadline_ms(timeout_s) / 1000.0
        why = (
            f"{marker.describe()} is in flight since t={marker.since_ms / 1000.0:.1f} s; the "
            f"next switch waits until the runtime reports it done or rolled back, or until "
            f"t={deadline_s:.1f} s"
        )
        return _hold(result, gear, DecisionReason.TRANSITION_IN_FLIGHT, why, deadline_s)
    return result


def _hold(
    result: DecideResult,
    gear: GearState,
    reason: DecisionReason,
    why: str,
    retry_after_s: float | None = None,
) -> DecideResult:
    state = replace(
        result.state,
        last_switch_s=gear.last_switch_s,
        last_from_plan_id=gear.last_from_plan_id,
        last_to_plan_id=gear.last_to_plan_id,
    )
    name = result.decision.deployment if result.decision is not None else ""
    explanation = (
        f"{name}: {reason.value} (trigger {result.trigger.value}). {why}. "
        f"Held: {result.explanation}"
    )
    return replace(
        result,
        decision=None,
        reason=reason,
        explanation=explanation,
        state=state,
        retry_after_s=retry_after_s,
    )


def logged_marker(payload: GearDecision, trigger_time_ms: int) -> InFlight | None:
    """The decision in flight a logged decision left: itself when it is a switch, else the
    marker its context recorded."""
    if payload.to_plan_id is not None:
        taken = payload.decision.taken_gpus if payload.decision is not None else ()
        return InFlight(
            payload.decision_id, payload.seq, payload.to_plan_id, trigger_time_ms, taken
        )
    return payload.context.in_flight
