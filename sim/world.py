"""The simulated world around the product's own loop, on simulated time only.

:class:`World` joins three things and nothing else:

* the world — a :class:`~sim.fleet.SimFleet` (the scenario's cluster and its node agents) whose
  telemetry envelopes are the only way the stream learns what happened;
* the product's decision path (gearbox's knobs: ``cfg.gearbox``) —
  :class:`streams.replay.Replayer` folds those envelopes, the
  runtime's serving reports and its transition records exactly as a stream worker does, and
  decides through :func:`streams.step.make_input` and :func:`streams.step.step`;
* the product's runtime — a :class:`runtime.host.RuntimeHost` (one inventory, pool and VMM for
  every deployment, as one runtime worker serving them all) applies the same cluster events
  and samples and carries the decisions out.

The caller owns the clock (a discrete-event loop) and calls :meth:`World.observe` at the fleet's
instants (:meth:`World.fleet_instants`), :meth:`World.report`, :meth:`World.decision_step`,
:meth:`World.pump` after anything that may have produced records. Transition records are
acknowledged at once (an in-memory log); envelopes get event times ``epoch + t``. Nothing reads
the wall clock; same scenario and seed, same envelopes, same decisions.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from flexpipe import envelope
from flexpipe.config import FlexPipeConfig
from flexpipe.envelope import Envelope
from flexpipe.schemas import (
    ClusterEvent,
    GearTransition,
    GpuSample,
    TransitionPhase,
)
from gearbox.blocks import AtomicBlock, build_blocks
from gearbox.decisions import Trigger
from gearbox.plans import DeploymentPlan
from gearbox.starting import starting_plans
from gearbox.types import TopologySnapshot
from runtime.host import RuntimeHost
from runtime.types import Completion
from sim.cluster import SimCluster
from sim.fleet import SimFleet
from sim.spec import Scenario
from streams.cursor import TriggerInfo, tick_due_ms
from streams.deployments import resolve_deployments
from streams.replay import Replayer
from streams.snapshot import build_topology
from streams.step import StepOutput, view_timeout_s

RUNTIME_SOURCE = "sim-world/runtime"


def follow_placement(cluster: SimCluster, record: GearTransition) -> None:
    """A finished transition moves the deployment's processes in the simulated cluster, so the
    agents report the GPUs' memory where the runtime put it."""
    plan = record.plan
    if record.phase is not TransitionPhase.DONE or plan is None:
        return
    groups = [tuple(u for st in r.stages for u in st.gpu_uuids) for r in plan.replicas]
    cluster.place(record.deployment, groups)


@dataclass(frozen=True, slots=True)
class Pumped:
    """What one deployment's runtime produced since the last pump."""

    completions: tuple[Completion, ...]
    records: tuple[GearTransition, ...]  # persisted (folded and acknowledged), in order
    refused: tuple[tuple[str, str], ...] = ()  # (request id, reason): held for a load, refused


class World:
    """Fleet → stream (Replayer) → runtime (RuntimeHost), stepped by the caller's clock."""

    def __init__(
        self, cfg: FlexPipeConfig, scenario: Scenario, seed: int, host: RuntimeHost
    ) -> None:
        """``cfg`` must describe ``scenario`` (:func:`sim.catalog.with_scenario`); ``host``
        serves its deployments."""
        self.cfg = cfg
        self.scenario = scenario
        self.host = host
        self.catalog, self.deployments = resolve_deployments(cfg)
        self.fleet = SimFleet(
            scenario,
            seed,
            sample_interval_s=cfg.intervals.sample_s,
            launch_interval_s=None,  # kernel-launch counts feed no decision
            heartbeat_s=cfg.intervals.heartbeat_s,
        )
        self.replayer = Replayer(cfg, self.catalog, self.deployments)
        self._seq = 0

    # ---- time ----------------------------------------------------------------------------------

    def event_ms(self, t_s: float) -> int:
        """The event time of simulated instant ``t_s``."""
        return self.scenario.epoch_ms + round(t_s * 1000.0)

    def fleet_instants(self, until_s: float) -> Iterator[float]:
        """Every instant in ``[0, until_s)`` at which an agent may publish: the sample grid and
        the scenario's timeline, ascending."""
        step_s = self.cfg.intervals.sample_s
        grid = (k * step_s for k in range(int(until_s // step_s) + 1))
        marks = {t for t in grid if t < until_s}
        marks |= {ev.t_s for ev in self.scenario.timeline if 0 <= ev.t_s < until_s}
        yield from sorted(marks)

    def _wrap(self, payload: Any, t_s: float) -> Envelope[Any]:
        self._seq += 1
        return envelope.make(
            payload, event_time_ms=self.event_ms(t_s), source=RUNTIME_SOURCE, seq=self._seq
        )

    # ---- world → stream and runtime ------------------------------------------------------------

    def observe(self, t_s: float) -> bool:
        """The agents' envelopes of instant ``t_s``, folded by the stream and the runtime; True
        when the stream saw a topology change."""
        changed = False
        for env in self.fleet.events(t_s, t_s + 0.001):
            changed = self.replayer.fold(env) or changed
            payload = env.payload
            if isinstance(payload, ClusterEvent):
                self.host.on_cluster_event(payload)
            elif isinstance(payload, GpuSample):
                self.host.on_gpu_sample(payload)
        return changed

    def topology(self) -> tuple[TopologySnapshot, tuple[AtomicBlock, ...]]:
        """The stream's topology at its clock, and gearbox's blocks of it."""
        now_s = self.replayer.clock_ms / 1000.0
        topology = build_topology(
            self.replayer.published,
            self.replayer.nodes,
            self.catalog,
            now_s,
            view_timeout_s(self.cfg),
        )
        return topology, build_blocks(topology, self.cfg.gearbox)

    def starting_plans(self) -> dict[str, DeploymentPlan]:
        """Each deployment's starting plan from the stream's current view (the one rule,
        :func:`gearbox.starting.starting_plans`): the plan the stream assumes is serving."""
        topology, blocks = self.topology()
        plans = starting_plans(self.deployments, topology, blocks)
        return {name: plan for name, plan in plans.items() if plan is not None}

    def start(self, plans: dict[str, DeploymentPlan], t_s: float) -> None:
        """Nothing runs until the runtime loads it: the runtime adopts ``plans`` (transition 0)
        and the simulated cluster follows the runtime from here on."""
        for name in self.host.runtimes:
            self.fleet.cluster.place(name, [])
        self.host.adopt(plans, t_s)

    # ---- runtime → stream ----------------------------------------------------------------------

    def report(self, t_s: float) -> None:
        """The runtime's serving windows, published and folded."""
        for load in self.host.serving_reports(t_s):
            self.replayer.fold(self._wrap(load, t_s))

    def pump(self, deployment: str, t_s: float) -> Pumped:
        """Drain a runtime: each transition record is folded by the stream (the transitions
        topic), acknowledged, and followed by the simulated cluster."""
        rt = self.host.runtimes[deployment]
        completions: list[Completion] = []
        records: list[GearTransition] = []
        refused: list[tuple[str, str]] = []
        while True:
            out = rt.drain()
            completions += out.completions
            refused += [(rid, str(why)) for rid, why in out.refused]
            if not out.records:
                return Pumped(tuple(completions), tuple(records), tuple(refused))
            for record in out.records:
                self.replayer.fold(self._wrap(record, t_s))
                rt.on_persisted(record, t_s)
                follow_placement(self.fleet.cluster, record)
                records.append(record)

    # ---- stream → runtime ----------------------------------------------------------------------

    def decision_step(
        self, trigger: Trigger, t_s: float, changed_s: float | None = None
    ) -> list[StepOutput]:
        """The stream's decision step for every deployment at ``t_s``; every decision goes to
        the runtime (holds are filtered there). ``changed_s``: when the topology changed (a
        TOPOLOGY_CHANGE trigger's time)."""
        now_ms = self.event_ms(t_s)
        if trigger is Trigger.TOPOLOGY_CHANGE:
            info = TriggerInfo(trigger, self.event_ms(changed_s or t_s), "topology")
        else:
            due_ms = tick_due_ms(now_ms, self.cfg.intervals.decision_s)
            info = TriggerInfo(trigger, due_ms, "periodic tick")
        outs = self.replayer.decide_all(info, now_ms)
        for out in outs:
            self.host.on_decision(out.decision, t_s)
        return outs
