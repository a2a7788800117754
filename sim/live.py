"""The live gear timeline of `flexpipe up`: what changed, as it happens, and a periodic status.

:class:`Timeline` follows the decisions, transitions and cluster-event topics. It prints the
decisions that change a plan (and forced or operator ones) with a one-line reason, each
transition phase as it completes, and the cluster events; holds — the stream publishes one per
deployment per tick — are only counted, by reason. :func:`status_loop` samples the runtime worker
(whether each deployment has a replica on live GPUs: the run's unserved time) and prints one
block every couple of simulated minutes: per deployment the serving plan and its GPUs, the
window's TTFT/TBT p95 and its admitted and rejected requests. Everything it reads comes from the
simulated cluster and engines.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable
from typing import Any

from flexpipe import envelope
from flexpipe.config import FlexPipeConfig
from flexpipe.errors import ValidationError
from flexpipe.kafka import make_consumer, running
from flexpipe.schemas import (
    ClusterEvent,
    GearDecision,
    GearTransition,
    PhaseStatus,
    TransitionPhase,
)
from flexpipe.topics import Topic, topic_name
from gearbox.plans import DeploymentPlan
from sim.fleet import SimFleet
from sim.record import ClusterMark, RunRecord, SeenDecision, hms, is_change, ms, p95, plan_shape
from sim.report import handover_text, short_explanation
from sim.world import follow_placement

SHOWN_EVENTS = frozenset({"preempt", "release", "xid", "node_down"})
LATE_S = 5.0  # simulated seconds between a decision's trigger and its reading worth a mention
GPU_SAMPLE_S = 5.0  # simulated seconds between samples of the GPUs each deployment serves on


class Timeline:
    """Follows decisions, transitions and cluster events; prints the live gear timeline."""

    def __init__(
        self,
        cfg: FlexPipeConfig,
        epoch_ms: int,
        fleet: SimFleet,
        clock: Callable[[], float],
        wall_to_sim: Callable[[int], float] | None = None,
    ) -> None:
        self.cfg = cfg
        self.epoch_s = epoch_ms / 1000.0
        self.fleet = fleet
        self.clock = clock  # the shared simulated clock: when this job saw a record
        # A record's broker timestamp (wall ms) on the simulated clock: when it was produced.
        self.wall_to_sim = wall_to_sim
        self.record = RunRecord()
        self.window_holds: Counter[str] = Counter()  # holds since the last status block

    async def follow(self, stop: asyncio.Event) -> None:
        """Consume until ``stop``; decisions and transitions are this run's audit trail."""
        topics = [
            topic_name(self.cfg, t) for t in (Topic.DECISIONS, Topic.TRANSITIONS, Topic.CLUSTER)
        ]
        consumer = make_consumer(self.cfg, *topics, group_id=None)
        async with running(consumer):
            while not stop.is_set():
                batch = await consumer.getmany(timeout_ms=200)
                for records in batch.values():
                    for rec in records:
                        self.on_message(rec.value, rec.timestamp)

    def on_message(self, raw: bytes | None, timestamp_ms: int | None = None) -> None:
        """One record from a followed topic (invalid ones are skipped); ``timestamp_ms`` is its
        broker timestamp."""
        try:
            env = envelope.decode(raw)
        except ValidationError:
            return
        t_s = env.event_time_s - self.epoch_s
        p = env.payload
        if isinstance(p, GearDecision):
            produced = None
            if timestamp_ms is not None and self.wall_to_sim is not None:
                produced = self.wall_to_sim(timestamp_ms)
            self._decision(t_s, p, produced)
        elif isinstance(p, GearTransition):
            self._transition(t_s, p)
        elif isinstance(p, ClusterEvent) and p.type.value in SHOWN_EVENTS:
            label = f"{p.type.value} on {p.node} ({len(p.gpu_uuids)} GPUs)"
            self.record.events.append(ClusterMark(t_s, p.type.value, label))
            print(f"{hms(t_s)}  ⚡ {label} {p.detail}".rstrip(), flush=True)

    def _decision(self, t_s: float, d: GearDecision, produced_s: float | None = None) -> None:
        seen_s = self.clock()
        self.record.decisions.append(SeenDecision(t_s, seen_s, d, produced_s))
        if not is_change(d):
            self.record.holds[(d.deployment, d.reason)] += 1
            self.window_holds[d.reason] += 1
            return
        target = plan_shape(d.decision.to_plan) if d.decision is not None else "hold"
        # NOTE: stamped with its trigger's event time; when it took a while to arrive, say so.
        late = f" (seen {hms(seen_s)})" if seen_s - t_s > LATE_S else ""
        print(
            f"{hms(t_s)}  ⚙ {d.deployment}: {d.reason} [{d.trigger}] → {target} {d.to_plan_id}"
            f"{late}\n            {short_explanation(d.explanation)}",
            flush=True,
        )

    def _transition(self, t_s: float, rec: GearTransition) -> None:
        self.record.transitions.append((t_s, rec))
        # The simulated agents must report the deployment where the runtime moved it.
        follow_placement(self.fleet.cluster, rec)
        if rec.status is PhaseStatus.STARTED and rec.attempt == 1:
            if rec.phase is TransitionPhase.PREPARE:  # the shift begins
                shape = plan_shape(rec.plan)
                print(f"{hms(t_s)}    ↳ {rec.deployment} #{rec.transition_seq} → {shape}")
            return  # NOTE: phase starts are implied by the previous phase's end
        took = f" {rec.duration_ms / 1000:.1f} s" if rec.duration_ms is not None else ""
        mark = {PhaseStatus.FAILED: "✗", PhaseStatus.STARTED: "…"}.get(rec.status, "✓")
        step = f"{rec.deployment} #{rec.transition_seq} {rec.phase}{took} {mark}"
        switched = rec.phase is TransitionPhase.SWITCH and rec.status is PhaseStatus.COMPLETED
        detail = handover_text(rec.detail) if switched else rec.detail
        print(f"{hms(t_s)}    ↳ {step} {detail}".rstrip(), flush=True)


def serves(worker: Any, deployment: str) -> bool:
    """Whether the runtime can serve ``deployment`` now: a routable replica on live GPUs."""
    core = worker.runtimes[deployment].core
    return any(
        not any(worker.pool.is_lost(u) for u in core.plan_of(r).gpu_uuids) for r in core.routable()
    )


def serving_gpus(worker: Any, deployment: str) -> tuple[DeploymentPlan | None, int]:
    """The runtime's serving plan of ``deployment`` and how many of its GPUs are not lost."""
    plan = worker.runtimes[deployment].state.serving
    if plan is None:
        return None, 0
    return plan, sum(1 for u in plan.gpu_uuids if not worker.pool.is_lost(u))


def status_block(timeline: Timeline, worker: Any, t0_s: float, t1_s: float) -> list[str]:
    """The status lines for the window [t0, t1): plans, latency, admissions, holds."""
    record = timeline.record
    lines = []
    for dep in worker.deployments:
        plan, live = serving_gpus(worker, dep)
        where = f"{plan.plan_id[:11]} {plan_shape(plan)}" if plan else "no plan"
        if plan is not None and live < plan.num_gpus:
            where += f", {plan.num_gpus - live} lost"
        done = [s for s in record.served if s.deployment == dep and t0_s <= s.finish_s < t1_s]
        ttft, tbt = p95([s.ttft_s for s in done]) * 1000, p95([s.tbt_s for s in done]) * 1000
        rejected = Counter(r for t, d, r in record.rejections if d == dep and t0_s <= t < t1_s)
        why = f" ({', '.join(f'{r} {n}' for r, n in rejected.most_common())})" if rejected else ""
        lines.append(
            f"▸ {dep:<10} {where:<36} TTFT/TBT p95 {ms(ttft):>6}/{ms(tbt):<5} ms"
            f"  served {len(done)}, rejected {sum(rejected.values())}{why}"
        )
    holds = ", ".join(f"{r} {n}" for r, n in timeline.window_holds.most_common()) or "none"
    lines.append(f"▸ holds since {hms(t0_s)}: {holds}")
    timeline.window_holds.clear()
    return [f"{hms(t1_s) if i == 0 else '':<8}  {line}" for i, line in enumerate(lines)]


async def status_loop(timeline: Timeline, worker: Any, every_s: float, stop: asyncio.Event) -> None:
    """Sample the GPUs each deployment serves on; print a status block every ``every_s``."""
    next_print = every_s
    while not stop.is_set():
        now = worker.now_s()
        for dep in worker.deployments:
            timeline.record.gpus.append((now, dep, serving_gpus(worker, dep)[1]))
            timeline.record.serving.append((now, dep, serves(worker, dep)))
        if now >= next_print:
            print("\n".join(status_block(timeline, worker, next_print - every_s, next_print)))
            next_print += every_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), GPU_SAMPLE_S / worker.clock.speed)
