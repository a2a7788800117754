"""Execution plans: the first-class "gear" objects the runtime carries out.

An :class:`ExecutionPlan` is one serving pipeline of a model: stages (each a TP group inside one
atomic block) holding contiguous layer ranges, optionally split into a prefill pipeline and a
decode pipeline joined by a KV hand-off link. A :class:`DeploymentPlan` is the set of plans
(replicas) one deployment co-runs on disjoint GPUs. Communication groups and the KV partition are
derived from the stages, so they can never disagree with them.

Plan ids are content hashes (sha256 of the canonical JSON), so equal plans have equal ids in every
process; a deployment's id ignores the deployment name and replica order.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Self

from gearbox.model import ModelSpec
from gearbox.serde import Serialisable, from_plain, to_plain
from gearbox.types import GpuClass, LinkClass

__all__ = [
    "CommGroup",
    "CommKind",
    "DeploymentPlan",
    "ExecutionPlan",
    "KvShard",
    "Stage",
    "StageRole",
]


class StageRole(StrEnum):
    """What a stage runs."""

    UNIFIED = "unified"  # prefill and decode (continuous batching)
    PREFILL = "prefill"  # prefill only; hands KV to the decode pipeline
    DECODE = "decode"  # decode only


class CommKind(StrEnum):
    """What a communication group carries."""

    TP = "tp"  # all-reduces inside a stage
    PP = "pp"  # activations between consecutive stages
    KV_HANDOFF = "kv_handoff"  # KV from the prefill pipeline's last stage to the decode pipeline


@dataclass(frozen=True, slots=True)
class Stage(Serialisable):
    """One TP group inside one atomic block, holding layers [layer_start, layer_end)."""

    block_id: str
    domain_id: str
    gpu_uuids: tuple[str, ...]  # TP ranks in order
    layer_start: int
    layer_end: int  # exclusive
    role: StageRole
    gpu_class: GpuClass  # limiting class of the group (element-wise minimum on mixed hardware)
    tp_link: LinkClass  # link the group's all-reduces use

    @property
    def tp(self) -> int:
        """Tensor-parallel degree."""
        return len(self.gpu_uuids)

    @property
    def num_layers(self) -> int:
        """Layers this stage holds."""
        return self.layer_end - self.layer_start


@dataclass(frozen=True, slots=True)
class CommGroup(Serialisable):
    """GPUs that communicate, and over which link."""

    kind: CommKind
    gpu_uuids: tuple[str, ...]
    link: LinkClass


@dataclass(frozen=True, slots=True)
class KvShard(Serialisable):
    """The KV cache slice one GPU holds: a layer range × a KV-head range."""

    gpu_uuid: str
    layer_start: int
    layer_end: int
    kv_head_start: int
    kv_head_end: int


def _check_pipeline(stages: tuple[Stage, ...], num_layers: int | None) -> int:
    expected = 0
    for stage in stages:
        if stage.layer_start != expected or stage.layer_end <= stage.layer_start:
            raise ValueError("stages: layer ranges must be contiguous and non-empty from layer 0")
        if not stage.gpu_uuids:
            raise ValueError("stages: every stage needs at least one GPU")
        expected = stage.layer_end
    if num_layers is not None and expected != num_layers:
        raise ValueError("stages: prefill and decode pipelines must cover the same layers")
    return expected


@dataclass(frozen=True, slots=True)
class ExecutionPlan(Serialisable):
    """One replica's parallel layout: stages, their links and the optional PD split."""

    model_name: str
    stages: tuple[Stage, ...]  # unified pipeline, or prefill stages followed by decode stages
    pp_link: LinkClass | None = None  # link between consecutive stages; None without PP
    kv_handoff_link: LinkClass | None = None  # set exactly when prefill/decode are split

    def __post_init__(self) -> None:
        prefill, decode = self.prefill_stages, self.decode_stages
        roles = [s.role for s in self.stages]
        if not self.stages:
            raise ValueError("stages: a plan needs at least one stage")
        if self.is_disaggregated:
            if roles != [StageRole.PREFILL] * len(prefill) + [StageRole.DECODE] * len(decode):
                raise ValueError("stages: prefill stages must precede decode stages")
            if not prefill or not decode or self.kv_handoff_link is None:
                raise ValueError("kv_handoff_link: a PD split needs both pipelines and a link")
        elif self.kv_handoff_link is not None:
            raise ValueError("kv_handoff_link: only a PD-split plan has a KV hand-off link")
        _check_pipeline(decode, _check_pipeline(prefill, None))
        if (max(len(prefill), len(decode)) > 1) != (self.pp_link is not None):
            raise ValueError("pp_link: required exactly when a pipeline has several stages")
        gpus = self.gpu_uuids
        if len(set(gpus)) != len(gpus):
            raise ValueError("stages: a GPU may appear in only one stage")

    @property
    def is_disaggregated(self) -> bool:
        """True when prefill and decode run on separate stages."""
        return any(s.role is not StageRole.UNIFIED for s in self.stages)

    @property
    def prefill_stages(self) -> tuple[Stage, ...]:
        """Stages that run prefill, in pipeline order."""
        return tuple(s for s in self.stages if s.role is not StageRole.DECODE)

    @property
    def decode_stages(self) -> tuple[Stage, ...]:
        """Stages that run decode (and hold the KV cache), in pipeline order."""
        return tuple(s for s in self.stages if s.role is not StageRole.PREFILL)

    @property
    def gpu_uuids(self) -> tuple[str, ...]:
        """All GPUs of the plan, stage by stage."""
        return tuple(uuid for stage in self.stages for uuid in stage.gpu_uuids)

    @property
    def block_ids(self) -> tuple[str, ...]:
        """Sorted distinct blocks the plan uses."""
        return tuple(sorted({s.block_id for s in self.stages}))

    @property
    def plan_id(self) -> str:
        """Deterministic content hash."""
        return _execution_plan_id(self)

    def comm_groups(self) -> tuple[CommGroup, ...]:
        """TP groups per stage, PP pairs between consecutive stages, and the KV hand-off pair."""
        groups = [CommGroup(CommKind.TP, s.gpu_uuids, s.tp_link) for s in self.stages if s.tp > 1]
        pipelines = (
            (self.prefill_stages, self.decode_stages) if self.is_disaggregated else (self.stages,)
        )
        for pipeline in pipelines:
            for left, right in itertools.pairwise(pipeline):
                assert self.pp_link is not None
                pair = left.gpu_uuids + right.gpu_uuids
                groups.append(CommGroup(CommKind.PP, pair, self.pp_link))
        if self.kv_handoff_link is not None:
            pair = self.prefill_stages[-1].gpu_uuids + self.decode_stages[0].gpu_uuids
            groups.append(CommGroup(CommKind.KV_HANDOFF, pair, self.kv_handoff_link))
        return tuple(groups)

    def kv_partition(self, model: ModelSpec) -> tuple[KvShard, ...]:
        """Which layers and KV heads each decode GPU holds (heads split evenly across TP ranks)."""
        shards = []
        for stage in self.decode_stages:
            heads_per_rank = model.num_kv_heads // stage.tp
            for rank, uuid in enumerate(stage.gpu_uuids):
                start = rank * heads_per_rank
                shards.append(
                    KvShard(uuid, stage.layer_start, stage.layer_end, start, start + heads_per_rank)
                )
        return tuple(shards)

    def to_dict(self) -> dict[str, object]:
        """Plain dict including the derived ``plan_id``."""
        return {**_plain(self), "plan_id": self.plan_id}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> Self:
        """Inverse of :meth:`to_dict`; a ``plan_id`` present must match the content."""
        plan = from_plain(cls, {k: v for k, v in data.items() if k != "plan_id"})
        _check_claimed_id(plan.plan_id, data)
        return plan


@dataclass(frozen=True, slots=True)
class DeploymentPlan(Serialisable):
    """All replicas one deployment runs at once, on disjoint GPUs."""

    deployment: str  # deployment name (not part of the plan id)
    model_name: str
    replicas: tuple[ExecutionPlan, ...]  # canonical order: by first GPU uuid

    def __post_init__(self) -> None:
        ordered = tuple(sorted(self.replicas, key=lambda r: r.stages[0].gpu_uuids[0]))
        object.__setattr__(self, "replicas", ordered)
        seen: set[str] = set()
        for replica in ordered:
            if replica.model_name != self.model_name:
                raise ValueError("replicas: every replica must serve the deployment's model")
            gpus = set(replica.gpu_uuids)
            if seen & gpus:
                raise ValueError("replicas: replicas must use disjoint GPUs")
            seen |= gpus

    @property
    def plan_id(self) -> str:
        """Deterministic content hash of the model and the replica plans."""
        return _deployment_plan_id(self)

    @property
    def gpu_uuids(self) -> frozenset[str]:
        """Every GPU any replica uses."""
        return frozenset(u for r in self.replicas for u in r.gpu_uuids)

    @property
    def num_gpus(self) -> int:
        """GPUs the deployment holds."""
        return sum(len(r.gpu_uuids) for r in self.replicas)

    def to_dict(self) -> dict[str, object]:
        """Plain dict including the derived ``plan_id``."""
        return {**_plain(self), "plan_id": self.plan_id}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> Self:
        """Inverse of :meth:`to_dict`; a ``plan_id`` present must match the content."""
        plan = from_plain(cls, {k: v for k, v in data.items() if k != "plan_id"})
        _check_claimed_id(plan.plan_id, data)
        return plan


def _plain(value: object) -> dict[str, object]:
    plain = to_plain(value)
    assert isinstance(plain, dict)
    return plain


def _digest(prefix: str, payload: object) -> str:
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return f"{prefix}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


@functools.lru_cache(maxsize=65_536)
def _execution_plan_id(plan: ExecutionPlan) -> str:
    return _digest("xp", _plain(plan))


@functools.lru_cache(maxsize=4096)
def _deployment_plan_id(plan: DeploymentPlan) -> str:
    return _digest("dp", [plan.model_name, sorted(r.plan_id for r in plan.replicas)])


def _check_claimed_id(actual: str, data: Mapping[str, object]) -> None:
    claimed = data.get("plan_id")
    if claimed is not None and claimed != actual:
        raise ValueError(f"plan_id: content hashes to {actual}, message says {claimed}")
