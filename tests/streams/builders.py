"""Builders for stream tests: samples, events, envelopes, configs, a small fragmented cluster."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from flexpipe import envelope
from flexpipe.config import DeploymentConfig, FlexPipeConfig, load_config
from flexpipe.envelope import Envelope
from flexpipe.schemas import (
    ClusterEvent,
    ClusterEventType,
    DomainInfo,
    GpuSample,
    KernelLaunches,
    SampleReason,
    ServingLoad,
)

GIB = 1024**3
T0_MS = 1_736_150_400_000  # 2025-01-06T08:00:00Z, the seed scenario's epoch


def make_sample(
    uuid: str = "gpu-0",
    *,
    node: str = "node-0",
    gpu_class: str | None = "h100-sxm",
    domain: str | None = "A",
    index: int = 0,
    total_gib: int = 80,
    used_gib: float = 0.0,
    healthy: bool = True,
    util_pct: float | None = 0.0,
) -> GpuSample:
    """A complete NVML-shaped sample."""
    total = total_gib * GIB
    used = int(used_gib * GIB)
    return GpuSample(
        gpu_uuid=uuid,
        node=node,
        name="test gpu",
        reason=SampleReason.DELTA,
        memory_total_bytes=total,
        memory_used_bytes=used,
        memory_free_bytes=total - used,
        healthy=healthy,
        gpu_class=gpu_class,
        domain=domain,
        index=index,
        sm_util_pct=util_pct,
    )


def make_event(
    kind: ClusterEventType,
    node: str = "node-0",
    gpus: tuple[str, ...] = (),
    *,
    domains: tuple[DomainInfo, ...] = (),
    xid: int | None = None,
) -> ClusterEvent:
    """A cluster event."""
    return ClusterEvent(kind, node, gpus, domains, xid)


def node_up(node: str, domain: str, link: str, bandwidth_gbps: float | None = None) -> ClusterEvent:
    """NODE_UP with the node's domain and a 100 GbE inter-domain network."""
    return make_event(
        ClusterEventType.NODE_UP,
        node,
        domains=(
            DomainInfo(domain, link, bandwidth_gbps),
            DomainInfo("inter-domain", "ethernet", 12.5),
        ),
    )


def make_load(deployment: str = "chat", **overrides: Any) -> ServingLoad:
    """A serving report: 10 s window, 2 rps."""
    base = ServingLoad(
        deployment=deployment,
        model="llama-2-7b",
        window_s=10.0,
        arrivals=20,
        arrival_rate_rps=2.0,
        queue_len=3,
        active_sequences=8,
        prefill_tokens_per_s=1000.0,
        decode_tokens_per_s=400.0,
        mean_prompt_tokens=500.0,
        mean_output_tokens=200.0,
        ttft_p95_ms=300.0,
        tbt_p95_ms=40.0,
        kv_bytes=GIB,
    )
    return replace(base, **overrides)


def make_launches(
    uuid: str = "gpu-0", launches: int = 100, interval_s: float = 0.2
) -> KernelLaunches:
    """A launch-count report."""
    return KernelLaunches(uuid, "node-0", interval_s, launches, launches / interval_s)


def env(payload: Any, t_ms: int = T0_MS, source: str = "src", seq: int = 1) -> Envelope[Any]:
    """Wrap a payload."""
    return envelope.make(payload, event_time_ms=t_ms, source=source, seq=seq)


def raw(payload: Any, t_ms: int = T0_MS, source: str = "src", seq: int = 1) -> bytes:
    """Wrap and encode a payload."""
    return envelope.encode(env(payload, t_ms, source, seq))


# The article's cluster in miniature: block A (8 × H100 on NVLink over two nodes), block B
# (4 × A100 on RDMA over two nodes), one 100 GbE network between them.
SMALL_CLUSTER: tuple[tuple[str, str, str, str, int], ...] = tuple(
    [("A", "nvlink", "h100-sxm", f"node-a{n}", i) for n in (1, 2) for i in range(4)]
    + [("B", "rdma", "a100-80g", f"node-b{n}", i) for n in (1, 2) for i in range(2)]
)


def gpu_uuid(domain: str, node: str, index: int) -> str:
    """Uuids that sort like the simulator's."""
    return f"GPU-{domain}-{node}-{index}"


def cluster_envelopes(t_ms: int = T0_MS, seq0: int = 0) -> Iterator[Envelope[Any]]:
    """NODE_UP for every node, then one sample per GPU of :data:`SMALL_CLUSTER`, at ``t_ms``."""
    seq = seq0
    nodes = sorted({(d, link, node) for d, link, _, node, _ in SMALL_CLUSTER})
    for domain, link, node in nodes:
        seq += 1
        yield env(node_up(node, domain, link), t_ms, "scheduler", seq)
    for domain, _, cls, node, i in SMALL_CLUSTER:
        seq += 1
        sample = make_sample(
            gpu_uuid(domain, node, i), node=node, gpu_class=cls, domain=domain, index=i
        )
        yield env(sample, t_ms, f"{node}/agent", seq)


def heartbeats(t_ms: int, seq0: int) -> Iterator[Envelope[Any]]:
    """One sample per GPU of :data:`SMALL_CLUSTER` at ``t_ms``."""
    seq = seq0
    for domain, _, cls, node, i in SMALL_CLUSTER:
        seq += 1
        sample = make_sample(
            gpu_uuid(domain, node, i), node=node, gpu_class=cls, domain=domain, index=i
        )
        yield env(sample, t_ms, f"{node}/agent", seq)


def streams_config(
    *,
    deployments: tuple[DeploymentConfig, ...] | None = None,
    env_overrides: dict[str, str] | None = None,
    **streams: Any,
) -> FlexPipeConfig:
    """A config with a 7B deployment on block A (TP2) unless told otherwise."""
    cfg = load_config(env=env_overrides or {})
    deps = deployments
    if deps is None:
        deps = (
            DeploymentConfig(name="chat", model="llama-2-7b", block="A", tp=2, arrival_rps=2.0),
        )
    section = cfg.streams.model_copy(update={"warmup_s": 0.0, **streams})
    return cfg.model_copy(update={"streams": section, "deployments": deps})
