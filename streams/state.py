"""Per-GPU and per-node state folded from telemetry and cluster events (pure, time as input).

A GPU's state comes from its samples (each one is complete, so the newest rebuilds it); a node's
from cluster events (up/down, isolation, tenant reservations, fatal XIDs, link changes). Whether a
GPU is schedulable combines both and the heartbeat timeout — see :mod:`streams.snapshot`.

Agents deliver at least once, so folds drop duplicates: an envelope is a duplicate when it comes
from the source that was seen last, with a sequence number and an event time no newer than the
last one's. NOTE: the event-time condition lets a restarted agent, whose sequence starts again
at 1, through.

``rev`` counts writes of a record; it survives restarts inside the changelogged value, so a
reader of the changelog (:mod:`streams.view`) can tell a newer record from an older echo.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

from flexpipe.schemas import FATAL_XIDS, ClusterEvent, ClusterEventType, DomainInfo, GpuSample

__all__ = [
    "Dedupe",
    "DomainLink",
    "FoldOutcome",
    "GpuState",
    "NodeState",
    "fold_cluster_event",
    "fold_gpu_sample",
    "is_duplicate",
    "mark_timed_out",
    "material_gpu_change",
]

GIB = 1024**3
FREE_MEMORY_STEP_BYTES = GIB  # free memory moves the shared view only by a GiB or more
UTILISATION_STEP = 0.05  # and utilisation by 5 points or more


class FoldOutcome(StrEnum):
    """What folding one event did."""

    APPLIED = "applied"
    DUPLICATE = "duplicate"  # same (source, seq) seen before: agents are at-least-once
    STALE = "stale"  # older than the state it would replace
    NO_CHANGE = "no_change"  # valid, but nothing the state records moved


@dataclass(frozen=True, slots=True)
class Dedupe:
    """The last envelope folded into a record."""

    source: str = ""
    seq: int = -1
    event_time_ms: int = -1


def is_duplicate(last: Dedupe, source: str, seq: int, event_time_ms: int) -> bool:
    """True for a redelivery of something already folded (see the module docstring)."""
    return source == last.source and seq <= last.seq and event_time_ms <= last.event_time_ms


@dataclass(frozen=True, slots=True)
class GpuState:
    """One GPU as its latest sample describes it, plus when it was last heard from."""

    uuid: str
    node: str
    name: str
    gpu_class: str | None  # preset key, resolved by streams.catalog
    domain: str | None
    index: int | None
    total_memory_bytes: int
    free_memory_bytes: int
    used_memory_bytes: int
    healthy: bool
    utilisation: float  # compute utilisation in [0, 1] (0 when NVML cannot say)
    xid_errors: tuple[int, ...]
    last_seen_s: float  # event time of the latest sample (a heartbeat is a sample)
    timed_out: bool = False  # set by the heartbeat sweep, cleared by the next sample
    rev: int = 0
    dedupe: Dedupe = Dedupe()


def fold_gpu_sample(
    state: GpuState | None, sample: GpuSample, source: str, seq: int, event_time_ms: int
) -> tuple[GpuState | None, FoldOutcome]:
    """Fold one sample; returns the new state (unchanged on duplicates and stale samples)."""
    if state is not None:
        if is_duplicate(state.dedupe, source, seq, event_time_ms):
            return state, FoldOutcome.DUPLICATE
        if event_time_ms / 1000.0 < state.last_seen_s:
            return state, FoldOutcome.STALE
    util_pct = sample.sm_util_pct if sample.sm_util_pct is not None else 0.0
    new = GpuState(
        uuid=sample.gpu_uuid,
        node=sample.node,
        name=sample.name,
        gpu_class=sample.gpu_class,
        domain=sample.domain,
        index=sample.index,
        total_memory_bytes=max(0, sample.memory_total_bytes),
        free_memory_bytes=max(0, sample.memory_free_bytes),
        used_memory_bytes=max(0, sample.memory_used_bytes),
        healthy=sample.healthy,
        utilisation=min(1.0, max(0.0, util_pct / 100.0)),
        xid_errors=tuple(sample.xid_errors),
        last_seen_s=event_time_ms / 1000.0,
        timed_out=False,
        rev=state.rev if state is not None else 0,
        dedupe=Dedupe(source, seq, event_time_ms),
    )
    return new, FoldOutcome.APPLIED


def _identity(s: GpuState) -> tuple[object, ...]:
    return (s.node, s.gpu_class, s.domain, s.total_memory_bytes, s.healthy, s.timed_out)


def material_gpu_change(published: GpuState | None, current: GpuState, refresh_s: float) -> bool:
    """Whether ``current`` must reach the shared view: a field the planner uses moved (free
    memory by a GiB, utilisation by 5 points, anything else at all), or the published copy's
    ``last_seen_s`` is ``refresh_s`` or more behind."""
    if published is None or _identity(published) != _identity(current):
        return True
    if abs(current.free_memory_bytes - published.free_memory_bytes) >= FREE_MEMORY_STEP_BYTES:
        return True
    if abs(current.utilisation - published.utilisation) >= UTILISATION_STEP:
        return True
    return current.last_seen_s - published.last_seen_s >= refresh_s


def mark_timed_out(state: GpuState, now_s: float, timeout_s: float) -> GpuState | None:
    """The state marked timed out when its heartbeat is overdue at ``now_s``; None otherwise."""
    if state.timed_out or now_s - state.last_seen_s <= timeout_s:
        return None
    return replace(state, timed_out=True)


@dataclass(frozen=True, slots=True)
class DomainLink:
    """A domain's link as a node agent reported it."""

    domain_id: str
    link: str  # link preset key
    bandwidth_gbps: float | None


@dataclass(frozen=True, slots=True)
class NodeState:
    """A node as cluster events describe it; GPU sets are sorted uuids."""

    node: str
    up: bool = True
    domains: tuple[DomainLink, ...] = ()
    isolated: tuple[str, ...] = ()  # fault-isolated by the scheduler
    reserved: tuple[str, ...] = ()  # held by another tenant's reservation (preemption)
    failed: tuple[str, ...] = ()  # fatal XID: needs a reset
    updated_ms: int = 0  # event time of the last event that changed the node
    rev: int = 0
    dedupe: Dedupe = Dedupe()


def _add(gpus: tuple[str, ...], more: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(sorted(set(gpus) | set(more)))


def _remove(gpus: tuple[str, ...], less: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(sorted(set(gpus) - set(less)))


def _links(domains: tuple[DomainInfo, ...]) -> tuple[DomainLink, ...]:
    return tuple(
        sorted(
            (DomainLink(d.domain_id, d.link, d.bandwidth_gbps) for d in domains),
            key=lambda d: d.domain_id,
        )
    )


def _relink(node: NodeState, changed: tuple[DomainInfo, ...]) -> tuple[DomainLink, ...]:
    updates = {d.domain_id: d for d in _links(changed)}
    kept = [updates.pop(d.domain_id, d) for d in node.domains]
    return tuple(sorted([*kept, *updates.values()], key=lambda d: d.domain_id))


def _apply(node: NodeState, ev: ClusterEvent) -> NodeState:
    t = ClusterEventType
    gpus = tuple(ev.gpu_uuids)
    if ev.type is t.NODE_UP:
        return replace(node, up=True, domains=_links(ev.domains) or node.domains)
    if ev.type is t.NODE_DOWN:
        return replace(node, up=False)
    if ev.type is t.GPU_ISOLATED:
        return replace(node, isolated=_add(node.isolated, gpus))
    if ev.type is t.GPU_RESTORED:
        return replace(
            node, isolated=_remove(node.isolated, gpus), failed=_remove(node.failed, gpus)
        )
    if ev.type is t.PREEMPT:
        return replace(node, reserved=_add(node.reserved, gpus))
    if ev.type is t.RELEASE:
        return replace(node, reserved=_remove(node.reserved, gpus))
    if ev.type is t.XID and ev.xid in FATAL_XIDS:
        return replace(node, failed=_add(node.failed, gpus))
    if ev.type is t.LINK:
        return replace(node, domains=_relink(node, ev.domains))
    return node  # recoverable XIDs: the samples carry them; schedulability does not change


def fold_cluster_event(
    state: NodeState | None, ev: ClusterEvent, source: str, seq: int, event_time_ms: int
) -> tuple[NodeState, FoldOutcome]:
    """Fold one cluster event into its node's state."""
    node = state or NodeState(ev.node)
    if state is not None and is_duplicate(state.dedupe, source, seq, event_time_ms):
        return state, FoldOutcome.DUPLICATE
    dedupe = Dedupe(source, seq, event_time_ms)
    applied = _apply(node, ev)
    if state is not None and applied == node:
        return replace(node, dedupe=dedupe), FoldOutcome.NO_CHANGE
    return replace(applied, updated_ms=event_time_ms, dedupe=dedupe), FoldOutcome.APPLIED
