"""Switch cost: what a shift from one deployment plan to another costs, in one unit.

The unit is token-equivalents: tokens the deployment would have served but does not. Parts:

* Weight loading: each new replica loads its weight shard at ``weight_load_gbps`` per GPU
  (local NVMe / page cache; PCIe Gen4 NVMe reads ~5–7 GB/s). It runs in the shadow phase while
  the old plan serves, except on GPUs the old plan must first release — that part blocks.
* KV hand-over of the active sequences on replaced replicas: per sequence, migrate its KV bytes
  (2 × layers × kv_heads × head_dim × dtype bytes per token) over the path's bandwidth ×
  ``kv_transfer_efficiency``, or replay it (re-prefill on the new plan). Both proceed at once on
  different resources (link vs new plan's compute), so each sequence, longest first, takes
  whichever would finish it earlier given what is already queued on each — the cheaper one.
  Duration = the later of the two queues. Sequences whose GPUs were lost can only be replayed.
  Across a deployment, distinct replica pairs migrate in parallel (one lane per pair, each over
  the slowest source→destination link) and every new replica replays its share.
* Throughput lost while switching: the replaced replicas' share of served tokens, lost at
  ``switch_throughput_loss`` (overlapped hand-over dips rather than stops) during comm setup
  and KV hand-over, fully during blocking weight loads; replayed prompt tokens are recomputed.
* Cold start: each new replica serves its first ``cold_start_requests`` requests
  ``cold_start_slowdown`` slower (empty prefix caches, un-captured graphs, allocator warm-up).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from gearbox.config import DEFAULT_CONFIG, GearboxConfig
from gearbox.cost import pipeline_prefill_s, replica_capacity, replica_shape
from gearbox.model import ModelSpec
from gearbox.plans import DeploymentPlan, ExecutionPlan
from gearbox.ranking import available_memory
from gearbox.scoring import estimate_deployment, request_profile
from gearbox.serde import Serialisable
from gearbox.types import LinkClass, LoadSnapshot, TopologySnapshot

__all__ = [
    "KvAction",
    "KvChoice",
    "KvHandover",
    "SwitchCost",
    "handover_link",
    "plan_kv_handover",
    "switch_cost",
]

_GB = 1e9
_US = 1e-6


class KvAction(StrEnum):
    """How one sequence's KV reaches the new plan."""

    MIGRATE = "migrate"
    REPLAY = "replay"


class KvChoice(StrEnum):
    """Summary of the KV hand-over of a whole switch."""

    NONE = "none"  # no active sequence moves
    MIGRATE = "migrate"
    REPLAY = "replay"
    MIXED = "mixed"


@dataclass(frozen=True, slots=True)
class KvHandover(Serialisable):
    """The hand-over of one sequence."""

    seq_id: str
    action: KvAction
    num_tokens: int  # context length
    transfer_bytes: int  # bytes over the link (0 when replayed)
    est_s: float  # this sequence's own migrate or replay time


@dataclass(frozen=True, slots=True)
class SwitchCost(Serialisable):
    """Breakdown of a switch's cost; ``total_tokens`` is what hysteresis compares against."""

    weights_bytes: int  # weights loaded into new replicas
    weights_load_s: float  # slowest GPU's shard load
    blocking_weights_s: float  # part of the load that stalls serving (GPUs reused in place)
    kv_choice: KvChoice
    kv_sequences_migrated: int
    kv_sequences_replayed: int
    kv_migrate_bytes: int
    kv_replay_tokens: int
    kv_handover_s: float  # the later of the migrate and replay queues
    duration_s: float  # modelled shift: blocking load + comm setup + KV hand-over
    lost_tokens: float  # served tokens lost while switching, replay recompute included
    cold_start_tokens: float
    total_tokens: float  # lost + cold start
    # a handover's wait: until the neighbour it takes GPUs from has moved off them
    handover_wait_s: float = 0.0

    @classmethod
    def zero(cls) -> SwitchCost:
        """The cost of staying put."""
        return cls(0, 0.0, 0.0, KvChoice.NONE, 0, 0, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0)

    @property
    def transition_s(self) -> float:
        """The whole modelled transition, from its start until the new plan serves.

        ``duration_s`` counts the weight load only where it blocks serving; here the shadow
        load counts too (the runtime loads weights before it switches), which is what the
        deployment waits for when the plan it serves on is broken; a handover first waits for the
        neighbour it takes GPUs from to move off them.
        """
        load_s = self.weights_load_s - self.blocking_weights_s
        return self.duration_s + load_s + self.handover_wait_s


def handover_link(
    sources: Sequence[ExecutionPlan], targets: Sequence[ExecutionPlan], snapshot: TopologySnapshot
) -> LinkClass:
    """Slowest link between any source decode stage and any target decode stage."""
    source_domains = sorted({s.domain_id for p in sources for s in p.decode_stages})
    target_domains = sorted({s.domain_id for p in targets for s in p.decode_stages})
    links = [snapshot.link_between(a, b) for a in source_domains for b in target_domains]
    return min(links, key=lambda link: (link.bandwidth_gbps, -link.latency_us, link.name))


def _migrate_s(num_tokens: int, model: ModelSpec, link: LinkClass, config: GearboxConfig) -> float:
    rate = link.bandwidth_gbps * _GB * config.kv_transfer_efficiency
    return num_tokens * model.kv_bytes_per_token / rate + link.latency_us * _US


def _replay_s(
    num_tokens: int, plan: ExecutionPlan, model: ModelSpec, config: GearboxConfig
) -> float:
    shape = replica_shape(plan, {})
    latency, _ = pipeline_prefill_s(shape.prefill, shape.pp_link, model, num_tokens, config)
    return latency


def plan_kv_handover(
    sequences: Sequence[tuple[str, int]],
    from_plan: ExecutionPlan,
    to_plan: ExecutionPlan,
    snapshot: TopologySnapshot,
    model: ModelSpec,
    config: GearboxConfig = DEFAULT_CONFIG,
) -> tuple[KvHandover, ...]:
    """Migrate-or-replay for each ``(seq_id, context_tokens)``, longest sequences first.

    Each sequence takes the action that would finish it earlier given the work already queued
    on the link (migrations) and on the new plan (replays); see the module docstring. When a
    GPU of the old plan's decode stages is no longer live, every sequence is replayed.
    """
    link = handover_link((from_plan,), (to_plan,), snapshot)
    live = {g.uuid for g in snapshot.gpus if snapshot.gpu_is_live(g)}
    # NOTE: KV on a GPU that is gone cannot be migrated; those sequences can only be replayed.
    can_migrate = all(u in live for s in from_plan.decode_stages for u in s.gpu_uuids)
    link_busy_s = compute_busy_s = 0.0
    out = []
    for seq_id, num_tokens in sorted(sequences, key=lambda s: (-s[1], s[0])):
        migrate = _migrate_s(num_tokens, model, link, config)
        replay = _replay_s(num_tokens, to_plan, model, config)
        if can_migrate and link_busy_s + migrate <= compute_busy_s + replay:
            link_busy_s += migrate
            moved = num_tokens * model.kv_bytes_per_token
            out.append(KvHandover(seq_id, KvAction.MIGRATE, num_tokens, moved, migrate))
        else:
            compute_busy_s += replay
            out.append(KvHandover(seq_id, KvAction.REPLAY, num_tokens, 0, replay))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class _KvSplit:
    migrated: int
    replayed: int
    migrate_bytes: int
    replay_tokens: int
    duration_s: float


def _uniform_split(
    movable: int,
    lost: int,
    num_tokens: int,
    migrate_s: float,
    replay_s: float,
    model: ModelSpec,
) -> _KvSplit:
    """Closed form of the earliest-finish rule for equal sequences.

    ``lost`` sequences sat on GPUs that are gone and must be replayed; of the ``movable`` ones,
    k migrate so that the link queue (k·m) and the replay queue ((movable − k + lost)·r) balance.
    """
    if movable + lost == 0:
        return _KvSplit(0, 0, 0, 0, 0.0)
    balanced = round(((movable + lost) * replay_s) / (migrate_s + replay_s))
    migrated = max(0, min(movable, balanced))
    replayed = movable + lost - migrated
    return _KvSplit(
        migrated,
        replayed,
        migrated * num_tokens * model.kv_bytes_per_token,
        replayed * num_tokens,
        max(migrated * migrate_s, replayed * replay_s),
    )


def _weights(
    added: Sequence[ExecutionPlan], freed: frozenset[str], model: ModelSpec, config: GearboxConfig
) -> tuple[int, float, float]:
    total_bytes, load_s, blocking_s = 0, 0.0, 0.0
    for plan in added:
        for stage in plan.stages:
            shard = model.weight_bytes * stage.num_layers / model.num_layers / stage.tp
            total_bytes += math.ceil(shard) * stage.tp
            stage_s = shard / (config.weight_load_gbps * _GB)
            load_s = max(load_s, stage_s)
            if freed.intersection(stage.gpu_uuids):
                blocking_s = max(blocking_s, stage_s)
    return total_bytes, load_s, blocking_s


def _kv_choice(split: _KvSplit) -> KvChoice:
    if split.migrated and split.replayed:
        return KvChoice.MIXED
    if split.migrated:
        return KvChoice.MIGRATE
    return KvChoice.REPLAY if split.replayed else KvChoice.NONE


@dataclass(frozen=True, slots=True)
class _Affected:
    served_tok_s: float  # what the still-live current replicas serve
    live_share: float  # capacity share of replaced replicas whose GPUs are all live
    lost_share: float  # capacity share of replaced replicas that lost GPUs (KV is gone)


def _affected(
    current: DeploymentPlan | None,
    removed: Sequence[ExecutionPlan],
    model: ModelSpec,
    load: LoadSnapshot,
    config: GearboxConfig,
    available: Mapping[str, int],
) -> _Affected:
    """How much of the current plan a switch touches.

    Sequences are spread in proportion to each replica's nominal capacity (what it had before
    any GPU was lost, counting a lost GPU at its class's full memory).
    """
    if current is None or not removed:
        return _Affected(0.0, 0.0, 0.0)
    prompt, output = request_profile(load, config)
    nominal = {
        u: available.get(u, s.gpu_class.memory_bytes)
        for r in current.replicas
        for s in r.stages
        for u in s.gpu_uuids
    }
    removed_ids = {r.plan_id for r in removed}
    live_shapes, live_gpus = [], 0
    total = live_removed = lost_removed = 0.0
    for replica in current.replicas:
        rps = replica_capacity(
            replica_shape(replica, nominal), model, prompt, output, config
        ).capacity_rps
        is_live = all(u in available for u in replica.gpu_uuids)
        total += rps
        if replica.plan_id in removed_ids:
            live_removed += rps if is_live else 0.0
            lost_removed += 0.0 if is_live else rps
        if is_live:
            live_shapes.append(replica_shape(replica, available))
            live_gpus += len(replica.gpu_uuids)
    served = 0.0
    if live_shapes:
        served = estimate_deployment(live_shapes, live_gpus, model, load, config).served_tok_s
    if total <= 0:
        return _Affected(served, 0.0, 1.0)
    return _Affected(served, live_removed / total, lost_removed / total)


def _kv_handover_split(
    removed: Sequence[ExecutionPlan],
    destinations: Sequence[ExecutionPlan],
    affected: _Affected,
    snapshot: TopologySnapshot,
    model: ModelSpec,
    load: LoadSnapshot,
    config: GearboxConfig,
) -> _KvSplit:
    movable = round(load.active_sequences * affected.live_share)
    lost = round(load.active_sequences * affected.lost_share)
    if movable + lost == 0:
        return _KvSplit(0, 0, 0, 0, 0.0)
    tokens = max(1, load.active_kv_tokens // max(1, load.active_sequences))
    link = handover_link(removed, destinations, snapshot)
    # NOTE: distinct source/destination replica pairs migrate over distinct NICs, and every
    # destination replica replays its share, so both queues drain in parallel lanes.
    lanes = min(len(removed), len(destinations))
    migrate = _migrate_s(tokens, model, link, config) / lanes
    replay = 1.0 / sum(1.0 / _replay_s(tokens, d, model, config) for d in destinations)
    return _uniform_split(movable, lost, tokens, migrate, replay, model)


def switch_cost(
    current: DeploymentPlan | None,
    target: DeploymentPlan,
    snapshot: TopologySnapshot,
    model: ModelSpec,
    load: LoadSnapshot,
    config: GearboxConfig,
    available: Mapping[str, int] | None = None,
) -> SwitchCost:
    """Cost of moving from ``current`` to ``target`` (replicas present in both are untouched).

    ``available`` maps GPU uuid → bytes for the current plan's capacity; it defaults to
    :func:`gearbox.ranking.available_memory` for the snapshot and the current plan's GPUs.
    Active sequences are assumed spread over current replicas in proportion to capacity, each
    holding the mean context ``active_kv_tokens / active_sequences``.
    """
    current_ids = {r.plan_id for r in current.replicas} if current else set()
    target_ids = {r.plan_id for r in target.replicas}
    removed = [r for r in current.replicas if r.plan_id not in target_ids] if current else []
    added = [r for r in target.replicas if r.plan_id not in current_ids]
    if not removed and not added:
        return SwitchCost.zero()
    if available is None:
        available = available_memory(snapshot, current.gpu_uuids if current else frozenset())
    prompt, output = request_profile(load, config)
    affected = _affected(current, removed, model, load, config, available)
    freed = frozenset(u for r in removed for u in r.gpu_uuids)
    weights_bytes, load_s, blocking_s = _weights(added, freed, model, config)
    destinations = added or list(target.replicas)
    split = _kv_handover_split(removed, destinations, affected, snapshot, model, load, config)
    affected_tok_s = affected.served_tok_s * affected.live_share
    lost_tokens = (
        affected_tok_s * blocking_s
        + affected_tok_s * (config.comm_setup_s + split.duration_s) * config.switch_throughput_loss
        + split.replay_tokens
    )
    cold = len(added) * config.cold_start_requests * (prompt + output) * config.cold_start_slowdown
    return SwitchCost(
        weights_bytes=weights_bytes,
        weights_load_s=load_s,
        blocking_weights_s=blocking_s,
        kv_choice=_kv_choice(split),
        kv_sequences_migrated=split.migrated,
        kv_sequences_replayed=split.replayed,
        kv_migrate_bytes=split.migrate_bytes,
        kv_replay_tokens=split.replay_tokens,
        kv_handover_s=split.duration_s,
        duration_s=blocking_s + config.comm_setup_s + split.duration_s,
        lost_tokens=lost_tokens,
        cold_start_tokens=cold,
        total_tokens=lost_tokens + cold,
    )
