"""Atomic blocks: groups of live GPUs whose shared interconnect can carry tensor parallelism.

A block is one interconnect domain's live GPUs (healthy, schedulable, heartbeat within the
timeout). A domain whose link is slower than ``min_block_link_gbps`` cannot carry TP across its
hosts, so it is split into one block per node. Plans consume blocks; TP never spans two blocks.

Block ids must survive small membership changes, because the fragment history is keyed by them:
:func:`assign_block_ids` reuses a previous id when the Jaccard overlap of GPU sets reaches
``block_id_jaccard``; otherwise the id is derived from the member set, so it is deterministic.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from gearbox.config import GearboxConfig
from gearbox.serde import Serialisable
from gearbox.types import LinkClass, TopologySnapshot

__all__ = ["AtomicBlock", "BlockGroup", "assign_block_ids", "build_blocks", "jaccard"]


@dataclass(frozen=True, slots=True)
class AtomicBlock(Serialisable):
    """A schedulable unit of GPUs sharing one TP-capable link."""

    block_id: str  # stable across small membership changes
    domain_id: str  # interconnect domain the GPUs belong to
    link: LinkClass  # link between any two of its GPUs
    gpu_uuids: tuple[str, ...]  # sorted
    nodes: tuple[str, ...]  # sorted host names

    @property
    def num_gpus(self) -> int:
        """Number of GPUs in the block."""
        return len(self.gpu_uuids)


@dataclass(frozen=True, slots=True)
class BlockGroup:
    """A block's membership before an id is assigned."""

    domain_id: str
    link: LinkClass
    gpu_uuids: tuple[str, ...]  # sorted
    nodes: tuple[str, ...]  # sorted


def build_blocks(
    snapshot: TopologySnapshot,
    config: GearboxConfig,
    previous: Sequence[AtomicBlock] = (),
) -> tuple[AtomicBlock, ...]:
    """Group the snapshot's live GPUs into atomic blocks, sorted by block id."""
    members: dict[tuple[str, str], list[tuple[str, str]]] = defaultdict(list)
    links = {d.domain_id: d.link for d in snapshot.domains}
    for gpu in snapshot.gpus:
        if not snapshot.gpu_is_live(gpu):
            continue
        link = links.get(gpu.domain, snapshot.inter_domain_link)
        # NOTE: below the threshold the domain's hosts cannot share a TP group, so each host's
        # GPUs form their own block (a host's GPUs can always talk over local PCIe at least).
        split_key = gpu.node if link.bandwidth_gbps < config.min_block_link_gbps else ""
        members[(gpu.domain, split_key)].append((gpu.uuid, gpu.node))
    groups = []
    for (domain_id, _), pairs in sorted(members.items()):
        groups.append(
            BlockGroup(
                domain_id=domain_id,
                link=links.get(domain_id, snapshot.inter_domain_link),
                gpu_uuids=tuple(sorted(uuid for uuid, _ in pairs)),
                nodes=tuple(sorted({node for _, node in pairs})),
            )
        )
    return assign_block_ids(groups, previous, config.block_id_jaccard)


def jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    """|a ∩ b| / |a ∪ b| (0 for two empty sets)."""
    union = len(a | b)
    return len(a & b) / union if union else 0.0


def assign_block_ids(
    groups: Sequence[BlockGroup], previous: Sequence[AtomicBlock], min_jaccard: float
) -> tuple[AtomicBlock, ...]:
    """Give each group the id of the previous block it overlaps most (Jaccard >= min_jaccard).

    Matching is greedy on descending overlap with ids as tie-breakers, so it is deterministic and
    each previous id is reused at most once. Unmatched groups get a content-derived id.
    """
    owner_of: dict[str, AtomicBlock] = {}
    for block in previous:
        for uuid in block.gpu_uuids:
            owner_of[uuid] = block
    scored: list[tuple[float, int, str]] = []
    for index, group in enumerate(groups):
        members = frozenset(group.gpu_uuids)
        touched = {owner_of[u].block_id: owner_of[u] for u in group.gpu_uuids if u in owner_of}
        for block_id, block in touched.items():
            overlap = jaccard(members, frozenset(block.gpu_uuids))
            if overlap >= min_jaccard:
                scored.append((-overlap, index, block_id))
    scored.sort()
    chosen: dict[int, str] = {}
    used: set[str] = set()
    for _, index, block_id in scored:
        if index not in chosen and block_id not in used:
            chosen[index] = block_id
            used.add(block_id)
    blocks = []
    for index, group in enumerate(groups):
        block_id = chosen.get(index) or _fresh_id(group, used)
        used.add(block_id)
        blocks.append(
            AtomicBlock(block_id, group.domain_id, group.link, group.gpu_uuids, group.nodes)
        )
    return tuple(sorted(blocks, key=lambda b: b.block_id))


def _fresh_id(group: BlockGroup, used: set[str]) -> str:
    digest = hashlib.sha256("\n".join(group.gpu_uuids).encode()).hexdigest()
    base = f"{group.domain_id}:{digest[:8]}"
    candidate, suffix = base, 1
    while candidate in used:
        suffix += 1
        candidate = f"{base}.{suffix}"
    return candidate
