"""Ranks of an execution plan and the KV re-partition between two layouts. Pure: no torch.

One process per GPU of the plan. A rank knows its stage, its TP slice (query heads, KV heads,
MLP columns) and its layer range; the KV it holds is exactly ``layers × kv heads`` of that
slice, so moving a sequence between layouts is a set of rectangle intersections
(:func:`repartition`): every (layer, KV head) of the destination comes from exactly one source
rank. The same plan serves a PD split's hand-off (prefill pipeline → decode pipeline) and a gear
shift's migration (old plan's decode pipeline → new plan's).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from gearbox.plans import ExecutionPlan, StageRole
from runtime.engine.torch.config import LlamaConfig


class Pipeline(StrEnum):
    """Which pipeline of a plan a rank belongs to."""

    UNIFIED = "unified"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class RankSpec:
    """One process of a plan: its place in the pipeline and its slice of the model."""

    rank: int  # global rank in the engine's process group
    gpu_uuid: str
    pipeline: Pipeline
    stage_pos: int  # position inside its pipeline
    num_stages: int  # stages in its pipeline
    tp_rank: int
    tp_size: int
    tp_group: tuple[int, ...]  # global ranks of its stage, TP order
    layer_start: int
    layer_end: int  # exclusive
    kv_head_start: int
    kv_head_end: int
    prev_leader: int | None  # TP rank 0 of the previous stage (sends activations here)
    next_stage: tuple[int, ...]  # ranks of the next stage (receive activations from here)

    @property
    def is_first(self) -> bool:
        """Embeds tokens."""
        return self.stage_pos == 0

    @property
    def is_last(self) -> bool:
        """Holds the final norm and LM head."""
        return self.stage_pos == self.num_stages - 1

    @property
    def is_leader(self) -> bool:
        """TP rank 0: sends activations on and returns sampled tokens."""
        return self.tp_rank == 0

    @property
    def num_layers(self) -> int:
        """Layers this rank runs."""
        return self.layer_end - self.layer_start

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank holds."""
        return self.kv_head_end - self.kv_head_start


@dataclass(frozen=True, slots=True)
class CopyOp:
    """Copy layers × KV heads of a sequence from one rank's pool to another's (global indices)."""

    src_rank: int
    dst_rank: int
    layer_start: int
    layer_end: int
    kv_head_start: int
    kv_head_end: int


def plan_ranks(plan: ExecutionPlan, cfg: LlamaConfig) -> tuple[RankSpec, ...]:
    """Every rank of ``plan`` in global-rank order (stage by stage, TP order inside a stage)."""
    for stage in plan.stages:
        if not cfg.valid_tp(stage.tp):
            raise ValueError(f"stages: TP {stage.tp} does not split {cfg.name}'s heads/MLP evenly")
        if stage.layer_end > cfg.num_layers:
            raise ValueError(f"stages: layer {stage.layer_end} past the model's {cfg.num_layers}")
    pipelines: list[tuple[Pipeline, list[int]]] = []
    if plan.is_disaggregated:
        roles = [s.role for s in plan.stages]
        pre = [i for i, r in enumerate(roles) if r is StageRole.PREFILL]
        dec = [i for i, r in enumerate(roles) if r is StageRole.DECODE]
        pipelines = [(Pipeline.PREFILL, pre), (Pipeline.DECODE, dec)]
    else:
        pipelines = [(Pipeline.UNIFIED, list(range(len(plan.stages))))]
    first_rank: list[int] = []
    total = 0
    for stage in plan.stages:
        first_rank.append(total)
        total += stage.tp
    out: list[RankSpec] = []
    for kind, indices in pipelines:
        for pos, index in enumerate(indices):
            stage = plan.stages[index]
            group = tuple(range(first_rank[index], first_rank[index] + stage.tp))
            prev = first_rank[indices[pos - 1]] if pos > 0 else None
            nxt: tuple[int, ...] = ()
            if pos + 1 < len(indices):
                following = plan.stages[indices[pos + 1]]
                nxt = tuple(
                    range(first_rank[indices[pos + 1]], first_rank[indices[pos + 1]] + following.tp)
                )
            kv_per_rank = cfg.num_kv_heads // stage.tp
            for tp_rank, uuid in enumerate(stage.gpu_uuids):
                out.append(
                    RankSpec(
                        rank=group[tp_rank],
                        gpu_uuid=uuid,
                        pipeline=kind,
                        stage_pos=pos,
                        num_stages=len(indices),
                        tp_rank=tp_rank,
                        tp_size=stage.tp,
                        tp_group=group,
                        layer_start=stage.layer_start,
                        layer_end=stage.layer_end,
                        kv_head_start=tp_rank * kv_per_rank,
                        kv_head_end=(tp_rank + 1) * kv_per_rank,
                        prev_leader=prev,
                        next_stage=nxt,
                    )
                )
    return tuple(sorted(out, key=lambda r: r.rank))


def kv_holders(ranks: tuple[RankSpec, ...], pipeline: Pipeline) -> tuple[RankSpec, ...]:
    """Ranks of one pipeline (each holds the KV of its layers × KV heads)."""
    return tuple(r for r in ranks if r.pipeline is pipeline)


def repartition(src: tuple[RankSpec, ...], dst: tuple[RankSpec, ...]) -> tuple[CopyOp, ...]:
    """The copies that move a sequence's KV from the ``src`` ranks' layout to the ``dst`` one.

    Each op is the intersection of a source and a destination rank's (layers × KV heads)
    rectangle; together they cover every destination rectangle exactly once (both layouts
    tile the same layers × heads).
    """
    ops = []
    for d in dst:
        for s in src:
            layers = (max(s.layer_start, d.layer_start), min(s.layer_end, d.layer_end))
            heads = (max(s.kv_head_start, d.kv_head_start), min(s.kv_head_end, d.kv_head_end))
            if layers[0] < layers[1] and heads[0] < heads[1]:
                ops.append(CopyOp(s.rank, d.rank, *layers, *heads))
    return tuple(ops)
