"""Adapter to gearbox's KV hand-over planner: migrate or replay, per sequence, longest first.

:func:`gearbox.switch.plan_kv_handover` needs the link between the two replicas' decode stages,
which it reads from a topology snapshot. The runtime has no snapshot of its own; the plans carry
each stage's domain and link, and the inter-domain link comes from configuration. The planner
also checks that the source's GPUs are live (KV on a lost GPU can only be replayed): the
executor only hands over sequences from replicas whose engine is alive, so every GPU of the
plans is entered as live.
"""

from __future__ import annotations

from collections.abc import Sequence

from gearbox.config import GearboxConfig
from gearbox.model import ModelSpec
from gearbox.plans import ExecutionPlan, Stage
from gearbox.switch import KvHandover, plan_kv_handover
from gearbox.types import Domain, Gpu, LinkClass, TopologySnapshot


def link_snapshot(plans: Sequence[ExecutionPlan], inter_domain_link: LinkClass) -> TopologySnapshot:
    """A snapshot of the plans' GPUs (all live) and the domains (and links) they use."""
    domains: dict[str, LinkClass] = {}
    gpus: dict[str, Gpu] = {}
    for plan in plans:
        for stage in plan.stages:
            domains.setdefault(stage.domain_id, stage.tp_link)
            for uuid in stage.gpu_uuids:
                gpus.setdefault(uuid, _live_gpu(uuid, stage.domain_id, stage))
    return TopologySnapshot(
        now_s=0.0,
        gpus=tuple(gpus.values()),
        domains=tuple(Domain(d, link) for d, link in sorted(domains.items())),
        inter_domain_link=inter_domain_link,
    )


def _live_gpu(uuid: str, domain_id: str, stage: Stage) -> Gpu:
    memory = stage.gpu_class.memory_bytes
    return Gpu(uuid, "", stage.gpu_class, domain_id, memory, 0, True, True, 0.0, 0.0)


def plan_handover(
    sequences: Sequence[tuple[str, int]],
    source: ExecutionPlan,
    target: ExecutionPlan,
    model: ModelSpec,
    config: GearboxConfig,
    inter_domain_link: LinkClass,
) -> tuple[KvHandover, ...]:
    """Migrate-or-replay for ``(seq_id, context_tokens)`` moving from ``source`` to ``target``."""
    snapshot = link_snapshot((source, target), inter_domain_link)
    return plan_kv_handover(sequences, source, target, snapshot, model, config)
