"""The decision loop's I/O side: when to decide, for which deployments, and publishing.

Runs :func:`streams.step.step` on periodic ticks (every ``intervals.decision_s`` of event time)
and on topology triggers (debounced by the trigger agent's batching). A deployment is decided by
the worker that owns its partition; on the first decision after every rebalance the worker reads
the deployment's last decision back from the decisions topic and rolls its tables forward
(:func:`streams.step.reconcile`). Tables are written only after the broker acknowledged the
decision, and a revoked worker stops deciding before it gives its partitions up — so no decision
id is ever published twice.

No network wait holds the decider up for long: the decision log is read before the lock is
taken, and a decision the broker does not acknowledge within ``PUBLISH_WAIT_S`` (an outage) is
left to its producer while the lock is released — its deployment is not decided for until the
send ends, and then the topic, read again, says whether it landed. A topology or operator trigger
that cannot be decided now (worker not ready, log unreadable, a send unresolved) waits and is
decided first once it can be.

A round decides the deployments whose plan the view disturbs first, in the replay's order
(:func:`streams.step.decision_order`), and sends each decision as soon as its step ends. A
topology change for a deployment whose plan it did not disturb is decided ``LATER_S`` later,
merged with the changes that came meanwhile, and gives way to a topology round that is pending
then — but not once it has waited ``intervals.decision_s`` of event time (a tick's interval).
A tick's round gives way the same: an undisturbed deployment whose step it has not begun when a
topology round is pending is left for later, so a forced switch waits for one step at most,
not for every deployment's. The on-demand deployments of a round all decide from what its first
on-demand step read (one time, topology, plans and serving windows): each takes its verdict from
one residency round over all of them, so they must see the same one.

A topology trigger the cursor refuses (not newer than the last trigger decided) is still decided
when the view holds cluster events that no decision of the deployment saw yet: cluster events
are keyed by node, so one partition's event can be folded after a later event of another
partition (or a later tick) was decided. It is decided at the worker's clock, after the cursor.
"""

from __future__ import annotations

import asyncio
import cProfile
import logging
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from aiokafka.errors import KafkaError

from flexpipe import envelope
from gearbox.config import DEFAULT_CONFIG, GearboxConfig
from gearbox.decisions import Trigger
from gearbox.history import GearState
from gearbox.residency import OnDemandModel
from gearbox.types import TopologySnapshot
from streams import codec
from streams.intake import DeadLetterReason, Rejected
from streams.load import ServingWindows
from streams.neighbours import neighbours_view
from streams.ondemand import is_on_demand, on_demand_view, round_plans
from streams.ports import DecisionLog, Message, TableName, TriggerMessage
from streams.processor import StreamProcessor
from streams.snapshot import TopologyBuilder
from streams.step import (
    TRIGGER_RANK,
    Cursor,
    DeploymentTables,
    LoggedDecision,
    OverrideState,
    PlanState,
    RoundOrder,
    StepInput,
    StepOutput,
    TriggerInfo,
    claimed_gpus,
    decision_order,
    make_input,
    plan_disturbed,
    reconcile,
    step,
    taken_gpus,
    tick_due_ms,
    view_timeout_s,
)

__all__ = ["Decider", "profile_steps"]

log = logging.getLogger(__name__)
MAX_TRIGGER_TEXT = 300
GEAR_STATE_EVERY_S = 30.0  # event time between block-history writes when nothing else moved
PUBLISH_WAIT_S = 2.0  # wall seconds to wait for a decision's acknowledgement under the lock
LOG_READ_S = 5.0  # wall seconds a read of the decisions topic may take before it is retried
REVOKE_WAIT_S = 30.0  # wall seconds a revocation waits for unacknowledged decisions
# NOTE: a step costs ~25 ms of CPU on 1,000 GPUs, on the interpreter lock the event loop folds
# telemetry with: deciding every deployment on every cluster event (16/s in bench.pipeline) made
# the worker CPU-bound and a forced switch queue behind the others' steps. Those others may
# gain from freed GPUs, never lose a plan: a second costs them little, and it merges the
# changes of that second into one step each.
LATER_S = 1.0  # wall seconds an undisturbed deployment's topology change waits for more
# NOTE: one thread runs every decision step of the process, one at a time: gearbox's caches
# are touched by that thread only, and the event loop stays free to fold telemetry. The step is
# pure Python, so it shares the interpreter lock with the loop (switched every few ms) rather
# than adding a core; what it removes is the loop's stall for a whole batch of decisions.
_DECISIONS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streams-decide")


@dataclass(frozen=True, slots=True)
class _BatchStart:
    """What every on-demand step of one batch reads, taken at its first: one time, one
    topology, the plans and serving windows as they were (:func:`streams.ondemand.round_plans`).

    NOTE: telemetry and transitions keep folding while steps run; without this, the on-demand
    deployments of one tick decided from different views, and so from different rounds.
    """

    now_ms: int
    topology: TopologySnapshot
    plans: dict[str, PlanState]
    serving: dict[str, ServingWindows]


class Decider:
    """Decides for the deployments this worker owns, one batch of triggers at a time."""

    def __init__(
        self,
        engine: StreamProcessor,
        decision_log: DecisionLog,
        owns: Callable[[str], bool],
        gearbox_config: GearboxConfig = DEFAULT_CONFIG,
    ) -> None:
        self.engine = engine
        self.decision_log = decision_log
        self.owns = owns
        self.gearbox_config = gearbox_config
        self.accepting = True
        self.generation = 0
        self._verified: dict[str, int] = {}
        # NOTE: one lock for all deciding: it is CPU-bound anyway, and a revocation waits on it.
        self._lock = asyncio.Lock()
        self._pending: dict[str, list[TriggerInfo]] = {}
        self._pending_since_s = 0.0
        self._pending_loop_s = 0.0  # the event loop's clock when the first pending one came
        self._debounce: asyncio.Task[None] | None = None
        self._topology: tuple[tuple[int, int], TopologySnapshot] | None = None
        self._builder = TopologyBuilder(engine.catalog)
        self._block_rows: list[tuple[str, str, int]] | None = None  # the block gauges shown
        self._by_name = {d.name: d for d in engine.deployments}
        self._has_on_demand = any(is_on_demand(d) for d in engine.deployments)
        self._rank = {d.name: i for i, d in enumerate(engine.deployments)}
        self._gear_written: dict[str, tuple[int, object, float | None]] = {}
        self._gear_unwritten: set[str] = set()
        self._unacked: dict[str, asyncio.Future[None]] = {}  # sends past PUBLISH_WAIT_S
        self._deferred: dict[str, TriggerInfo] = {}  # triggers to decide first when possible
        self._later: dict[str, list[TriggerInfo]] = {}  # triggers left for later
        self._urgent = 0  # rounds with a topology or operator trigger waiting for the lock
        self._later_task: asyncio.Task[None] | None = None
        # deployment → event time of the oldest topology change left for later, not decided yet
        self._later_since_ms: dict[str, int] = {}
        # deployment → the view's ``nodes_version`` its last stored decision saw
        self._nodes_seen: dict[str, int] = {}
        self._log_lock = asyncio.Lock()  # NOTE: one consumer reads the log: one read at a time

    @property
    def lock(self) -> asyncio.Lock:
        """Held while deciding until the decision's tables are written: hold it to change a
        deployment's plan, or that table write (from the plan read before) overwrites it."""
        return self._lock

    # ---- rebalance --------------------------------------------------------------------------

    async def on_revoked(self) -> None:
        """Stop deciding and let decisions in flight reach the broker before partitions move."""
        self.accepting = False
        self._pending.clear()
        self._deferred.clear()
        self._later.clear()
        self._later_since_ms.clear()
        self._nodes_seen.clear()
        if self._unacked:  # NOTE: the next owner must find them on the topic
            await asyncio.wait(list(self._unacked.values()), timeout=REVOKE_WAIT_S)
        async with self._lock:
            for name in sorted(self._gear_unwritten):
                gear = self.engine.load_gear(name)
                if gear is not None:
                    self.engine.store_gear(name, gear)
            self._gear_unwritten.clear()
            self._gear_written.clear()
            self.engine.flush()
            self.engine.forget()

    def on_assigned(self) -> None:
        """A new assignment: re-read every deployment's last decision before deciding again."""
        self.generation += 1
        self.accepting = True

    # ---- triggers ---------------------------------------------------------------------------

    def submit(self, name: str, trigger: TriggerInfo, received_wall_s: float) -> None:
        """Decide for a topology change after the debounce, in this process (the fast path).

        The same trigger also travels the triggers topic (the durable path); whichever arrives
        second finds it decided and is skipped.
        """
        if not self._pending:
            self._pending_since_s = received_wall_s
            self._pending_loop_s = asyncio.get_running_loop().time()
        self._pending.setdefault(name, []).append(trigger)
        if self._debounce is None or self._debounce.done():
            self._debounce = asyncio.ensure_future(self._after_debounce())

    async def _after_debounce(self) -> None:
        # NOTE: a trigger submitted while this task decides finds it not done and starts no
        # other: it is decided by the next round here, not left pending (ticks skip a
        # deployment with a pending trigger) until some later cluster event.
        while self._pending:
            # NOTE: the window runs from the first trigger's arrival: one that arrived while the
            # last round was deciding has waited already
            loop = asyncio.get_running_loop()
            debounce_s = self.engine.cfg.streams.debounce_ms / 1000.0
            await asyncio.sleep(max(0.0, self._pending_loop_s + debounce_s - loop.time()))
            pending, self._pending = self._pending, {}
            try:
                await self.evaluate_many(
                    {name: _merge(triggers) for name, triggers in pending.items()},
                    self._pending_since_s,
                )
            except Exception:  # NOTE: the triggers topic still carries these triggers
                log.exception("debounced decision failed")

    async def _after_later(self) -> None:
        """Decide the topology changes left for later, ``LATER_S`` after they were left."""
        while self._later:
            await asyncio.sleep(LATER_S)
            later, self._later = self._later, {}
            try:
                merged = {name: _merge(triggers) for name, triggers in later.items()}
                await self.evaluate_many(merged, self.engine.wall(), later=True)
            except Exception:  # NOTE: the triggers topic still carries these triggers
                log.exception("later decision failed")

    async def on_triggers(self, batch: Sequence[Message], received_wall_s: float) -> None:
        """A debounced batch from the triggers topic: one decision per deployment in it."""
        by_name: dict[str, list[TriggerInfo]] = defaultdict(list)
        for msg in batch:
            try:
                trigger = codec.loads(TriggerMessage, msg.value or b"")
            except ValueError as exc:
                bad = Rejected(DeadLetterReason.INVALID_FIELD, "", f"trigger: {exc}"[:500])
                await self.engine.reject(bad, msg, "triggers")
                continue
            if trigger.node is not None:
                self.engine.view.apply_node(trigger.node)
            self.engine.clock = self.engine.clock.observe(trigger.time_ms, received_wall_s)
            info = TriggerInfo(trigger.kind, trigger.time_ms, trigger.description)
            by_name[trigger.deployment].append(info)
        merged = {name: _merge(triggers) for name, triggers in by_name.items()}
        await self.evaluate_many(merged, received_wall_s)

    async def tick(self) -> None:
        """Decide for every owned deployment whose periodic tick is due."""
        now_ms = self.engine.now_ms()
        if now_ms < 0:
            return
        if self._deferred and self.engine.ready():
            deferred, self._deferred = self._deferred, {}
            await self.evaluate_many(deferred, self.engine.wall())
        due = tick_due_ms(now_ms, self.engine.cfg.intervals.decision_s)
        todo = {}
        for dep in self.engine.deployments:
            cursor = self.engine.load(TableName.CURSORS, dep.name, Cursor) or Cursor()
            # NOTE: a topology change waiting out its debounce (or deferred) decides first, and
            # explains why.
            if dep.name in self._pending or dep.name in self._deferred:
                continue
            if cursor.admits(Trigger.TIMER, due) and self.owns(dep.name):
                todo[dep.name] = TriggerInfo(Trigger.TIMER, due, "periodic tick")
        if todo:
            await self.evaluate_many(todo, self.engine.wall())

    # ---- deciding ---------------------------------------------------------------------------

    async def evaluate(self, name: str, trigger: TriggerInfo, received_wall_s: float) -> None:
        """Decide once for ``trigger`` if this worker owns ``name`` and is ready."""
        await self.evaluate_many({name: trigger}, received_wall_s)

    def _admissible(self, triggers: Mapping[str, TriggerInfo]) -> dict[str, TriggerInfo]:
        metrics = self.engine.metrics
        wanted = {}
        for name, trigger in triggers.items():
            if name not in self._by_name or not self.accepting or not self.owns(name):
                metrics.skipped.labels("not_owner").inc()
            elif not self.engine.ready():
                metrics.skipped.labels("not_ready").inc()
                self._defer(name, trigger)
            elif name in self._unacked:
                metrics.skipped.labels("publish_pending").inc()
                self._defer(name, trigger)
            else:
                wanted[name] = trigger
        return wanted

    def _defer(self, name: str, trigger: TriggerInfo) -> None:
        """Keep a topology or operator trigger for later (a timer comes again by itself)."""
        if trigger.kind is Trigger.TIMER:
            return
        earlier = self._deferred.get(name)
        self._deferred[name] = trigger if earlier is None else _merge([earlier, trigger])

    async def _read_logs(
        self, triggers: Mapping[str, TriggerInfo]
    ) -> dict[str, tuple[int, LoggedDecision | None]]:
        """The last logged decision of each deployment not yet verified since the assignment,
        read outside the decider's lock and bounded by ``LOG_READ_S``; a deployment whose read
        failed is left out (and its trigger deferred)."""
        out: dict[str, tuple[int, LoggedDecision | None]] = {}
        for name, trigger in triggers.items():
            generation = self.generation
            if self._verified.get(name) == generation:
                continue
            try:
                async with self._log_lock:
                    last = await asyncio.wait_for(self.decision_log.last(name), LOG_READ_S)
            except (TimeoutError, KafkaError, OSError) as exc:
                log.warning("%s: decisions topic not readable (%r); deciding later", name, exc)
                self.engine.metrics.skipped.labels("log_unreadable").inc()
                self._defer(name, trigger)
                continue
            out[name] = (generation, last)
        return out

    async def evaluate_many(
        self, triggers: Mapping[str, TriggerInfo], received_wall_s: float, *, later: bool = False
    ) -> None:
        """Decide for each (deployment, trigger); publish all, then store each acknowledged one.

        ``later``: the round of the topology changes left for later (see the module docstring).
        """
        wanted = self._admissible(triggers)
        if not wanted:
            return
        logged = await self._read_logs(wanted)
        urgent = not later and any(t.kind is not Trigger.TIMER for t in wanted.values())
        self._urgent += int(urgent)
        try:
            await self._lock.acquire()
        finally:
            self._urgent -= int(urgent)
        try:
            await self._decide_locked(wanted, logged, received_wall_s, later)
        finally:
            self._lock.release()

    async def _decide_locked(
        self,
        wanted: dict[str, TriggerInfo],
        logged: Mapping[str, tuple[int, LoggedDecision | None]],
        received_wall_s: float,
        later: bool,
    ) -> None:
        """:meth:`evaluate_many`'s round, under the lock."""
        wanted = {n: t for n, t in wanted.items() if self._can_decide(n, logged.get(n))}
        e = self.engine
        # NOTE: before the sweep and flush (a few ms on 1,000 GPUs): the durable copy of a
        # trigger the fast path decided, or a redelivery, usually ends here
        for name in [n for n, t in wanted.items() if self._refused(n, t, logged.get(n))]:
            e.metrics.skipped.labels("already_decided").inc()
            del wanted[name]
        if not wanted:
            return
        # NOTE: sweep and publish first, so timed-out heartbeats are judged at the decision's
        # own clock (as the offline replay does), not at the last housekeeping timer's.
        e.sweep()
        e.flush()
        outs, sends = [], []
        decided: dict[str, PlanState] = {}  # this batch's plans, claimed for the next ones
        start: _BatchStart | None = None
        # NOTE: the replay's order: an earlier deployment's new plan is claimed before a
        # later one plans.
        first, then = self._order(wanted)
        for name in first + then:
            if name in then and self._leave(name, wanted[name], later):
                continue
            trigger = self._with_left(name, wanted[name])
            # NOTE: read with the input, before the step and the sends are awaited, which
            # let more cluster events fold
            nodes_version = e.view.nodes_version
            if start is None and is_on_demand(self._by_name[name]):
                start = self._batch_start(wanted, decided)
            inp = self._input(name, trigger, logged.get(name), decided, start)
            # NOTE: the step (gearbox) runs off the event loop, so telemetry keeps folding
            # meanwhile: its input is an immutable snapshot taken here, and the lock keeps
            # the tables it writes from changing until its result is stored.
            started_s = e.wall()
            out = None if inp is None else await self._step(inp)
            stepped_s = e.wall()
            if not self.accepting:
                break  # NOTE: revoked meanwhile: what was sent is still awaited and stored
            if out is None:
                e.metrics.skipped.labels("already_decided").inc()
                continue
            decided[name] = out.plan
            self._later_since_ms.pop(name, None)
            outs.append((name, out, trigger, nodes_version))
            # NOTE: sent at once: a decision does not wait for the batch's later steps
            sends.append(asyncio.ensure_future(self._send(name, out)))
            if name in first and trigger.kind is Trigger.TOPOLOGY_CHANGE:
                self._time_stages(sends[-1], received_wall_s, started_s, stepped_s)
        if not outs:
            return
        await asyncio.wait(sends, timeout=PUBLISH_WAIT_S)
        for (name, out, trigger, nodes_version), sent in zip(outs, sends, strict=True):
            if not sent.done():
                self._park(name, out, sent)
            elif sent.exception() is not None:
                self._verified.pop(name, None)  # NOTE: it may have landed all the same
                log.error(
                    "%s: decision %s not published: %r",
                    name,
                    out.decision.seq,
                    sent.exception(),
                )
            else:
                self._stored(name, out, trigger, received_wall_s)
                self._nodes_seen[name] = nodes_version

    def _time_stages(
        self, sent: asyncio.Future[None], received_s: float, started_s: float, stepped_s: float
    ) -> None:
        """Observe a disturbed deployment's wait, step and publish stages once ``sent`` ends."""
        stage = self.engine.metrics.forced_stage

        def acknowledged(fut: asyncio.Future[None]) -> None:
            if fut.cancelled() or fut.exception() is not None:
                return
            stage.labels("wait").observe(max(0.0, started_s - received_s))
            stage.labels("step").observe(max(0.0, stepped_s - started_s))
            stage.labels("publish").observe(max(0.0, self.engine.wall() - stepped_s))

        sent.add_done_callback(acknowledged)

    def _order(self, wanted: Mapping[str, TriggerInfo]) -> RoundOrder:
        """The round's order (:func:`streams.step.decision_order`) on the view now."""
        e = self.engine
        names = sorted(wanted, key=self._rank.__getitem__)
        plans = {n: p.current for n in names if (p := e.load(TableName.PLANS, n, PlanState))}
        now_ms = max(e.now_ms(), *(t.time_ms for t in wanted.values()))
        return decision_order(names, plans, self._topology_at(now_ms))

    def _leave(self, name: str, trigger: TriggerInfo, later: bool) -> bool:
        """Leave undisturbed ``name``'s ``trigger`` for later: a topology change from its own
        round, and from the later round while a topology round is pending; a tick while a
        topology round is pending; not once the oldest trigger left has waited
        ``intervals.decision_s`` of event time."""
        yielding = bool(self._pending) or self._urgent > 0
        if trigger.kind is Trigger.TOPOLOGY_CHANGE:
            if later and not yielding:
                return False
        elif trigger.kind is not Trigger.TIMER or not yielding:
            return False
        since_ms = self._later_since_ms.setdefault(name, trigger.time_ms)
        if self.engine.now_ms() - since_ms >= self.engine.cfg.intervals.decision_s * 1000:
            return False
        self._later.setdefault(name, []).append(trigger)
        if self._later_task is None or self._later_task.done():
            self._later_task = asyncio.ensure_future(self._after_later())
        self.engine.metrics.skipped.labels("later").inc()
        return True

    def _with_left(self, name: str, trigger: TriggerInfo) -> TriggerInfo:
        """``trigger`` merged with the topology changes left for later for ``name``: the step
        decided now answers them too."""
        left = self._later.pop(name, None)
        if left is None:
            return trigger
        # NOTE: as the newest of them (a tick's boundary can be older than a change left)
        return _merge(sorted([*left, trigger], key=lambda t: (t.time_ms, TRIGGER_RANK[t.kind])))

    def _can_decide(self, name: str, logged: tuple[int, LoggedDecision | None] | None) -> bool:
        """After the lock was taken: still accepting, no send of its unresolved, and verified
        since the assignment or its log read belongs to this assignment."""
        if not self.accepting or name in self._unacked:
            return False
        return self._verified.get(name) == self.generation or (
            logged is not None and logged[0] == self.generation
        )

    def _park(self, name: str, out: StepOutput, sent: asyncio.Future[None]) -> None:
        """Leave an unacknowledged decision to its producer; when the send ends, the topic is
        read again before the deployment is decided for (it rolls the tables forward if the
        decision landed, and its id is not reused if it did)."""
        log.warning(
            "%s: decision %s not acknowledged within %.0f s; not deciding for it until it is",
            name,
            out.decision.decision_id,
            PUBLISH_WAIT_S,
        )
        self._unacked[name] = sent

        def ended(fut: asyncio.Future[None]) -> None:
            self._unacked.pop(name, None)
            self._verified.pop(name, None)
            exc = None if fut.cancelled() else fut.exception()
            if exc is None:
                log.info("%s: decision %s acknowledged late", name, out.decision.decision_id)
            else:
                log.error("%s: decision %s not published: %r", name, out.decision.seq, exc)

        sent.add_done_callback(ended)

    def _state(
        self, name: str, logged: tuple[int, LoggedDecision | None] | None
    ) -> tuple[Cursor, PlanState, GearState]:
        e = self.engine
        cursor = e.load(TableName.CURSORS, name, Cursor) or Cursor()
        plan = e.load(TableName.PLANS, name, PlanState) or PlanState()
        gear = e.load_gear(name) or GearState()
        if self._verified.get(name) != self.generation and logged is not None:
            fixed = reconcile(cursor, plan, gear, logged[1])
            if fixed != (cursor, plan, gear):
                log.info("%s: tables rolled forward to decision %s", name, fixed[0].seq)
                cursor, plan, gear = fixed
                e.store(TableName.CURSORS, name, cursor)
                e.store(TableName.PLANS, name, plan)
                e.store_gear(name, gear)
            self._verified[name] = self.generation
        return cursor, plan, gear

    def _topology_at(self, now_ms: int) -> TopologySnapshot:
        e = self.engine
        key = (now_ms, e.view.version)
        if self._topology is None or self._topology[0] != key:
            timeout_s = view_timeout_s(e.cfg)
            snap = self._builder.build(e.view.gpus, e.view.nodes, now_ms / 1000, timeout_s)
            self._topology = (key, snap)
        return self._topology[1]

    def _refused(
        self, name: str, trigger: TriggerInfo, logged: tuple[int, LoggedDecision | None] | None
    ) -> bool:
        """Whether the cursor refuses ``trigger`` and it is no late topology trigger either."""
        cursor, _, _ = self._state(name, logged)
        if cursor.admits(trigger.kind, trigger.time_ms):
            return False
        return self._late(name, trigger, cursor) is None

    def _input(
        self,
        name: str,
        trigger: TriggerInfo,
        logged: tuple[int, LoggedDecision | None] | None,
        decided: dict[str, PlanState],
        start: _BatchStart | None,
    ) -> StepInput | None:
        """The step's input for ``trigger``, snapshotted now (an on-demand deployment's: as
        ``start``, its batch's first on-demand step, saw it); None when the cursor refuses it."""
        e = self.engine
        dep = self._by_name[name]
        cursor, plan, gear = self._state(name, logged)
        if not cursor.admits(trigger.kind, trigger.time_ms):
            late = self._late(name, trigger, cursor)
            if late is None:
                return None
            trigger = late
        tables = DeploymentTables(
            plan,
            gear,
            e.load(TableName.OVERRIDES, name, OverrideState) or OverrideState(),
            cursor,
            e.load(TableName.SERVING, name, ServingWindows) or ServingWindows(),
        )
        if start is not None and is_on_demand(dep):
            now_ms = max(start.now_ms, trigger.time_ms)
            plans = round_plans(self._plans(decided), start.plans, e.deployments)
            serving = start.serving
            topology = start.topology if now_ms == start.now_ms else self._topology_at(now_ms)
        else:
            now_ms = max(e.now_ms(), trigger.time_ms)
            plans = self._plans(decided)
            serving = self._serving()
            topology = self._topology_at(now_ms)
        return make_input(
            dep,
            e.deployments,
            tables,
            (e.view.gpus, e.view.nodes),
            e.catalog,
            e.load_window,
            now_ms,
            trigger,
            view_timeout_s(e.cfg),
            self.gearbox_config,
            e.worker,
            topology=topology,
            transition_timeout_s=e.cfg.streams.transition_timeout_s,
            claims=claimed_gpus(plans, name),
            taken=taken_gpus(plans, name),
            on_demand=self._on_demand(plans, serving, now_ms),
            placement=e.cfg.placement,
            neighbours=neighbours_view(
                e.deployments,
                plans,
                serving,
                e.load_gear,
                e.load_window,
                now_ms / 1000.0,
                name,
            ),
        )

    async def _step(self, inp: StepInput) -> StepOutput | None:
        """:func:`streams.step.step` on the decision thread (the loop folds input meanwhile)."""
        return await asyncio.get_running_loop().run_in_executor(_DECISIONS, _profiled_step, inp)

    def _batch_start(
        self, wanted: Mapping[str, TriggerInfo], decided: dict[str, PlanState]
    ) -> _BatchStart:
        """What this batch's on-demand steps read (:class:`_BatchStart`), taken now."""
        now_ms = max(self.engine.now_ms(), *(t.time_ms for t in wanted.values()))
        return _BatchStart(now_ms, self._topology_at(now_ms), self._plans(decided), self._serving())

    def _late(self, name: str, trigger: TriggerInfo, cursor: Cursor) -> TriggerInfo | None:
        """A topology trigger the cursor refused, as one it admits, when cluster events were
        folded since ``name``'s last stored decision; else None (a redelivery or the durable
        copy of a trigger already decided, or the deployment's last decision is not known here).

        NOTE: without this, an event folded after a later trigger was decided (another
        partition's event or a tick, while this partition trailed) changes the view but is
        decided by nothing until the next trigger or tick — a preemption of a serving GPU went
        unanswered for good when its release was folded before that. The decision is stamped at
        the clock (and after the cursor): when the worker learned of the event.
        """
        seen = self._nodes_seen.get(name)
        if trigger.kind is not Trigger.TOPOLOGY_CHANGE or seen is None:
            return None
        if self.engine.view.nodes_version <= seen:
            return None
        time_ms = self._past_cursor(cursor)
        text = (
            f"{trigger.description} (late: event time t={trigger.time_ms / 1000:.3f} s, folded"
            f" after the decision at t={cursor.trigger_time_ms / 1000:.3f} s)"
        )
        return TriggerInfo(trigger.kind, time_ms, text[:MAX_TRIGGER_TEXT])

    def _plans(self, decided: dict[str, PlanState]) -> dict[str, PlanState]:
        """Every deployment's plan state this worker can read, this batch's decisions first:
        the other deployments' claims and the on-demand view both come from it.

        NOTE: tables are partitioned by deployment, so a worker sees the plans of the
        deployments it owns; with several workers, another worker's deployments are known only
        through telemetry (their GPUs' memory), as before.
        """
        e = self.engine
        loaded = {
            d.name: p
            for d in e.deployments
            if d.name not in decided
            and (p := e.load(TableName.PLANS, d.name, PlanState)) is not None
        }
        return loaded | decided

    def _serving(self) -> dict[str, ServingWindows]:
        """Every deployment's serving windows this worker can read: read once per step for both
        the on-demand view and the neighbours."""
        e = self.engine
        return {
            d.name: s
            for d in e.deployments
            if (s := e.load(TableName.SERVING, d.name, ServingWindows)) is not None
        }

    def _on_demand(
        self, plans: dict[str, PlanState], serving: dict[str, ServingWindows], now_ms: int
    ) -> tuple[OnDemandModel, ...]:
        """Every on-demand deployment's view from ``plans`` (:meth:`_plans`) and ``serving``
        (:meth:`_serving`), as the replay builds it; empty when none is on demand."""
        if not self._has_on_demand:
            return ()
        e = self.engine
        return on_demand_view(
            e.deployments, plans, serving, e.load_window, now_ms / 1000.0, self.gearbox_config
        )

    async def _send(self, name: str, out: StepOutput) -> None:
        e = self.engine
        env = envelope.make(
            out.decision,
            event_time_ms=out.event_time_ms,
            source=f"streams/{e.worker}",
            seq=out.decision.seq,
        )
        await e.send(e.topics.decisions, name.encode(), envelope.encode(env), wait=True)

    def _stored(
        self, name: str, out: StepOutput, trigger: TriggerInfo, received_wall_s: float
    ) -> None:
        e = self.engine
        # NOTE: only after the acknowledgement: the topic stays ahead of the tables, never behind.
        e.store(TableName.CURSORS, name, out.cursor)
        e.store(TableName.PLANS, name, out.plan)
        self._store_gear(name, out.gear, out.event_time_ms)
        wall_s = e.wall()
        kind = trigger.kind.value
        e.metrics.decisions.labels(out.decision.reason, kind).inc()
        e.metrics.decision_latency.labels(kind).observe(max(0.0, wall_s - trigger.time_ms / 1000))
        e.metrics.decision_processing.labels(kind).observe(max(0.0, wall_s - received_wall_s))
        rows = [(b.block_id, b.domain_id, b.num_gpus) for b in out.gear.blocks]
        if rows != self._block_rows:  # NOTE: ~125 labelled gauges: set only when they moved
            e.metrics.set_blocks(rows)
            self._block_rows = rows
        e.metrics.set_ttft(name, out.result.current, out.decision.context.load)
        self.show_plan(name, out.plan)
        d = out.decision
        log.info("%s %s: %s", d.decision_id, d.reason, d.to_plan_id)

    def _store_gear(self, name: str, gear: GearState, t_ms: int) -> None:
        """Write the gear state when blocks or the last switch changed, else at most every
        ``GEAR_STATE_EVERY_S`` of event time (the topic restores the last switch after a crash;
        a few lost history samples do not matter). A write carries the block history as its
        difference from the last base (:mod:`streams.gearstore`), not the whole ≈ 1 MB."""
        e = self.engine
        last = self._gear_written.get(name)
        changed = last is None or (last[1], last[2]) != (gear.blocks, gear.last_switch_s)
        if changed or last is None or t_ms - last[0] >= GEAR_STATE_EVERY_S * 1000:
            e.store_gear(name, gear)
            self._gear_written[name] = (t_ms, gear.blocks, gear.last_switch_s)
            self._gear_unwritten.discard(name)
        else:
            e.remember(TableName.GEAR_STATE, name, gear)
            self._gear_unwritten.add(name)

    def after_transition(self, name: str, plan: PlanState, wall_s: float) -> None:
        """Decide for ``name`` again when a transition record left it on a plan the view
        disturbs.

        NOTE: a cluster event folded before the runtime's report of a switch (the transitions
        backlog trails, or the switch ended just after the event) was decided on the plan the
        worker knew: a GPU lost by the switch's target is answered by a hold when the serving
        plan stays feasible (the runtime rolls back, ``ALREADY_SERVING``). When the report says
        the switch was done after all, no other trigger would come before the next tick."""
        current = plan.current
        if current is None or not self.owns(name):
            return
        now_ms = self.engine.now_ms()
        if now_ms < 0 or not plan_disturbed(current, self._topology_at(now_ms)):
            return
        cursor = self.engine.load(TableName.CURSORS, name, Cursor) or Cursor()
        why = f"the runtime reports {current.plan_id}, which lost GPUs since it was decided"
        trigger = TriggerInfo(Trigger.TOPOLOGY_CHANGE, self._past_cursor(cursor), why)
        self.submit(name, trigger, wall_s)

    def _past_cursor(self, cursor: Cursor) -> int:
        """Event time for a trigger the worker raises itself: the clock, and after ``cursor``'s
        last trigger, so the cursor admits it."""
        return max(self.engine.now_ms(), cursor.trigger_time_ms + 1)

    def show_plan(self, name: str, plan: PlanState) -> None:
        """Export ``plan`` as the deployment's current plan."""
        current = plan.current
        self.engine.metrics.set_plan(
            name,
            current.plan_id if current is not None else None,
            plan.source.value,
            current.num_gpus if current is not None else 0,
        )


_step_profile: list[cProfile.Profile] = []  # NOTE: set by profile_steps: the worker's --profile


def profile_steps(profile: cProfile.Profile) -> None:
    """Profile every later decision step with ``profile`` (on the decision thread, which the
    event loop thread's profiler does not see)."""
    _step_profile[:] = [profile]


def _profiled_step(inp: StepInput) -> StepOutput | None:
    if not _step_profile:
        return step(inp)
    profile = _step_profile[0]
    profile.enable()
    try:
        return step(inp)
    finally:
        profile.disable()


def _merge(triggers: Sequence[TriggerInfo]) -> TriggerInfo:
    """Several triggers of one debounce window as one: the newest time, every description."""
    texts = list(dict.fromkeys(t.description for t in triggers))
    kind = triggers[-1].kind
    return TriggerInfo(kind, max(t.time_ms for t in triggers), "; ".join(texts)[:MAX_TRIGGER_TEXT])
