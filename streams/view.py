"""The cluster-wide view every worker keeps: all GPUs' and nodes' latest records.

Telemetry is partitioned by GPU and node, but every decision needs the whole topology, so each
worker reads the ``gpus`` and ``nodes`` table changelogs in full (a hand-rolled global table —
see :mod:`streams.readers` for why not Faust's GlobalTable). Records carry a write counter
(``rev``); the view keeps the highest, so a late echo never replaces a newer local write.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from streams.state import GpuState, NodeState

__all__ = ["ClusterView"]


@dataclass
class ClusterView:
    """Mutable latest-record maps (owned by one worker's event loop)."""

    gpus: dict[str, GpuState] = field(default_factory=dict)
    nodes: dict[str, NodeState] = field(default_factory=dict)
    max_seen_ms: int = -1  # newest last-seen among applied GPU records
    version: int = 0  # bumped on every applied record (snapshot caches key on it)
    nodes_version: int = 0  # bumped on every applied node record: the cluster events folded

    def apply_gpu(self, state: GpuState) -> bool:
        """Keep ``state`` unless an equal or newer revision is known; True when kept."""
        known = self.gpus.get(state.uuid)
        if known is not None and known.rev >= state.rev:
            return False
        self.gpus[state.uuid] = state
        self.version += 1
        self.max_seen_ms = max(self.max_seen_ms, round(state.last_seen_s * 1000))
        return True

    def apply_node(self, state: NodeState) -> bool:
        """Keep ``state`` unless an equal or newer revision is known; True when kept."""
        known = self.nodes.get(state.node)
        if known is not None and known.rev >= state.rev:
            return False
        self.nodes[state.node] = state
        self.version += 1
        self.nodes_version += 1
        return True
