"""The one starting-plan rule: natural order, live GPUs only, fit or nothing, valid shapes."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from gearbox.blocks import build_blocks
from gearbox.config import DEFAULT_CONFIG
from gearbox.model import ModelSpec
from gearbox.plans import DeploymentPlan
from gearbox.presets import LINK_CLASSES, MODEL_7B_MHA, MODEL_70B_GQA
from gearbox.starting import PlanHint, hint_groups, natural_key, starting_plan, starting_plans
from gearbox.types import TopologySnapshot
from tests.gearbox.builders import NOW_S, DomainSpec, make_cluster, with_gpus

pytestmark = pytest.mark.unit


@dataclass(frozen=True, slots=True)
class Dep:
    name: str
    model: ModelSpec
    hint: PlanHint | None


def cluster(a: int = 12, b: int = 4) -> TopologySnapshot:
    """Block A: ``a`` H100 on NVLink; block B: ``b`` A100 on RDMA."""
    return make_cluster(
        (
            DomainSpec("A", "nvlink", ("h100-sxm",) * a, gpus_per_node=4),
            DomainSpec("B", "rdma", ("a100-80g",) * b, gpus_per_node=2),
        )
    )


def plan_of(deps: tuple[Dep, ...], name: str, snap: TopologySnapshot) -> DeploymentPlan | None:
    return starting_plan(deps, name, snap, build_blocks(snap, DEFAULT_CONFIG))


def test_natural_key_orders_digit_runs_as_numbers() -> None:
    names = ["gpu-10", "gpu-2", "node-b1", "gpu-1", "node-a10", "node-a9"]
    assert sorted(names, key=natural_key) == [
        "gpu-1",
        "gpu-2",
        "gpu-10",
        "node-a9",
        "node-a10",
        "node-b1",
    ]


def test_groups_follow_natural_order_and_skip_earlier_hints() -> None:
    available = {"A": [f"g{i}" for i in (10, 2, 1, 3, 11, 4)]}
    groups = hint_groups(
        [("first", PlanHint("A", tp=2)), ("none", None), ("second", PlanHint("A", replicas=2))],
        available,
    )
    assert groups == {"first": (("g1", "g2"),), "none": None, "second": (("g3",), ("g4",))}


def test_a_hint_that_does_not_fit_takes_nothing() -> None:
    available = {"A": ["g1", "g2", "g3"], "B": ["h1"]}
    groups = hint_groups(
        [
            ("big", PlanHint("A", tp=2, replicas=2)),  # needs 4 of 3
            ("after", PlanHint("A", tp=2)),
            ("unknown-block", PlanHint("Z")),
        ],
        available,
    )
    assert groups == {"big": None, "after": (("g1", "g2"),), "unknown-block": None}


def test_plan_uses_live_gpus_of_the_block_in_natural_order() -> None:
    snap = cluster()
    dead = [f"A-g{i:02d}" for i in (0, 3)]
    snap = with_gpus(snap, dead[:1], healthy=False)
    snap = with_gpus(snap, dead[1:], last_seen_s=NOW_S - 10 * snap.heartbeat_timeout_s)
    snap = with_gpus(snap, ["A-g01"], schedulable=False)  # isolated
    deps = (Dep("chat", MODEL_7B_MHA, PlanHint("A", tp=4)),)
    plan = plan_of(deps, "chat", snap)
    assert plan is not None
    (replica,) = plan.replicas
    assert replica.stages[0].gpu_uuids == ("A-g02", "A-g04", "A-g05", "A-g06")
    assert replica.stages[0].tp_link == LINK_CLASSES["nvlink"]


def test_too_few_live_gpus_give_none_and_leave_them_to_later_hints() -> None:
    snap = with_gpus(cluster(b=4), ["B-g00"], healthy=False)
    deps = (
        Dep("wide", MODEL_7B_MHA, PlanHint("B", tp=4)),
        Dep("narrow", MODEL_7B_MHA, PlanHint("B", tp=2)),
    )
    plans = starting_plans(deps, snap, build_blocks(snap, DEFAULT_CONFIG))
    assert plans["wide"] is None
    narrow = plans["narrow"]
    assert narrow is not None and narrow.gpu_uuids == {"B-g01", "B-g02"}


def test_invalid_tp_gives_none_but_still_takes_its_gpus() -> None:
    snap = cluster(a=6)
    deps = (
        Dep("odd", MODEL_7B_MHA, PlanHint("A", tp=3)),  # 3 does not divide 32 heads
        Dep("next", MODEL_7B_MHA, PlanHint("A", tp=2)),
    )
    plans = starting_plans(deps, snap, build_blocks(snap, DEFAULT_CONFIG))
    assert plans["odd"] is None
    nxt = plans["next"]
    assert nxt is not None and nxt.gpu_uuids == {"A-g03", "A-g04"}


def test_no_hint_no_plan_and_unknown_name_none() -> None:
    snap = cluster()
    deps = (Dep("free", MODEL_7B_MHA, None),)
    assert plan_of(deps, "free", snap) is None
    assert plan_of(deps, "missing", snap) is None


def test_pipeline_hint_splits_layers_and_links_stages() -> None:
    snap = cluster(a=12)
    deps = (Dep("big", MODEL_70B_GQA, PlanHint("A", tp=2, pp=3, replicas=2)),)
    plan = plan_of(deps, "big", snap)
    assert plan is not None
    first, second = plan.replicas
    assert [(s.layer_start, s.layer_end) for s in first.stages] == [(0, 26), (26, 53), (53, 80)]
    assert [s.gpu_uuids for s in first.stages] == [
        ("A-g00", "A-g01"),
        ("A-g02", "A-g03"),
        ("A-g04", "A-g05"),
    ]
    assert second.stages[0].gpu_uuids == ("A-g06", "A-g07")
    assert first.pp_link == LINK_CLASSES["nvlink"]
    assert first.model_name == plan.model_name == MODEL_70B_GQA.name


def test_more_stages_than_layers_is_no_plan() -> None:
    tiny = ModelSpec("tiny", 1_000_000, 2, 128, 1, 1, 128)
    snap = cluster(a=4)
    assert plan_of((Dep("t", tiny, PlanHint("A", pp=3)),), "t", snap) is None


def test_same_inputs_same_plan_id() -> None:
    snap = cluster()
    deps = (Dep("chat", MODEL_7B_MHA, PlanHint("A", tp=2, replicas=2)),)
    one, two = plan_of(deps, "chat", snap), plan_of(deps, "chat", snap)
    assert one is not None and one == two
