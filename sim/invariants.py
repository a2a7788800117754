"""What `flexpipe up` checks about its own run: invariants over what the run recorded.

Pure: :func:`evaluate` takes :class:`RunFacts` — the decisions and transitions read back from the
run's topics, the cluster events, the planned outages (chaos), the stream worker's failed-tick
count and the runtime's sequence accounting — and returns a :class:`Summary` with one
:class:`Check` per :class:`Invariant` and the figures behind each. ``up`` writes it to
``summary.json`` and exits non-zero naming what broke. Times are simulated seconds since the
scenario's epoch; no clock is read here.

An event *makes a serving plan infeasible* when it takes GPUs away (a preemption, a node down, an
isolation, a fatal XID) and the plan a deployment served at that moment — its last finished
transition — uses one of them. It is *answered* by the first forced decision for that deployment
(or a ``no_feasible_plan`` decision) that the run read after the event, and the deployment *serves
again* once a transition to a plan clear of the lost GPUs is done — required unless the stream
never found a plan for it afterwards (not enough GPUs: the summary says so). Both delays count
from the event, or from the end of a planned outage (worker killed, broker stopped) that began
before the answer and ended after the event: measured from recovery.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

from flexpipe.schemas import FATAL_XIDS, GearTransition, TransitionPhase
from sim.summary import (
    Check,
    DecisionFact,
    DeploymentFacts,
    DeploymentOutcome,
    EventFact,
    EventOutcome,
    Invariant,
    Limits,
    Outage,
    RunFacts,
    Summary,
)

__all__ = ["DEFAULT_LIMITS", "count_flaps", "evaluate", "measured_from", "unserved_s"]

LOSS_TYPES = frozenset({"preempt", "node_down", "gpu_isolated"})  # plus fatal XIDs
TERMINAL = frozenset({TransitionPhase.DONE, TransitionPhase.ROLLED_BACK})
NO_FEASIBLE_PLAN = "no_feasible_plan"
DEFAULT_LIMITS = Limits()


# ---- evaluation ---------------------------------------------------------------------------------


def evaluate(facts: RunFacts, limits: Limits = DEFAULT_LIMITS) -> Summary:
    """Judge a run: one :class:`Check` per invariant, with the figures behind each."""
    done = _done_plans(facts.transitions)
    events = tuple(
        _event_outcome(facts, limits, done, ev, dep, plan)
        for ev in facts.events
        for dep, plan in _hit(ev, done, facts.gpu_nodes)
    )
    ids = Counter(d.decision_id for d in facts.decisions)
    duplicates = {i: n for i, n in ids.items() if n > 1}
    targets = _targets_serving(facts.decisions, done)
    unfinished = _unfinished(facts.transitions, facts.active_at_exit)
    deployments = {d.name: _deployment(d, facts.transitions, limits) for d in facts.deployments}
    checks = (
        _check_answered(events, limits),
        _check_serving(events, limits),
        _check_unique(len(facts.decisions), duplicates),
        _check_targets(targets),
        _check_ticks(facts.failed_ticks, facts.failed_ticks_source),
        _check_unfinished(unfinished, facts.transitions),
        _check_sequences(deployments),
        _check_dead_letters(facts.dead_letters),
    )
    return Summary(
        checks=checks,
        events=events,
        deployments=deployments,
        decisions=len(facts.decisions),
        duplicate_decisions=sum(n - 1 for n in duplicates.values()),
        failed_ticks=facts.failed_ticks,
        failed_ticks_source=facts.failed_ticks_source,
        unfinished_transitions=unfinished,
        outages=facts.outages,
        limits=limits,
    )


@dataclass(frozen=True, slots=True)
class _Done:
    t_s: float
    plan_id: str
    gpus: frozenset[str]
    decision_id: str  # the decision the transition carried out


def _done_plans(transitions: Iterable[tuple[float, GearTransition]]) -> dict[str, list[_Done]]:
    """Per deployment, every finished transition's plan, in time order."""
    out: dict[str, list[_Done]] = defaultdict(list)
    for t_s, rec in transitions:
        if rec.phase is TransitionPhase.DONE and rec.plan is not None and rec.to_plan_id:
            gpus = rec.plan.gpu_uuids
            out[rec.deployment].append(_Done(t_s, rec.to_plan_id, gpus, rec.decision_id))
    for items in out.values():
        items.sort(key=lambda d: d.t_s)
    return out


def _serving_at(done: Sequence[_Done], t_s: float) -> _Done | None:
    before = [d for d in done if d.t_s <= t_s]
    return before[-1] if before else None


def _lost_gpus(ev: EventFact, gpu_nodes: Mapping[str, str]) -> frozenset[str]:
    fatal_xid = ev.type == "xid" and ev.xid in FATAL_XIDS
    if ev.type not in LOSS_TYPES and not fatal_xid:
        return frozenset()
    if ev.type == "node_down" and not ev.gpu_uuids:
        return frozenset(u for u, node in gpu_nodes.items() if node == ev.node)
    return frozenset(ev.gpu_uuids)


def _hit(
    ev: EventFact, done: Mapping[str, list[_Done]], gpu_nodes: Mapping[str, str]
) -> list[tuple[str, _Done]]:
    """The deployments whose serving plan the event made infeasible, with that plan."""
    lost = _lost_gpus(ev, gpu_nodes)
    out = []
    for dep, items in sorted(done.items()):
        serving = _serving_at(items, ev.t_s)
        if lost and serving is not None and serving.gpus & lost:
            out.append((dep, serving))
    return out


def measured_from(event_s: float, outages: Sequence[Outage], until_s: float | None) -> float:
    """When a delay starts: the event, or the end of a planned outage that ended after it and
    before ``until_s`` (what is being timed; None when it never happened)."""
    t0 = event_s
    for o in sorted(outages, key=lambda o: o.start_s):
        began_before = until_s is None or o.start_s < until_s
        over_by = until_s is None or o.end_s <= until_s
        if began_before and over_by and o.end_s > t0:
            t0 = o.end_s
    return t0


def _event_outcome(
    facts: RunFacts,
    limits: Limits,
    done: Mapping[str, list[_Done]],
    ev: EventFact,
    dep: str,
    plan: _Done,
) -> EventOutcome:
    lost = _lost_gpus(ev, facts.gpu_nodes)
    after = sorted(
        (d for d in facts.decisions if d.deployment == dep and d.seen_s >= ev.t_s),
        key=lambda d: d.seen_s,
    )
    again = next((d for d in done.get(dep, []) if d.t_s > ev.t_s and not d.gpus & lost), None)
    answer, enough, moving = _answer(after, again)
    answered_s = answer.seen_s if answer else None
    t0_answer = measured_from(ev.t_s, facts.outages, answered_s)
    t0_serving = measured_from(ev.t_s, facts.outages, again.t_s if again else None)
    answered_after = answered_s - t0_answer if answered_s is not None else None
    serving_after = again.t_s - t0_serving if again else None
    # NOTE: a run that ended before a limit ran out cannot say the limit was missed.
    cut_answer = answer is None and t0_answer + limits.answer_within_s > facts.end_s
    cut_serving = again is None and t0_serving + limits.serve_within_s > facts.end_s
    answered_ok = (
        moving
        or cut_answer
        or (answered_after is not None and answered_after <= limits.answer_within_s)
    )
    serving_ok = (
        not enough
        or cut_serving
        or (serving_after is not None and serving_after <= limits.serve_within_s)
    )
    return EventOutcome(
        t_s=ev.t_s,
        label=ev.label,
        deployment=dep,
        plan_id=plan.plan_id,
        lost_gpus=len(plan.gpus & lost),
        measured_from_s=t0_answer,
        answered_after_s=answered_after,
        answer_reason=answer.reason if answer else ("shift_under_way" if moving else None),
        decision_id=answer.decision_id if answer else None,
        enough_gpus=enough,
        serving_again_after_s=serving_after,
        serving_plan_id=again.plan_id if again else None,
        judged=not (cut_answer or (enough and cut_serving)),
        answered_ok=answered_ok,
        serving_ok=serving_ok,
    )


def _answer(
    after: Sequence[DecisionFact], again: _Done | None
) -> tuple[DecisionFact | None, bool, bool]:
    """The decision that answered an event, whether enough GPUs existed, and whether a shift
    decided before the event took the deployment clear of the lost GPUs (no answer needed).

    NOTE: the answer is the first forced decision with a plan. A ``no_feasible_plan`` answers
    only when the stream never found a plan afterwards (not enough GPUs): one on a stale view
    (after an outage) followed by a forced plan is no answer.
    """
    forced = next((d for d in after if d.forced and d.to_plan_id is not None), None)
    none_fits = next((d for d in after if d.reason == NO_FEASIBLE_PLAN), None)
    enough = forced is not None or again is not None or none_fits is None
    moving = again is not None and again.decision_id not in {d.decision_id for d in after}
    return (forced if enough else none_fits), enough, moving


def _targets_serving(
    decisions: Sequence[DecisionFact], done: Mapping[str, list[_Done]]
) -> list[tuple[DecisionFact, float | None]]:
    """Decisions whose target is the plan serving at their trigger's time (when it began)."""
    out: list[tuple[DecisionFact, float | None]] = []
    for d in decisions:
        if d.to_plan_id is None:
            continue
        serving = _serving_at(done.get(d.deployment, []), d.t_s)
        if serving is not None and serving.plan_id == d.to_plan_id:
            out.append((d, serving.t_s))
        elif d.from_plan_id == d.to_plan_id:
            out.append((d, None))
    return out


def _unfinished(
    transitions: Sequence[tuple[float, GearTransition]], active_at_exit: Sequence[str]
) -> tuple[str, ...]:
    last: dict[tuple[str, int], GearTransition] = {}
    for _, rec in transitions:
        last[(rec.deployment, rec.transition_seq)] = rec
    still = [(d, s, r) for (d, s), r in sorted(last.items()) if r.phase not in TERMINAL]
    busy = {d for d, _, _ in still}
    return tuple(
        [f"{d} #{s} {r.phase} {r.status}" for d, s, r in still]
        + [f"{d} (a transition not yet persisted)" for d in active_at_exit if d not in busy]
    )


def _deployment(
    d: DeploymentFacts, transitions: Sequence[tuple[float, GearTransition]], limits: Limits
) -> DeploymentOutcome:
    last: dict[int, tuple[float, GearTransition]] = {}
    for t_s, rec in transitions:
        if rec.deployment == d.name:
            last[rec.transition_seq] = (t_s, rec)
    shifts = [last[s] for s in sorted(last) if s > 0]
    finished = [
        (t, r.from_plan_id, r.to_plan_id) for t, r in shifts if r.phase is TransitionPhase.DONE
    ]
    return DeploymentOutcome(
        unserved_s=d.unserved_s,
        served=d.served,
        rejected=dict(sorted(d.rejected.items())),
        shifts=len(shifts),
        rolled_back=sum(r.phase is TransitionPhase.ROLLED_BACK for _, r in shifts),
        flaps_10min=count_flaps(finished, limits.flap_window_s),
        sequences=d.sequences,
    )


def count_flaps(
    shifts: Sequence[tuple[float, str | None, str | None]], window_s: float = 600.0
) -> int:
    """Finished shifts (time, from plan, to plan) that went straight back to the plan the
    previous one left, within ``window_s`` of it."""
    flaps = 0
    for (t0, from0, _), (t1, _, to1) in pairwise(shifts):
        if from0 is not None and to1 == from0 and t1 - t0 <= window_s:
            flaps += 1
    return flaps


def unserved_s(samples: Sequence[tuple[float, bool]], start_s: float, end_s: float) -> float:
    """Simulated seconds in [start, end) the samples (time, serving) say nothing served; each
    sample holds until the next."""
    total = 0.0
    ordered = sorted(samples)
    for i, (t_s, serving) in enumerate(ordered):
        nxt = ordered[i + 1][0] if i + 1 < len(ordered) else end_s
        lo, hi = max(t_s, start_s), min(nxt, end_s)
        if not serving and hi > lo:
            total += hi - lo
    return total


# ---- the checks -------------------------------------------------------------------------------


def _at(t_s: float) -> str:
    t = int(t_s)
    return f"{t // 3600:02d}:{t // 60 % 60:02d}:{t % 60:02d}"


def _s(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f} s"


def _check_answered(events: Sequence[EventOutcome], limits: Limits) -> Check:
    name, limit = Invariant.INFEASIBLE_ANSWERED, limits.answer_within_s
    bad = [e for e in events if not e.answered_ok]
    if bad:
        e = bad[0]
        more = f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""
        when = f"after {_s(e.answered_after_s)}" if e.answered_after_s is not None else "never"
        return Check(
            name,
            False,
            f"{e.deployment}: {e.label} at {_at(e.t_s)} answered {when} (limit {limit:.0f} s)"
            + more,
        )
    if not events:
        return Check(name, True, "no event made a serving plan infeasible")
    worst = max((e.answered_after_s or 0.0) for e in events)
    return Check(
        name,
        True,
        f"{len(events)} infeasible plan(s) answered after {worst:.1f} s at most"
        f" (limit {limit:.0f} s)",
    )


def _check_serving(events: Sequence[EventOutcome], limits: Limits) -> Check:
    name, limit = Invariant.SERVING_AGAIN, limits.serve_within_s
    bad = [e for e in events if not e.serving_ok]
    if bad:
        e = bad[0]
        after = e.serving_again_after_s
        when = "never" if after is None else f"after {after:.1f} s"
        more = f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""
        return Check(
            name,
            False,
            f"{e.deployment}: after {e.label} at {_at(e.t_s)} serving again {when}"
            f" (limit {limit:.0f} s){more}",
        )
    timed = [e.serving_again_after_s for e in events if e.serving_again_after_s is not None]
    short = sum(not e.enough_gpus for e in events)
    parts = (
        [f"serving again after {max(timed):.1f} s at most (limit {limit:.0f} s)"] if timed else []
    )
    parts += [f"{short} without enough GPUs (no feasible plan)"] if short else []
    return Check(name, True, "; ".join(parts) or "no event made a serving plan infeasible")


def _check_unique(num: int, duplicates: Mapping[str, int]) -> Check:
    name = Invariant.UNIQUE_DECISION_IDS
    if duplicates:
        ids = ", ".join(f"{i} ×{n}" for i, n in sorted(duplicates.items())[:3])
        more = f" (+{len(duplicates) - 3} more)" if len(duplicates) > 3 else ""
        return Check(name, False, f"{len(duplicates)} decision id(s) twice: {ids}{more}")
    return Check(name, True, f"{num} decisions, no id twice")


def _check_targets(targets: Sequence[tuple[DecisionFact, float | None]]) -> Check:
    name = Invariant.NO_DECISION_TARGETS_SERVING
    if not targets:
        return Check(name, True, "no decision targets the plan already serving")
    d, since = targets[0]
    when = f" since {_at(since)}" if since is not None else " (its own from-plan)"
    more = f" (+{len(targets) - 1} more)" if len(targets) > 1 else ""
    return Check(
        name,
        False,
        f"{d.decision_id} at {_at(d.t_s)} targets {d.to_plan_id}, serving{when}{more}",
    )


def _check_ticks(failed: int | None, source: str) -> Check:
    name = Invariant.NO_FAILED_TICKS
    if failed is None:
        return Check(name, False, "the stream worker's failed ticks could not be read")
    where = "the stream worker's metric" if source == "metric" else f"the stream worker's {source}"
    return Check(name, failed == 0, f"{failed} failed decision runs ({where})")


def _check_dead_letters(dead_letters: Mapping[str, int]) -> Check:
    name = Invariant.NOTHING_DEAD_LETTERED
    if not dead_letters:
        return Check(name, True, "0 records refused by the stream")
    shown = ", ".join(f"{n} {what}" for what, n in sorted(dead_letters.items()))
    return Check(name, False, f"{sum(dead_letters.values())} records refused: {shown}")


def _check_unfinished(
    unfinished: Sequence[str], transitions: Sequence[tuple[float, GearTransition]]
) -> Check:
    name = Invariant.TRANSITIONS_FINISHED
    if unfinished:
        return Check(name, False, "left unfinished at exit: " + ", ".join(unfinished))
    num = len({(r.deployment, r.transition_seq) for _, r in transitions})
    return Check(name, True, f"{num} transitions, each done or rolled back")


def _check_sequences(deployments: Mapping[str, DeploymentOutcome]) -> Check:
    name = Invariant.SEQUENCES_ACCOUNTED
    bad = [
        f"{d}: {o.sequences.lost} lost, {o.sequences.owned_twice} owned twice"
        for d, o in deployments.items()
        if o.sequences.lost or o.sequences.owned_twice
    ]
    if bad:
        return Check(name, False, "; ".join(bad))
    admitted = sum(o.sequences.admitted for o in deployments.values())
    in_flight = sum(o.sequences.in_flight for o in deployments.values())
    return Check(
        name, True, f"{admitted} admitted: each completed or in flight ({in_flight}), once"
    )
