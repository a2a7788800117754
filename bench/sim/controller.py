"""FlexPipe's decision loop under the simulated clock: serving load in, gear decisions out.

The stream processor's path, minus Kafka: every ``serving_publish_s`` the runtime's
:class:`runtime.stats.ServingWindow` becomes a ``ServingLoad`` report, folded into the streams'
hopping windows (:func:`streams.load.fold_serving`); on each decision tick — the timer, or a
debounced topology change — the window's aggregate becomes a :class:`gearbox.LoadSnapshot`, the
cluster's state a :class:`gearbox.TopologySnapshot`, and :func:`gearbox.decide` runs with the
deployment's carried :class:`gearbox.GearState`. A decision travels to the runtime as the
``GearDecision`` message the decisions topic would carry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from bench.sim.runtime import BenchRuntime
from bench.sim.topology import ClusterView
from flexpipe.schemas import GearDecision
from gearbox import (
    DecideResult,
    DeploymentPlan,
    GearboxConfig,
    GearState,
    LoadSnapshot,
    ModelSpec,
    Overrides,
    Trigger,
    decide,
    record_failed_target,
)
from runtime.stats import ServingWindow
from sim.spec import DeploymentSpec
from streams.load import ServingWindows, fold_serving, serving_aggregate
from streams.windows import HoppingWindow

SOURCE = "bench-runtime"
# NOTE: window means are published in 16-token steps (about 1 % of these profiles). gearbox
# memoises replica capacities per (prompt, output) profile, rounded to whole tokens, so a mean
# that drifts by a token every tick would re-enumerate every plan from scratch (most of a
# decision's time); relative accuracy is all the cost model needs.
PROFILE_STEP_TOKENS = 16


@dataclass(frozen=True, slots=True)
class DecisionLog:
    """One decision tick's outcome (every tick, switches or not)."""

    t_s: float
    deployment: str
    trigger: str
    reason: str
    seq: int | None  # decision sequence when it switched
    forced: bool
    from_plan_id: str | None
    to_plan_id: str | None
    to_gpus: int
    est_shift_s: float  # gearbox's modelled shift duration
    est_kv_bytes: int  # gearbox's modelled KV migration
    explanation: str


class LoadTracker:
    """A deployment's serving reports folded into the streams' hopping window."""

    def __init__(self, dep: DeploymentSpec, model: ModelSpec, window: HoppingWindow) -> None:
        self.deployment = dep.name
        self.model = model
        self.window = window
        self.state = ServingWindows()
        self._seq = 0
        mixes = (dep.workload.chat, dep.workload.summarisation)
        rps = sum(m.arrival_rps for m in mixes)
        # Nominal profile until telemetry arrives (the streams' DeploymentConfig defaults).
        self._nominal = (
            rps,
            sum(m.arrival_rps * m.prompt_tokens_mean for m in mixes) / max(rps, 1e-9),
            sum(m.arrival_rps * m.output_tokens_mean for m in mixes) / max(rps, 1e-9),
        )

    def report(self, rt: BenchRuntime, now_s: float) -> None:
        """Publish the runtime's window (as the worker does) and fold it (as the streams do)."""
        core = rt.core
        load = core.window.report(
            self.deployment,
            self.model.name,
            now_s,
            queue_len=core.queue_len(),
            active_sequences=core.active_sequences(),
            kv_bytes=core.kv_bytes(),
            plan_id=core.serving_plan_id,
        )
        core.window = ServingWindow(start_s=now_s)
        self._seq += 1
        self.state, _ = fold_serving(
            self.state, self.window, load, SOURCE, self._seq, round(now_s * 1000)
        )

    def load(self, now_s: float) -> LoadSnapshot:
        """The window's aggregate as gearbox's load input."""
        agg = serving_aggregate(self.state, self.window, now_s)
        rps, prompt, output = self._nominal
        if agg.reports:
            rps = agg.arrival_rate_rps
            prompt = agg.mean_prompt_tokens or prompt
            output = agg.mean_output_tokens or output
        return LoadSnapshot(
            now_s=now_s,
            arrival_rate_rps=rps,
            mean_prompt_tokens=_profile_tokens(prompt),
            mean_output_tokens=_profile_tokens(output),
            queue_len=agg.queue_len,
            active_sequences=agg.active_sequences,
            active_kv_tokens=agg.kv_bytes // self.model.kv_bytes_per_token,
            ttft_p95_ms=agg.ttft_p95_ms,
            tbt_p95_ms=agg.tbt_p95_ms,
        )


def _profile_tokens(mean: float) -> float:
    step = PROFILE_STEP_TOKENS
    return float(max(step, round(mean / step) * step))


def current_plan(rt: BenchRuntime) -> DeploymentPlan | None:
    """The plan the deployment is in or moving to (the transitions log's view)."""
    active = rt.state.active
    return active.to_plan if active is not None else rt.state.serving


def held_gpus(rt: BenchRuntime) -> set[str]:
    """GPUs the deployment holds or is about to: installed replicas and the plan it moves to."""
    held = {u for rid in rt.core.replica_ids() for u in rt.core.plan_of(rid).gpu_uuids}
    plan = current_plan(rt)
    if plan is not None:
        held |= plan.gpu_uuids
    return held


class GearLoop:
    """The decision loop over a system's deployments."""

    def __init__(
        self,
        runtimes: Mapping[str, BenchRuntime],
        models: Mapping[str, ModelSpec],
        view: ClusterView,
        config: GearboxConfig,
        trackers: Mapping[str, LoadTracker],
    ) -> None:
        self.runtimes = runtimes
        self.models = models
        self.view = view
        self.config = config
        self.trackers = trackers
        self.states: dict[str, GearState] = {name: GearState() for name in runtimes}
        self.seqs: dict[str, int] = dict.fromkeys(runtimes, 0)
        self.log: list[DecisionLog] = []

    def _used_by_others(self, deployment: str) -> dict[str, int]:
        """GPUs other deployments hold, shown full.

        NOTE: the runtime's inventory never lets two deployments claim one GPU, so memory left
        free on another deployment's GPU is not usable; shown as free (as NVML would report it),
        gearbox plans small replicas onto those remnants and every such shift fails in prepare.
        """
        used: dict[str, int] = {}
        for name, rt in self.runtimes.items():
            if name == deployment:
                continue
            for uuid in held_gpus(rt):
                used[uuid] = self.view.gpu_class_of[uuid].memory_bytes
        return used

    def note_rollback(self, deployment: str, to_plan_id: str, now_s: float) -> None:
        """A transition to ``to_plan_id`` rolled back: gearbox quarantines that target.

        The streams learn it from the transitions topic; without this, ``decide`` re-proposes
        the same failing target at every cooldown.
        """
        self.states[deployment] = record_failed_target(
            self.states[deployment], to_plan_id, now_s, self.config
        )

    def place(self, deployment: str, plan: DeploymentPlan, now_s: float) -> DecisionLog:
        """The starting plan, pinned (every system starts from the scenario's plan)."""
        return self._run(deployment, now_s, Trigger.OPERATOR, Overrides(pinned_plan=plan))

    def tick(self, now_s: float, trigger: Trigger) -> list[DecisionLog]:
        """One decision tick for every deployment, largest model first.

        NOTE: each deployment is decided alone (gearbox has no cross-deployment arbitration);
        the one that is hardest to place goes first, so a small model cannot take the last
        blocks a large one needs in the same tick.
        """
        order = sorted(self.runtimes, key=lambda n: (-self.models[n].num_params, n))
        return [self._run(name, now_s, trigger, Overrides()) for name in order]

    def _run(
        self, deployment: str, now_s: float, trigger: Trigger, overrides: Overrides
    ) -> DecisionLog:
        rt = self.runtimes[deployment]
        snapshot = self.view.snapshot(now_s, self._used_by_others(deployment))
        result = decide(
            current_plan(rt),
            snapshot,
            self.trackers[deployment].load(now_s),
            self.states[deployment],
            self.config,
            model=self.models[deployment],
            deployment=deployment,
            trigger=trigger,
            overrides=overrides,
        )
        self.states[deployment] = result.state
        seq = self._send(rt, result, now_s)
        entry = _log_entry(deployment, result, seq, now_s)
        self.log.append(entry)
        return entry

    def _send(self, rt: BenchRuntime, result: DecideResult, now_s: float) -> int | None:
        decision = result.decision
        if decision is None:
            return None
        self.seqs[rt.deployment] += 1
        seq = self.seqs[rt.deployment]
        message = GearDecision(
            deployment=rt.deployment,
            decision_id=f"{rt.deployment}/{seq}",
            seq=seq,
            trigger=str(decision.trigger),
            reason=str(decision.reason),
            forced=decision.forced,
            from_plan_id=decision.from_plan_id,
            to_plan_id=decision.to_plan_id,
            explanation=decision.explanation,
            decision=decision.to_dict(),
        )
        rt.on_decision(message, now_s)
        return seq


def _log_entry(deployment: str, result: DecideResult, seq: int | None, now_s: float) -> DecisionLog:
    d = result.decision
    return DecisionLog(
        t_s=now_s,
        deployment=deployment,
        trigger=str(result.trigger),
        reason=str(result.reason),
        seq=seq,
        forced=d.forced if d is not None else False,
        from_plan_id=d.from_plan_id if d is not None else None,
        to_plan_id=d.to_plan_id if d is not None else None,
        to_gpus=d.to_plan.num_gpus if d is not None else 0,
        est_shift_s=d.switch_cost.duration_s if d is not None else 0.0,
        est_kv_bytes=d.switch_cost.kv_migrate_bytes if d is not None else 0,
        explanation=result.explanation,
    )
