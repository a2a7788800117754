"""The latest known state of GPUs, from the telemetry and cluster-event topics.

Prepare re-checks a transition's target GPUs here: a GPU preempted by another tenant, isolated,
unhealthy, lost to a fatal XID (until GPU_RESTORED) or on a node that went down is not free, and
a GPU claimed by another deployment of this worker is not free either — unless both claims are
*memory shares*: deployments named ``sharing`` (on-demand models) hold a share of a GPU's memory
and several share one GPU; whether the memory is there is the VMM's to say when the replica
reserves and commits its weights (a refusal fails the prepare, which rolls back). GPUs never
reported are assumed usable (a worker may run without probes); the engine's own load is the
final check. Pure state, updated by the worker.
"""

from __future__ import annotations

from collections.abc import Iterable

from flexpipe.schemas import FATAL_XIDS, ClusterEvent, ClusterEventType, GpuSample

_TAKES = {
    ClusterEventType.PREEMPT: "preempted",
    ClusterEventType.GPU_ISOLATED: "isolated",
}
_FATAL = "fatal xid"
_GIVES = {
    ClusterEventType.RELEASE: "preempted",
    ClusterEventType.GPU_RESTORED: "isolated",
}


class GpuInventory:
    """Unavailable GPUs with why, the node of each GPU, and claims by deployments."""

    def __init__(self, sharing: Iterable[str] = ()) -> None:
        """``sharing``: the deployments whose claims are memory shares (see the module)."""
        self._why: dict[str, set[str]] = {}
        self._node_of: dict[str, str] = {}
        self._down_nodes: set[str] = set()
        self._claims: dict[str, set[str]] = {}  # GPU → the deployments holding it
        self._sharing = frozenset(sharing)

    def apply_sample(self, sample: GpuSample) -> None:
        """A GPU sample: remembers the node and tracks health."""
        self._node_of[sample.gpu_uuid] = sample.node
        reasons = self._why.setdefault(sample.gpu_uuid, set())
        (reasons.discard if sample.healthy else reasons.add)("unhealthy")

    def apply_event(self, event: ClusterEvent) -> list[str]:
        """A cluster event; returns the GPUs it made unavailable (for the simulated pool)."""
        if event.type is ClusterEventType.NODE_DOWN:
            self._down_nodes.add(event.node)
            return [*event.gpu_uuids, *self.gpus_on(event.node)]
        if event.type is ClusterEventType.NODE_UP:
            self._down_nodes.discard(event.node)
            return []
        if event.type in _TAKES:
            for uuid in event.gpu_uuids:
                self._node_of.setdefault(uuid, event.node)
                self._why.setdefault(uuid, set()).add(_TAKES[event.type])
            return list(event.gpu_uuids)
        if event.type is ClusterEventType.XID and event.xid in FATAL_XIDS:
            # NOTE: a fatal XID means the GPU fell off the bus or needs a reset: its processes
            # are gone until an operator restores it (as the streams' fold treats it).
            for uuid in event.gpu_uuids:
                self._node_of.setdefault(uuid, event.node)
                self._why.setdefault(uuid, set()).add(_FATAL)
            return list(event.gpu_uuids)
        if event.type in _GIVES:
            for uuid in event.gpu_uuids:
                reasons = self._why.get(uuid, set())
                reasons.discard(_GIVES[event.type])
                if event.type is ClusterEventType.GPU_RESTORED:
                    reasons.discard(_FATAL)
        return []

    def known_gpus(self) -> list[str]:
        """Every GPU the telemetry or events mentioned."""
        return sorted(set(self._why) | set(self._node_of))

    def gpus_on(self, node: str) -> list[str]:
        """GPUs known to sit on ``node``."""
        return sorted(u for u, n in self._node_of.items() if n == node)

    def problems(self, gpu_uuids: Iterable[str], owner: str) -> tuple[str, ...]:
        """Why the GPUs are not free for ``owner`` (empty when they are)."""
        out = []
        for uuid in sorted(set(gpu_uuids)):
            reasons = sorted(self._why.get(uuid, ()))
            if self._node_of.get(uuid) in self._down_nodes:
                reasons.append("node down")
            others = self._claims.get(uuid, set()) - {owner}
            if others and not (owner in self._sharing and others <= self._sharing):
                reasons.append(f"claimed by {', '.join(sorted(others))}")
            if reasons:
                out.append(f"{uuid}: {', '.join(reasons)}")
        return tuple(out)

    def held_only_by(self, gpu_uuids: Iterable[str], owner: str, holders: Iterable[str]) -> bool:
        """Whether the GPUs are free for ``owner`` but for claims of ``holders`` (at least
        one): a handover's target while the deployment it takes them from moves off."""
        allowed = frozenset(holders)
        held = False
        for uuid in set(gpu_uuids):
            if not self.is_available(uuid):
                return False
            others = self._claims.get(uuid, set()) - {owner}
            if others - allowed:
                return False
            held = held or bool(others)
        return held

    def is_available(self, gpu_uuid: str) -> bool:
        """True when nothing is known against the GPU (claims aside)."""
        return not self._why.get(gpu_uuid) and self._node_of.get(gpu_uuid) not in self._down_nodes

    def claim(self, gpu_uuids: Iterable[str], owner: str) -> None:
        """Mark GPUs as held by ``owner`` (beside the other holders of a shared GPU)."""
        for uuid in gpu_uuids:
            self._claims.setdefault(uuid, set()).add(owner)

    def release(self, gpu_uuids: Iterable[str], owner: str) -> None:
        """Return GPUs ``owner`` held; others' claims are untouched."""
        for uuid in gpu_uuids:
            holders = self._claims.get(uuid)
            if holders is not None:
                holders.discard(owner)
                if not holders:
                    del self._claims[uuid]
