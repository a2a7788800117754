"""Switch cost and the per-sequence KV hand-over plan."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from gearbox import (
    DEFAULT_CONFIG,
    MODEL_7B_MHA,
    MODEL_70B_GQA,
    DeploymentPlan,
    ExecutionPlan,
    KvAction,
    KvChoice,
    LinkOverride,
    LoadSnapshot,
    ModelSpec,
    SwitchCost,
    TopologySnapshot,
    available_memory,
    plan_kv_handover,
    switch_cost,
)
from gearbox.types import LinkClass
from tests.gearbox.builders import article_cluster, deployment, make_load, tp_plan, with_gpus

A8 = tuple(f"A-g{i:02d}" for i in range(8))
B8 = tuple(f"B-g{i:02d}" for i in range(8))


def _b_plan(model: ModelSpec = MODEL_70B_GQA) -> ExecutionPlan:
    return tp_plan(B8, model, block_id="blk-b", domain_id="B", gpu_class="a100-80g", link="rdma")


def _cost(
    current: DeploymentPlan | None,
    target: DeploymentPlan,
    snapshot: TopologySnapshot | None = None,
    load: LoadSnapshot | None = None,
    model: ModelSpec = MODEL_70B_GQA,
) -> SwitchCost:
    snapshot = snapshot or article_cluster()
    load = load or make_load(5.0, active_sequences=300)
    own = current.gpu_uuids if current is not None else frozenset()
    return switch_cost(
        current, target, snapshot, model, load, DEFAULT_CONFIG, available_memory(snapshot, own)
    )


@pytest.mark.unit
def test_staying_put_costs_nothing() -> None:
    plan = deployment(tp_plan(A8, MODEL_70B_GQA))
    assert _cost(plan, plan) == SwitchCost.zero()


@pytest.mark.unit
def test_handover_is_long_first_and_migrates_over_nvlink() -> None:
    src, dst = tp_plan(A8[:4], MODEL_7B_MHA), tp_plan(A8[4:], MODEL_7B_MHA)
    sequences = [("s-short", 100), ("s-long", 4000), ("s-mid", 1000)]
    out = plan_kv_handover(sequences, src, dst, article_cluster(), MODEL_7B_MHA)
    assert [h.seq_id for h in out] == ["s-long", "s-mid", "s-short"]
    assert out[0].action is KvAction.MIGRATE
    assert out[0].transfer_bytes == 4000 * MODEL_7B_MHA.kv_bytes_per_token


@pytest.mark.unit
def test_handover_replays_when_the_path_is_too_slow() -> None:
    crawl = LinkClass("crawl", 0.05, 100.0)
    snapshot = replace(article_cluster(), link_overrides=(LinkOverride("A", "B", crawl),))
    out = plan_kv_handover(
        [(f"s{i}", 500) for i in range(5)],
        _b_plan(),
        tp_plan(A8, MODEL_70B_GQA),
        snapshot,
        MODEL_70B_GQA,
    )
    assert {h.action for h in out} == {KvAction.REPLAY}
    assert all(h.transfer_bytes == 0 for h in out)


@pytest.mark.unit
def test_handover_uses_both_paths_when_they_are_comparable() -> None:
    out = plan_kv_handover(
        [(f"s{i:03d}", 1100) for i in range(200)],
        _b_plan(),
        tp_plan(A8, MODEL_70B_GQA),
        article_cluster(),
        MODEL_70B_GQA,
    )
    actions = {h.action for h in out}
    assert actions == {KvAction.MIGRATE, KvAction.REPLAY}
    link_s = sum(h.est_s for h in out if h.action is KvAction.MIGRATE)
    compute_s = sum(h.est_s for h in out if h.action is KvAction.REPLAY)
    assert abs(link_s - compute_s) < max(h.est_s for h in out)  # queues balanced


@pytest.mark.unit
def test_full_shift_moves_kv_and_loads_weights() -> None:
    cost = _cost(deployment(_b_plan()), deployment(tp_plan(A8, MODEL_70B_GQA)))
    assert cost.kv_choice in (KvChoice.MIGRATE, KvChoice.MIXED)
    assert cost.kv_sequences_migrated + cost.kv_sequences_replayed == 300
    assert cost.weights_bytes >= MODEL_70B_GQA.weight_bytes
    assert cost.blocking_weights_s == 0.0  # new GPUs: loaded in the shadow phase
    assert cost.duration_s == pytest.approx(DEFAULT_CONFIG.comm_setup_s + cost.kv_handover_s)
    assert cost.total_tokens == pytest.approx(cost.lost_tokens + cost.cold_start_tokens)
    assert SwitchCost.from_dict(json.loads(json.dumps(cost.to_dict()))) == cost


@pytest.mark.unit
def test_reusing_the_same_gpus_blocks_on_weight_loading() -> None:
    current = deployment(tp_plan(A8, MODEL_70B_GQA))
    target = deployment(tp_plan(A8[:4], MODEL_70B_GQA), tp_plan(A8[4:], MODEL_70B_GQA))
    cost = _cost(current, target)
    assert cost.blocking_weights_s > 0
    assert cost.duration_s > cost.kv_handover_s + cost.blocking_weights_s
    # the whole transition counts the load once, blocking or not
    assert cost.transition_s == pytest.approx(cost.duration_s)


@pytest.mark.unit
def test_the_whole_transition_counts_the_shadow_weight_load() -> None:
    cost = _cost(deployment(_b_plan()), deployment(tp_plan(A8, MODEL_70B_GQA)))
    assert cost.blocking_weights_s == 0.0 and cost.weights_load_s > 1.0
    # 70B over TP8: a 1/8 shard per GPU at weight_load_gbps
    shard_s = MODEL_70B_GQA.weight_bytes / 8 / (DEFAULT_CONFIG.weight_load_gbps * 1e9)
    assert cost.weights_load_s == pytest.approx(shard_s, rel=1e-3)
    assert cost.transition_s == pytest.approx(cost.weights_load_s + cost.duration_s)
    assert SwitchCost.zero().transition_s == 0.0


@pytest.mark.unit
def test_adding_a_replica_moves_no_kv() -> None:
    current = deployment(tp_plan(A8, MODEL_70B_GQA))
    cost = _cost(current, deployment(tp_plan(A8, MODEL_70B_GQA), _b_plan()))
    assert cost.kv_choice is KvChoice.NONE and cost.lost_tokens == 0
    assert cost.cold_start_tokens > 0


@pytest.mark.unit
def test_kv_on_lost_gpus_must_be_replayed() -> None:
    current = deployment(tp_plan(A8, MODEL_70B_GQA))
    broken = with_gpus(article_cluster(), A8[:2], healthy=False)
    cost = _cost(current, deployment(_b_plan()), snapshot=broken)
    assert cost.kv_choice is KvChoice.REPLAY and cost.kv_sequences_replayed == 300


@pytest.mark.unit
def test_bigger_kv_makes_a_longer_shift() -> None:
    load = make_load(5.0, active_sequences=300)
    small = _cost(
        deployment(_b_plan(MODEL_7B_MHA)),
        deployment(tp_plan(A8, MODEL_7B_MHA)),
        load=load,
        model=MODEL_7B_MHA,
    )
    big = _cost(deployment(_b_plan()), deployment(tp_plan(A8, MODEL_70B_GQA)), load=load)
    assert big.duration_s > small.duration_s > 0


@pytest.mark.unit
def test_switch_cost_is_deterministic() -> None:
    args = (deployment(_b_plan()), deployment(tp_plan(A8, MODEL_70B_GQA)))
    assert _cost(*args) == _cost(*args)


@pytest.mark.unit
def test_handover_from_lost_gpus_replays_everything() -> None:
    broken = with_gpus(article_cluster(), B8[:1], healthy=False)
    out = plan_kv_handover(
        [("s0", 4000), ("s1", 10)], _b_plan(), tp_plan(A8, MODEL_70B_GQA), broken, MODEL_70B_GQA
    )
    assert [h.action for h in out] == [KvAction.REPLAY, KvAction.REPLAY]


@pytest.mark.unit
def test_default_memory_map_matches_the_explicit_one() -> None:
    current, target = deployment(_b_plan()), deployment(tp_plan(A8, MODEL_70B_GQA))
    snapshot, load = article_cluster(), make_load(5.0, active_sequences=300)
    implicit = switch_cost(current, target, snapshot, MODEL_70B_GQA, load, DEFAULT_CONFIG)
    assert implicit == _cost(current, target, snapshot, load)
