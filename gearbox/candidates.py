"""Replica options: the building blocks of candidate deployments, enumerated per block.

Pruning keeps the count proportional to blocks, not GPUs:

* TP only inside a block, at degrees that divide the query and KV heads and are at least the
  memory minimum (weights + KV reserve per GPU). A block offers its TP degree as data-parallel
  copies on disjoint GPU groups — one option per (block, degree), however many GPUs it has.
* PP only across blocks that cannot host the model alone, chained greedily (strongest first)
  over links of at least ``min_pp_link_gbps``; layers are split in proportion to each stage's
  speed on its hardware, capped by what fits in its memory.
* PD (prefill on one of the strongest blocks, decode on another) only over links of at least
  ``min_pd_link_gbps``.
* Within one block, an option that another option beats on capacity, latency and GPU count at
  once is dropped (dominated).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from gearbox import cache
from gearbox.blocks import AtomicBlock
from gearbox.config import GearboxConfig
from gearbox.cost import (
    ReplicaCapacity,
    ReplicaShape,
    StageShape,
    layer_time_s,
    max_layers_fitting,
    memory_bucket,
    min_tp_for_memory,
    replica_capacity,
)
from gearbox.model import ModelSpec
from gearbox.plans import ExecutionPlan, Stage, StageRole
from gearbox.types import Gpu, GpuClass, LinkClass, TopologySnapshot

__all__ = [
    "OptionKind",
    "ReplicaCopy",
    "ReplicaOption",
    "StageTemplate",
    "enumerate_options",
    "limiting_class",
    "split_layers",
]


class OptionKind(StrEnum):
    """Parallel layout of an option."""

    TP = "tp"  # one stage inside one block, as many copies as the block holds
    PP = "pp"  # a pipeline of stages over several blocks
    PD = "pd"  # prefill stage on one block, decode stage on another


@dataclass(frozen=True, slots=True)
class StageTemplate:
    """A stage without its GPUs."""

    block_id: str
    domain_id: str
    role: StageRole
    layer_start: int
    layer_end: int
    tp_link: LinkClass


@dataclass(frozen=True, slots=True)
class ReplicaCopy:
    """One placement of an option's stages on concrete GPUs."""

    gpu_groups: tuple[tuple[str, ...], ...]  # per stage, TP ranks in order
    gpu_classes: tuple[GpuClass, ...]  # per stage, limiting class
    shape: ReplicaShape
    capacity: ReplicaCapacity


@dataclass(frozen=True, slots=True)
class ReplicaOption:
    """A replica layout on a fixed set of blocks, with its feasible copies (best first)."""

    label: str  # readable and unique per call, e.g. "tp4@blk-a"
    kind: OptionKind
    block_ids: tuple[str, ...]
    stages: tuple[StageTemplate, ...]
    pp_link: LinkClass | None
    handoff_link: LinkClass | None
    copies: tuple[ReplicaCopy, ...]
    # NOTE: derived once here: every decision reads them for each of its ~600 options, most of
    # them cached from earlier decisions (gearbox.cache)
    gpus_per_copy: int = field(init=False, compare=False, repr=False)  # GPUs one copy uses
    total_rps: float = field(init=False, compare=False, repr=False)  # all copies' capacity

    def __post_init__(self) -> None:
        first = self.copies[0].gpu_groups if self.copies else ()  # NOTE: none: left out later
        object.__setattr__(self, "gpus_per_copy", sum(len(g) for g in first))
        object.__setattr__(self, "total_rps", sum(c.capacity.capacity_rps for c in self.copies))

    def plan(self, model_name: str, copy_index: int) -> ExecutionPlan:
        """Materialise one copy as an :class:`ExecutionPlan`."""
        copy = self.copies[copy_index]
        stages = tuple(
            Stage(t.block_id, t.domain_id, gpus, t.layer_start, t.layer_end, t.role, cls, t.tp_link)
            for t, gpus, cls in zip(self.stages, copy.gpu_groups, copy.gpu_classes, strict=True)
        )
        return ExecutionPlan(model_name, stages, self.pp_link, self.handoff_link)


def limiting_class(classes: Sequence[GpuClass]) -> GpuClass:
    """Element-wise minimum of several classes: a TP group runs at its weakest member's pace."""
    unique = sorted({c.name: c for c in classes}.values(), key=lambda c: c.name)
    if len(unique) == 1:
        return unique[0]
    return GpuClass(
        "+".join(c.name for c in unique),
        min(c.peak_bf16_tflops for c in unique),
        min(c.memory_bytes for c in unique),
        min(c.memory_bandwidth_gbps for c in unique),
    )


@dataclass(frozen=True, slots=True)
class _Context:
    model: ModelSpec
    config: GearboxConfig
    prompt_tokens: int
    output_tokens: int
    available: Mapping[str, int]


def _group_shape(
    ctx: _Context, gpus: Sequence[Gpu], layers: int, link: LinkClass
) -> tuple[GpuClass, StageShape]:
    cls = limiting_class([g.gpu_class for g in gpus])
    least = memory_bucket(min(ctx.available.get(g.uuid, 0) for g in gpus))
    return cls, StageShape(cls, len(gpus), layers, link, least)


def _tp_option(ctx: _Context, block: AtomicBlock, gpus: Sequence[Gpu], tp: int) -> ReplicaOption:
    layers = ctx.model.num_layers
    template = StageTemplate(
        block.block_id, block.domain_id, StageRole.UNIFIED, 0, layers, block.link
    )
    memo: dict[StageShape, ReplicaCapacity] = {}
    copies = []
    # NOTE: GPUs that cannot hold their share at this degree (another deployment's weights on
    # them) are left out before the groups are cut: cut in place, one sank its whole group, and
    # a block of six hoppers, one a neighbour's, offered no TP4 over the other five
    room = [
        g
        for g in gpus
        if min_tp_for_memory(ctx.available.get(g.uuid, 0), ctx.model, ctx.config) <= tp
    ]
    for start in range(0, len(room) - tp + 1, tp):
        group = room[start : start + tp]
        cls, stage_shape = _group_shape(ctx, group, layers, block.link)
        shape = ReplicaShape((stage_shape,), (), None, None)
        if stage_shape not in memo:
            memo[stage_shape] = replica_capacity(
                shape, ctx.model, ctx.prompt_tokens, ctx.output_tokens, ctx.config
            )
        if memo[stage_shape].feasible:
            copies.append(
                ReplicaCopy((tuple(g.uuid for g in group),), (cls,), shape, memo[stage_shape])
            )
    copies.sort(key=lambda c: -c.capacity.capacity_rps)
    return ReplicaOption(
        f"tp{tp}@{block.block_id}",
        OptionKind.TP,
        (block.block_id,),
        (template,),
        None,
        None,
        tuple(copies),
    )


def _block_tp_options(
    ctx: _Context, block: AtomicBlock, gpus: Sequence[Gpu]
) -> list[ReplicaOption]:
    best_available = max(ctx.available.get(g.uuid, 0) for g in gpus)
    min_tp = min_tp_for_memory(best_available, ctx.model, ctx.config)
    sizes = ctx.model.valid_tp_sizes(min(len(gpus), ctx.config.max_tp))
    options = [_tp_option(ctx, block, gpus, tp) for tp in sizes if tp >= min_tp]
    return _prune_dominated([o for o in options if o.copies])


def _summary(option: ReplicaOption) -> tuple[float, float, float, float, int]:
    best = option.copies[0].capacity
    per_gpu = best.capacity_rps / option.gpus_per_copy
    return (
        option.total_rps,
        per_gpu,
        -best.prefill_latency_s,
        -best.unloaded_tbt_s,
        -option.gpus_per_copy,
    )


def _prune_dominated(options: list[ReplicaOption]) -> list[ReplicaOption]:
    """Drop options another option matches or beats on every axis (and beats on one).

    Axes: total capacity, capacity per GPU, prefill latency, unloaded TBT, GPUs per copy — the
    last keeps small TP degrees, which serve low load on fewer GPUs.
    """
    summaries = [_summary(o) for o in options]
    kept = []
    for i, mine in enumerate(summaries):
        dominated = any(
            other != mine and all(a >= b for a, b in zip(other, mine, strict=True))
            for other in summaries
        )
        if not dominated:
            kept.append(options[i])
    return kept


def split_layers(
    num_layers: int, speeds: Sequence[float], caps: Sequence[int]
) -> tuple[int, ...] | None:
    """Split layers in proportion to stage speeds, never above a stage's cap, at least 1 each.

    Water-filling: stages whose proportional share exceeds their cap are pinned at the cap and
    the rest is re-shared; the integer split uses largest remainders (ties: earlier stage).
    Returns None when the caps cannot hold the model.
    """
    n = len(speeds)
    if n == 0 or n > num_layers or sum(caps) < num_layers or min(caps) < 1:
        return None
    alloc = [0] * n
    free = list(range(n))
    remaining = num_layers
    while True:
        total = sum(speeds[i] for i in free)
        ideal = {i: remaining * speeds[i] / total for i in free}
        over = [i for i in free if ideal[i] > caps[i]]
        if not over or len(over) == len(free):
            break
        for i in over:
            alloc[i] = caps[i]
            remaining -= caps[i]
            free.remove(i)
    for i in free:
        alloc[i] = min(caps[i], max(1, math.floor(ideal[i])))
    by_remainder = sorted(free, key=lambda i: (-(ideal[i] - math.floor(ideal[i])), i))
    while sum(alloc) < num_layers:
        grow = next((i for i in by_remainder if alloc[i] < caps[i]), None)
        if grow is None:
            return None
        alloc[grow] += 1
        by_remainder.remove(grow)
        by_remainder.append(grow)
    while sum(alloc) > num_layers:
        shrink = max(range(n), key=lambda i: (alloc[i], -i))
        alloc[shrink] -= 1
    return tuple(alloc)


def _largest_tp_group(ctx: _Context, gpus: Sequence[Gpu]) -> Sequence[Gpu]:
    tp = max(ctx.model.valid_tp_sizes(min(len(gpus), ctx.config.max_tp)))
    return gpus[:tp]


def _pipeline_option(
    ctx: _Context,
    snapshot: TopologySnapshot,
    chain: Sequence[tuple[AtomicBlock, Sequence[Gpu]]],
) -> ReplicaOption | None:
    groups = [_largest_tp_group(ctx, gpus) for _, gpus in chain]
    shapes = [_group_shape(ctx, g, 1, b.link) for (b, _), g in zip(chain, groups, strict=True)]
    caps = [max_layers_fitting(s.available_bytes, s.tp, ctx.model, ctx.config) for _, s in shapes]
    speeds = [
        1.0
        / layer_time_s(
            c, s.tp, s.tp_link, ctx.model, ctx.prompt_tokens, ctx.output_tokens, ctx.config
        )
        for c, s in shapes
    ]
    split = split_layers(ctx.model.num_layers, speeds, caps)
    if split is None:
        return None
    hops = [
        snapshot.link_between(a.domain_id, b.domain_id)
        for (a, _), (b, _) in itertools.pairwise(chain)
    ]
    pp_link = min(hops, key=lambda link: (link.bandwidth_gbps, link.name))
    templates, stage_shapes, start = [], [], 0
    for (block, _), (_, s), layers in zip(chain, shapes, split, strict=True):
        templates.append(
            StageTemplate(
                block.block_id,
                block.domain_id,
                StageRole.UNIFIED,
                start,
                start + layers,
                block.link,
            )
        )
        stage_shapes.append(StageShape(s.gpu_class, s.tp, layers, s.tp_link, s.available_bytes))
        start += layers
    shape = ReplicaShape(tuple(stage_shapes), (), pp_link, None)
    capacity = replica_capacity(shape, ctx.model, ctx.prompt_tokens, ctx.output_tokens, ctx.config)
    if not capacity.feasible:
        return None
    copy = ReplicaCopy(
        tuple(tuple(g.uuid for g in group) for group in groups),
        tuple(c for c, _ in shapes),
        shape,
        capacity,
    )
    block_ids = tuple(b.block_id for b, _ in chain)
    return ReplicaOption(
        f"pp{len(chain)}@{'+'.join(block_ids)}",
        OptionKind.PP,
        block_ids,
        tuple(templates),
        pp_link,
        None,
        (copy,),
    )


def _pp_options(
    ctx: _Context, snapshot: TopologySnapshot, small: Sequence[tuple[AtomicBlock, Sequence[Gpu]]]
) -> list[ReplicaOption]:
    def power(entry: tuple[AtomicBlock, Sequence[Gpu]]) -> float:
        group = _largest_tp_group(ctx, entry[1])
        return len(group) * limiting_class([g.gpu_class for g in group]).peak_bf16_tflops

    def cap(entry: tuple[AtomicBlock, Sequence[Gpu]]) -> int:
        _, shape = _group_shape(ctx, _largest_tp_group(ctx, entry[1]), 1, entry[0].link)
        return max_layers_fitting(shape.available_bytes, shape.tp, ctx.model, ctx.config)

    options: list[ReplicaOption] = []
    chain: list[tuple[AtomicBlock, Sequence[Gpu]]] = []
    for entry in sorted(small, key=lambda e: (-power(e), e[0].block_id)):
        if cap(entry) < 1:
            continue
        if chain:
            hop = snapshot.link_between(chain[-1][0].domain_id, entry[0].domain_id)
            if hop.bandwidth_gbps < ctx.config.min_pp_link_gbps:
                continue
        chain.append(entry)
        if len(chain) >= 2 and sum(cap(e) for e in chain) >= ctx.model.num_layers:
            option = _pipeline_option(ctx, snapshot, chain)
            if option is not None:
                options.append(option)
                chain = []
                continue
        if len(chain) >= ctx.config.max_pp_stages:
            chain.pop(0)  # the strongest blocks cannot hold it together; slide the window
    return options


def _pd_option(
    ctx: _Context, prefill: ReplicaOption, decode: ReplicaOption, link: LinkClass
) -> ReplicaOption | None:
    p_copy, d_copy = prefill.copies[0], decode.copies[0]
    shape = ReplicaShape(p_copy.shape.prefill, d_copy.shape.prefill, None, link)
    capacity = replica_capacity(shape, ctx.model, ctx.prompt_tokens, ctx.output_tokens, ctx.config)
    if not capacity.feasible:
        return None
    layers = ctx.model.num_layers
    p_tpl, d_tpl = prefill.stages[0], decode.stages[0]
    templates = (
        StageTemplate(p_tpl.block_id, p_tpl.domain_id, StageRole.PREFILL, 0, layers, p_tpl.tp_link),
        StageTemplate(d_tpl.block_id, d_tpl.domain_id, StageRole.DECODE, 0, layers, d_tpl.tp_link),
    )
    copy = ReplicaCopy(
        p_copy.gpu_groups + d_copy.gpu_groups,
        p_copy.gpu_classes + d_copy.gpu_classes,
        shape,
        capacity,
    )
    return ReplicaOption(
        f"pd:{prefill.label}>{decode.label}",
        OptionKind.PD,
        (p_tpl.block_id, d_tpl.block_id),
        templates,
        None,
        link,
        (copy,),
    )


def _pd_options(
    ctx: _Context,
    snapshot: TopologySnapshot,
    hosts: Sequence[Sequence[ReplicaOption]],
    signatures: Mapping[str, cache.Key],
    common: cache.Key,
) -> list[ReplicaOption]:
    # NOTE: each block's biggest option once, not once per pairing it is in
    biggest = [max(opts, key=lambda o: (o.gpus_per_copy, o.label)) for opts in hosts]
    fastest = sorted(
        biggest,
        key=lambda o: (o.copies[0].capacity.prefill_latency_s, o.block_ids),
    )
    options = []
    for prefill in fastest[: ctx.config.max_pd_prefill_blocks]:
        for decode in biggest:
            if decode.block_ids == prefill.block_ids:
                continue
            link = snapshot.link_between(prefill.stages[0].domain_id, decode.stages[0].domain_id)
            if link.bandwidth_gbps < ctx.config.min_pd_link_gbps:
                continue
            key = cache.Key(
                "pd",
                common,
                signatures[prefill.block_ids[0]],
                signatures[decode.block_ids[0]],
                link,
            )
            option = cache.OPTIONS.get_or(
                key,
                lambda p=prefill, d=decode, k=link: _pd_option(ctx, p, d, k),  # type: ignore[misc]
            )
            if option is not None:
                options.append(option)
    return options


def enumerate_options(
    blocks: Sequence[AtomicBlock],
    snapshot: TopologySnapshot,
    model: ModelSpec,
    prompt_tokens: int,
    output_tokens: int,
    available: Mapping[str, int],
    config: GearboxConfig,
) -> tuple[ReplicaOption, ...]:
    """All non-dominated replica options over ``blocks`` (TP per block, PP and PD across blocks).

    ``available`` maps each live GPU's uuid to the bytes a plan may use there (free memory, plus
    what the deployment itself holds on its own GPUs); a block's GPUs missing from it are not
    used (callers leave out GPUs a new replica may not take). Output order is deterministic.
    """
    ctx = _Context(model, config, prompt_tokens, output_tokens, available)
    by_uuid = {g.uuid: g for g in snapshot.gpus}
    hosts: list[tuple[ReplicaOption, ...]] = []
    small: list[tuple[AtomicBlock, Sequence[Gpu]]] = []
    # NOTE: options are memoised per block signature (gearbox.cache): a trigger that touched one
    # block enumerates that block again, not the cluster
    common = cache.OPTIONS.intern(cache.Key(model, config, prompt_tokens, output_tokens))
    signatures: dict[str, cache.Key] = {}
    for block in sorted(blocks, key=lambda b: b.block_id):
        gpus = sorted(
            (by_uuid[u] for u in block.gpu_uuids if u in by_uuid and u in available),
            key=lambda g: (g.gpu_class.name, g.node, g.uuid),
        )
        if not gpus:
            continue
        signature = cache.OPTIONS.intern(cache.block_signature(block, gpus, available))
        signatures[block.block_id] = signature
        tp_options = cache.OPTIONS.get_or(
            cache.Key("tp", common, signature),
            lambda b=block, g=gpus: tuple(_block_tp_options(ctx, b, g)),  # type: ignore[misc]
        )
        if tp_options:
            hosts.append(tp_options)
        else:
            small.append((block, gpus))
    options = [o for opts in hosts for o in opts]
    if config.max_pp_stages >= 2 and small:
        links = (snapshot.inter_domain_link, snapshot.link_overrides)
        key = cache.Key("pp", common, links, tuple(signatures[b.block_id] for b, _ in small))
        options += cache.OPTIONS.get_or(key, lambda: tuple(_pp_options(ctx, snapshot, small)))
    options += _pd_options(ctx, snapshot, hosts, signatures, common)
    return tuple(options)
