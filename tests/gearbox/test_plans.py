"""Execution and deployment plans: validation, ids, derived groups, serialisation."""

from __future__ import annotations

import json

import pytest

from gearbox import (
    MODEL_7B_MHA,
    MODEL_70B_GQA,
    CommKind,
    DeploymentPlan,
    ExecutionPlan,
    KvShard,
    StageRole,
)
from gearbox.presets import LINK_CLASSES
from gearbox.types import LinkClass
from tests.gearbox.builders import deployment, make_stage, tp_plan

GPUS = tuple(f"A-g{i:02d}" for i in range(8))


def _pp_pd_plan() -> ExecutionPlan:
    """Prefill TP4 on A; decode pipelined over two TP2 stages on B."""
    return ExecutionPlan(
        MODEL_70B_GQA.name,
        (
            make_stage(GPUS[:4], (0, 80), role=StageRole.PREFILL),
            make_stage(
                ("B-g0", "B-g1"),
                (0, 50),
                block_id="blk-b",
                domain_id="B",
                role=StageRole.DECODE,
                gpu_class="a100-80g",
                link="rdma",
            ),
            make_stage(
                ("B-g2", "B-g3"),
                (50, 80),
                block_id="blk-b",
                domain_id="B",
                role=StageRole.DECODE,
                gpu_class="a100-80g",
                link="rdma",
            ),
        ),
        pp_link=LINK_CLASSES["rdma"],
        kv_handoff_link=LINK_CLASSES["ethernet"],
    )


@pytest.mark.unit
def test_plan_id_is_a_content_hash() -> None:
    a = tp_plan(GPUS, MODEL_70B_GQA)
    assert a.plan_id == tp_plan(GPUS, MODEL_70B_GQA).plan_id
    assert a.plan_id.startswith("xp-")
    assert a.plan_id != tp_plan(GPUS[::-1], MODEL_70B_GQA).plan_id  # rank order matters


@pytest.mark.unit
def test_deployment_id_ignores_name_and_replica_order() -> None:
    r1, r2 = tp_plan(GPUS[:4], MODEL_7B_MHA), tp_plan(GPUS[4:], MODEL_7B_MHA)
    assert deployment(r1, r2).plan_id == deployment(r2, r1, name="other").plan_id
    assert deployment(r1).plan_id != deployment(r1, r2).plan_id


@pytest.mark.unit
def test_pp_pd_plan_structure() -> None:
    plan = _pp_pd_plan()
    assert plan.is_disaggregated
    assert [s.tp for s in plan.prefill_stages] == [4]
    assert [(s.layer_start, s.layer_end) for s in plan.decode_stages] == [(0, 50), (50, 80)]
    assert plan.block_ids == ("blk-a", "blk-b")
    kinds = [(g.kind, g.link.name) for g in plan.comm_groups()]
    assert kinds == [
        (CommKind.TP, "nvlink"),
        (CommKind.TP, "rdma"),
        (CommKind.TP, "rdma"),
        (CommKind.PP, "rdma"),
        (CommKind.KV_HANDOFF, "ethernet"),
    ]


@pytest.mark.unit
def test_kv_partition_splits_kv_heads_over_tp_ranks() -> None:
    shards = _pp_pd_plan().kv_partition(MODEL_70B_GQA)
    assert shards[:2] == (KvShard("B-g0", 0, 50, 0, 4), KvShard("B-g1", 0, 50, 4, 8))
    assert {s.gpu_uuid for s in shards} == {"B-g0", "B-g1", "B-g2", "B-g3"}


@pytest.mark.unit
@pytest.mark.parametrize(
    ("stages", "pp_link", "handoff_link", "message"),
    [
        ((), None, None, "at least one stage"),
        (((0, 40), (41, 80)), LINK_CLASSES["rdma"], None, "contiguous"),
        (((0, 40), (40, 80)), None, None, "pp_link"),
        (((0, 80),), None, LINK_CLASSES["rdma"], "kv_handoff_link"),
    ],
)
def test_invalid_plans_are_rejected(
    stages: tuple[tuple[int, int], ...],
    pp_link: LinkClass | None,
    handoff_link: LinkClass | None,
    message: str,
) -> None:
    built = tuple(make_stage((f"g{i}",), layers) for i, layers in enumerate(stages))
    with pytest.raises(ValueError, match=message):
        ExecutionPlan("m", built, pp_link, handoff_link)


@pytest.mark.unit
def test_a_gpu_serves_one_stage_and_one_replica() -> None:
    with pytest.raises(ValueError, match="only one stage"):
        ExecutionPlan(
            "m",
            (make_stage(("g0",), (0, 1)), make_stage(("g0",), (1, 2))),
            pp_link=LINK_CLASSES["rdma"],
        )
    plan = tp_plan(GPUS[:2], MODEL_7B_MHA)
    with pytest.raises(ValueError, match="disjoint"):
        DeploymentPlan("d", MODEL_7B_MHA.name, (plan, tp_plan(GPUS[1:3], MODEL_7B_MHA)))


@pytest.mark.unit
def test_round_trip_through_json() -> None:
    plan = deployment(_pp_pd_plan(), tp_plan(("C-g0",), MODEL_70B_GQA))
    wire = json.dumps(plan.to_dict())
    back = DeploymentPlan.from_dict(json.loads(wire))
    assert back == plan and back.plan_id == plan.plan_id
    single = _pp_pd_plan()
    assert ExecutionPlan.from_dict(json.loads(json.dumps(single.to_dict()))) == single


@pytest.mark.unit
def test_tampered_plan_id_is_rejected() -> None:
    data = tp_plan(GPUS, MODEL_70B_GQA).to_dict()
    data["plan_id"] = "xp-0000000000000000"
    with pytest.raises(ValueError, match="plan_id"):
        ExecutionPlan.from_dict(data)


@pytest.mark.unit
def test_malformed_payload_names_the_field() -> None:
    data = tp_plan(GPUS, MODEL_70B_GQA).to_dict()
    stages = data["stages"]
    assert isinstance(stages, list)
    stages[0]["layer_end"] = "eighty"
    with pytest.raises(ValueError, match="layer_end"):
        ExecutionPlan.from_dict(data)
