"""Multi-model placement: filter → score → anti-affinity → queue/evict; dead memory."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from gearbox import (
    DEFAULT_PLACEMENT_CONFIG,
    MODEL_7B_MHA,
    ModelFootprint,
    PlacementDecision,
    PlacementReason,
    PlacementStatus,
    ResidentModel,
    TopologySnapshot,
    dead_memory,
    place_model,
)
from gearbox.placement import Backlog, EvictionRule
from gearbox.presets import GIB, LINK_CLASSES
from tests.gearbox.builders import NOW_S, make_gpu

MINUTE = 60.0
SMALL = ModelFootprint("bert", 1 * GIB, 36 * 1024, batch_size=8, seq_len_tokens=512)


def _cluster(*gpus_free_gib: tuple[str, str, float], util: float = 0.0) -> TopologySnapshot:
    """A100 GPUs given as (uuid, node, free GiB)."""
    gpus = tuple(
        replace(
            make_gpu(uuid, node=node, gpu_class="a100-80g", utilisation=util),
            free_memory_bytes=int(free * GIB),
        )
        for uuid, node, free in gpus_free_gib
    )
    return TopologySnapshot(NOW_S, gpus, (), LINK_CLASSES["rdma"])


def _resident(
    model: str,
    gpu: str,
    *,
    idle_min: float,
    gap_min: float,
    reload_min: float = 2.0,
    active: int = 0,
    gib: float = 20.0,
) -> ResidentModel:
    return ResidentModel(
        model,
        gpu,
        int(gib * GIB),
        active,
        NOW_S - idle_min * MINUTE,
        gap_min * MINUTE,
        reload_min * MINUTE,
    )


@pytest.mark.unit
def test_memory_estimate_formula() -> None:
    # model_size + k × batch × seq × kv_bytes_per_token
    assert SMALL.estimated_bytes(1.3) == GIB + int(1.3 * 8 * 512 * 36 * 1024)
    assert SMALL.estimated_bytes(1.3, resident=True) == int(1.3 * 8 * 512 * 36 * 1024)
    spec = ModelFootprint.from_spec(MODEL_7B_MHA, 4, 2048)
    assert spec.model_bytes == MODEL_7B_MHA.weight_bytes


@pytest.mark.unit
def test_scores_prefer_free_memory_and_idle_gpus() -> None:
    snapshot = _cluster(("g-busy", "n0", 20.0), ("g-free", "n1", 70.0))
    decision = place_model(SMALL, snapshot, (), DEFAULT_PLACEMENT_CONFIG)
    assert decision.status is PlacementStatus.PLACED
    assert decision.gpu_uuids == ("g-free",)
    assert decision.verdicts[0].score > decision.verdicts[1].score


@pytest.mark.unit
def test_affinity_outweighs_free_memory() -> None:
    snapshot = _cluster(("g-holds", "n0", 30.0), ("g-empty", "n1", 79.0))
    residents = (_resident("bert", "g-holds", idle_min=0, gap_min=1, active=3),)
    decision = place_model(SMALL, snapshot, residents, DEFAULT_PLACEMENT_CONFIG)
    assert decision.gpu_uuids == ("g-holds",)


@pytest.mark.unit
def test_hard_filters_name_their_rule() -> None:
    snapshot = _cluster(("g-tiny", "n0", 0.5), ("g-full", "n1", 13.0), ("g-capped", "n2", 60.0))
    snapshot = replace(snapshot, gpus=(*snapshot.gpus, replace(make_gpu("g-dead"), healthy=False)))
    residents = tuple(
        _resident(f"m{i}", "g-capped", idle_min=0, gap_min=1, active=1, gib=1) for i in range(4)
    )
    decision = place_model(SMALL, snapshot, residents, DEFAULT_PLACEMENT_CONFIG)
    reasons = {v.gpu_uuid: v.reason for v in decision.verdicts}
    assert reasons == {
        "g-tiny": PlacementReason.INSUFFICIENT_MEMORY,
        "g-full": PlacementReason.OOM_WATERMARK,  # fits, but past the 85 % pre-OOM fill
        "g-capped": PlacementReason.CONCURRENCY_CAP,
        "g-dead": PlacementReason.GPU_NOT_LIVE,
    }
    assert decision.status is PlacementStatus.QUEUED


@pytest.mark.unit
def test_replicas_spread_over_nodes_before_score() -> None:
    snapshot = _cluster(("a0", "node-a", 79.0), ("a1", "node-a", 78.0), ("b0", "node-b", 40.0))
    decision = place_model(replace(SMALL, num_replicas=2), snapshot, (), DEFAULT_PLACEMENT_CONFIG)
    assert decision.gpu_uuids == ("a0", "b0")
    three = place_model(replace(SMALL, num_replicas=4), snapshot, (), DEFAULT_PLACEMENT_CONFIG)
    assert three.gpu_uuids == ("a0", "b0", "a1")
    assert three.reason is PlacementReason.PLACED_PARTIAL


@pytest.mark.unit
def test_queue_proposes_lru_evictions_of_cold_idle_models() -> None:
    big = ModelFootprint("llm", 40 * GIB, 512 * 1024, batch_size=4, seq_len_tokens=2048)
    snapshot = _cluster(("g0", "n0", 10.0))
    residents = (
        _resident("cold-old", "g0", idle_min=300, gap_min=600, gib=25),
        _resident("cold-new", "g0", idle_min=60, gap_min=600, gib=25),
        _resident("busy", "g0", idle_min=90, gap_min=600, active=2, gib=10),
    )
    decision = place_model(big, snapshot, residents, DEFAULT_PLACEMENT_CONFIG)
    assert decision.status is PlacementStatus.QUEUED
    assert decision.reason is PlacementReason.INSUFFICIENT_MEMORY
    assert [e.model_name for e in decision.evictions] == ["cold-old", "cold-new"]
    assert "busy" not in decision.explanation.split("evicting")[-1]


@pytest.mark.unit
def test_models_due_soon_are_not_evicted() -> None:
    # requested every 35 min, idle 30 min, 2-minute load: next request in ~5 min < 2 min × 3
    big = ModelFootprint("llm", 40 * GIB, 512 * 1024, batch_size=4, seq_len_tokens=2048)
    snapshot = _cluster(("g0", "n0", 10.0))
    residents = (_resident("periodic", "g0", idle_min=30, gap_min=35, gib=60),)
    decision = place_model(big, snapshot, residents, DEFAULT_PLACEMENT_CONFIG)
    assert decision.status is PlacementStatus.QUEUED and decision.evictions == ()
    overdue = (_resident("periodic", "g0", idle_min=70, gap_min=35, gib=60),)
    assert place_model(big, snapshot, overdue, DEFAULT_PLACEMENT_CONFIG).evictions


@pytest.mark.unit
def test_placement_round_trips_and_is_deterministic() -> None:
    snapshot = _cluster(("a0", "n0", 50.0), ("a1", "n1", 50.0))
    first = place_model(SMALL, snapshot, (), DEFAULT_PLACEMENT_CONFIG)
    assert first == place_model(SMALL, snapshot, (), DEFAULT_PLACEMENT_CONFIG)
    assert first.gpu_uuids == ("a0",)  # equal scores: uuid breaks the tie
    assert PlacementDecision.from_dict(json.loads(json.dumps(first.to_dict()))) == first


@pytest.mark.unit
def test_dead_memory_is_free_memory_no_model_can_use() -> None:
    snapshot = _cluster(("g0", "n0", 8.0), ("g1", "n1", 30.0), ("g2", "n2", 2.0))
    seven_b = ModelFootprint.from_spec(MODEL_7B_MHA, 1, 2048)  # ~13.6 GB + KV
    report = dead_memory(snapshot, [seven_b], DEFAULT_PLACEMENT_CONFIG)
    assert report.free_bytes == 40 * GIB
    assert report.dead_bytes == 10 * GIB and report.num_dead_gpus == 2
    assert report.dead_share == pytest.approx(0.25)
    with_small = dead_memory(snapshot, [seven_b, SMALL], DEFAULT_PLACEMENT_CONFIG)
    assert with_small.dead_bytes == 0


@pytest.mark.unit
def test_models_with_queued_requests_are_never_evicted() -> None:
    # Cold by every other rule (idle 5 h, requested every 10 h, nothing running), but 3 requests
    # wait for it: evicting it would fail them.
    big = ModelFootprint("llm", 40 * GIB, 512 * 1024, batch_size=4, seq_len_tokens=2048)
    snapshot = _cluster(("g0", "n0", 10.0))
    cold = _resident("waited-for", "g0", idle_min=300, gap_min=600, gib=60)
    assert place_model(big, snapshot, (cold,), DEFAULT_PLACEMENT_CONFIG).evictions
    queued = replace(cold, queued_requests=3)
    decision = place_model(big, snapshot, (queued,), DEFAULT_PLACEMENT_CONFIG)
    assert decision.status is PlacementStatus.QUEUED and decision.evictions == ()
    running = replace(cold, active_requests=1)
    assert place_model(big, snapshot, (running,), DEFAULT_PLACEMENT_CONFIG).evictions == ()


@pytest.mark.unit
def test_no_proposal_ever_names_a_busy_model() -> None:
    # Every mix of running/queued counts over several GPUs: proposals name idle models only.
    big = ModelFootprint("llm", 40 * GIB, 512 * 1024, batch_size=4, seq_len_tokens=2048)
    snapshot = _cluster(("g0", "n0", 5.0), ("g1", "n1", 5.0))
    for mask in range(64):
        residents = tuple(
            replace(
                _resident(f"m{n}", f"g{n % 2}", idle_min=300 + n, gap_min=600, gib=25),
                active_requests=(mask >> n) & 1,
                queued_requests=(mask >> (n + 3)) & 1 if n < 3 else 0,
            )
            for n in range(6)
        )
        busy = {r.model_name for r in residents if r.active_requests or r.queued_requests}
        decision = place_model(big, snapshot, residents, DEFAULT_PLACEMENT_CONFIG)
        assert not busy & {e.model_name for e in decision.evictions}


# ---- the queue rule: an idle model may go before it is cold for the requests it unblocks --------

BIG = ModelFootprint("llm", 40 * GIB, 512 * 1024, batch_size=4, seq_len_tokens=2048)
# idle 10 min of a 15-min mean gap, 2-minute reload: not cold (idle < 30 min); evicting it
# makes ~1 + 2/15 of its requests wait out a reload, × 3 (eviction_reload_factor) ≈ 3.4
WARM = _resident("warm", "g0", idle_min=10, gap_min=15, gib=60)


@pytest.mark.unit
def test_an_idle_model_goes_before_it_is_cold_when_the_queue_outweighs_its_loss() -> None:
    snapshot = _cluster(("g0", "n0", 10.0))
    decision = place_model(BIG, snapshot, (WARM,), DEFAULT_PLACEMENT_CONFIG, Backlog(412))
    assert [(e.model_name, e.rule) for e in decision.evictions] == [("warm", EvictionRule.QUEUE)]
    assert decision.evictions[0].expected_loss == pytest.approx(1 + 2 / 15)
    assert "evict warm@g0 (idle 10 min, next expected in 5 min" in decision.explanation
    assert "for llm: 412 requests waiting" in decision.explanation


@pytest.mark.unit
def test_no_queue_eviction_when_the_queue_does_not_outweigh_the_loss() -> None:
    snapshot = _cluster(("g0", "n0", 10.0))
    for backlog in (None, Backlog(0), Backlog(3)):  # 3 < 3 × (1 + 2/15)
        decision = place_model(BIG, snapshot, (WARM,), DEFAULT_PLACEMENT_CONFIG, backlog)
        assert decision.status is PlacementStatus.QUEUED and decision.evictions == ()
    # its expected rate counts over the victim's reload: 3 waiting + 0.01/s × 120 s = 4.2 > 3.4
    assert place_model(BIG, snapshot, (WARM,), DEFAULT_PLACEMENT_CONFIG, Backlog(3, 0.01)).evictions
    # a busier victim costs more: every 30 s, 1 + 4 requests wait out its reload, × 3 = 15
    busy = replace(WARM, mean_interarrival_s=30.0, last_request_s=NOW_S - 7 * MINUTE)
    assert (
        place_model(BIG, snapshot, (busy,), DEFAULT_PLACEMENT_CONFIG, Backlog(14)).evictions == ()
    )
    assert place_model(BIG, snapshot, (busy,), DEFAULT_PLACEMENT_CONFIG, Backlog(16)).evictions


@pytest.mark.unit
def test_the_queue_rule_never_evicts_a_model_with_active_or_queued_requests() -> None:
    snapshot = _cluster(("g0", "n0", 10.0))
    strict = replace(DEFAULT_PLACEMENT_CONFIG, displace_in_use=False)
    for busy in (replace(WARM, active_requests=1), replace(WARM, queued_requests=1)):
        decision = place_model(BIG, snapshot, (busy,), strict, Backlog(10**6))
        assert decision.evictions == ()
        # by default a pile of waiting requests is no rate: it does not displace it either
        decision = place_model(BIG, snapshot, (busy,), DEFAULT_PLACEMENT_CONFIG, Backlog(10**6))
        assert decision.evictions == ()
        # a model asked for at 1 / s does: drained, never cut by the queue rule
        decision = place_model(BIG, snapshot, (busy,), DEFAULT_PLACEMENT_CONFIG, Backlog(1, 1.0))
        assert [e.rule for e in decision.evictions] == [EvictionRule.DISPLACE]


@pytest.mark.unit
def test_cold_models_go_before_the_queue_rule_is_used() -> None:
    # "frequent" is the least recently used, idle 40 min but due every 5 min (5 ≤ 2 × 3: not
    # cold); "cold" is idle 31 min of a 10-hour gap. One of them makes room: the cold one goes.
    frequent = _resident("frequent", "g0", idle_min=40, gap_min=5, gib=30)
    cold = _resident("cold", "g0", idle_min=31, gap_min=600, gib=30)
    snapshot = _cluster(("g0", "n0", 30.0))
    decision = place_model(BIG, snapshot, (frequent, cold), DEFAULT_PLACEMENT_CONFIG, Backlog(99))
    assert [(e.model_name, e.rule) for e in decision.evictions] == [("cold", EvictionRule.COLD)]
    # across GPUs too: a cold model on g1 beats a queue eviction on g0
    two = _cluster(("g0", "n0", 10.0), ("g1", "n1", 10.0))
    elsewhere = replace(cold, gpu_uuid="g1", memory_bytes=60 * GIB)
    decision = place_model(BIG, two, (WARM, elsewhere), DEFAULT_PLACEMENT_CONFIG, Backlog(99))
    assert [(e.model_name, e.rule) for e in decision.evictions] == [("cold", EvictionRule.COLD)]


@pytest.mark.unit
def test_a_model_idle_less_than_its_residence_guard_is_never_evicted_by_the_queue_rule() -> None:
    # factor 3 × 2-minute reload: 6 minutes idle (so resident at least that long) first
    snapshot = _cluster(("g0", "n0", 10.0))
    fresh = replace(WARM, last_request_s=NOW_S - 5 * MINUTE)
    assert (
        place_model(BIG, snapshot, (fresh,), DEFAULT_PLACEMENT_CONFIG, Backlog(10**6)).evictions
        == ()
    )
    settled = replace(WARM, last_request_s=NOW_S - 7 * MINUTE)
    assert place_model(BIG, snapshot, (settled,), DEFAULT_PLACEMENT_CONFIG, Backlog(10)).evictions


@pytest.mark.unit
def test_a_first_replica_counts_its_demand_over_its_wait_not_only_the_victims_reload() -> None:
    """A model with no replica: every request until it loads waits, so its expected arrivals
    count over its wait horizon (the load window), not only over the victim's reload."""
    snapshot = _cluster(("g0", "n0", 10.0))
    quiet = replace(WARM, reload_s=5.0)  # loss 1 + 5 s / 15 min, × 3 ≈ 3.02
    sparse = Backlog(1, 1 / 30, first_replica=True)  # one waiting, one more every 30 s
    over_reload = place_model(BIG, snapshot, (quiet,), DEFAULT_PLACEMENT_CONFIG, sparse)
    assert over_reload.evictions == ()  # 1 + 5/30 ≈ 1.2
    waits = replace(sparse, wait_horizon_s=60.0)  # 1 + 60/30 = 3 < 3.02: still not
    assert place_model(BIG, snapshot, (quiet,), DEFAULT_PLACEMENT_CONFIG, waits).evictions == ()
    longer = replace(sparse, wait_horizon_s=90.0)  # 1 + 90/30 = 4 > 3.02
    decision = place_model(BIG, snapshot, (quiet,), DEFAULT_PLACEMENT_CONFIG, longer)
    assert [(e.model_name, e.rule) for e in decision.evictions] == [("warm", EvictionRule.QUEUE)]
    assert "~4.0 with those expected over the 90 s it would wait with no replica" in (
        decision.explanation
    )


# ---- replicas in use: the last one displaced, an extra one drained, by value ------------------

# in use (2 running), one request a minute, 2-minute reload, its replica set unchanged an hour:
# displacing it costs 1/60 request per second, × 3 (eviction_reload_factor) = 0.05
BUSY = replace(
    _resident("busy", "g0", idle_min=0, gap_min=1, gib=60, active=2), steady_s=60 * MINUTE
)


@pytest.mark.unit
def test_a_last_replica_in_use_is_displaced_only_for_demand_many_times_its_own() -> None:
    snapshot = _cluster(("g0", "n0", 10.0))
    config = DEFAULT_PLACEMENT_CONFIG
    hot = Backlog(2, 0.1)  # 0.1 requests a second against 0.05
    decision = place_model(BIG, snapshot, (BUSY,), config, hot)
    assert [(e.model_name, e.rule) for e in decision.evictions] == [("busy", EvictionRule.DISPLACE)]
    assert decision.evictions[0].expected_loss == pytest.approx(1 / 60)
    assert "drain busy@g0 (its last replica, in use at 1.0 requests/min" in decision.explanation
    assert "asked for at 6.0 requests/min, against 1.0 of the drained (displace rule)" in (
        decision.explanation
    )
    warm = Backlog(2, 0.03)  # 0.03 < 0.05
    assert place_model(BIG, snapshot, (BUSY,), config, warm).evictions == ()
    assert place_model(BIG, snapshot, (BUSY,), config, None).evictions == ()
    off = replace(config, displace_in_use=False)  # the article's rule: never a model in use
    assert place_model(BIG, snapshot, (BUSY,), off, hot).evictions == ()
    # a rarely used victim still costs the request that finds it gone: 3 such, by the margin
    rare = replace(BUSY, mean_interarrival_s=600 * MINUTE)
    assert place_model(BIG, snapshot, (rare,), config, Backlog(0, 0.02)).evictions == ()  # 2.4
    assert place_model(BIG, snapshot, (rare,), config, Backlog(1, 0.02)).evictions  # 3.4


@pytest.mark.unit
def test_a_model_whose_replicas_changed_lately_is_not_displaced() -> None:
    # factor 3 × its 2-minute reload: its replica set holds 6 minutes first
    snapshot = _cluster(("g0", "n0", 10.0))
    flood = Backlog(100, 10.0)
    fresh = replace(BUSY, steady_s=5 * MINUTE)
    assert place_model(BIG, snapshot, (fresh,), DEFAULT_PLACEMENT_CONFIG, flood).evictions == ()
    settled = replace(BUSY, steady_s=7 * MINUTE)
    assert place_model(BIG, snapshot, (settled,), DEFAULT_PLACEMENT_CONFIG, flood).evictions


@pytest.mark.unit
def test_two_models_cannot_take_one_gpu_from_each_other_at_the_same_rates() -> None:
    snapshot = _cluster(("g0", "n0", 10.0))
    gaps_s = (2.0, 6.0, 20.0, 60.0, 200.0, 600.0)
    for a_gap in gaps_s:
        for b_gap in gaps_s:
            # a waits with no request queued yet while b serves, and the other way round
            b_serves = replace(BUSY, model_name="b", mean_interarrival_s=b_gap)
            a_serves = replace(BUSY, model_name="a", mean_interarrival_s=a_gap)
            a_takes = place_model(
                BIG, snapshot, (b_serves,), DEFAULT_PLACEMENT_CONFIG, Backlog(0, 1 / a_gap)
            ).evictions
            b_takes = place_model(
                BIG, snapshot, (a_serves,), DEFAULT_PLACEMENT_CONFIG, Backlog(0, 1 / b_gap)
            ).evictions
            assert not (a_takes and b_takes), (a_gap, b_gap)
            # 3 × b's rate, and 3 requests over b's 120-s reload (the one that finds it gone)
            assert bool(a_takes) is (a_gap * 3 < b_gap and 120 / a_gap > 3), (a_gap, b_gap)


@pytest.mark.unit
def test_an_idle_model_goes_before_any_model_in_use_is_displaced() -> None:
    two = _cluster(("g0", "n0", 10.0), ("g1", "n1", 10.0))
    warm = replace(WARM, gpu_uuid="g1")
    decision = place_model(BIG, two, (BUSY, warm), DEFAULT_PLACEMENT_CONFIG, Backlog(412, 1.0))
    assert [(e.model_name, e.rule) for e in decision.evictions] == [("warm", EvictionRule.QUEUE)]
