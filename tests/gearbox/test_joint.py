"""Forced switches decided jointly: the standby loss a plan's GPUs cost the other deployments."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from gearbox import (
    DEFAULT_CONFIG,
    MODEL_7B_MHA,
    MODEL_70B_GQA,
    DecideResult,
    DecisionReason,
    GearboxConfig,
    TopologySnapshot,
    build_blocks,
    decide,
)
from gearbox.correction import DEPLOYMENT_WIDE, Correction, Corrections
from gearbox.history import DemandSample
from gearbox.joint import Neighbour, has_spare_twin, standby_meter
from gearbox.ranking import available_memory, rank_candidates
from tests.gearbox.builders import (
    NOW_S,
    DomainSpec,
    article_cluster,
    deployment,
    make_cluster,
    make_load,
    tp_plan,
    with_gpus,
)
from tests.gearbox.test_decide import A8, _state
from tests.gearbox.test_downshift import _tp8

pytestmark = pytest.mark.unit

# mixed-failures seed 8 in small: the 7B's host (2 A100) dies; spare are 6 H100 on NVLink (H);
# a 70B serves on its own 4-H100 island (X, full). At 6.6 rps, under pressure, the 7B has two
# plans on H restoring its SLOs: 4 GPUs (up in ≈ 1.2 s) and 2 GPUs (≈ 1.9 s)
H6 = tuple(f"H-g{i:02d}" for i in range(6))
X4 = frozenset(f"X-g{i:02d}" for i in range(4))
B2 = ("B-g00", "B-g01")


def _seven_b_cluster() -> TopologySnapshot:
    domains = (
        DomainSpec("H", "nvlink", ("h100-sxm",) * 6),
        DomainSpec("B", "rdma", ("a100-80g",) * 2),
        DomainSpec("X", "nvlink", ("h100-sxm",) * 4),
    )
    snapshot = make_cluster(domains)
    gpus = tuple(replace(g, free_memory_bytes=0) if g.uuid in X4 else g for g in snapshot.gpus)
    return with_gpus(replace(snapshot, gpus=gpus), B2, healthy=False)


LOST_HOST = _seven_b_cluster()
PRESSED_7B = replace(
    make_load(6.6, prompt_tokens=700, output_tokens=210, active_sequences=5),
    ttft_p95_ms=20_000.0,
)
# a 70B at 3 rps: TP4 on four H100 serves it within its SLOs; on two it cannot keep up
CHAT_70B = Neighbour("chat", MODEL_70B_GQA, make_load(3.0), X4)


def _seven_b_forced(*neighbours: Neighbour, config: GearboxConfig = DEFAULT_CONFIG) -> DecideResult:
    current = deployment(
        *(
            tp_plan((u,), MODEL_7B_MHA, block_id="B", domain_id="B", gpu_class="a100-80g")
            for u in B2
        ),
        name="assist",
    )
    result = decide(
        current,
        LOST_HOST,
        PRESSED_7B,
        _state(LOST_HOST),
        config,
        model=MODEL_7B_MHA,
        neighbours=neighbours,
    )
    assert result.reason is DecisionReason.FORCED_INFEASIBLE and result.decision is not None
    return result


def test_the_faster_restoring_plan_wins_when_nobody_else_wants_the_gpus() -> None:
    result = _seven_b_forced()
    assert result.decision is not None
    by_gpus = {c.num_gpus: c for c in result.candidates}
    four, two = by_gpus[4], by_gpus[2]
    # both restore the SLOs with the margin and serve the same tokens: the outage decides
    for c in (four, two):
        assert c.est_ttft_p95_ms <= 0.7 * DEFAULT_CONFIG.ttft_slo_ms
        assert c.est_tbt_p95_ms <= 0.7 * DEFAULT_CONFIG.tbt_slo_ms
    assert four.gain_tokens == pytest.approx(two.gain_tokens)
    assert four.cost_tokens < two.cost_tokens
    assert result.decision.to_plan_id == four.plan_id
    assert "its standby loss: none" in result.explanation
    # a neighbour that fits anywhere (a 7B) loses nothing either
    small = _seven_b_forced(replace(CHAT_70B, model=MODEL_7B_MHA))
    assert small.decision is not None and small.decision.to_plan_id == four.plan_id


def test_the_smaller_plan_wins_when_a_neighbour_would_need_the_gpus() -> None:
    result = _seven_b_forced(CHAT_70B)
    assert result.decision is not None
    chosen = result.decision.to_plan
    assert chosen.num_gpus == 2 and chosen.gpu_uuids <= frozenset(H6)
    # four H100 left: the 70B could restore itself there; two would not serve it
    assert "Forced choice (joint): among the plans restoring the SLOs" in result.explanation
    assert "chat could restore" in result.explanation
    # the chosen plan is listed once among the candidates
    ids = [c.plan_id for c in result.candidates]
    assert len(ids) == len(set(ids)) and result.decision.to_plan_id in ids


def test_the_neighbour_is_priced_with_its_learned_factor() -> None:
    # at 0.6 rps the 70B's fallback on the two H100 the 4-GPU plan leaves is within an 800 ms
    # TTFT SLO by the plain model (≈ 256 ms) but not by its learned factor (× 4): the joint
    # choice then leaves it four (mixed-failures seeds 8-11, where the plain model said a
    # preempted 70B's fallback was within its SLO and its factor said it was not)
    config = replace(DEFAULT_CONFIG, ttft_slo_ms=800.0)
    plain = replace(CHAT_70B, load=make_load(0.6))
    learned = replace(
        plain, corrections=Corrections(entries=(Correction(DEPLOYMENT_WIDE, 4.0, NOW_S, 50),))
    )
    unaware = _seven_b_forced(plain, config=config)
    aware = _seven_b_forced(learned, config=config)
    assert unaware.decision is not None and aware.decision is not None
    assert unaware.decision.to_plan.num_gpus == 4
    assert "its standby loss: none." in unaware.explanation
    assert aware.decision.to_plan.num_gpus == 2
    assert "best by gain − cost alone" in aware.explanation
    assert "chat could restore" in aware.explanation


def test_a_voluntary_switch_leaves_a_neighbour_its_fallback() -> None:
    # the 7B on one A100 (its host back), under pressure at 12 rps (one A100 keeps up to ~10):
    # its best plan by gain − cost alone keeps that A100 and adds two H100; a 70B at 8 rps
    # could use the A100s in its fallback, so the joint choice serves the 7B on H100s alone
    snapshot = with_gpus(LOST_HOST, B2, healthy=True)
    one = tp_plan(B2[:1], MODEL_7B_MHA, block_id="B", domain_id="B", gpu_class="a100-80g")
    busy = replace(CHAT_70B, load=make_load(8.0))
    pressed = replace(PRESSED_7B, arrival_rate_rps=12.0)
    args = (deployment(one, name="assist"), snapshot, pressed, _state(snapshot))

    def choose(*neighbours: Neighbour) -> DecideResult:
        result = decide(*args, DEFAULT_CONFIG, model=MODEL_7B_MHA, neighbours=neighbours)
        assert result.reason is DecisionReason.SWITCH_GAIN and result.decision is not None
        return result

    alone, joint = choose(), choose(busy)
    assert alone.decision is not None and joint.decision is not None
    assert alone.decision.to_plan.gpu_uuids == frozenset({B2[0], *H6[:2]})
    assert "Joint choice" not in alone.explanation  # nobody to weigh
    assert joint.decision.to_plan.gpu_uuids <= frozenset(H6)
    assert "Joint choice: among the worthwhile plans" in joint.explanation
    assert f"{alone.decision.to_plan_id}, best by gain − cost alone" in joint.explanation
    # a neighbour that needs none of them changes nothing
    idle = choose(CHAT_70B).decision
    assert idle is not None and idle.to_plan_id == alone.decision.to_plan_id


def test_the_standby_loss_is_what_the_neighbour_could_no_longer_restore() -> None:
    blocks = build_blocks(LOST_HOST, DEFAULT_CONFIG)
    available = available_memory(LOST_HOST, frozenset(B2))
    two, four = frozenset(H6[:2]), frozenset(H6[:4])
    loss = standby_meter((CHAT_70B,), LOST_HOST, blocks, available, DEFAULT_CONFIG)
    losses = {gpus: loss(gpus) for gpus in (two, four)}
    assert losses[two].tokens == 0.0 and losses[two].worst is None
    assert losses[four].tokens > 0.0
    worst = losses[four].worst
    assert worst is not None
    name, whole, left = worst
    assert name == "chat" and left < whole
    assert losses[four].tokens == pytest.approx((whole - left) * DEFAULT_CONFIG.gain_horizon_s)
    # no neighbours: nothing to lose
    none = standby_meter((), LOST_HOST, blocks, available, DEFAULT_CONFIG)
    assert none(four).tokens == 0.0
    # the neighbour's own GPUs are never its standby: holding them costs it nothing
    assert loss(X4).tokens == 0.0


# the 70B's TP8 on block A with one GPU lost, observed far over its SLOs (pressure: no GPU
# credit in the scores): at 3 rps both TP8 elsewhere on A (TBT p95 est ≈ 48 ms, up in ≈ 4.2 s)
# and TP4 on A (≈ 77 ms, a longer transition) restore the SLOs within 0.7 × 150 = 105 ms.
# Block C is out, so a second 70B serving on block B has only block A to fall back on.
C6 = tuple(f"C-g{i:02d}" for i in range(6))
BROKEN = with_gpus(with_gpus(article_cluster(), A8[:1], healthy=False), C6, healthy=False)
PRESSED = replace(make_load(3.0, active_sequences=5), ttft_p95_ms=20_000.0, tbt_p95_ms=400.0)
# credit for freed GPUs that would otherwise take TP4 (the blanket credit no longer counts)
VALUED = GearboxConfig(idle_gpu_value_tok_s=300.0)
ON_B = Neighbour("other", MODEL_70B_GQA, make_load(3.0), frozenset(f"B-g{i:02d}" for i in range(9)))


def _forced(config: GearboxConfig, *neighbours: Neighbour, state_peak: float = 0.0) -> DecideResult:
    state = _state(BROKEN)
    if state_peak:
        state = replace(state, demand=(DemandSample(NOW_S - 600.0, state_peak),))
    result = decide(
        _tp8(), BROKEN, PRESSED, state, config, model=MODEL_70B_GQA, neighbours=neighbours
    )
    assert result.reason is DecisionReason.FORCED_INFEASIBLE and result.decision is not None
    return result


def test_a_forced_70b_leaves_another_70b_its_fallback() -> None:
    alone = _forced(VALUED).decision
    assert alone is not None and alone.to_plan.num_gpus == 8  # sooner, the credit aside
    joint = _forced(VALUED, ON_B).decision
    assert joint is not None and joint.to_plan.num_gpus == 4


def test_a_forced_switch_takes_a_larger_plan_when_only_it_restores_the_slos() -> None:
    # a 400 ms TTFT SLO: the 4-GPU plan (≈ 297 ms) is within it but not within 0.7 × 400 = 280 ms
    tight = replace(VALUED, ttft_slo_ms=400.0)
    result = _forced(tight, ON_B)
    assert result.decision is not None and result.decision.to_plan.num_gpus == 8
    # the only one restoring them: taken whatever the other 70B's standby loses
    assert "its standby loss: 825,431 tok" in result.explanation


def test_a_forced_switch_falls_back_to_the_best_estimate_when_none_restores_the_slos() -> None:
    hopeless = replace(VALUED, downshift_slo_margin=0.01)
    result = _forced(hopeless, ON_B)
    assert result.decision is not None
    assert result.decision.to_plan_id == result.candidates[0].plan_id


def test_a_forced_switch_must_restore_the_slos_at_the_lookbacks_peak() -> None:
    # 9 rps ten minutes ago: the 4-GPU plan is within the margin now but not at that peak
    assert DEFAULT_CONFIG.downshift_lookback_s == 3600.0
    result = _forced(VALUED, ON_B, state_peak=9.0)
    assert result.decision is not None and result.decision.to_plan.num_gpus == 8
    forgetful = _forced(replace(VALUED, downshift_lookback_s=0.0), ON_B, state_peak=9.0)
    assert forgetful.decision is not None and forgetful.decision.to_plan.num_gpus == 4


def test_the_standby_takes_an_unvalidated_ablation_config() -> None:
    # bench.sim.systems.permissive sets hysteresis 1.0, out of its bounds, without validation:
    # the standby's credit-free copy must not validate it again
    permissive = copy.copy(DEFAULT_CONFIG)
    object.__setattr__(permissive, "hysteresis", 1.0)
    result = _seven_b_forced(CHAT_70B, config=permissive)
    assert result.decision is not None and result.decision.to_plan.num_gpus == 2


def _exhaustive(neighbour: Neighbour, snapshot: TopologySnapshot, gpus: frozenset[str]) -> float:
    """The standby loss by definition: the neighbour ranked on the whole pool and on what
    ``gpus`` leave, no shortcut."""
    plain = replace(DEFAULT_CONFIG, idle_gpu_value_tok_s=0.0)
    blocks = build_blocks(snapshot, DEFAULT_CONFIG)
    pool = {u: b for u, b in available_memory(snapshot, frozenset()).items()}

    def best(on: dict[str, int]) -> float:
        spare = {u: b for u, b in on.items() if u not in neighbour.gpu_uuids}
        ranked = rank_candidates(snapshot, blocks, neighbour.model, neighbour.load, plain,
                                 deployment=neighbour.deployment, available=spare)  # fmt: skip
        return max(0.0, ranked[0].estimate.utility_tok_s) if ranked else 0.0

    left = best({u: b for u, b in pool.items() if u not in gpus})
    return max(0.0, best(pool) - left) * DEFAULT_CONFIG.gain_horizon_s


@pytest.mark.parametrize("rps", [1.0, 3.0, 12.0, 40.0])
def test_the_standby_shortcuts_agree_with_ranking_the_whole_pool(rps: float) -> None:
    # six roomy NVLink blocks and a neighbour from light (served on any one block: the probe
    # answers) to heavy (it needs more than the probe's blocks: ranked on the whole pool)
    snapshot = make_cluster(
        tuple(DomainSpec(f"N{d}", "nvlink", ("h100-sxm",) * 8) for d in range(6)),
        inter_domain_link="rdma",
    )
    neighbour = Neighbour("chat", MODEL_70B_GQA, make_load(rps), frozenset())
    blocks = build_blocks(snapshot, DEFAULT_CONFIG)
    loss = standby_meter(
        (neighbour,), snapshot, blocks, available_memory(snapshot, frozenset()), DEFAULT_CONFIG
    )
    for taken in (1, 2, 3, 5):
        gpus = frozenset(f"N{d}-g{i:02d}" for d in range(taken) for i in range(8))
        expected = _exhaustive(neighbour, snapshot, gpus)
        assert loss(gpus).tokens == pytest.approx(expected, rel=1e-6, abs=1e-3)
    # the heaviest load loses what it needs once most blocks are taken: the check can fail
    if rps == 40.0:
        assert loss(gpus).tokens > 0.0


# mixed-failures at its 2,400 s preemption, in small: the 70B's island X is lost; island H (4
# H100, NVLink) has two spare GPUs and two a 7B serves on; four A100 over RDMA are spare. On
# the spare GPUs alone the 70B's best restoring plan spans H's two and the A100s (a 70 GB shard
# per H100: ≈ 15 s to load); TP4 on H is up sooner and faster, and the 7B loses nothing on the
# A100s: a handover
LOST4 = tuple(f"X-g{i:02d}" for i in range(4))
H4 = tuple(f"H-g{i:02d}" for i in range(4))
ISLAND = with_gpus(
    make_cluster(
        (
            DomainSpec("X", "nvlink", ("h100-sxm",) * 4),
            DomainSpec("H", "nvlink", ("h100-sxm",) * 4),
            DomainSpec("B", "rdma", ("a100-80g",) * 4),
        )
    ),
    LOST4,
    healthy=False,
)
# the 7B's GPUs as the step hands the 70B the cluster: another deployment's GPUs are full
ISLAND = replace(
    ISLAND,
    gpus=tuple(replace(g, free_memory_bytes=0) if g.uuid in H4[:2] else g for g in ISLAND.gpus),
)
ASSIST = Neighbour(
    "assist",
    MODEL_7B_MHA,
    make_load(6.0, prompt_tokens=700, output_tokens=210),
    frozenset(H4[:2]),
    plan=deployment(tp_plan(H4[:2], MODEL_7B_MHA, block_id="H", domain_id="H"), name="assist"),
)


def _seventy_b_lost(
    snapshot: TopologySnapshot, *neighbours: Neighbour, config: GearboxConfig = DEFAULT_CONFIG
) -> DecideResult:
    """The 70B of TP4 on the lost island X at 3 rps, decided on ``snapshot``."""
    current = deployment(tp_plan(LOST4, MODEL_70B_GQA, block_id="X", domain_id="X"), name="chat")
    load = replace(make_load(3.0, active_sequences=5), ttft_p95_ms=900.0)
    return decide(
        current,
        snapshot,
        load,
        _state(snapshot),
        config,
        model=MODEL_70B_GQA,
        neighbours=neighbours,
    )


def _seventy_b_forced(
    *neighbours: Neighbour, config: GearboxConfig = DEFAULT_CONFIG
) -> DecideResult:
    result = _seventy_b_lost(ISLAND, *neighbours, config=config)
    assert result.reason is DecisionReason.FORCED_INFEASIBLE and result.decision is not None
    return result


def test_a_forced_switch_takes_a_settled_neighbours_gpus_when_it_loses_nothing() -> None:
    alone = _seventy_b_forced().decision
    assert alone is not None and alone.takes_from is None
    assert alone.to_plan.gpu_uuids == frozenset(H4[2:]) | {f"B-g{i:02d}" for i in range(4)}
    result = _seventy_b_forced(ASSIST)
    chosen = result.decision
    assert chosen is not None and chosen.to_plan.gpu_uuids == frozenset(H4)
    assert chosen.takes_from == "assist" and chosen.taken_gpus == H4[:2]
    # the outage counts the 7B's move off them; still sooner than the 15 s shard load
    assert chosen.switch_cost.handover_wait_s > 0
    assert chosen.switch_cost.transition_s < alone.switch_cost.transition_s
    assert "Handover: takes 2 GPU(s) of assist (H-g00, H-g01); it moves first" in result.explanation
    # its SLO goodput is the same after the move: it is charged its switch cost only
    assert "SLO goodput est 5,472 → 5,472 tok/s" in result.explanation


def test_no_handover_from_a_neighbour_mid_switch_or_when_switched_off() -> None:
    moving = _seventy_b_forced(replace(ASSIST, plan=None)).decision
    assert moving is not None and moving.takes_from is None
    off = _seventy_b_forced(ASSIST, config=GearboxConfig(handover_candidates=0)).decision
    assert off is not None and off.takes_from is None


def test_no_handover_leaves_a_neighbour_nowhere_to_serve() -> None:
    # the A100s out too: the 7B would have nowhere left to serve
    crowded = with_gpus(ISLAND, tuple(f"B-g{i:02d}" for i in range(4)), healthy=False)
    result = _seventy_b_lost(crowded, ASSIST)
    assert result.decision is not None and result.decision.takes_from is None
    assert result.decision.to_plan.gpu_uuids == frozenset(H4[2:])


def test_no_handover_is_priced_where_the_neighbours_blocks_have_spare_twins() -> None:
    blocks = build_blocks(ISLAND, DEFAULT_CONFIG)
    pool = available_memory(ISLAND, frozenset(LOST4))
    assert not has_spare_twin(blocks, ASSIST, ISLAND, pool)
    # a wholly free 4-H100 NVLink island beside: anything a handover of H could make has its
    # counterpart there, with no neighbour to wait for
    twin = make_cluster(
        (
            DomainSpec("X", "nvlink", ("h100-sxm",) * 4),
            DomainSpec("H", "nvlink", ("h100-sxm",) * 4),
            DomainSpec("B", "rdma", ("a100-80g",) * 4),
            DomainSpec("Y", "nvlink", ("h100-sxm",) * 4),
        )
    )
    held = tuple(replace(g, free_memory_bytes=0) if g.uuid in H4[:2] else g for g in twin.gpus)
    twin = with_gpus(replace(twin, gpus=held), LOST4, healthy=False)
    assert has_spare_twin(
        build_blocks(twin, DEFAULT_CONFIG), ASSIST, twin, available_memory(twin, frozenset(LOST4))
    )
    # two GPUs of Y held elsewhere: no longer a twin
    half = replace(
        twin,
        gpus=tuple(
            replace(g, free_memory_bytes=0) if g.uuid in ("Y-g00", "Y-g01") else g
            for g in twin.gpus
        ),
    )
    assert not has_spare_twin(
        build_blocks(half, DEFAULT_CONFIG), ASSIST, half, available_memory(half, frozenset(LOST4))
    )


def test_a_neighbour_moving_off_handed_over_gpus_is_charged_no_outage() -> None:
    # the 7B of ASSIST, its two H100s taken by a handover: its plan still serves until its
    # switch, so no candidate is charged an outage; lost to a failure, every one is
    assert ASSIST.plan is not None
    # as the step hands it the cluster: the taken GPUs are full (another deployment's)
    seven_b = ISLAND
    args = (seven_b, ASSIST.load, _state(seven_b), DEFAULT_CONFIG)
    handed = decide(ASSIST.plan, *args, model=MODEL_7B_MHA, handed_over=frozenset(H4[:2]))
    assert handed.reason is DecisionReason.FORCED_INFEASIBLE and handed.decision is not None
    assert handed.decision.to_plan.gpu_uuids.isdisjoint(H4[:2])
    assert "of outage" not in handed.explanation
    lost = with_gpus(seven_b, H4[:2], healthy=False)
    broken = decide(
        ASSIST.plan, lost, ASSIST.load, _state(lost), DEFAULT_CONFIG, model=MODEL_7B_MHA
    )
    assert broken.reason is DecisionReason.FORCED_INFEASIBLE and "of outage" in broken.explanation


def test_a_handover_never_counts_on_the_neighbour_rebuilding_where_its_replicas_run() -> None:
    # the 70B's island is lost and nothing is spare; the 7B serves one TP8 replica over all of
    # H. Four of H would restore the 70B if the 7B moved to the other four — which its running
    # replica holds: the runtime loads new replicas before it releases old ones, so the 7B's
    # own step finds no such plan and the handover would wait out handover_wait_s and roll back
    h8 = tuple(f"H-g{i:02d}" for i in range(8))
    cluster = make_cluster(
        (DomainSpec("X", "nvlink", ("h100-sxm",) * 4), DomainSpec("H", "nvlink", ("h100-sxm",) * 8))
    )
    cluster = with_gpus(cluster, LOST4, healthy=False)
    cluster = replace(
        cluster,
        gpus=tuple(replace(g, free_memory_bytes=0) if g.uuid in h8 else g for g in cluster.gpus),
    )
    wide = Neighbour(
        "assist",
        MODEL_7B_MHA,
        make_load(1.0, prompt_tokens=700, output_tokens=210),
        frozenset(h8),
        plan=deployment(tp_plan(h8, MODEL_7B_MHA, block_id="H", domain_id="H"), name="assist"),
    )
    result = _seventy_b_lost(cluster, wide)
    assert result.reason is DecisionReason.NO_FEASIBLE_PLAN and result.decision is None
