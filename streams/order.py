"""The order of a decision round: deployments whose plan the topology disturbed go first.

Pure; :mod:`streams.step` re-exports it. The live decider (:mod:`streams.decider`) and the replay
(:mod:`streams.replay`, which the simulated world and ``bench.fragmented`` run) order every round
by :func:`decision_order`, so both decide the same deployments in the same order.

A plan is *disturbed* on a topology when it cannot run as planned there: one of its GPUs is gone
or not live (preempted, isolated, failed, its node down, silent past the heartbeat timeout), sits
in another domain than its stage was planned in, or a stage's domain now has another link than
the one the stage was planned on (a LINK event). A deployment with no plan yet needs a first
placement and counts as disturbed too. A GPU's free memory moving (telemetry, not a cluster
event) disturbs nothing here: gearbox still judges memory when it decides.

NOTE: deciding one deployment costs ~25 ms of CPU on a 1,000-GPU cluster, and a cluster event
decides every owned deployment: in the configured order a forced switch waited behind every
deployment the event did not touch. Disturbed deployments first, each in the configured order,
then the others: those may gain from GPUs an event freed, so they are still decided, later. An
earlier deployment's new plan is claimed before a later one plans, so a forced switch now takes
its GPUs before an undisturbed deployment can take them for a voluntary one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gearbox.plans import DeploymentPlan
from gearbox.types import Gpu, LinkClass, TopologySnapshot

__all__ = ["RoundOrder", "decision_order", "plan_disturbed"]

RoundOrder = tuple[tuple[str, ...], tuple[str, ...]]  # (disturbed, undisturbed), each in order


def plan_disturbed(
    plan: DeploymentPlan | None,
    topology: TopologySnapshot,
    gpus: Mapping[str, Gpu] | None = None,
    links: Mapping[str, LinkClass] | None = None,
) -> bool:
    """Whether ``plan`` cannot run as planned on ``topology`` (None: no plan, it needs one).

    ``gpus`` (by uuid) and ``links`` (by domain) are the topology's, when the caller built them
    once for several plans."""
    if plan is None:
        return True
    gpus = gpus if gpus is not None else {g.uuid: g for g in topology.gpus}
    links = links if links is not None else {d.domain_id: d.link for d in topology.domains}
    for replica in plan.replicas:
        for stage in replica.stages:
            # NOTE: the link a block's TP group uses, as gearbox.blocks reads it
            if links.get(stage.domain_id, topology.inter_domain_link) != stage.tp_link:
                return True
            for uuid in stage.gpu_uuids:
                gpu = gpus.get(uuid)
                if gpu is None or gpu.domain != stage.domain_id or not topology.gpu_is_live(gpu):
                    return True
    return False


def decision_order(
    names: Sequence[str],
    plans: Mapping[str, DeploymentPlan | None],
    topology: TopologySnapshot,
) -> RoundOrder:
    """``names`` (in the configured order) split into the deployments whose plan (``plans``,
    absent: none) ``topology`` disturbs and the others, each keeping the configured order."""
    gpus = {g.uuid: g for g in topology.gpus}
    links = {d.domain_id: d.link for d in topology.domains}
    disturbed = tuple(n for n in names if plan_disturbed(plans.get(n), topology, gpus, links))
    chosen = set(disturbed)
    return disturbed, tuple(n for n in names if n not in chosen)
