"""On-demand residency: load a requested cold model, evict the least recently used cold one."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from gearbox.config import PlacementConfig, PlacementStrategy
from gearbox.decisions import DecisionReason
from gearbox.placement import (
    Backlog,
    EvictionRule,
    ModelFootprint,
    PlacementReason,
    ResidentModel,
    place_model,
)
from gearbox.presets import GIB, LINK_CLASSES
from gearbox.residency import (
    OnDemandModel,
    Residency,
    ResidencyAction,
    decide_residency,
    held_bytes,
    kv_floor_tokens,
    residency_round,
    room,
)
from gearbox.types import TopologySnapshot
from tests.gearbox.builders import NOW_S, make_gpu

CONFIG = PlacementConfig(cold_after_s=60.0, max_models_per_gpu=1)
SMALL = ModelFootprint("small", 10 * GIB, 64 * 1024, batch_size=8, seq_len_tokens=1024)
BIG = ModelFootprint("big", 60 * GIB, 128 * 1024, batch_size=8, seq_len_tokens=1024)


def _snapshot(*gpus: tuple[str, str, str], free_fraction: float = 1.0) -> TopologySnapshot:
    """GPUs as (uuid, node, class), all free as telemetry shows them before a load's memory
    shows (the round takes what the models' plans hold off them)."""
    out = tuple(
        make_gpu(uuid, node=node, gpu_class=cls, free_fraction=free_fraction)
        for uuid, node, cls in gpus
    )
    return TopologySnapshot(NOW_S, out, (), LINK_CLASSES["pcie"])


def _model(
    name: str,
    footprint: ModelFootprint = SMALL,
    *,
    state: Residency = Residency.COLD,
    gpu: str | None = None,
    active: int = 0,
    queued: int = 0,
    idle_s: float | None = None,
    arrival_rps: float = 0.0,
    **kw: object,
) -> OnDemandModel:
    last = -math.inf if idle_s is None else NOW_S - idle_s
    return OnDemandModel(
        name=name,
        footprint=footprint,
        state=state,
        gpu_uuids=(gpu,) if gpu else (),
        active_requests=active,
        queued_requests=queued,
        last_demand_s=last,
        arrival_rps=arrival_rps,
        reload_s=2.0,
        **kw,  # type: ignore[arg-type]
    )


def _resident(name: str, gpu: str, idle_s: float, **kw: object) -> OnDemandModel:
    return _model(name, state=Residency.RESIDENT, gpu=gpu, idle_s=idle_s, **kw)  # type: ignore[arg-type]


TWO_GPUS = (("g0", "n0", "l40s"), ("g1", "n1", "l40s"))


@pytest.mark.unit
def test_a_requested_cold_model_loads_on_a_free_gpu_with_its_explanation() -> None:
    models = [_model("m", queued=3), _resident("r", "g0", idle_s=5.0)]
    verdict = decide_residency("m", models, _snapshot(*TWO_GPUS), CONFIG)
    assert verdict.action is ResidencyAction.LOAD and verdict.gpu_uuids == ("g1",)
    assert verdict.reason is DecisionReason.LOAD_ON_DEMAND
    assert "3 requests wait" in verdict.explanation and "g1" in verdict.explanation


@pytest.mark.unit
def test_a_cold_model_nobody_asks_for_stays_cold() -> None:
    verdict = decide_residency("m", [_model("m")], _snapshot(*TWO_GPUS), CONFIG)
    assert verdict.action is ResidencyAction.HOLD and verdict.reason is DecisionReason.COLD


@pytest.mark.unit
def test_the_least_recently_used_idle_model_is_evicted_for_a_waiting_one() -> None:
    models = [
        _model("m", queued=2),
        _resident("old", "g0", idle_s=600.0),
        _resident("recent", "g1", idle_s=120.0),
    ]
    snap = _snapshot(*TWO_GPUS)
    old = decide_residency("old", models, snap, CONFIG)
    recent = decide_residency("recent", models, snap, CONFIG)
    waiting = decide_residency("m", models, snap, CONFIG)
    assert old.action is ResidencyAction.EVICT and old.reason is DecisionReason.EVICT_COLD
    assert old.for_model == "m" and "idle 600 s" in old.explanation
    assert recent.action is ResidencyAction.HOLD and recent.reason is DecisionReason.RESIDENT
    assert waiting.action is ResidencyAction.HOLD
    assert waiting.reason is DecisionReason.WAITING_FOR_ROOM and "old@g0" in waiting.explanation


@pytest.mark.unit
@pytest.mark.parametrize("busy", [{"active": 1}, {"queued": 1}])
def test_a_model_with_active_or_queued_requests_is_never_evicted(busy: dict[str, int]) -> None:
    models = [_model("m", queued=2), _resident("r", "g0", idle_s=3600.0, **busy)]
    verdict = decide_residency("r", models, _snapshot(TWO_GPUS[0]), CONFIG)
    assert verdict.action is ResidencyAction.HOLD
    waiting = decide_residency("m", models, _snapshot(TWO_GPUS[0]), CONFIG)
    assert waiting.reason is DecisionReason.WAITING_FOR_ROOM and waiting.placement is not None
    assert waiting.placement.evictions == ()


@pytest.mark.unit
def test_a_model_idle_less_than_cold_after_is_kept() -> None:
    models = [_model("m", queued=2), _resident("r", "g0", idle_s=30.0)]
    verdict = decide_residency("r", models, _snapshot(TWO_GPUS[0]), CONFIG)
    assert verdict.action is ResidencyAction.HOLD and verdict.reason is DecisionReason.RESIDENT


@pytest.mark.unit
def test_two_waiting_models_never_take_the_same_gpu_in_one_round() -> None:
    models = [_model("a", queued=5), _model("b", queued=1)]
    snap = _snapshot(TWO_GPUS[0])
    first = decide_residency("a", models, snap, CONFIG)
    second = decide_residency("b", models, snap, CONFIG)
    assert first.action is ResidencyAction.LOAD and second.action is ResidencyAction.HOLD


@pytest.mark.unit
def test_a_big_model_goes_first_and_a_small_one_packs_onto_the_small_gpu() -> None:
    gpus = (("big-gpu", "n0", "h100-sxm"), ("small-gpu", "n1", "l40s"))
    models = [_model("tiny", queued=9), _model("huge", BIG, queued=1)]
    snap = _snapshot(*gpus)
    assert decide_residency("huge", models, snap, CONFIG).gpu_uuids == ("big-gpu",)
    assert decide_residency("tiny", models, snap, CONFIG).gpu_uuids == ("small-gpu",)


@pytest.mark.unit
def test_pin_and_anti_affinity_restrict_the_gpus_and_affinity_prefers_a_node() -> None:
    gpus = (("g0", "n0", "l40s"), ("g0b", "n0", "l40s"), ("g1", "n1", "l40s"))
    peer = _resident("peer", "g0", idle_s=1.0)
    snap = _snapshot(*gpus)
    free = _model("m", queued=1)
    away = _model("m", queued=1, anti_affinity=("peer",))
    assert decide_residency("m", [free, peer], snap, CONFIG).gpu_uuids == ("g0b",)
    assert decide_residency("m", [away, peer], snap, CONFIG).gpu_uuids == ("g1",)
    pinned = _model("m", queued=1, pin_domain="elsewhere")
    pin = decide_residency("m", [pinned, peer], snap, CONFIG)
    assert pin.action is ResidencyAction.HOLD and "pinned to domain elsewhere" in pin.explanation
    near = _model("m", queued=1, affinity=("peer2",))
    peer2 = _resident("peer2", "g2b", idle_s=1.0)
    gpus4 = (*gpus, ("g2", "n2", "l40s"), ("g2b", "n2", "l40s"))
    snap4 = _snapshot(*gpus4)
    assert decide_residency("m", [free, peer, peer2], snap4, CONFIG).gpu_uuids == ("g0b",)
    assert decide_residency("m", [near, peer, peer2], snap4, CONFIG).gpu_uuids == ("g2",)


@pytest.mark.unit
def test_a_model_in_transition_holds() -> None:
    loading = _model("m", state=Residency.LOADING, gpu="g0", queued=4)
    verdict = decide_residency("m", [loading], _snapshot(*TWO_GPUS), CONFIG)
    assert verdict.action is ResidencyAction.HOLD
    assert verdict.reason is DecisionReason.TRANSITION_IN_FLIGHT


# ---- several models per GPU ------------------------------------------------------------------

PACK = PlacementConfig(  # oom_watermark 0.85
    cold_after_s=60.0, max_models_per_gpu=4, strategy=PlacementStrategy.PACK
)
MID = ModelFootprint("mid", 25 * GIB, 64 * 1024, batch_size=8, seq_len_tokens=1024)


@pytest.mark.unit
def test_room_is_telemetry_free_at_most_total_minus_what_the_models_hold() -> None:
    gpu = ("g0", "n0", "h100-sxm")  # 80 GiB
    models = [_resident("r", "g0", idle_s=5.0), _model("l", MID, state=Residency.LOADING, gpu="g0")]
    held = held_bytes(models[0], PACK) + held_bytes(models[1], PACK)
    assert held_bytes(models[0], PACK) == SMALL.estimated_bytes(PACK.memory_k)
    lagging = room(_snapshot(gpu), models, PACK).gpus[0]  # the load's memory not sampled yet
    assert lagging.free_memory_bytes == 80 * GIB - held
    busy = room(_snapshot(gpu, free_fraction=0.25), models, PACK).gpus[0]  # KV past footprints
    assert busy.free_memory_bytes == 20 * GIB


@pytest.mark.unit
def test_small_models_share_a_gpu_while_all_their_footprints_fit_under_the_watermark() -> None:
    # l40s: 48 GiB, watermark 40.8 GiB; SMALL holds 10.65 GiB: four would need 42.6
    models = [
        _resident("a", "g0", idle_s=5.0),
        _model("b", queued=1),
        _model("c", queued=1),
        _model("d", queued=1),
    ]
    snap = _snapshot(TWO_GPUS[0])
    assert decide_residency("b", models, snap, PACK).gpu_uuids == ("g0",)
    assert decide_residency("c", models, snap, PACK).gpu_uuids == ("g0",)
    d = decide_residency("d", models, snap, PACK)
    assert d.action is ResidencyAction.HOLD and d.reason is DecisionReason.WAITING_FOR_ROOM
    assert d.placement is not None and d.placement.reason is PlacementReason.OOM_WATERMARK
    assert d.placement.evictions == ()  # "a" was requested 5 s ago: not cold
    capped = PlacementConfig(cold_after_s=60.0, max_models_per_gpu=2)
    assert decide_residency("c", models, snap, capped).action is ResidencyAction.HOLD


@pytest.mark.unit
def test_best_fit_fills_a_partly_used_gpu_before_an_empty_big_one() -> None:
    gpus = (("big", "n0", "h100-sxm"), ("mid", "n1", "l40s"))
    models = [_resident("r", "mid", idle_s=5.0), _model("tiny", queued=1)]
    tiny = decide_residency("tiny", models, _snapshot(*gpus), PACK)
    assert tiny.gpu_uuids == ("mid",) and "(pack;" in tiny.explanation
    both = [*models, _model("huge", BIG, queued=1)]  # placed first: the big GPU stays its own
    assert decide_residency("huge", both, _snapshot(*gpus), PACK).gpu_uuids == ("big",)
    assert decide_residency("tiny", both, _snapshot(*gpus), PACK).gpu_uuids == ("mid",)
    spread = replace(PACK, strategy=PlacementStrategy.SPREAD)  # the same round, the other way
    assert decide_residency("tiny", models, _snapshot(*gpus), spread).gpu_uuids == ("big",)


@pytest.mark.unit
def test_a_loading_model_holds_its_share_and_is_never_proposed_for_eviction() -> None:
    loading = _model("l", MID, state=Residency.LOADING, gpu="g0", idle_s=600.0)
    waiting = _model("m", MID, queued=1)
    alone = decide_residency("m", [loading, waiting], _snapshot(TWO_GPUS[0]), PACK)
    assert alone.reason is DecisionReason.WAITING_FOR_ROOM
    assert alone.placement is not None and alone.placement.evictions == ()
    two = decide_residency("m", [loading, waiting], _snapshot(*TWO_GPUS), PACK)
    assert two.gpu_uuids == ("g1",)


@pytest.mark.unit
def test_an_eviction_frees_only_its_models_share_and_the_busy_neighbour_stays() -> None:
    # g0 (l40s, 40.8 GiB under the watermark): busy SMALL 10.65 + idle MID 25.65 GiB
    models = [
        _resident("busy", "g0", idle_s=600.0, active=2),
        _model("old", MID, state=Residency.RESIDENT, gpu="g0", idle_s=600.0),
        _model("m", MID, queued=2),
        _model("s", queued=1),
    ]
    snap = _snapshot(TWO_GPUS[0])
    old = decide_residency("old", models, snap, PACK)
    assert old.action is ResidencyAction.EVICT and old.for_model == "m"
    assert decide_residency("busy", models, snap, PACK).action is ResidencyAction.HOLD
    m = decide_residency("m", models, snap, PACK)
    assert m.reason is DecisionReason.WAITING_FOR_ROOM and m.placement is not None
    (proposal,) = m.placement.evictions
    assert (proposal.model_name, proposal.gpu_uuid) == ("old", "g0")
    assert proposal.freed_bytes == MID.estimated_bytes(PACK.memory_k)  # not the whole GPU
    # what the eviction frees is promised to m: s neither gets it nor evicts the busy model
    s = decide_residency("s", models, snap, PACK)
    assert s.reason is DecisionReason.WAITING_FOR_ROOM and s.placement is not None
    assert s.placement.evictions == ()


@pytest.mark.unit
def test_anti_affinity_binds_both_ways_when_gpus_are_shared() -> None:
    gpus = (("g0", "n0", "l40s"), ("g1", "n1", "l40s"))
    named = _resident("peer", "g0", idle_s=5.0, anti_affinity=("m",))
    snap = _snapshot(*gpus)
    assert decide_residency("m", [named, _model("m", queued=1)], snap, PACK).gpu_uuids == ("g1",)
    free = _resident("peer", "g0", idle_s=5.0)
    assert decide_residency("m", [free, _model("m", queued=1)], snap, PACK).gpu_uuids == ("g0",)


@pytest.mark.unit
def test_each_models_runtime_overhead_counts_on_a_shared_gpu() -> None:
    # l40s, 40.8 GiB under the watermark: two 18 GiB models fit (37.3), not with 2 GiB each
    # of runtime memory beside their weights (41.3)
    bare = ModelFootprint("w", 18 * GIB, 64 * 1024, batch_size=8, seq_len_tokens=1024)
    heavy = replace(bare, overhead_bytes=2 * GIB)
    for footprint, fits in ((bare, True), (heavy, False)):
        models = [
            _model("r", footprint, state=Residency.RESIDENT, gpu="g0", idle_s=5.0),
            _model("m", footprint, queued=1),
        ]
        verdict = decide_residency("m", models, _snapshot(TWO_GPUS[0]), PACK)
        assert (verdict.action is ResidencyAction.LOAD) is fits


@pytest.mark.unit
def test_an_idle_model_not_yet_cold_goes_when_the_waiting_requests_outweigh_its_loss() -> None:
    # idle 30 s (< cold_after_s 60), next expected in ~60 s, 2 s reload: evicting it makes
    # ~1 + 2/60 requests wait out a reload, × 3 ≈ 3.1; 5 waiting outweigh that, 2 do not
    snap = _snapshot(TWO_GPUS[0])
    many = [_model("m", queued=5), _resident("r", "g0", idle_s=30.0)]
    evicted = decide_residency("r", many, snap, CONFIG)
    assert evicted.action is ResidencyAction.EVICT and evicted.reason is DecisionReason.EVICT_QUEUE
    assert evicted.for_model == "m" and "queue rule" in evicted.explanation
    assert "(idle 30 s, next expected in 30 s" in evicted.explanation
    assert "for small: 5 requests waiting" in evicted.explanation  # the footprint's model
    few = [_model("m", queued=2), _resident("r", "g0", idle_s=30.0)]
    assert decide_residency("r", few, snap, CONFIG).action is ResidencyAction.HOLD


@pytest.mark.unit
def test_the_queue_rule_keeps_a_recently_used_model_and_prefers_cold_ones() -> None:
    # residence guard: idle 5 s < 3 × 2 s reload — kept whatever waits
    fresh = [_model("m", queued=1000), _resident("r", "g0", idle_s=5.0)]
    assert decide_residency("r", fresh, _snapshot(TWO_GPUS[0]), CONFIG).action is (
        ResidencyAction.HOLD
    )
    # "frequent" is the least recently used but due every second (not cold); "cold" goes
    models = [
        _model("m", queued=1000),
        replace(_resident("frequent", "g0", idle_s=600.0), arrival_rps=1.0),
        _resident("cold", "g1", idle_s=120.0),
    ]
    snap = _snapshot(*TWO_GPUS)
    cold = decide_residency("cold", models, snap, CONFIG)
    assert cold.action is ResidencyAction.EVICT and cold.reason is DecisionReason.EVICT_COLD
    assert decide_residency("frequent", models, snap, CONFIG).action is ResidencyAction.HOLD


# ---- replicas: scale-out and scale-in in the round ---------------------------------------------

THREE_GPUS = (*TWO_GPUS, ("g2", "n2", "l40s"))


def _hot(name: str, gpu: str, queued: int = 4) -> OnDemandModel:
    """Resident on ``gpu``, 120 arrivals over its 60 s window, 30 of them refused (429)."""
    busy = _resident(name, gpu, idle_s=0.0, active=8, queued=queued)
    return replace(busy, arrival_rps=2.0, refused=30, window_s=60.0)


@pytest.mark.unit
def test_a_resident_model_turning_requests_away_gets_one_more_replica() -> None:
    hot = _hot("hot", "g0")
    verdict = decide_residency("hot", [hot], _snapshot(*TWO_GPUS), PACK)
    assert verdict.action is ResidencyAction.SCALE_OUT
    assert verdict.reason is DecisionReason.SCALE_OUT
    assert verdict.gpu_uuids == ("g0", "g1")  # its replica stays, one more beside it
    assert "30 refused + 4 waiting of 120 arrivals" in verdict.explanation
    just = replace(hot, steady_s=10.0)  # its replicas changed 10 s ago: the window is stale
    assert decide_residency("hot", [just], _snapshot(*TWO_GPUS), PACK).action is (
        ResidencyAction.HOLD
    )


@pytest.mark.unit
def test_two_scale_outs_in_one_round_do_not_take_the_same_room() -> None:
    # an l40s (40.8 GiB under the watermark) fits three SMALLs (10.65 GiB each): g1 holds two
    a, b = _hot("a", "g0", queued=5), _hot("b", "g0")  # a waits more: it goes first
    c = _resident("c", "g1", idle_s=0.0, active=1)
    d = _resident("d", "g1", idle_s=0.0, active=1)
    models = [a, b, c, d]
    snap = _snapshot(*TWO_GPUS)
    first = decide_residency("a", models, snap, PACK)
    second = decide_residency("b", models, snap, PACK)
    assert first.action is ResidencyAction.SCALE_OUT and first.gpu_uuids == ("g0", "g1")
    assert second.action is ResidencyAction.HOLD  # g1 is full once a's replica is promised


@pytest.mark.unit
def test_a_multi_replica_model_gives_back_an_idle_replica_never_one_in_use() -> None:
    idle = replace(_resident("m", "g0", idle_s=600.0), gpu_uuids=("g0", "g1"))
    verdict = decide_residency("m", [idle], _snapshot(*TWO_GPUS), PACK)
    assert verdict.action is ResidencyAction.SCALE_IN and len(verdict.gpu_uuids) == 1
    busy = replace(idle, active_requests=1)
    assert decide_residency("m", [busy], _snapshot(*TWO_GPUS), PACK).action is (
        ResidencyAction.HOLD
    )
    queued = replace(idle, queued_requests=1)
    assert decide_residency("m", [queued], _snapshot(*TWO_GPUS), PACK).action is (
        ResidencyAction.HOLD
    )


@pytest.mark.unit
def test_an_extra_replica_makes_room_for_a_cold_model_before_any_last_replica() -> None:
    # both GPUs full to the cap (one model each); "m" has a replica on each, "solo" none else
    capped = replace(PACK, max_models_per_gpu=1, cold_after_s=60.0)
    extra = replace(_resident("m", "g0", idle_s=600.0), gpu_uuids=("g0", "g1"))
    solo = _resident("solo", "g2", idle_s=600.0)
    waiting = _model("w", queued=2)
    models = [extra, solo, waiting]
    snap = _snapshot(*THREE_GPUS)
    m = decide_residency("m", models, snap, capped)
    assert m.action is ResidencyAction.SCALE_IN and m.for_model == "w"
    assert len(m.gpu_uuids) == 1  # one replica stays
    assert decide_residency("solo", models, snap, capped).action is ResidencyAction.HOLD


@pytest.mark.unit
def test_a_model_whose_whole_batch_fits_no_card_loads_with_its_batch_cut() -> None:
    # 36 GiB of weights on an L40S (48 GiB, watermark 40.8 GiB): 8 sequences of 4,096 tokens at
    # k = 1.3 need 41.2 GiB in all; 7 fit, so it loads, saying so. Weights past the watermark
    # never do: that card can hold none of its KV.
    wide = ModelFootprint("wide", 36 * GIB, 128 * 1024, batch_size=8, seq_len_tokens=4096)
    config = PlacementConfig()
    assert wide.estimated_bytes(config.memory_k) > config.oom_watermark * 48 * GIB
    one = (("g0", "n0", "l40s"),)
    verdict = decide_residency("m", [_model("m", wide, queued=1)], _snapshot(*one), config)
    assert verdict.action is ResidencyAction.LOAD and verdict.gpu_uuids == ("g0",)
    assert "batch cut to 7 of 8 sequences" in verdict.explanation
    heavy = replace(wide, model_bytes=42 * GIB)
    verdict = decide_residency("m", [_model("m", heavy, queued=1)], _snapshot(*one), config)
    assert verdict.reason is DecisionReason.WAITING_FOR_ROOM


@pytest.mark.unit
def test_the_round_gives_every_model_the_verdict_it_decides_for_itself() -> None:
    # one path: the benchmark's round for all models is each deployment's own decision
    models = [
        _model("m", queued=2),
        _resident("idle", "g0", idle_s=600.0),
        _resident("busy", "g1", idle_s=1.0, active=1),
        _model("loading", state=Residency.LOADING, gpu="g1"),
        _model("nobody"),
    ]
    snapshot = _snapshot(*TWO_GPUS)
    verdicts = residency_round(models, snapshot, CONFIG)
    assert verdicts == {m.name: decide_residency(m.name, models, snapshot, CONFIG) for m in models}
    assert verdicts["idle"].action is ResidencyAction.EVICT


@pytest.mark.unit
def test_an_extra_replica_in_use_is_drained_for_a_model_with_no_replica() -> None:
    # as above, but "m" serves requests on both replicas and "solo" too: no idle model anywhere.
    # One of m's replicas is given back by a drain (the runtime finishes its requests there);
    # solo's last replica never goes.
    # Each of m's two replicas carries half its request a second (0.5 / s); w's 2 / s outweighs
    # that by 3 (eviction_reload_factor); solo's last replica (1 / s) would need 3 / s.
    capped = replace(PACK, max_models_per_gpu=1, cold_after_s=60.0)
    busy = replace(
        _resident("m", "g0", idle_s=0.0, active=3, arrival_rps=1.0), gpu_uuids=("g0", "g1")
    )
    solo = _resident("solo", "g2", idle_s=0.0, active=1, arrival_rps=1.0)
    models = [busy, solo, _model("w", queued=2, arrival_rps=2.0)]
    snap = _snapshot(*THREE_GPUS)
    m = decide_residency("m", models, snap, capped)
    assert m.action is ResidencyAction.SCALE_IN and m.for_model == "w" and len(m.gpu_uuids) == 1
    assert "drained" in m.explanation
    assert decide_residency("solo", models, snap, capped).action is ResidencyAction.HOLD
    assert decide_residency("w", models, snap, capped).reason is DecisionReason.WAITING_FOR_ROOM
    # a model asked for at 1 / s waits: the drain would cost more than it gains
    sparse = [busy, solo, _model("w", queued=2, arrival_rps=1.0)]
    assert decide_residency("m", sparse, snap, capped).action is ResidencyAction.HOLD


@pytest.mark.unit
def test_only_a_first_replica_drains_a_replica_in_use_and_only_for_more_than_its_share() -> None:
    # m: a request a second over two replicas, 0.5 / s each; × 3 (eviction_reload_factor) = 1.5.
    # 2 / s is enough for a model with no replica; a model scaling out never drains another's
    # replica; 1 / s is not enough, however many requests wait.
    gpu = _snapshot(("g0", "n0", "l40s"))
    held = ResidentModel("m", "g0", 40 * GIB, 3, NOW_S, 1.0, 2.0)
    others = ResidentModel("m", "g1", 40 * GIB, 3, NOW_S, 1.0, 2.0)
    config = replace(PACK, max_models_per_gpu=1)
    first = place_model(SMALL, gpu, [held, others], config, Backlog(2, 2.0, first_replica=True))
    assert [(e.rule, e.expected_loss) for e in first.evictions] == [(EvictionRule.DRAIN, 0.5)]
    assert "asked for at 120.0 requests/min, against 30.0 of the drained (drain rule)" in (
        first.explanation
    )
    assert place_model(SMALL, gpu, [held, others], config, Backlog(2, 2.0)).evictions == ()
    piled = Backlog(500, 1.0, first_replica=True)
    assert place_model(SMALL, gpu, [held, others], config, piled).evictions == ()
    # its last replica carries all of m's rate (1 / s): 2 / s does not outweigh it
    alone = place_model(SMALL, gpu, [held], config, Backlog(2, 2.0, first_replica=True))
    assert alone.evictions == ()


@pytest.mark.parametrize("evicting_for", ["x", "other", None])
def test_a_model_a_displaced_one_still_makes_room_for_displaces_no_other(
    evicting_for: str | None,
) -> None:
    # v1 on g0 is being displaced (waiting for an idle moment); v2 on g1 is in use at a
    # twentieth of x's rate, so the displace rule would take it for x — unless v1's eviction
    # is already for x
    v1 = _model("v1", state=Residency.EVICTING, gpu="g0", active=1, evicting_for=evicting_for)
    v2 = _resident("v2", "g1", idle_s=0.0, active=2, arrival_rps=0.05)
    x = _model("x", queued=3, arrival_rps=1.0)
    verdicts = residency_round([v1, v2, x], _snapshot(*TWO_GPUS), CONFIG)
    assert verdicts["x"].reason is DecisionReason.WAITING_FOR_ROOM
    if evicting_for == "x":
        assert verdicts["v2"].action is ResidencyAction.HOLD, verdicts["v2"].explanation
        assert "v1 making room for it: no other displaced" in verdicts["x"].explanation
    else:
        assert verdicts["v2"].reason is DecisionReason.EVICT_DISPLACE
        assert verdicts["v2"].for_model == "x"


@pytest.mark.parametrize("evicting_for", ["x", None])
def test_a_scale_out_a_displaced_model_still_makes_room_for_displaces_no_other(
    evicting_for: str | None,
) -> None:
    # x serves on g2 and refuses two thirds of its requests: it would scale out onto g1 by
    # displacing v2, unless v1's eviction on g0 is already for x
    gpus = (*TWO_GPUS, ("g2", "n2", "l40s"))
    v1 = _model("v1", state=Residency.EVICTING, gpu="g0", active=1, evicting_for=evicting_for)
    v2 = _resident("v2", "g1", idle_s=0.0, active=2, arrival_rps=0.05)
    x = _resident("x", "g2", idle_s=0.0, active=8, queued=5, arrival_rps=1.0, refused=40)
    verdicts = residency_round([v1, v2, x], _snapshot(*gpus), CONFIG)
    if evicting_for == "x":
        assert verdicts["v2"].action is ResidencyAction.HOLD, verdicts["v2"].explanation
        assert verdicts["x"].action is ResidencyAction.HOLD
    else:
        assert verdicts["v2"].reason is DecisionReason.EVICT_DISPLACE
        assert verdicts["v2"].for_model == "x"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("evicting_for", "steady_s"), [("x", 5.0), ("x", 60.0), ("other", 5.0), (None, 5.0)]
)
def test_the_room_a_displacement_made_goes_first_to_the_model_it_was_made_for(
    evicting_for: str | None, steady_s: float
) -> None:
    # v was displaced from g0 for x's scale-out and has just gone; c, cold, waits too. Cold
    # models are placed before scale-outs, so c would take g0 — unless v went for x within
    # its load window (60 s)
    v = _model("v", evicting_for=evicting_for, steady_s=steady_s)
    x = _resident("x", "g1", idle_s=0.0, active=8, queued=5, arrival_rps=1.0, refused=40)
    c = _model("c", queued=3, arrival_rps=0.5)
    verdicts = residency_round([v, x, c], _snapshot(*TWO_GPUS), CONFIG)
    if evicting_for == "x" and steady_s < 60.0:
        assert verdicts["x"].action is ResidencyAction.SCALE_OUT, verdicts["x"].explanation
        assert verdicts["x"].gpu_uuids == ("g0", "g1")
        assert verdicts["c"].reason is DecisionReason.WAITING_FOR_ROOM
    else:
        assert verdicts["c"].action is ResidencyAction.LOAD
        assert verdicts["c"].gpu_uuids == ("g0",)
        assert verdicts["x"].action is ResidencyAction.HOLD, verdicts["x"].explanation


@pytest.mark.unit
def test_a_cold_model_a_displacement_made_room_for_is_placed_before_larger_ones() -> None:
    # both wait for g0, the only free GPU; big goes first by footprint unless v was just
    # displaced for small
    v = _model("v", evicting_for="small", steady_s=5.0)
    small = _model("small", queued=1, arrival_rps=0.5)
    big = _model("big", replace(SMALL, model_name="big", model_bytes=20 * GIB), queued=3)
    held = _resident("h", "g1", idle_s=0.0, active=1, arrival_rps=1.0)
    verdicts = residency_round([v, small, big, held], _snapshot(*TWO_GPUS), CONFIG)
    assert verdicts["small"].action is ResidencyAction.LOAD, verdicts["small"].explanation
    assert "first in the round: v displaced for it" in verdicts["small"].explanation
    assert verdicts["big"].reason is DecisionReason.WAITING_FOR_ROOM
    plain = residency_round(
        [replace(v, evicting_for=None), small, big, held], _snapshot(*TWO_GPUS), CONFIG
    )
    assert plain["big"].action is ResidencyAction.LOAD


@pytest.mark.unit
def test_a_replicas_kv_floor_is_none_by_default_and_the_configured_batch_otherwise() -> None:
    # the runtime's VMM floor for an on-demand replica: its weights, plus this much KV
    assert kv_floor_tokens(1000, PlacementConfig()) == 0
    assert kv_floor_tokens(1000, PlacementConfig(kv_floor_batch=8)) == 10_400  # 1.3 × 8 × 1000
