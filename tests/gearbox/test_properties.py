"""Property tests: invariants over random fragmented clusters and loads."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gearbox import (
    DEFAULT_CONFIG,
    DEFAULT_PLACEMENT_CONFIG,
    MODEL_7B_MHA,
    MODEL_70B_GQA,
    DecisionReason,
    DeploymentPlan,
    Domain,
    GearState,
    LoadSnapshot,
    ModelFootprint,
    ModelSpec,
    PlacementStatus,
    TopologySnapshot,
    available_memory,
    build_blocks,
    decide,
    place_model,
    rank_candidates,
)
from gearbox.presets import GPU_CLASSES, LINK_CLASSES
from tests.gearbox.builders import NOW_S, article_cluster, make_gpu, make_load

PROPERTY_SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
MODELS = st.sampled_from([MODEL_7B_MHA, MODEL_70B_GQA])


@st.composite
def clusters(draw: st.DrawFn) -> TopologySnapshot:
    """1–5 domains of 1–12 GPUs: mixed classes and links, uneven memory, some GPUs out."""
    gpus = []
    domains = []
    for d in range(draw(st.integers(1, 5))):
        domain_id = f"D{d}"
        link = draw(st.sampled_from(sorted(LINK_CLASSES)))
        domains.append(Domain(domain_id, LINK_CLASSES[link]))
        classes = draw(st.lists(st.sampled_from(sorted(GPU_CLASSES)), min_size=1, max_size=2))
        per_node = draw(st.integers(1, 8))
        for i in range(draw(st.integers(1, 12))):
            gpu = make_gpu(
                f"{domain_id}-g{i:02d}",
                node=f"{domain_id}-n{i // per_node}",
                gpu_class=classes[i % len(classes)],
                domain=domain_id,
                free_fraction=draw(st.sampled_from([0.1, 0.5, 0.9, 1.0, 1.0])),
                healthy=draw(st.booleans()) or draw(st.booleans()),
                schedulable=draw(st.integers(0, 9)) > 0,
                last_seen_s=NOW_S - draw(st.sampled_from([0.0, 10.0, 44.0, 60.0])),
            )
            gpus.append(gpu)
    inter = LINK_CLASSES[draw(st.sampled_from(["rdma", "ethernet", "pcie"]))]
    return TopologySnapshot(NOW_S, tuple(gpus), tuple(domains), inter)


@st.composite
def loads(draw: st.DrawFn) -> LoadSnapshot:
    return make_load(
        draw(st.floats(0.05, 30.0)),
        prompt_tokens=draw(st.sampled_from([64.0, 500.0, 2000.0, 6000.0])),
        output_tokens=draw(st.sampled_from([16.0, 200.0, 800.0])),
        active_sequences=draw(st.integers(0, 400)),
        queue_len=draw(st.integers(0, 50)),
    )


def _stage_need_bytes(model: ModelSpec, layers: int, tp: int, prompt: float) -> float:
    share = layers / model.num_layers
    reserve_tokens = max(DEFAULT_CONFIG.min_kv_reserve_tokens, round(prompt))
    return (
        model.weight_bytes * share + reserve_tokens * model.kv_bytes_per_token * share
    ) / tp + DEFAULT_CONFIG.runtime_overhead_bytes


def _check_plan(
    plan: DeploymentPlan,
    snapshot: TopologySnapshot,
    model: ModelSpec,
    load: LoadSnapshot,
    own: frozenset[str],
) -> None:
    blocks = build_blocks(snapshot, DEFAULT_CONFIG)
    block_of = {u: b.block_id for b in blocks for u in b.gpu_uuids}
    available = available_memory(snapshot, own)
    live = {g.uuid for g in snapshot.gpus if snapshot.gpu_is_live(g)}
    for replica in plan.replicas:
        for stage in replica.stages:
            assert set(stage.gpu_uuids) <= live, "plan uses a GPU that is not live"
            assert len({block_of[u] for u in stage.gpu_uuids}) == 1, "TP spans blocks"
            assert model.num_heads % stage.tp == 0 and model.num_kv_heads % stage.tp == 0
            need = _stage_need_bytes(model, stage.num_layers, stage.tp, load.mean_prompt_tokens)
            for uuid in stage.gpu_uuids:
                assert need <= available[uuid] * DEFAULT_CONFIG.memory_utilisation, "oversubscribed"


@pytest.mark.unit
@PROPERTY_SETTINGS
@given(snapshot=clusters(), model=MODELS, load=loads())
def test_every_candidate_respects_blocks_health_and_memory(
    snapshot: TopologySnapshot, model: ModelSpec, load: LoadSnapshot
) -> None:
    blocks = build_blocks(snapshot, DEFAULT_CONFIG)
    ranked = rank_candidates(snapshot, blocks, model, load, DEFAULT_CONFIG, deployment="p")
    for candidate in ranked:
        _check_plan(candidate.plan, snapshot, model, load, frozenset())
    utilities = [c.estimate.utility_tok_s for c in ranked]
    assert utilities == sorted(utilities, reverse=True)


@pytest.mark.unit
@PROPERTY_SETTINGS
@given(snapshot=clusters())
def test_blocks_partition_the_live_gpus(snapshot: TopologySnapshot) -> None:
    blocks = build_blocks(snapshot, DEFAULT_CONFIG)
    members = [u for b in blocks for u in b.gpu_uuids]
    live = sorted(g.uuid for g in snapshot.gpus if snapshot.gpu_is_live(g))
    assert sorted(members) == live
    assert len({b.block_id for b in blocks}) == len(blocks)
    assert build_blocks(snapshot, DEFAULT_CONFIG, blocks) == blocks


@pytest.mark.unit
@PROPERTY_SETTINGS
@given(snapshot=clusters(), model=MODELS, load=loads(), since_s=st.floats(0.0, 400.0))
def test_decide_is_deterministic_and_respects_hysteresis_and_cooldown(
    snapshot: TopologySnapshot, model: ModelSpec, load: LoadSnapshot, since_s: float
) -> None:
    first = decide(None, snapshot, load, GearState(), DEFAULT_CONFIG, model=model, deployment="p")
    if first.decision is None:
        assert first.reason is DecisionReason.NO_FEASIBLE_PLAN
        return
    current = first.decision.to_plan
    _check_plan(current, snapshot, model, load, frozenset())
    later = replace(snapshot, now_s=NOW_S + since_s)
    state = replace(first.state, last_switch_s=NOW_S)
    args = (current, later, replace(load, arrival_rate_rps=load.arrival_rate_rps * 2.5), state)
    result = decide(*args, DEFAULT_CONFIG, model=model)
    assert result == decide(*args, DEFAULT_CONFIG, model=model)
    decision = result.decision
    if decision is None:
        return
    if decision.forced:  # heartbeats may have timed out meanwhile
        assert decision.reason is DecisionReason.FORCED_INFEASIBLE and result.problems
        return
    assert decision.reason is DecisionReason.SWITCH_GAIN
    chosen = next(c for c in decision.candidates if c.plan_id == decision.to_plan_id)
    assert chosen.gain_tokens > chosen.cost_tokens * DEFAULT_CONFIG.hysteresis
    assert since_s >= DEFAULT_CONFIG.cooldown_s
    _check_plan(decision.to_plan, later, model, args[2], current.gpu_uuids)


@pytest.mark.unit
@settings(max_examples=15, deadline=None)
@given(
    model=MODELS,
    rate=st.sampled_from([0.5, 2.0, 6.0]),
    noise=st.lists(st.floats(0.97, 1.03), min_size=8, max_size=8),
)
def test_load_noise_never_switches(model: ModelSpec, rate: float, noise: list[float]) -> None:
    snapshot = article_cluster()
    load = make_load(rate, active_sequences=150)
    first = decide(None, snapshot, load, GearState(), DEFAULT_CONFIG, model=model, deployment="n")
    assert first.decision is not None
    current, state = first.decision.to_plan, first.state
    for tick, factor in enumerate(noise, start=1):
        now_s = NOW_S + 120.0 * tick  # every tick is outside the cooldown
        noisy = replace(load, now_s=now_s, arrival_rate_rps=rate * factor)
        result = decide(
            current, replace(snapshot, now_s=now_s), noisy, state, DEFAULT_CONFIG, model=model
        )
        assert result.decision is None, result.explanation
        state = result.state


@pytest.mark.unit
@PROPERTY_SETTINGS
@given(
    snapshot=clusters(),
    batch=st.integers(1, 64),
    seq=st.sampled_from([128, 2048, 8192]),
    replicas=st.integers(1, 4),
)
def test_placement_never_oversubscribes(
    snapshot: TopologySnapshot, batch: int, seq: int, replicas: int
) -> None:
    request = ModelFootprint.from_spec(MODEL_7B_MHA, batch, seq, replicas)
    decision = place_model(request, snapshot, (), DEFAULT_PLACEMENT_CONFIG)
    by_uuid = {g.uuid: g for g in snapshot.gpus}
    assert len(set(decision.gpu_uuids)) == len(decision.gpu_uuids) <= replicas
    for uuid in decision.gpu_uuids:
        gpu = by_uuid[uuid]
        need = request.estimated_bytes(DEFAULT_PLACEMENT_CONFIG.memory_k)
        assert snapshot.gpu_is_live(gpu) and need <= gpu.free_memory_bytes
        used = gpu.total_memory_bytes - gpu.free_memory_bytes + need
        assert used <= DEFAULT_PLACEMENT_CONFIG.oom_watermark * gpu.total_memory_bytes
    assert (decision.status is PlacementStatus.PLACED) == bool(decision.gpu_uuids)
