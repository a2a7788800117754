"""Replica scale-out / scale-in (gearbox.scaling) and the pack vs spread strategy."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from gearbox import ModelFootprint, ResidentModel, TopologySnapshot, place_model
from gearbox.config import PlacementConfig, PlacementStrategy
from gearbox.placement import EvictionRule, PlacementStatus
from gearbox.presets import GIB, LINK_CLASSES
from gearbox.scaling import (
    ReplicaDemand,
    ScaleAction,
    ScaleReason,
    max_replicas,
    scale_replicas,
)
from tests.gearbox.builders import NOW_S, make_gpu

pytestmark = pytest.mark.unit

CONFIG = PlacementConfig()  # eviction_reload_factor 3, scale_out_unmet_share 0.05
HOT = ModelFootprint("hot", 14 * GIB, 128 * 1024, batch_size=8, seq_len_tokens=1024)
RELOAD_S = 10.0


def _cluster(*gpus: tuple[str, str, float]) -> TopologySnapshot:
    """A100s given as (uuid, node, free GiB)."""
    built = tuple(
        replace(make_gpu(u, node=n, gpu_class="a100-80g"), free_memory_bytes=int(f * GIB))
        for u, n, f in gpus
    )
    return TopologySnapshot(NOW_S, built, (), LINK_CLASSES["rdma"])


def _replica(
    gpu: str,
    *,
    idle_s: float = 0.0,
    active: int = 0,
    queued: int = 0,
    loading: bool = False,
    model: str = "hot",
) -> ResidentModel:
    return ResidentModel(
        model,
        gpu,
        20 * GIB,
        active,
        NOW_S - idle_s,
        5.0,
        RELOAD_S,
        queued,
        in_transition=loading,
    )


def _demand(
    arrivals: int, refused: int, waiting: int = 0, steady_s: float = math.inf
) -> ReplicaDemand:
    return ReplicaDemand(arrivals, refused, waiting, 60.0, steady_s)


def test_scale_out_when_unmet_demand_exceeds_capacity_on_another_node() -> None:
    snapshot = _cluster(("g0", "n0", 30.0), ("g1", "n0", 70.0), ("g2", "n1", 40.0))
    decision = scale_replicas(
        HOT, _demand(200, 40, 5), snapshot, [_replica("g0", active=30)], CONFIG
    )
    assert decision.action is ScaleAction.OUT
    assert decision.reason is ScaleReason.UNMET_DEMAND
    # anti-affinity: n1 has no replica of it, though g1 on n0 has more room
    assert decision.gpu_uuid == "g2"
    assert "40 refused + 5 waiting of 200 arrivals" in decision.explanation


def test_no_scale_out_under_the_threshold_or_while_a_replica_loads() -> None:
    snapshot = _cluster(("g0", "n0", 30.0), ("g1", "n1", 70.0))
    few = scale_replicas(HOT, _demand(200, 2), snapshot, [_replica("g0", active=3)], CONFIG)
    assert (few.action, few.reason) == (ScaleAction.HOLD, ScaleReason.STEADY)  # 2 < max(3, 10)
    loading = [_replica("g0", active=30), _replica("g1", loading=True)]
    busy = scale_replicas(HOT, _demand(200, 80), snapshot, loading, CONFIG)
    assert busy.reason is ScaleReason.REPLICA_IN_TRANSITION


def test_no_second_scale_out_on_the_refusals_that_asked_for_the_first() -> None:
    """Hysteresis: the window must be counted entirely on the current replica set."""
    snapshot = _cluster(("g0", "n0", 30.0), ("g1", "n1", 30.0), ("g2", "n2", 70.0))
    residents = [_replica("g0", active=30), _replica("g1", active=30)]
    stale = scale_replicas(HOT, _demand(200, 80, steady_s=20.0), snapshot, residents, CONFIG)
    assert stale.reason is ScaleReason.WINDOW_NOT_STEADY
    fresh = scale_replicas(HOT, _demand(200, 80, steady_s=60.0), snapshot, residents, CONFIG)
    assert fresh.action is ScaleAction.OUT


def test_scale_out_stops_at_the_maximum() -> None:
    snapshot = _cluster(*((f"g{i}", f"n{i}", 70.0) for i in range(6)))
    capped = replace(CONFIG, max_replicas_per_model=2)  # half of 6 GPUs is more: 3
    residents = [_replica(f"g{i}", active=30) for i in range(3)]
    decision = scale_replicas(HOT, _demand(200, 80), snapshot, residents, capped)
    assert decision.reason is ScaleReason.AT_MAX_REPLICAS
    fixed = replace(capped, max_replica_share=0.0)  # the fixed number alone
    held = scale_replicas(HOT, _demand(200, 80), snapshot, residents[:2], fixed)
    assert held.reason is ScaleReason.AT_MAX_REPLICAS


def test_the_maximum_follows_the_fleet_a_hot_model_may_hold_half_of_a_large_one() -> None:
    # on 12 GPUs a model at 4 replicas with unmet demand gets a fifth (half the fleet: 6); on
    # 8 GPUs half is 4, the fixed number, and it holds
    residents = [_replica(f"g{i}", active=30) for i in range(4)]
    large = _cluster(*((f"g{i}", f"n{i}", 70.0) for i in range(12)))
    grown = scale_replicas(HOT, _demand(200, 80), large, residents, CONFIG)
    assert (grown.action, grown.reason) == (ScaleAction.OUT, ScaleReason.UNMET_DEMAND)
    assert grown.gpu_uuid not in {r.gpu_uuid for r in residents}
    small = _cluster(*((f"g{i}", f"n{i}", 70.0) for i in range(8)))
    held = scale_replicas(HOT, _demand(200, 80), small, residents, CONFIG)
    assert held.reason is ScaleReason.AT_MAX_REPLICAS
    assert [max_replicas(CONFIG, n) for n in (2, 8, 9, 12, 27)] == [4, 4, 4, 6, 13]


def test_no_room_proposes_evictions_the_unmet_demand_outweighs() -> None:
    snapshot = _cluster(("g0", "n0", 30.0), ("g1", "n1", 15.0))  # hot needs 15.3 GiB
    # idle 20 s: under factor × reload (30 s), the minimum residence — never evicted yet
    recent = replace(_replica("g1", idle_s=20.0, model="other"), mean_interarrival_s=60.0)
    residents = [_replica("g0", active=30), recent]
    decision = scale_replicas(HOT, _demand(200, 80, 5), snapshot, residents, CONFIG)
    assert (decision.action, decision.reason) == (ScaleAction.HOLD, ScaleReason.NO_ROOM)
    assert decision.placement is not None and decision.placement.evictions == ()
    # idle 10 min, not cold (30 min): the queue rule, 5 waiting + 85/60 s × 10 s reload = 19.2
    # requests against 3 × (1 + 10/60) = 3.5 expected to wait out its reload
    settled = replace(recent, last_request_s=NOW_S - 600.0)
    decision = scale_replicas(HOT, _demand(200, 80, 5), snapshot, [residents[0], settled], CONFIG)
    assert decision.placement is not None
    assert [e.rule for e in decision.placement.evictions] == [EvictionRule.QUEUE]
    # a trickle does not outweigh it: 3 refused of 40, none waiting → 3/60 s × 10 s = 0.5 < 3.5
    few = scale_replicas(HOT, _demand(40, 3), snapshot, [residents[0], settled], CONFIG)
    assert few.placement is not None and few.placement.evictions == ()


@pytest.mark.parametrize(
    ("active", "queued"),
    [(1, 0), (0, 1)],
)
def test_never_scales_in_a_replica_with_active_or_queued_requests(active: int, queued: int) -> None:
    snapshot = _cluster(("g0", "n0", 30.0), ("g1", "n1", 30.0))
    residents = [
        _replica("g0", idle_s=3600.0, active=active, queued=queued),
        _replica("g1", idle_s=3600.0, active=active, queued=queued),
    ]
    decision = scale_replicas(HOT, _demand(0, 0), snapshot, residents, CONFIG)
    assert decision.action is ScaleAction.HOLD


def test_scale_in_gives_back_the_longest_idle_extra_never_the_last() -> None:
    snapshot = _cluster(("g0", "n0", 30.0), ("g1", "n1", 30.0))
    residents = [_replica("g0", idle_s=40.0), _replica("g1", idle_s=90.0)]
    decision = scale_replicas(HOT, _demand(0, 0), snapshot, residents, CONFIG)
    assert (decision.action, decision.gpu_uuid) == (ScaleAction.IN, "g1")
    last = scale_replicas(HOT, _demand(0, 0), snapshot, residents[:1], CONFIG)
    assert last.action is ScaleAction.HOLD
    floor = replace(_demand(0, 0), min_replicas=2)
    assert scale_replicas(HOT, floor, snapshot, residents, CONFIG).action is ScaleAction.HOLD


def test_no_flap_scale_in_waits_out_the_minimum_residence() -> None:
    """An extra replica just loaded and idle for less than factor × reload (30 s) stays, and
    while anything is unmet nothing is given back."""
    snapshot = _cluster(("g0", "n0", 30.0), ("g1", "n1", 30.0))
    residents = [_replica("g0", idle_s=10.0), _replica("g1", idle_s=25.0)]
    assert scale_replicas(HOT, _demand(0, 0), snapshot, residents, CONFIG).action is (
        ScaleAction.HOLD
    )
    settled = [_replica("g0", idle_s=100.0), _replica("g1", idle_s=100.0)]
    unmet = scale_replicas(HOT, _demand(50, 0, 1), snapshot, settled, CONFIG)
    assert unmet.action is ScaleAction.HOLD


def test_an_idle_extra_replica_is_evicted_before_any_last_replica() -> None:
    snapshot = _cluster(("g0", "n0", 10.0), ("g1", "n1", 10.0))  # new needs 10.3 GiB
    cold_last = replace(
        _replica("g0", idle_s=3600.0, model="old"), mean_interarrival_s=7200.0, reload_s=60.0
    )
    extra = [_replica("g1", idle_s=120.0), _replica("g9", active=4)]  # hot keeps g9 serving
    request = ModelFootprint("new", 10 * GIB, 64 * 1024, batch_size=8, seq_len_tokens=512)
    decision = place_model(request, snapshot, [cold_last, *extra], CONFIG)
    assert decision.status is PlacementStatus.QUEUED
    assert [(e.model_name, e.gpu_uuid, e.rule) for e in decision.evictions] == [
        ("hot", "g1", EvictionRule.EXTRA_REPLICA)
    ]
    # a model's only replica is never "extra": with g9 gone, hot on g1 is its last
    alone = place_model(request, _cluster(("g1", "n1", 10.0)), extra[:1], CONFIG)
    assert alone.evictions == ()


def test_pack_and_spread_choose_different_gpus() -> None:
    snapshot = _cluster(("big", "n0", 70.0), ("part", "n1", 20.0))
    request = ModelFootprint("small", 2 * GIB, 32 * 1024, batch_size=8, seq_len_tokens=512)
    spread = place_model(request, snapshot, [], CONFIG)
    pack = place_model(request, snapshot, [], replace(CONFIG, strategy=PlacementStrategy.PACK))
    assert spread.gpu_uuids == ("big",)  # most free memory after: best score
    assert pack.gpu_uuids == ("part",)  # least room left under the watermark: best fit


@pytest.mark.parametrize(
    ("knob", "value"),
    [("scale_out_unmet_share", 1.5), ("max_replicas_per_model", 0), ("max_replica_share", 1.5)],
)
def test_a_bad_scale_knob_names_its_key(knob: str, value: float) -> None:
    with pytest.raises(ValueError, match=knob):
        PlacementConfig(**{knob: value})  # type: ignore[arg-type]


def test_strategy_is_validated_by_name() -> None:
    assert PlacementConfig(strategy="pack").strategy is PlacementStrategy.PACK  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="strategy"):
        PlacementConfig(strategy="tetris")  # type: ignore[arg-type]
    assert PlacementConfig.from_dict(PlacementConfig().to_dict()) == PlacementConfig()
