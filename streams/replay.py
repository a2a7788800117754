"""Offline replay: recorded telemetry through the same folds and decision step as the live app.

:class:`Replayer` folds envelopes exactly as a worker does — including the shared view's
publication rule (a GPU record moves only on a material change or after ``view_refresh_s``)
and the heartbeat sweep — and decides through :func:`streams.step.make_input` and
:func:`streams.step.step`, the code the live decider runs. Two uses:

* :func:`run_free` plays a trace and decides on its own triggers (ticks on event-time
  boundaries, topology changes) — the golden-trace test pins its output;
* :func:`compare` re-decides every recorded decision at the snapshot time the decision recorded
  and reports whether the outcome (reason, target plan) is the same.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from flexpipe.config import FlexPipeConfig
from flexpipe.envelope import Envelope
from flexpipe.schemas import (
    ClusterEvent,
    ControlCommand,
    GearTransition,
    GpuSample,
    ServingLoad,
)
from gearbox.decisions import Trigger
from gearbox.history import GearState
from gearbox.types import TopologySnapshot
from streams.catalog import Catalog
from streams.deployments import Deployment
from streams.load import ServingWindows, fold_serving
from streams.neighbours import neighbours_view
from streams.ondemand import is_on_demand, on_demand_view, round_plans
from streams.snapshot import build_topology
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
    Cursor,
    DeploymentTables,
    LoggedDecision,
    OverrideState,
    PlanState,
    StepOutput,
    TriggerInfo,
    claimed_gpus,
    decision_order,
    fold_control,
    fold_rollback,
    fold_transition,
    make_input,
    reconcile,
    step,
    taken_gpus,
    tick_due_ms,
    view_timeout_s,
)
from streams.windows import HoppingWindow

__all__ = ["Mismatch", "ReplayReport", "Replayer", "compare", "run_free"]


@dataclass
class Replayer:
    """One process's replica of a worker's state, owning every deployment."""

    cfg: FlexPipeConfig  # NOTE: gearbox's knobs are cfg.gearbox, as the live worker's are
    catalog: Catalog
    deployments: tuple[Deployment, ...]
    latest: dict[str, GpuState] = field(default_factory=dict)
    published: dict[str, GpuState] = field(default_factory=dict)
    nodes: dict[str, NodeState] = field(default_factory=dict)
    tables: dict[str, DeploymentTables] = field(default_factory=dict)
    clock_ms: int = -1

    def __post_init__(self) -> None:
        s = self.cfg.streams
        self.load_window = HoppingWindow(s.load_window_s, s.load_step_s)
        for dep in self.deployments:
            self.tables[dep.name] = DeploymentTables(
                PlanState(), GearState(), OverrideState(), Cursor(), ServingWindows()
            )

    def _publish(self, state: GpuState) -> None:
        old = self.published.get(state.uuid)
        if material_gpu_change(old, state, self.cfg.streams.view_refresh_s):
            self.published[state.uuid] = replace(state, rev=(old.rev if old else 0) + 1)

    def fold(self, env: Envelope[Any]) -> bool:
        """Fold one envelope; True when it changed the topology (a topology trigger)."""
        self.clock_ms = max(self.clock_ms, env.event_time_ms)
        p = env.payload
        if isinstance(p, GpuSample):
            new, outcome = fold_gpu_sample(
                self.latest.get(p.gpu_uuid), p, env.source, env.seq, env.event_time_ms
            )
            if outcome is FoldOutcome.APPLIED and new is not None:
                self.latest[p.gpu_uuid] = new
                self._publish(new)
        elif isinstance(p, ClusterEvent):
            node, outcome = fold_cluster_event(
                self.nodes.get(p.node), p, env.source, env.seq, env.event_time_ms
            )
            self.nodes[p.node] = node
            return outcome is FoldOutcome.APPLIED
        elif isinstance(p, ServingLoad | GearTransition | ControlCommand):
            self._fold_deployment(env)
        return False

    def _fold_deployment(self, env: Envelope[Any]) -> None:
        p = env.payload
        t = self.tables.get(p.deployment)
        if t is None:
            return
        if isinstance(p, ServingLoad):
            serving, _ = fold_serving(
                t.serving, self.load_window, p, env.source, env.seq, env.event_time_ms
            )
            t = replace(t, serving=serving)
        elif isinstance(p, GearTransition):
            try:
                t = replace(t, plan=fold_transition(t.plan, p, env.event_time_ms))
            except (TypeError, ValueError):
                return  # the live app dead-letters it
            t = replace(t, gear=fold_rollback(t.gear, p, env.event_time_ms, self.cfg.gearbox))
        else:
            t = replace(t, overrides=fold_control(t.overrides, t.plan, p, env.event_time_ms))
        self.tables[p.deployment] = t

    def sweep(self, now_ms: int) -> None:
        """The heartbeat sweep the owning worker runs."""
        for uuid, state in list(self.latest.items()):
            new = mark_timed_out(state, now_ms / 1000.0, self.cfg.intervals.heartbeat_timeout_s)
            if new is not None:
                self.latest[uuid] = new
                self._publish(new)

    def decide(
        self,
        name: str,
        trigger: TriggerInfo,
        now_ms: int,
        start: Mapping[str, PlanState] | None = None,
    ) -> StepOutput | None:
        """Decide for ``name`` at ``now_ms``; the step's state is kept. ``start``: the plans as
        the batch this decision belongs to began (:func:`streams.ondemand.round_plans`)."""
        self.sweep(now_ms)
        dep = next(d for d in self.deployments if d.name == name)
        return self._decide(dep, trigger, now_ms, None, start)

    def plans(self) -> dict[str, PlanState]:
        """Every deployment's plan state now."""
        return {n: t.plan for n, t in self.tables.items()}

    def decide_all(self, trigger: TriggerInfo, now_ms: int) -> list[StepOutput]:
        """Decide for every deployment at ``now_ms`` in the live decider's order
        (:func:`streams.step.decision_order`: those whose plan the topology disturbed first,
        each group in the configured order): one sweep, one topology for the instant (the
        decider's per-instant cache), each deployment's own tables. Steps that refuse the
        trigger (not newer than the last decided) yield nothing. On-demand deployments decide
        from the plans as the batch began (:func:`streams.ondemand.round_plans`)."""
        self.sweep(now_ms)
        topology = build_topology(
            self.published, self.nodes, self.catalog, now_ms / 1000.0, view_timeout_s(self.cfg)
        )
        by_name = {dep.name: dep for dep in self.deployments}
        start = self.plans()
        plans = {name: p.current for name, p in start.items()}
        first, then = decision_order(tuple(by_name), plans, topology)
        outs = (
            self._decide(by_name[name], trigger, now_ms, topology, start) for name in first + then
        )
        return [out for out in outs if out is not None]

    def _decide(
        self,
        dep: Deployment,
        trigger: TriggerInfo,
        now_ms: int,
        topology: TopologySnapshot | None,
        start: Mapping[str, PlanState] | None,
    ) -> StepOutput | None:
        name = dep.name
        t = self.tables[name]
        plans = self.plans()
        if start is not None and is_on_demand(dep):
            plans = round_plans(plans, start, self.deployments)
        serving = {n: tb.serving for n, tb in self.tables.items()}
        now_s = now_ms / 1000.0
        inp = make_input(
            dep,
            self.deployments,
            t,
            (self.published, self.nodes),
            self.catalog,
            self.load_window,
            now_ms,
            trigger,
            view_timeout_s(self.cfg),
            self.cfg.gearbox,
            "replay",
            topology=topology,
            transition_timeout_s=self.cfg.streams.transition_timeout_s,
            claims=claimed_gpus(plans, name),
            taken=taken_gpus(plans, name),
            on_demand=on_demand_view(
                self.deployments, plans, serving, self.load_window, now_s, self.cfg.gearbox
            ),
            placement=self.cfg.placement,
            neighbours=neighbours_view(
                self.deployments,
                plans,
                serving,
                lambda n: self.tables[n].gear,
                self.load_window,
                now_s,
                name,
            ),
        )
        out = step(inp)
        if out is not None:
            self.tables[name] = replace(t, plan=out.plan, gear=out.gear, cursor=out.cursor)
        return out


def run_free(replayer: Replayer, envs: Iterable[Envelope[Any]]) -> list[StepOutput]:
    """Play ``envs`` (event-time order) and decide on topology changes and ticks, as live.

    After every event of an instant *t* is folded, a topology change at *t* is decided, then the
    latest tick boundary at or before *t* (which the cursor refuses when a change at the same
    time was just decided). Decisions are taken at ``now = t``, as the live worker records them,
    so :func:`compare` re-decides them from the same folded state.
    """
    interval_s = replayer.cfg.intervals.decision_s
    warmup_ms = round(replayer.cfg.streams.warmup_s * 1000)
    out: list[StepOutput] = []
    first_ms: int | None = None

    def decide_instant(t_ms: int, changed: bool) -> None:
        if first_ms is None or t_ms - first_ms < warmup_ms:
            return  # the live worker is not ready yet either
        triggers = [TriggerInfo(Trigger.TOPOLOGY_CHANGE, t_ms, "topology")] if changed else []
        triggers.append(TriggerInfo(Trigger.TIMER, tick_due_ms(t_ms, interval_s), "periodic tick"))
        for trigger in triggers:
            out.extend(replayer.decide_all(trigger, t_ms))

    instant: int | None = None
    changed = False
    for env in envs:
        t = env.event_time_ms
        if instant is not None and t != instant:
            decide_instant(instant, changed)
            changed = False
        first_ms = t if first_ms is None else first_ms
        instant = t
        changed = replayer.fold(env) or changed
    if instant is not None:
        decide_instant(instant, changed)
    return out


@dataclass(frozen=True, slots=True)
class Mismatch:
    """A recorded decision the replay decided differently."""

    decision_id: str
    recorded: str  # "reason → target"
    replayed: str
    same_inputs: bool  # equal snapshot digests: the logic differs, not the data


@dataclass(frozen=True, slots=True)
class ReplayReport:
    """How a replay compares with the recorded decisions."""

    compared: int
    matched: int
    mismatches: tuple[Mismatch, ...]
    not_replayed: int  # recorded decisions for deployments this config does not know

    @property
    def same(self) -> bool:
        """True when every compared decision was reached again."""
        return self.compared == self.matched


def _now_ms(rec: LoggedDecision) -> int:
    return round(rec.payload.context.now_s * 1000)


def _outcome(reason: str, to_plan_id: str | None) -> str:
    return f"{reason} → {to_plan_id or 'hold'}"


def compare(
    replayer: Replayer, envs: Sequence[Envelope[Any]], recorded: Sequence[LoggedDecision]
) -> ReplayReport:
    """Re-decide each recorded decision at its recorded snapshot time, in time order."""
    names = {d.name for d in replayer.deployments}
    order = sorted(recorded, key=lambda r: (_now_ms(r), r.payload.seq))
    i = matched = skipped = 0
    mismatches: list[Mismatch] = []
    # NOTE: the live decider's on-demand steps of one batch share its time and its plans as it
    # began; recorded decisions at one time are taken as one batch.
    batch_ms, start = -1, replayer.plans()
    for rec in order:
        p = rec.payload
        if p.deployment not in names:
            skipped += 1
            continue
        ctx = p.context
        now_ms = _now_ms(rec)
        while i < len(envs) and envs[i].event_time_ms <= now_ms:
            replayer.fold(envs[i])
            i += 1
        info = TriggerInfo(p.trigger, rec.trigger_time_ms, ctx.trigger_description)
        if now_ms != batch_ms:
            batch_ms, start = now_ms, replayer.plans()
        before = replayer.tables[p.deployment]
        out = replayer.decide(p.deployment, info, now_ms, start)
        want = _outcome(p.reason, p.to_plan_id)
        got = _outcome(out.decision.reason, out.decision.to_plan_id) if out else "not decided"
        if got == want:
            matched += 1
            continue
        same = out is not None and out.digest == ctx.digest
        mismatches.append(Mismatch(p.decision_id, want, got, same))
        # NOTE: follow the recorded decision from here on, so one difference is reported once
        # instead of cascading through every later decision of the deployment.
        gear = out.gear if out is not None else before.gear
        cursor, plan, gear = reconcile(Cursor(p.seq - 1), before.plan, gear, rec)
        replayer.tables[p.deployment] = replace(before, plan=plan, gear=gear, cursor=cursor)
    compared = len(order) - skipped
    return ReplayReport(compared, matched, tuple(mismatches), skipped)
