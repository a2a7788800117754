"""Builders for runtime tests: replicas, deployment plans, decisions, requests, a runtime."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from flexpipe.schemas import DecisionContext, GearDecision, PlanSource, TransitionPhase
from gearbox.decisions import Decision, DecisionReason, Trigger
from gearbox.model import ModelSpec
from gearbox.plans import DeploymentPlan, ExecutionPlan, Stage, StageRole
from gearbox.presets import GPU_CLASSES, LINK_CLASSES, MODEL_7B_MHA
from gearbox.switch import SwitchCost
from gearbox.types import LoadSnapshot
from runtime.deployment import DeploymentRuntime, RuntimeSettings
from runtime.executor import ExecutorSettings
from runtime.transition import TransitionPolicy
from runtime.types import Request, RequestKind
from tests.runtime.simdrive import SimDriver

DEPLOYMENT = "assist-7b"


def make_replica(
    gpus: Sequence[str],
    *,
    domain: str = "A",
    gpu_class: str = "h100-sxm",
    link: str = "nvlink",
    model: ModelSpec = MODEL_7B_MHA,
) -> ExecutionPlan:
    """A single-stage unified replica (TP over ``gpus``) inside one domain."""
    stage = Stage(
        block_id=f"blk-{domain}",
        domain_id=domain,
        gpu_uuids=tuple(gpus),
        layer_start=0,
        layer_end=model.num_layers,
        role=StageRole.UNIFIED,
        gpu_class=GPU_CLASSES[gpu_class],
        tp_link=LINK_CLASSES[link],
    )
    return ExecutionPlan(model_name=model.name, stages=(stage,))


def make_plan(*replicas: ExecutionPlan, deployment: str = DEPLOYMENT) -> DeploymentPlan:
    """A deployment plan co-running ``replicas``."""
    return DeploymentPlan(deployment, replicas[0].model_name, tuple(replicas))


def make_context(now_s: float = 0.0, *, digest: str = "d") -> DecisionContext:
    """What the stream saw, for a decision a test builds by hand (an idle load, no blocks)."""
    return DecisionContext(
        trigger_time_ms=round(now_s * 1000),
        trigger_description="",
        now_s=now_s,
        worker="test",
        plan_source=PlanSource.NONE,
        load_source="test",
        load=LoadSnapshot(now_s, 0.0, 1.0, 1.0),
        digest=digest,
        num_gpus=0,
        num_live_gpus=0,
        blocks=(),
        notes=(),
        serving_plan_id=None,
        in_flight=None,
    )


def gearbox_decision(
    plan: DeploymentPlan,
    *,
    now_s: float = 0.0,
    from_plan_id: str | None = None,
    reason: DecisionReason | None = None,
    trigger: Trigger = Trigger.TIMER,
) -> Decision:
    """Gearbox's decision to switch to ``plan``."""
    return Decision(
        deployment=plan.deployment,
        now_s=now_s,
        trigger=trigger,
        reason=reason
        or (DecisionReason.SWITCH_GAIN if from_plan_id else DecisionReason.INITIAL_PLACEMENT),
        forced=reason is DecisionReason.FORCED_INFEASIBLE,
        from_plan_id=from_plan_id,
        to_plan_id=plan.plan_id,
        to_plan=plan,
        candidates=(),
        switch_cost=SwitchCost.zero(),
        explanation="test decision",
    )


def make_decision(
    seq: int,
    plan: DeploymentPlan,
    *,
    from_plan_id: str | None = None,
    deployment: str = DEPLOYMENT,
    reason: DecisionReason | None = None,
) -> GearDecision:
    """A decision message as the streams publish it, carrying gearbox's Decision."""
    decision = gearbox_decision(
        DeploymentPlan(deployment, plan.model_name, plan.replicas),
        now_s=float(seq),
        from_plan_id=from_plan_id,
        reason=reason,
    )
    return GearDecision(
        deployment=deployment,
        decision_id=f"{deployment}/{seq}",
        seq=seq,
        trigger=decision.trigger,
        reason=decision.reason,
        forced=decision.forced,
        from_plan_id=from_plan_id,
        to_plan_id=decision.to_plan_id,
        explanation=decision.explanation,
        context=make_context(float(seq)),
        decision=decision,
    )


def make_request(
    i: int, prompt: int = 500, output: int = 64, arrival_s: float = 0.0, *, prefix: str = "r"
) -> Request:
    """Request ``<prefix><i>``."""
    kind = RequestKind.SUMMARISATION if prompt > 2000 else RequestKind.CHAT
    return Request(f"{prefix}{i}", prompt, output, arrival_s, kind)


FAST_POLICY = TransitionPolicy(
    prepare_timeout_s=60.0, switch_timeout_s=60.0, cleanup_timeout_s=60.0, retry_backoff_s=0.5
)
FAST_EXECUTOR = ExecutorSettings(canary_s=0.5, drain_timeout_s=5.0)


def make_runtime(
    *, pause_in: TransitionPhase | None = None, settings: RuntimeSettings | None = None
) -> DeploymentRuntime:
    """A runtime for ``DEPLOYMENT`` with short timeouts."""
    settings = settings or RuntimeSettings(policy=FAST_POLICY, executor=FAST_EXECUTOR)
    return DeploymentRuntime(DEPLOYMENT, settings=settings, pause_in=pause_in)


class Harness(SimDriver):
    """A SimDriver that checks the ownership invariant after every tick and fails on timeouts."""

    def __init__(self, rt: DeploymentRuntime, now_s: float = 0.0) -> None:
        super().__init__(rt, now_s)

    def decide(self, seq: int, plan: DeploymentPlan, from_plan_id: str | None = None) -> None:
        """Deliver decision ``seq`` for ``plan`` now."""
        self.deliver(make_decision(seq, plan, from_plan_id=from_plan_id))

    def advance_to(self, t_s: float, dt_s: float = 0.05) -> None:
        """Tick until ``t_s``, checking the ownership invariant each time."""
        while self.now_s < t_s - 1e-9:
            super().advance_to(min(t_s, self.now_s + dt_s), dt_s)
            self.check()

    def until(self, predicate: Callable[[], bool], limit_s: float, dt_s: float = 0.05) -> bool:
        """Tick until ``predicate`` holds; fail after ``limit_s`` simulated seconds."""
        assert super().until(predicate, limit_s, dt_s), f"not met within {limit_s} simulated s"
        return True

    def check(self) -> None:
        """The ownership invariant holds."""
        assert self.rt.core.router.check_invariants() == []

    def serve(self, plan: DeploymentPlan) -> Harness:
        """Deliver decision 1 for ``plan`` and run until its transition is done."""
        self.decide(1, plan)
        self.until(lambda: self.rt.state.active is None, 30)
        return self

    @property
    def phases(self) -> list[tuple[int, str, str, int]]:
        """(seq, phase, status, attempt) of every persisted record."""
        return [(r.transition_seq, r.phase, r.status, r.attempt) for r in self.outputs.records]
