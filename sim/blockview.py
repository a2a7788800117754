"""A live per-block view of the cluster, built from telemetry as any subscriber would see it.

Pure state (no Kafka here): feed decoded envelopes to :meth:`BlockView.apply`, read rows with
:meth:`BlockView.rows`. A GPU counts as free when it is healthy, was seen within the heartbeat
timeout and holds at most ``busy_fraction`` of its memory for other tenants.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from flexpipe.envelope import Envelope
from flexpipe.schemas import ClusterEvent, ClusterEventType, GpuSample

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class BlockRow:
    """One block (interconnect domain) at one moment."""

    domain: str
    num_gpus: int
    num_free: int
    free_memory_bytes: int
    num_unhealthy: int
    num_silent: int  # no sample or heartbeat within the timeout


@dataclass
class BlockView:
    """Latest sample per GPU, grouped by domain."""

    heartbeat_timeout_s: float = 45.0
    busy_fraction: float = 0.5
    gpus: dict[str, tuple[GpuSample, float]] = field(default_factory=dict)
    events: list[tuple[float, ClusterEvent]] = field(default_factory=list)
    num_envelopes: int = 0
    now_s: float = 0.0

    def apply(self, env: Envelope[Any]) -> ClusterEvent | None:
        """Fold one envelope into the view; returns a cluster event worth printing."""
        self.num_envelopes += 1
        self.now_s = max(self.now_s, env.event_time_s)
        payload = env.payload
        if isinstance(payload, GpuSample):
            self.gpus[payload.gpu_uuid] = (payload, env.event_time_s)
        elif isinstance(payload, ClusterEvent) and payload.type != ClusterEventType.NODE_UP:
            self.events.append((env.event_time_s, payload))
            return payload
        return None

    def rows(self) -> list[BlockRow]:
        """One row per domain, sorted by domain id."""
        by_domain: dict[str, list[tuple[GpuSample, float]]] = defaultdict(list)
        for sample, seen_s in self.gpus.values():
            by_domain[sample.domain or sample.node].append((sample, seen_s))
        return [self._row(domain, items) for domain, items in sorted(by_domain.items())]

    def _row(self, domain: str, items: list[tuple[GpuSample, float]]) -> BlockRow:
        free = unhealthy = silent = 0
        free_bytes = 0
        for sample, seen_s in items:
            if self.now_s - seen_s > self.heartbeat_timeout_s:
                silent += 1
            elif not sample.healthy:
                unhealthy += 1
            elif sample.memory_used_bytes <= self.busy_fraction * sample.memory_total_bytes:
                free += 1
                free_bytes += sample.memory_free_bytes
        return BlockRow(domain, len(items), free, free_bytes, unhealthy, silent)


def render_row(row: BlockRow) -> str:
    """``A ███████░░░░░ 7/12 free  548 GiB``: a fixed-width cell for the live view."""
    bar = "█" * row.num_free + "░" * (row.num_gpus - row.num_free)
    flags = ""
    if row.num_unhealthy:
        flags += f" {row.num_unhealthy}✗"
    if row.num_silent:
        flags += f" {row.num_silent}?"
    free_gib = row.free_memory_bytes / GIB
    return f"{row.domain} {bar} {row.num_free:>2}/{row.num_gpus:<2} {free_gib:>5.0f} GiB{flags}"
