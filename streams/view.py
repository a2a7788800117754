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
    # NOTE: the bytes of the GPU record this worker last wrote per key, applied as it wrote it:
    # the changelog echoes each write back to this worker's reader, which need not decode a
    # record it applied already (see :meth:`written_gpu` and streams.readers.ViewReader)
    own_gpu_records: dict[bytes, bytes] = field(default_factory=dict, compare=False, repr=False)

    def apply_gpu(self, state: GpuState) -> bool:
        """Keep ``state`` unless an equal or newer revision is known; True when kept."""
        known = self.gpus.get(state.uuid)
        if known is not None and known.rev >= state.rev:
            return False
        self.gpus[state.uuid] = state
        self.version += 1
        self.max_seen_ms = max(self.max_seen_ms, round(state.last_seen_s * 1000))
        return True

    def written_gpu(self, key: bytes, raw: bytes, state: GpuState) -> bool:
        """Apply ``state``, which this worker wrote to the GPU table as ``raw`` under ``key``,
        and remember the bytes: once applied, that record's echo changes nothing (the view
        keeps an equal or newer revision from then on)."""
        self.own_gpu_records[key] = raw
        return self.apply_gpu(state)

    def is_own_gpu_echo(self, key: bytes | None, raw: bytes) -> bool:
        """Whether ``raw`` is the record this worker last wrote under ``key`` (already applied)."""
        return key is not None and self.own_gpu_records.get(key) == raw

    def apply_node(self, state: NodeState) -> bool:
        """Keep ``state`` unless an equal or newer revision is known; True when kept."""
        known = self.nodes.get(state.node)
        if known is not None and known.rev >= state.rev:
            return False
        self.nodes[state.node] = state
        self.version += 1
        self.nodes_version += 1
        return True
