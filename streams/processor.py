"""The stream processor: admits messages, folds them into tables, keeps the view and the clock.

Independent of Faust (tables, sending and ownership are injected, see :mod:`streams.ports`), so
unit tests drive it directly. Per-GPU telemetry is the hot path: it folds into in-memory
caches, and :meth:`StreamProcessor.flush` writes a GPU's record to its table — and so to every
worker's view — only when a field the planner uses moved or its last-seen time fell
``view_refresh_s`` behind. Low-volume state (nodes, serving load, plans, overrides) is written
on every change. Decisions are :class:`streams.decider.Decider`'s job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from flexpipe.config import FlexPipeConfig
from flexpipe.envelope import Envelope
from flexpipe.schemas import (
    ClusterEvent,
    ControlCommand,
    GearTransition,
    GpuSample,
    KernelLaunches,
    Kind,
    NodeSamples,
    TransitionPhase,
)
from gearbox.decisions import Trigger
from gearbox.history import GearState
from streams import codec
from streams.catalog import Catalog
from streams.clock import EventClock
from streams.deployments import Deployment
from streams.gearstore import GearStore
from streams.intake import Accepted, Rejected, SourceTopic, admit, dead_letter
from streams.load import LaunchWindow, ServingWindows, fold_launches, fold_serving
from streams.metrics import StreamsMetrics
from streams.ports import Decisions, Message, Sender, TableName, Tables, TriggerMessage
from streams.state import (
    FoldOutcome,
    GpuState,
    NodeState,
    fold_cluster_event,
    fold_gpu_sample,
    mark_timed_out,
    material_gpu_change,
)
from streams.step import (
    OverrideState,
    PlanState,
    TriggerInfo,
    fold_control,
    fold_rollback,
    fold_transition,
)
from streams.view import ClusterView
from streams.windows import HoppingWindow

__all__ = ["ProcessorTopics", "StreamProcessor"]

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ProcessorTopics:
    """Broker-side names of the topics the processor writes."""

    decisions: str
    deadletter: str
    triggers: str


class StreamProcessor:
    """One worker's stream state and folds; single-threaded on the worker's event loop."""

    def __init__(
        self,
        cfg: FlexPipeConfig,
        *,
        catalog: Catalog,
        deployments: tuple[Deployment, ...],
        tables: Tables,
        send: Sender,
        decisions: Callable[[StreamProcessor], Decisions],
        topics: ProcessorTopics,
        metrics: StreamsMetrics,
        worker: str,
        wall: Callable[[], float] = time.time,
    ) -> None:
        s = cfg.streams
        self.cfg = cfg
        self.catalog = catalog
        self.deployments = deployments
        self.names = frozenset(d.name for d in deployments)
        self.tables = tables
        self.send = send
        self.topics = topics
        self.metrics = metrics
        self.worker = worker
        self.wall = wall
        self.view = ClusterView()
        self.clock = EventClock(idle_grace_s=2 * cfg.intervals.heartbeat_s)
        self.gpu_window = HoppingWindow(s.gpu_window_s, s.gpu_step_s)
        self.load_window = HoppingWindow(s.load_window_s, s.load_step_s)
        self.view_caught_up = False
        # NOTE: set by the app from its consumer's positions (see :meth:`trailing`): deciding
        # while a partition of the view's inputs trails the clock takes its GPUs for dead.
        self.input_current = True
        self._newest_ms: dict[tuple[str, int], int] = {}  # per input partition: newest event
        self._next_offset: dict[tuple[str, int], int] = {}  # per input partition: next to process
        self._peeked_to: dict[tuple[str, int], int] = {}  # per cluster partition: after the peek
        self._gpus: dict[str, GpuState] = {}
        self._published: dict[str, GpuState] = {}
        self._dirty_gpus: set[str] = set()
        self._loads: dict[str, LaunchWindow] = {}
        self._load_written_ms: dict[str, int] = {}
        self._dirty_loads: set[str] = set()
        self._cache: dict[tuple[TableName, str], Any] = {}
        self._gear = GearStore(tables)
        self._kinds = {k: metrics.events.labels(k.value) for k in Kind}
        self.decider = decisions(self)  # NOTE: a factory: the decider reads this processor

    # ---- tables -----------------------------------------------------------------------------

    def load(self, table: TableName, key: str, cls: type[T]) -> T | None:
        """A table value through the decode cache; None when absent or unreadable."""
        hit = self._cache.get((table, key))
        if hit is not None:
            value: T = hit
            return value
        raw = self.tables.get(table, key.encode())
        if raw is None:
            return None
        try:
            value = codec.loads(cls, raw)
        except ValueError as exc:  # a changelog record from an older layout: start afresh
            log.warning("table %s key %s unreadable, reset: %s", table.value, key, exc)
            return None
        self._cache[(table, key)] = value
        return value

    def store(self, table: TableName, key: str, value: object) -> None:
        """Write through the cache to the table (and its changelog)."""
        self._cache[(table, key)] = value
        self.tables.set(table, key.encode(), codec.dumps(value))

    def remember(self, table: TableName, key: str, value: object) -> None:
        """Update the cache only; the caller writes the table later (or accepts losing it)."""
        self._cache[(table, key)] = value

    def load_gear(self, name: str) -> GearState | None:
        """``name``'s gear state through the decode cache (:mod:`streams.gearstore`: two tables);
        None when absent or unreadable."""
        hit = self._cache.get((TableName.GEAR_STATE, name))
        if hit is not None:
            gear: GearState = hit
            return gear
        try:
            loaded = self._gear.load(name)
        except ValueError as exc:  # a changelog record from an older layout: start afresh
            log.warning("gear state of %s unreadable, reset: %s", name, exc)
            return None
        if loaded is not None:
            self._cache[(TableName.GEAR_STATE, name)] = loaded
        return loaded

    def store_gear(self, name: str, gear: GearState) -> None:
        """Write ``gear`` through the cache: its history as a difference from the last base."""
        self._cache[(TableName.GEAR_STATE, name)] = gear
        self._gear.store(name, gear)

    def _gpu(self, uuid: str) -> GpuState | None:
        state = self._gpus.get(uuid)
        if state is not None:
            return state
        raw = self.tables.get(TableName.GPUS, uuid.encode())
        if raw is None:
            return None
        try:
            state = codec.loads(GpuState, raw)
        except ValueError:
            return None
        self._gpus[uuid] = self._published[uuid] = state
        return state

    # ---- intake -----------------------------------------------------------------------------

    async def on_message(self, src: SourceTopic, msg: Message, *, peeked: bool = False) -> None:
        """Admit, fold and route one consumed message; bad input ends in the dead-letter topic.

        ``peeked``: a cluster event read ahead of faust's delivery (:mod:`streams.peek`); faust's
        delivery of it later is passed over (until the next rebalance, see :meth:`forget`).
        """
        if src is SourceTopic.CLUSTER:
            where = (msg.topic, msg.partition)
            if peeked:
                self._peeked_to[where] = msg.offset + 1
            elif msg.offset < self._peeked_to.get(where, -1):
                return
        wall_s = self.wall()
        verdict = admit(
            src,
            msg.key,
            msg.value,
            wall_s,
            self.clock.watermark_ms / 1000.0,
            self.cfg.streams.max_future_skew_s,
            self.names,
        )
        # NOTE: every consumed message advances the partition's position, a rejected one too:
        # otherwise a partition ending in bad input would count as unread forever (not ready).
        self._next_offset[(msg.topic, msg.partition)] = msg.offset + 1
        if isinstance(verdict, Rejected):
            await self.reject(verdict, msg, src.value)
            return
        await self._fold(src, verdict, msg, wall_s)

    async def reject(self, rejected: Rejected, msg: Message, topic_label: str) -> None:
        """Send ``msg`` to the dead-letter topic with the reason; count it."""
        record = dead_letter(
            rejected,
            topic=msg.topic,
            partition=msg.partition,
            offset=msg.offset,
            key=msg.key,
            value=msg.value,
            worker=self.worker,
            wall_ms=round(self.wall() * 1000),
        )
        await self.send(self.topics.deadletter, msg.key, record, wait=False)
        self.metrics.dead_letters.labels(rejected.reason.value, topic_label).inc()

    async def _fold(self, src: SourceTopic, ok: Accepted, msg: Message, wall_s: float) -> None:
        env = ok.env
        self.clock = self.clock.observe(env.event_time_ms, wall_s)
        where = (msg.topic, msg.partition)
        self._newest_ms[where] = max(self._newest_ms.get(where, -1), env.event_time_ms)
        if src is SourceTopic.NODE:
            self._fold_node(env)
        elif src is SourceTopic.GPU:
            self._fold_gpu(env)
        elif src is SourceTopic.LAUNCHES:
            self._fold_launches(env)
        elif src is SourceTopic.CLUSTER:
            await self._fold_cluster(env)
        elif src is SourceTopic.SERVING:
            self._fold_serving(env)
        elif src is SourceTopic.TRANSITIONS:
            await self._fold_transition(env, wall_s)
        else:
            await self._fold_control(env, wall_s)

    def _count(self, env: Envelope[Any], outcome: FoldOutcome | bool) -> None:
        if outcome is FoldOutcome.DUPLICATE or outcome is False:
            self.metrics.duplicates.labels(env.kind.value).inc()
        else:
            self._kinds[env.kind].inc()

    def _fold_node(self, env: Envelope[Any]) -> None:
        """One node's batch: each item folds as its per-GPU kind would, in one pass; events and
        duplicates are counted per item under the per-GPU kinds (one counter update each)."""
        batch: NodeSamples = env.payload
        source, seq, t_ms = env.source, env.seq, env.event_time_ms
        samples = launches = duplicates = 0
        for sample in batch.samples:
            if self._fold_sample(sample, source, seq, t_ms) is FoldOutcome.DUPLICATE:
                duplicates += 1
            else:
                samples += 1
        if duplicates:
            self.metrics.duplicates.labels(Kind.GPU_SAMPLE.value).inc(duplicates)
        duplicates = 0
        for report in batch.launches:
            if self._fold_launch(report, source, seq, t_ms):
                launches += 1
            else:
                duplicates += 1
        if duplicates:
            self.metrics.duplicates.labels(Kind.KERNEL_LAUNCHES.value).inc(duplicates)
        if samples:
            self._kinds[Kind.GPU_SAMPLE].inc(samples)
        if launches:
            self._kinds[Kind.KERNEL_LAUNCHES].inc(launches)

    def _fold_gpu(self, env: Envelope[Any]) -> None:
        outcome = self._fold_sample(env.payload, env.source, env.seq, env.event_time_ms)
        self._count(env, outcome)

    def _fold_sample(self, sample: GpuSample, source: str, seq: int, t_ms: int) -> FoldOutcome:
        uuid = sample.gpu_uuid
        new, outcome = fold_gpu_sample(self._gpu(uuid), sample, source, seq, t_ms)
        if outcome is FoldOutcome.APPLIED and new is not None:
            self._gpus[uuid] = new
            self._dirty_gpus.add(uuid)
        return outcome

    def _fold_launches(self, env: Envelope[Any]) -> None:
        applied = self._fold_launch(env.payload, env.source, env.seq, env.event_time_ms)
        self._count(env, applied)

    def _fold_launch(self, report: KernelLaunches, source: str, seq: int, t_ms: int) -> bool:
        """Fold one launch report; False for a duplicate (a late report counts as folded)."""
        uuid = report.gpu_uuid
        state = (
            self._loads.get(uuid)
            or self.load(TableName.GPU_LOAD, uuid, LaunchWindow)
            or LaunchWindow()
        )
        new, applied = fold_launches(state, self.gpu_window, report, source, seq, t_ms)
        if new.late > state.late:
            self.metrics.late.labels("gpu_launches").inc()
        self._loads[uuid] = new
        self._dirty_loads.add(uuid)
        return applied or new.late > state.late

    async def _fold_cluster(self, env: Envelope[Any]) -> None:
        ev: ClusterEvent = env.payload
        state = self.load(TableName.NODES, ev.node, NodeState)
        new, outcome = fold_cluster_event(state, ev, env.source, env.seq, env.event_time_ms)
        self._count(env, outcome)
        if outcome is FoldOutcome.DUPLICATE:
            return
        if outcome is not FoldOutcome.APPLIED:
            self._cache[(TableName.NODES, ev.node)] = new  # dedupe moved; nothing to publish
            return
        new = replace(new, rev=(state.rev if state is not None else 0) + 1)
        self.store(TableName.NODES, ev.node, new)
        self.view.apply_node(new)
        description = _describe(ev)
        info = TriggerInfo(Trigger.TOPOLOGY_CHANGE, env.event_time_ms, description)
        wall_s = self.wall()
        self.metrics.forced_stage.labels("fold").observe(
            max(0.0, wall_s - env.event_time_ms / 1000)
        )
        for dep in self.deployments:
            if self.decider.owns(dep.name):
                self.decider.submit(dep.name, info, wall_s)
        for dep in self.deployments:
            message = TriggerMessage(
                dep.name, Trigger.TOPOLOGY_CHANGE, env.event_time_ms, description, new
            )
            raw = codec.dumps(message)
            await self.send(self.topics.triggers, dep.name.encode(), raw, wait=False)

    def _fold_serving(self, env: Envelope[Any]) -> None:
        name = env.payload.deployment
        state = self.load(TableName.SERVING, name, ServingWindows) or ServingWindows()
        new, applied = fold_serving(
            state, self.load_window, env.payload, env.source, env.seq, env.event_time_ms
        )
        if new.late > state.late:
            self.metrics.late.labels("serving").inc()
        self._count(env, applied or new.late > state.late)
        if new != state:
            self.store(TableName.SERVING, name, new)

    async def _fold_transition(self, env: Envelope[Any], wall_s: float) -> None:
        tr: GearTransition = env.payload
        # NOTE: under the decider's lock: a decision being published writes the tables it read
        # before, which would drop this record's effect (a DONE settling the decision in flight,
        # a rollback's quarantine).
        async with self.decider.lock:
            plan = self.load(TableName.PLANS, tr.deployment, PlanState) or PlanState()
            new = fold_transition(plan, tr, env.event_time_ms)
            if new != plan:
                self.store(TableName.PLANS, tr.deployment, new)
                self.decider.show_plan(tr.deployment, new)
            if tr.phase is TransitionPhase.ROLLED_BACK:
                # gearbox quarantines the failed target: the next ticks do not re-propose it
                gear = self.load_gear(tr.deployment) or GearState()
                config = self.decider.gearbox_config
                rolled = fold_rollback(gear, tr, env.event_time_ms, config)
                self.store_gear(tr.deployment, rolled)
        if new != plan and tr.phase in (TransitionPhase.DONE, TransitionPhase.ROLLED_BACK):
            self.decider.after_transition(tr.deployment, new, wall_s)
        self._count(env, True)

    async def _fold_control(self, env: Envelope[Any], wall_s: float) -> None:
        cmd: ControlCommand = env.payload
        name = cmd.deployment
        plan = self.load(TableName.PLANS, name, PlanState) or PlanState()
        overrides = self.load(TableName.OVERRIDES, name, OverrideState) or OverrideState()
        self._count(env, True)
        self.store(TableName.OVERRIDES, name, fold_control(overrides, plan, cmd, env.event_time_ms))
        detail = f"operator {cmd.issued_by}: {cmd.action.value} {cmd.plan_id or ''}".rstrip()
        info = TriggerInfo(Trigger.OPERATOR, env.event_time_ms, f"{detail} {cmd.reason}".strip())
        await self.decider.evaluate(name, info, wall_s)

    # ---- periodic work ----------------------------------------------------------------------

    def now_ms(self) -> int:
        """Event time now: this worker's clock, or newer last-seen times in the shared view."""
        return max(self.clock.now_ms(self.wall()), self.view.max_seen_ms)

    def sweep(self) -> int:
        """Mark owned GPUs whose heartbeat timed out; returns how many were marked.

        Nothing while an input partition trails the clock (:meth:`trailing`): its GPUs' news is
        still queued, so their silence says nothing yet."""
        now_ms = self.now_ms()
        if now_ms < 0 or not self.input_current:
            return 0
        for raw in list(self.tables.keys(TableName.GPUS)):
            self._gpu(raw.decode())  # hydrate keys recovered after a rebalance
        marked = 0
        timeout_s = self.cfg.intervals.heartbeat_timeout_s
        for uuid, state in self._gpus.items():
            new = mark_timed_out(state, now_ms / 1000.0, timeout_s)
            if new is not None:
                self._gpus[uuid] = new
                self._dirty_gpus.add(uuid)
                marked += 1
        return marked

    def flush(self) -> int:
        """Write dirty per-GPU records that changed materially (see the module docstring)."""
        refresh_s = self.cfg.streams.view_refresh_s
        written = 0
        for uuid in self._dirty_gpus:
            state = self._gpus[uuid]
            published = self._published.get(uuid)
            if not material_gpu_change(published, state, refresh_s):
                continue
            state = replace(state, rev=max(state.rev, published.rev if published else 0) + 1)
            self._gpus[uuid] = self._published[uuid] = state
            key, raw = uuid.encode(), codec.dumps(state)
            self.tables.set(TableName.GPUS, key, raw)
            self.view.written_gpu(key, raw, state)
            written += 1
        self._dirty_gpus.clear()
        refresh_ms = round(refresh_s * 1000)
        still_dirty = set()
        for uuid in self._dirty_loads:
            newest = self._loads[uuid].dedupe.event_time_ms
            if newest - self._load_written_ms.get(uuid, -refresh_ms) >= refresh_ms:
                self.store(TableName.GPU_LOAD, uuid, self._loads[uuid])
                self._load_written_ms[uuid] = newest
            else:
                still_dirty.add(uuid)
        self._dirty_loads = still_dirty
        return written

    def export_gauges(self) -> None:
        """Refresh the view, table and clock gauges (a few times a minute is plenty)."""
        now_s = self.now_ms() / 1000.0
        timeout_s = self.cfg.intervals.heartbeat_timeout_s + self.cfg.streams.view_refresh_s
        live = sum(
            1
            for g in self.view.gpus.values()
            if not g.timed_out and now_s - g.last_seen_s <= timeout_s
        )
        self.metrics.view_gpus.labels("known").set(len(self.view.gpus))
        self.metrics.view_gpus.labels("heard_from").set(live)
        self.metrics.clock.set(max(0.0, now_s))
        for table in TableName:
            self.metrics.table_keys.labels(table.value).set(sum(1 for _ in self.tables.keys(table)))
        self.metrics.ready.set(1 if self.ready() else 0)

    def next_offset(self, topic: str, partition: int) -> int | None:
        """The offset after the last message of an input partition this worker processed."""
        return self._next_offset.get((topic, partition))

    def trailing(self, behind: Iterable[tuple[str, int]]) -> list[tuple[str, int]]:
        """Of the input partitions with records still to process, those whose newest processed
        event trails the clock by more than the heartbeat timeout less one heartbeat interval
        (or that gave none yet).

        NOTE: Faust reads partitions in chunks, not in event-time order: after a restart or a
        broker outage one partition's backlog can be minutes ahead of another's, and the
        clock follows the newest. Each partition is in event-time order by itself, so one that
        is close to the clock (or read to its end) holds no older news. Why that bound: an
        agent sends each GPU at least once per heartbeat interval, so every GPU of a partition
        read up to event time t was heard from at t − ``heartbeat_s`` or later, and is taken
        for dead only once the clock passes that by ``heartbeat_timeout_s``. A tighter bound
        held every decision while a telemetry backlog trailed a cluster event folded ahead of
        it (``streams.cluster_peek``), though no GPU could look dead yet.
        """
        now_ms = self.now_ms()
        intervals = self.cfg.intervals
        limit_ms = round((intervals.heartbeat_timeout_s - intervals.heartbeat_s) * 1000)
        return [tp for tp in behind if now_ms - self._newest_ms.get(tp, -1) > limit_ms]

    def newest_ms(self, topic: str, partition: int) -> int:
        """Event time of the newest message processed from an input partition (-1: none)."""
        return self._newest_ms.get((topic, partition), -1)

    def ready(self) -> bool:
        """Whether decisions may be made: the shared view caught up and holds GPUs, this
        worker's inputs are current (:meth:`trailing`), and it saw ``warmup_s`` of event time
        (so the first snapshot is not half-built)."""
        if not (self.view_caught_up and self.input_current and self.view.gpus):
            return False
        if not self.clock.started:
            return False
        warmup_ms = round(self.cfg.streams.warmup_s * 1000)
        return self.clock.watermark_ms - self.clock.first_ms >= warmup_ms

    def forget(self) -> None:
        """Drop every cache (after a rebalance: partitions may have moved)."""
        self._gpus.clear()
        self._published.clear()
        self._dirty_gpus.clear()
        self._loads.clear()
        self._dirty_loads.clear()
        self._load_written_ms.clear()
        self._cache.clear()
        self._gear.forget()
        # NOTE: faust delivers again from the committed offset what another worker may have
        # folded since: it folds once more (folds drop duplicates), not passed over
        self._peeked_to.clear()
        self._newest_ms.clear()
        # NOTE: _next_offset stays: a partition this worker keeps through the rebalance was read
        # up to there, and faust does not deliver its records again; forgetting it left a worker
        # that kept a partition with no new records "behind" for good, never deciding. Only
        # assigned partitions are asked about, and the input check prefers a newer commit.


def _describe(ev: ClusterEvent) -> str:
    gpus = f" ({len(ev.gpu_uuids)} GPUs)" if ev.gpu_uuids else ""
    detail = f": {ev.detail}" if ev.detail else ""
    return f"{ev.type.value} on {ev.node}{gpus}{detail}"[:300]
