"""Builders for gearbox tests: GPUs, clusters, the article's fragmented cluster, loads, plans."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from gearbox.model import ModelSpec
from gearbox.plans import DeploymentPlan, ExecutionPlan, Stage, StageRole
from gearbox.presets import GPU_CLASSES, LINK_CLASSES
from gearbox.types import Domain, Gpu, LoadSnapshot, TopologySnapshot

NOW_S = 1_000.0


def make_gpu(
    uuid: str = "gpu-0",
    *,
    node: str = "node-0",
    gpu_class: str = "h100-sxm",
    domain: str = "dom-0",
    free_fraction: float = 1.0,
    healthy: bool = True,
    schedulable: bool = True,
    utilisation: float = 0.0,
    last_seen_s: float = NOW_S,
) -> Gpu:
    """A GPU of a preset class; free memory as a fraction of its total."""
    cls = GPU_CLASSES[gpu_class]
    return Gpu(
        uuid=uuid,
        node=node,
        gpu_class=cls,
        domain=domain,
        total_memory_bytes=cls.memory_bytes,
        free_memory_bytes=int(cls.memory_bytes * free_fraction),
        healthy=healthy,
        schedulable=schedulable,
        utilisation=utilisation,
        last_seen_s=last_seen_s,
    )


@dataclass(frozen=True)
class DomainSpec:
    """One interconnect domain to build: its link, GPU classes (one per GPU) and host width."""

    domain_id: str
    link: str
    gpu_classes: tuple[str, ...]
    gpus_per_node: int = 8


def make_cluster(
    domains: Sequence[DomainSpec],
    *,
    now_s: float = NOW_S,
    inter_domain_link: str = "ethernet",
) -> TopologySnapshot:
    """A snapshot with every GPU live and idle; GPU uuids are ``<domain>-g<i>``."""
    gpus = []
    for spec in domains:
        for i, cls in enumerate(spec.gpu_classes):
            gpus.append(
                make_gpu(
                    f"{spec.domain_id}-g{i:02d}",
                    node=f"{spec.domain_id}-n{i // spec.gpus_per_node}",
                    gpu_class=cls,
                    domain=spec.domain_id,
                    last_seen_s=now_s,
                )
            )
    return TopologySnapshot(
        now_s=now_s,
        gpus=tuple(gpus),
        domains=tuple(Domain(s.domain_id, LINK_CLASSES[s.link]) for s in domains),
        inter_domain_link=LINK_CLASSES[inter_domain_link],
    )


ARTICLE_DOMAINS = (
    DomainSpec("A", "nvlink", ("h100-sxm",) * 12, gpus_per_node=12),
    DomainSpec("B", "rdma", ("a100-80g",) * 9, gpus_per_node=3),
    DomainSpec("C", "pcie", ("a6000-48g",) * 3 + ("l40s",) * 3, gpus_per_node=3),
)


def article_cluster(now_s: float = NOW_S) -> TopologySnapshot:
    """Block A: 12 H100 on NVLink; B: 9 A100-80G on RDMA; C: 6 mixed 48 GB GPUs on PCIe."""
    return make_cluster(ARTICLE_DOMAINS, now_s=now_s)


def with_gpus(
    snapshot: TopologySnapshot,
    uuids: Sequence[str],
    *,
    healthy: bool | None = None,
    schedulable: bool | None = None,
    last_seen_s: float | None = None,
    domain: str | None = None,
) -> TopologySnapshot:
    """Copy of ``snapshot`` with the given fields changed on the named GPUs."""
    wanted = set(uuids)
    gpus = []
    for gpu in snapshot.gpus:
        if gpu.uuid in wanted:
            gpu = replace(
                gpu,
                healthy=gpu.healthy if healthy is None else healthy,
                schedulable=gpu.schedulable if schedulable is None else schedulable,
                last_seen_s=gpu.last_seen_s if last_seen_s is None else last_seen_s,
                domain=gpu.domain if domain is None else domain,
            )
        gpus.append(gpu)
    return replace(snapshot, gpus=tuple(gpus))


def make_load(
    arrival_rate_rps: float = 5.0,
    *,
    now_s: float = NOW_S,
    prompt_tokens: float = 1000.0,
    output_tokens: float = 200.0,
    active_sequences: int = 100,
    queue_len: int = 0,
) -> LoadSnapshot:
    """A load with ``active_sequences`` sequences of mean prompt + half the output in KV."""
    mean_context = prompt_tokens + output_tokens / 2
    return LoadSnapshot(
        now_s=now_s,
        arrival_rate_rps=arrival_rate_rps,
        mean_prompt_tokens=prompt_tokens,
        mean_output_tokens=output_tokens,
        queue_len=queue_len,
        active_sequences=active_sequences,
        active_kv_tokens=int(active_sequences * mean_context),
    )


def make_stage(
    gpus: Sequence[str],
    layers: tuple[int, int],
    *,
    block_id: str = "blk-a",
    domain_id: str = "A",
    role: StageRole = StageRole.UNIFIED,
    gpu_class: str = "h100-sxm",
    link: str = "nvlink",
) -> Stage:
    """A stage on preset hardware."""
    return Stage(
        block_id,
        domain_id,
        tuple(gpus),
        layers[0],
        layers[1],
        role,
        GPU_CLASSES[gpu_class],
        LINK_CLASSES[link],
    )


def tp_plan(
    gpus: Sequence[str],
    model: ModelSpec,
    *,
    block_id: str = "blk-a",
    domain_id: str = "A",
    gpu_class: str = "h100-sxm",
    link: str = "nvlink",
) -> ExecutionPlan:
    """A single-stage TP plan holding every layer."""
    stage = make_stage(
        gpus,
        (0, model.num_layers),
        block_id=block_id,
        domain_id=domain_id,
        gpu_class=gpu_class,
        link=link,
    )
    return ExecutionPlan(model.name, (stage,))


def deployment(*replicas: ExecutionPlan, name: str = "chat") -> DeploymentPlan:
    """A deployment of the given replicas."""
    return DeploymentPlan(name, replicas[0].model_name, replicas)
