"""Targets must coexist with the current plan, and rolled-back targets are quarantined.

The executor loads a target's new replicas before it releases the current plan's, so a new
replica on a GPU the current plan holds cannot load (the bench's finding: every in-place
re-layout hit a VMM out-of-memory in prepare and rolled back, and gearbox re-proposed it).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gearbox import (
    DEFAULT_CONFIG,
    MODEL_70B_GQA,
    DecisionReason,
    DeploymentPlan,
    GearboxConfig,
    GearState,
    LoadSnapshot,
    ModelSpec,
    TopologySnapshot,
    build_blocks,
    decide,
    held_gpus,
    quarantined_plan_ids,
    rank_candidates,
    record_failed_target,
)
from tests.gearbox.builders import NOW_S, article_cluster, deployment, make_load, tp_plan
from tests.gearbox.test_properties import MODELS, PROPERTY_SETTINGS, clusters, loads

C4 = ("C-g00", "C-g01", "C-g02", "C-g03")


def _on_c() -> DeploymentPlan:
    plan = tp_plan(
        C4, MODEL_70B_GQA, block_id="C", domain_id="C", gpu_class="a6000-48g", link="pcie"
    )
    return deployment(plan)


def _assert_coexists(
    target: DeploymentPlan, current: DeploymentPlan, snapshot: TopologySnapshot
) -> None:
    """Every target replica is a current replica kept whole, or avoids the GPUs of every
    current replica that still runs (all its GPUs live)."""
    live = {g.uuid for g in snapshot.gpus if snapshot.gpu_is_live(g)}
    running = {u for r in current.replicas if live.issuperset(r.gpu_uuids) for u in r.gpu_uuids}
    kept = {r.plan_id for r in current.replicas}
    for replica in target.replicas:
        if replica.plan_id not in kept:
            assert not running.intersection(replica.gpu_uuids), replica.plan_id


@pytest.mark.unit
def test_candidates_never_reuse_current_gpus_for_new_replicas() -> None:
    snapshot = article_cluster()
    current = _on_c()
    blocks = build_blocks(snapshot, DEFAULT_CONFIG)
    ranked = rank_candidates(
        snapshot,
        blocks,
        MODEL_70B_GQA,
        make_load(3.0),
        DEFAULT_CONFIG,
        deployment="chat",
        current=current,
    )
    assert ranked
    for candidate in ranked:
        _assert_coexists(candidate.plan, current, snapshot)


@pytest.mark.unit
def test_only_current_gpus_left_means_no_re_layout() -> None:
    """With every other GPU gone, no target is proposed onto the current plan's own GPUs."""
    snapshot = article_cluster()
    gpus = tuple(replace(g, schedulable=g.uuid in C4) for g in snapshot.gpus)
    only_c = replace(snapshot, gpus=gpus)
    blocks = build_blocks(only_c, DEFAULT_CONFIG)
    state = GearState(blocks)
    result = decide(_on_c(), only_c, make_load(3.0), state, DEFAULT_CONFIG, model=MODEL_70B_GQA)
    assert result.decision is None


@pytest.mark.unit
def test_a_dead_replicas_surviving_gpus_are_free() -> None:
    """A replica that lost a GPU has died and released its memory: its other GPUs are usable."""
    current = _on_c()
    snapshot = article_cluster()
    assert held_gpus(current, build_blocks(snapshot, DEFAULT_CONFIG)) == set(C4)
    gpus = tuple(replace(g, schedulable=g.uuid != "C-g00") for g in snapshot.gpus)
    blocks = build_blocks(replace(snapshot, gpus=gpus), DEFAULT_CONFIG)
    assert held_gpus(current, blocks) == frozenset()
    assert held_gpus(None, blocks) == frozenset()


@pytest.mark.unit
def test_rolled_back_target_is_quarantined_then_released() -> None:
    snapshot = article_cluster()
    blocks = build_blocks(snapshot, DEFAULT_CONFIG)
    state = GearState(blocks)
    load = make_load(3.0)
    first = decide(_on_c(), snapshot, load, state, DEFAULT_CONFIG, model=MODEL_70B_GQA)
    assert first.decision is not None and first.reason is DecisionReason.SWITCH_GAIN
    failed_id = first.decision.to_plan_id

    failed = record_failed_target(state, failed_id, NOW_S, DEFAULT_CONFIG)
    assert quarantined_plan_ids(failed, NOW_S + 1, DEFAULT_CONFIG) == {failed_id}
    again = decide(_on_c(), snapshot, load, failed, DEFAULT_CONFIG, model=MODEL_70B_GQA)
    assert again.decision is None or again.decision.to_plan_id != failed_id
    assert failed_id not in {c.plan_id for c in again.candidates}
    assert "rolled back" in again.explanation
    assert again.state.failed == failed.failed

    expiry = NOW_S + DEFAULT_CONFIG.failed_target_quarantine_s + 1
    later = article_cluster(now_s=expiry)
    released = decide(
        _on_c(), later, make_load(3.0, now_s=expiry), failed, DEFAULT_CONFIG, model=MODEL_70B_GQA
    )
    assert released.decision is not None and released.decision.to_plan_id == failed_id
    assert released.state.failed == ()  # expired entries are dropped


@pytest.mark.unit
def test_record_failed_target_keeps_one_entry_per_plan() -> None:
    config = GearboxConfig(failed_target_quarantine_s=100.0)
    state = record_failed_target(GearState(), "dp-a", 10.0, config)
    state = record_failed_target(state, "dp-b", 50.0, config)
    state = record_failed_target(state, "dp-a", 60.0, config)
    assert [(f.plan_id, f.t_s) for f in state.failed] == [("dp-b", 50.0), ("dp-a", 60.0)]
    state = record_failed_target(state, "dp-c", 155.0, config)  # dp-b expired at 150
    assert quarantined_plan_ids(state, 155.0, config) == {"dp-a", "dp-c"}
    assert GearState.from_dict(state.to_dict()) == state


@pytest.mark.unit
@PROPERTY_SETTINGS
@given(snapshot=clusters(), model=MODELS, load=loads(), grow=st.floats(1.0, 4.0))
def test_no_proposed_target_reuses_a_current_gpu_for_a_new_replica(
    snapshot: TopologySnapshot, model: ModelSpec, load: LoadSnapshot, grow: float
) -> None:
    first = decide(None, snapshot, load, GearState(), DEFAULT_CONFIG, model=model, deployment="p")
    if first.decision is None:
        return
    current = first.decision.to_plan
    gpus = tuple(replace(g, last_seen_s=g.last_seen_s + 1_000.0) for g in snapshot.gpus)
    later = replace(snapshot, now_s=NOW_S + 1_000.0, gpus=gpus)
    busier = replace(load, arrival_rate_rps=load.arrival_rate_rps * grow, now_s=later.now_s)
    result = decide(current, later, busier, first.state, DEFAULT_CONFIG, model=model)
    if result.decision is not None:
        _assert_coexists(result.decision.to_plan, current, later)
    blocks = build_blocks(later, DEFAULT_CONFIG)
    ranked = rank_candidates(
        later, blocks, model, busier, DEFAULT_CONFIG, deployment="p", current=current
    )
    for candidate in ranked:
        _assert_coexists(candidate.plan, current, later)
