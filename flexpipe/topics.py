"""The topic catalog: every topic FlexPipe uses, its key, layout and cleanup policy."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from flexpipe.config import FlexPipeConfig
from flexpipe.schemas import ClusterEvent, GpuSample, KernelLaunches, NodeSamples


class Topic(enum.StrEnum):
    """Logical topic names; :func:`topic_name` applies the configured prefix."""

    GPU = "flexpipe.telemetry.gpu"
    LAUNCHES = "flexpipe.telemetry.launches"
    NODE = "flexpipe.telemetry.node"  # NodeSamples: one node's GPU samples and launch counts
    SERVING = "flexpipe.telemetry.serving"
    CLUSTER = "flexpipe.cluster.events"
    DECISIONS = "flexpipe.gear.decisions"
    TRANSITIONS = "flexpipe.gear.transitions"
    CONTROL = "flexpipe.control"
    DEADLETTER = "flexpipe.deadletter"
    OWNERSHIP = "flexpipe.runtime.ownership"


@dataclass(frozen=True, slots=True)
class TopicSpec:
    """How one topic is laid out on the broker."""

    topic: Topic
    key: str  # what the message key holds; keys pin ordering per entity
    compacted: bool  # transitions and control are state logs: the latest value per key wins
    retention_ms: int | None  # None: broker default; -1: keep forever
    partitions: int | None = None  # None: the configured default

    def configs(self) -> dict[str, str]:
        """Topic-level broker configs."""
        out = {"cleanup.policy": "compact" if self.compacted else "delete"}
        if self.retention_ms is not None:
            out["retention.ms"] = str(self.retention_ms)
        return out


_DAY_MS = 24 * 3600 * 1000
CATALOG: tuple[TopicSpec, ...] = (
    TopicSpec(Topic.GPU, "gpu uuid", compacted=False, retention_ms=2 * _DAY_MS),
    TopicSpec(Topic.LAUNCHES, "gpu uuid", compacted=False, retention_ms=2 * _DAY_MS),
    TopicSpec(Topic.NODE, "node", compacted=False, retention_ms=2 * _DAY_MS),
    TopicSpec(Topic.SERVING, "deployment", compacted=False, retention_ms=2 * _DAY_MS),
    TopicSpec(Topic.CLUSTER, "node", compacted=False, retention_ms=30 * _DAY_MS),
    TopicSpec(Topic.DECISIONS, "deployment", compacted=False, retention_ms=-1),
    TopicSpec(Topic.TRANSITIONS, "deployment/transition seq", compacted=True, retention_ms=None),
    TopicSpec(Topic.CONTROL, "deployment", compacted=True, retention_ms=None),
    TopicSpec(Topic.DEADLETTER, "original key", compacted=False, retention_ms=30 * _DAY_MS),
    # NOTE: compaction keeps exactly the in-flight set: a finished sequence is a tombstone.
    TopicSpec(Topic.OWNERSHIP, "deployment/request id", compacted=True, retention_ms=None),
)


def topic_name(cfg: FlexPipeConfig, topic: Topic) -> str:
    """The broker-side name: the configured prefix plus the logical name."""
    return f"{cfg.topics.prefix}{topic.value}"


_TELEMETRY_TOPIC: dict[type, Topic] = {
    GpuSample: Topic.GPU,
    KernelLaunches: Topic.LAUNCHES,
    ClusterEvent: Topic.CLUSTER,
    NodeSamples: Topic.NODE,
}


def telemetry_route(
    cfg: FlexPipeConfig, payload: GpuSample | KernelLaunches | ClusterEvent | NodeSamples
) -> tuple[str, bytes]:
    """Topic and key an agent publishes a payload under (GPU uuid; node for cluster events and
    node batches)."""
    per_node = isinstance(payload, ClusterEvent | NodeSamples)
    key = payload.node if per_node else payload.gpu_uuid  # type: ignore[union-attr]
    return topic_name(cfg, _TELEMETRY_TOPIC[type(payload)]), key.encode()
