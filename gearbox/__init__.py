"""gearbox — FlexPipe's pure decision core (no I/O, no clocks, no global randomness).

Functions take a snapshot and a config and return values; the stream processors, the runtime,
the simulator and the tests all call the same code. Public API:

* types: :class:`GpuClass`, :class:`LinkClass`, :class:`Gpu`, :class:`Domain`,
  :class:`TopologySnapshot`, :class:`LoadSnapshot`, :class:`ModelSpec` (+ ``gearbox.presets``)
* blocks: :func:`build_blocks`, :func:`assign_block_ids`, :class:`AtomicBlock`
* plans: :class:`ExecutionPlan`, :class:`DeploymentPlan`, :class:`Stage`
* planning: :func:`rank_candidates`, :func:`enumerate_options`, cost functions in ``gearbox.cost``
* switching: :func:`switch_cost`, :func:`plan_kv_handover`
* deciding: :func:`decide` → :class:`DecideResult` (:class:`Decision`, :class:`GearState`)
* placement: :func:`place_model`, :func:`dead_memory`; a resident model's replica count:
  ``gearbox.scaling.scale_replicas``; on-demand residency: ``gearbox.residency``
"""

from gearbox.blocks import AtomicBlock, assign_block_ids, build_blocks, jaccard
from gearbox.candidates import OptionKind, ReplicaOption, enumerate_options, split_layers
from gearbox.config import (
    DEFAULT_CONFIG,
    DEFAULT_PLACEMENT_CONFIG,
    GearboxConfig,
    PlacementConfig,
)
from gearbox.cost import ReplicaEstimate, clear_caches, estimate_replica, replica_shape
from gearbox.decide import NO_OVERRIDES, decide
from gearbox.decisions import (
    CandidateSummary,
    DecideResult,
    Decision,
    DecisionReason,
    Overrides,
    Trigger,
)
from gearbox.history import (
    BlockHistory,
    BlockSample,
    BlockSeries,
    FailedTarget,
    GearState,
    quarantined_plan_ids,
    record_blocks,
    record_failed_target,
    stability_factor,
    stability_factors,
)
from gearbox.model import ModelSpec
from gearbox.placement import (
    Backlog,
    EvictionProposal,
    EvictionRule,
    FragmentationReport,
    GpuVerdict,
    ModelFootprint,
    PlacementDecision,
    PlacementReason,
    PlacementStatus,
    ResidentModel,
    dead_memory,
    place_model,
)
from gearbox.plans import (
    CommGroup,
    CommKind,
    DeploymentPlan,
    ExecutionPlan,
    KvShard,
    Stage,
    StageRole,
)
from gearbox.presets import GPU_CLASSES, LINK_CLASSES, MODEL_7B_MHA, MODEL_70B_GQA
from gearbox.ranking import (
    RankedCandidate,
    available_memory,
    estimate_plan,
    held_gpus,
    plan_problems,
    rank_candidates,
)
from gearbox.scoring import DeploymentEstimate, demand_rps, estimate_deployment
from gearbox.switch import (
    KvAction,
    KvChoice,
    KvHandover,
    SwitchCost,
    plan_kv_handover,
    switch_cost,
)
from gearbox.types import (
    Domain,
    Gpu,
    GpuClass,
    LinkClass,
    LinkOverride,
    LoadSnapshot,
    TopologySnapshot,
)

__all__ = [
    "DEFAULT_CONFIG",
    "DEFAULT_PLACEMENT_CONFIG",
    "GPU_CLASSES",
    "LINK_CLASSES",
    "MODEL_7B_MHA",
    "MODEL_70B_GQA",
    "NO_OVERRIDES",
    "AtomicBlock",
    "Backlog",
    "BlockHistory",
    "BlockSample",
    "BlockSeries",
    "CandidateSummary",
    "CommGroup",
    "CommKind",
    "DecideResult",
    "Decision",
    "DecisionReason",
    "DeploymentEstimate",
    "DeploymentPlan",
    "Domain",
    "EvictionProposal",
    "EvictionRule",
    "ExecutionPlan",
    "FailedTarget",
    "FragmentationReport",
    "GearState",
    "GearboxConfig",
    "Gpu",
    "GpuClass",
    "GpuVerdict",
    "KvAction",
    "KvChoice",
    "KvHandover",
    "KvShard",
    "LinkClass",
    "LinkOverride",
    "LoadSnapshot",
    "ModelFootprint",
    "ModelSpec",
    "OptionKind",
    "Overrides",
    "PlacementConfig",
    "PlacementDecision",
    "PlacementReason",
    "PlacementStatus",
    "RankedCandidate",
    "ReplicaEstimate",
    "ReplicaOption",
    "ResidentModel",
    "Stage",
    "StageRole",
    "SwitchCost",
    "TopologySnapshot",
    "Trigger",
    "assign_block_ids",
    "available_memory",
    "build_blocks",
    "clear_caches",
    "dead_memory",
    "decide",
    "demand_rps",
    "enumerate_options",
    "estimate_deployment",
    "estimate_plan",
    "estimate_replica",
    "held_gpus",
    "jaccard",
    "place_model",
    "plan_kv_handover",
    "plan_problems",
    "quarantined_plan_ids",
    "rank_candidates",
    "record_blocks",
    "record_failed_target",
    "replica_shape",
    "split_layers",
    "stability_factor",
    "stability_factors",
    "switch_cost",
]
