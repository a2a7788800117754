"""The end of a `flexpipe up` run: read its topics back, judge it, write ``summary.json``.

:func:`gather` reads the run's decisions, transitions and cluster events back from their topics
(the run has its own topic prefix), collects the stream worker's failed ticks and the planned
outages, and :func:`conclude` judges them with :func:`sim.invariants.evaluate`, prints the
verdict, writes ``summary.json``, ``report.md`` and ``timeline.png``, and returns the exit code:
0 when every invariant held, 1 (with one line on stderr naming what broke) when not.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson

from flexpipe import envelope
from flexpipe.config import FlexPipeConfig
from flexpipe.errors import ValidationError
from flexpipe.schemas import ClusterEvent, GearDecision, GearTransition
from flexpipe.topics import Topic, topic_name
from sim.invariants import evaluate, unserved_s
from sim.ondemand import on_demand_checks, on_demand_lines
from sim.record import RunRecord
from sim.report import summary_lines, write_report
from sim.spec import Scenario
from sim.summary import (
    DecisionFact,
    DeploymentFacts,
    EventFact,
    Outage,
    RunFacts,
    SequenceFacts,
    Summary,
)

__all__ = ["EXIT_BROKEN", "RunOutcome", "SequenceLedger", "conclude", "gather", "run_facts"]

EXIT_BROKEN = 1  # an invariant did not hold (2 stays "the job itself failed", see flexpipe.cli)


@dataclass
class RunOutcome:
    """What a run left behind, for the checks."""

    record: RunRecord  # what the live view saw
    decisions: list[tuple[float, GearDecision]]  # read back: (trigger event time, decision)
    transitions: list[tuple[float, GearTransition]]  # read back: (event time, record)
    events: list[EventFact]  # read back, duplicates dropped
    end_s: float  # simulated time the run's checks ended
    failed_ticks: int | None = 0
    failed_ticks_source: str = "metric"
    outages: list[Outage] = field(default_factory=list)
    active_at_exit: tuple[str, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)  # scenario, seed, speed … for the JSON
    on_demand: dict[str, Any] | None = None  # on-demand scenarios: sim.ondemand's figures
    dead_letters: dict[str, int] = field(default_factory=dict)  # "topic reason" → records


async def read_back(
    cfg: FlexPipeConfig, topic: Topic, epoch_ms: int, *, dedupe: bool
) -> list[tuple[float, Any]]:
    """(simulated event time, payload) of every valid record of one of the run's topics;
    with ``dedupe``, a record redelivered under the same (source, seq) counts once."""
    from runtime.journal import read_to_end

    out: list[tuple[float, Any]] = []
    seen: set[tuple[str, int]] = set()
    for _, value in await read_to_end(cfg, topic_name(cfg, topic)):
        try:
            env = envelope.decode(value)
        except ValidationError:
            continue
        if dedupe:
            if (env.source, env.seq) in seen:
                continue
            seen.add((env.source, env.seq))
        out.append(((env.event_time_ms - epoch_ms) / 1000.0, env.payload))
    return out


async def gather(cfg: FlexPipeConfig, record: RunRecord, epoch_ms: int, end_s: float) -> RunOutcome:
    """Read the run's decisions, transitions and cluster events back from the broker."""
    decisions = await read_back(cfg, Topic.DECISIONS, epoch_ms, dedupe=False)
    transitions = await read_back(cfg, Topic.TRANSITIONS, epoch_ms, dedupe=False)
    cluster = await read_back(cfg, Topic.CLUSTER, epoch_ms, dedupe=True)
    dead_letters = await read_dead_letters(cfg)
    events = [
        EventFact(t, p.type.value, p.node, p.gpu_uuids, p.xid)
        for t, p in cluster
        if isinstance(p, ClusterEvent)
    ]
    return RunOutcome(
        record=record,
        decisions=[(t, p) for t, p in decisions if isinstance(p, GearDecision)],
        transitions=[(t, p) for t, p in transitions if isinstance(p, GearTransition)],
        events=events,
        end_s=end_s,
        dead_letters=dead_letters,
    )


async def read_dead_letters(cfg: FlexPipeConfig) -> dict[str, int]:
    """The run's dead-letter records counted by "source topic reason" (topics unprefixed)."""
    from runtime.journal import read_to_end

    logical = {topic_name(cfg, t): t.value for t in Topic}
    out: Counter[str] = Counter()
    for _, value in await read_to_end(cfg, topic_name(cfg, Topic.DEADLETTER)):
        try:
            record = orjson.loads(value or b"")
            where = logical.get(record["topic"], record["topic"])
            out[f"{where} {record['reason']}"] += 1
        except (orjson.JSONDecodeError, KeyError, TypeError):
            out["unreadable dead-letter record"] += 1
    return dict(out)


def _account(futures: Mapping[str, Any], core: Any) -> tuple[SequenceFacts, set[str]]:
    """Admitted sequences of one deployment against its runtime at one instant, and the ids
    neither completed (future resolved) nor in flight (owned by a replica, or waiting for one
    or for its model's load). A request held for a load and then refused was never admitted."""
    resolved = {rid for rid, fut in futures.items() if fut.done() and not fut.cancelled()}
    refused = {rid for rid in resolved if futures[rid].exception() is not None}
    completed = resolved - refused
    owned = set(core.router.ownership())
    unplaced = set(core.unplaced()) | set(core.held())
    in_flight = owned | unplaced
    unaccounted = set(futures) - resolved - in_flight
    twice = (completed & in_flight) | (owned & unplaced)
    facts = SequenceFacts(
        admitted=len(futures) - len(refused),
        completed=len(completed),
        in_flight=len(in_flight & set(futures)),
        lost=len(unaccounted),
        owned_twice=len(twice) + len(core.router.check_invariants()),
    )
    return facts, unaccounted


class SequenceLedger:
    """Every sequence the load generator got admitted, to account for each at the end.

    NOTE: a finished sequence leaves the router before the runtime resolves its future (the
    outbox is delivered across awaits), so one instant can show it nowhere. :meth:`load_ended`
    takes the figures when the load stops; :meth:`settle`, after the drain, calls lost only the
    sequences still neither completed nor in flight.
    """

    def __init__(self) -> None:
        self.futures: dict[str, dict[str, asyncio.Future[Any]]] = {}
        self.waiters: set[asyncio.Task[None]] = set()  # completion bookkeeping, cancelled last
        self._at_end: dict[str, SequenceFacts] = {}
        self._unaccounted: dict[str, set[str]] = {}

    def admit(self, deployment: str, request_id: str, fut: asyncio.Future[Any]) -> None:
        """One admitted sequence."""
        self.futures.setdefault(deployment, {})[request_id] = fut

    def load_ended(self, worker: Any) -> None:
        """The figures when the load stopped (one instant: no await here)."""
        for dep in worker.deployments:
            futures = self.futures.get(dep, {})
            facts, unaccounted = _account(futures, worker.runtimes[dep].core)
            self._at_end[dep], self._unaccounted[dep] = facts, unaccounted

    def settle(self, worker: Any) -> dict[str, SequenceFacts]:
        """Per deployment: the figures at the load's end, with lost recounted now."""
        out = {}
        for dep, facts in self._at_end.items():
            now, unaccounted = _account(self.futures.get(dep, {}), worker.runtimes[dep].core)
            lost = self._unaccounted[dep] & unaccounted
            out[dep] = replace(
                facts,
                lost=len(lost),
                owned_twice=max(facts.owned_twice, now.owned_twice),
                preemptions=worker.runtimes[dep].core.preemptions,
            )
        return out

    async def close(self) -> None:
        """Stop following completions."""
        for task in list(self.waiters):
            task.cancel()
        await asyncio.gather(*self.waiters, return_exceptions=True)


def run_facts(outcome: RunOutcome, scenario: Scenario) -> RunFacts:
    """The checks' input, from what the run left behind."""
    record = outcome.record
    seen: dict[str, float] = {}
    for d in record.decisions:
        # NOTE: when the stream produced it (its broker timestamp), not when this job's busy
        # consumer got to it; the read time only where the timestamp is missing.
        when = d.produced_s if d.produced_s is not None else d.seen_s
        seen.setdefault(d.decision.decision_id, max(when, d.t_s))
    decisions = tuple(
        DecisionFact(
            decision_id=d.decision_id,
            deployment=d.deployment,
            t_s=t_s,
            seen_s=seen.get(d.decision_id, t_s),
            forced=d.forced,
            reason=d.reason,
            from_plan_id=d.from_plan_id,
            to_plan_id=d.to_plan_id,
        )
        for t_s, d in outcome.decisions
    )
    load_end_s = record.load_end_s if record.load_end_s is not None else outcome.end_s
    deployments = tuple(
        DeploymentFacts(
            name=dep.name,
            served=sum(1 for s in record.served if s.deployment == dep.name),
            rejected=dict(Counter(r for _, d, r in record.rejections if d == dep.name)),
            unserved_s=unserved_s(
                [(t, ok) for t, d, ok in record.serving if d == dep.name],
                record.load_start_s,
                load_end_s,
            ),
            sequences=record.sequences.get(dep.name, SequenceFacts()),
        )
        for dep in scenario.deployments
    )
    return RunFacts(
        deployments=deployments,
        decisions=decisions,
        transitions=tuple(outcome.transitions),
        events=tuple(outcome.events),
        end_s=outcome.end_s,
        gpu_nodes={g.uuid: g.node for g in scenario.gpus},
        outages=tuple(outcome.outages),
        failed_ticks=outcome.failed_ticks,
        failed_ticks_source=outcome.failed_ticks_source,
        active_at_exit=outcome.active_at_exit,
        dead_letters=outcome.dead_letters,
    )


def write_summary(
    summary: Summary,
    meta: Mapping[str, Any],
    path: Path,
    on_demand: Mapping[str, Any] | None = None,
) -> Path:
    """``summary.json``: the verdict first, then the figures behind it."""
    data = summary.to_dict()
    data["run"] = {**meta, **data["run"]}
    if on_demand is not None:
        data["on_demand"] = dict(on_demand)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    return path


def conclude(
    outcome: RunOutcome,
    scenario: Scenario,
    duration_s: float,
    out_dir: Path,
    title: str,
) -> int:
    """Judge the run, print the verdict, write the files; the exit code."""
    summary = evaluate(run_facts(outcome, scenario))
    if outcome.on_demand is not None:
        checks = summary.checks + on_demand_checks(outcome.on_demand)
        summary = replace(summary, checks=checks)
    deployments: Sequence[str] = [d.name for d in scenario.deployments]
    print("\n".join(summary_lines(outcome.record, list(deployments), duration_s)))
    if outcome.on_demand is not None:
        print("\n".join(on_demand_lines(outcome.on_demand)))
    print("", *summary.lines(), sep="\n")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = write_summary(summary, outcome.meta, out_dir / "summary.json", outcome.on_demand)
    md, png = write_report(outcome.record, list(deployments), duration_s, out_dir, title, summary)
    print(f"\nsummary: {path}  report: {md}  timeline: {png}", flush=True)
    if summary.invariants_ok:
        return 0
    print(f"flexpipe up: {summary.broken_line()}", file=sys.stderr, flush=True)
    return EXIT_BROKEN
