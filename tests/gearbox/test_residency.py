"""On-demand residency: load a requested cold model, evict the least recently used cold one."""

from __future__ import annotations

import math

import pytest

from gearbox.config import PlacementConfig
from gearbox.decisions import DecisionReason
from gearbox.placement import ModelFootprint
from gearbox.presets import GIB, LINK_CLASSES
from gearbox.residency import (
    OnDemandModel,
    Residency,
    ResidencyAction,
    decide_residency,
)
from gearbox.types import TopologySnapshot
from tests.gearbox.builders import NOW_S, make_gpu

CONFIG = PlacementConfig(cold_after_s=60.0, max_models_per_gpu=1)
SMALL = ModelFootprint("small", 10 * GIB, 64 * 1024, batch_size=8, seq_len_tokens=1024)
BIG = ModelFootprint("big", 60 * GIB, 128 * 1024, batch_size=8, seq_len_tokens=1024)


def _snapshot(held: dict[str, str], *gpus: tuple[str, str, str]) -> TopologySnapshot:
    """GPUs as (uuid, node, class); a GPU some model holds shows no free memory, as the step's
    claims show it."""
    out = tuple(
        make_gpu(uuid, node=node, gpu_class=cls, free_fraction=0.0 if uuid in held else 1.0)
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
        arrival_rps=0.0,
        reload_s=2.0,
        **kw,  # type: ignore[arg-type]
    )


def _resident(name: str, gpu: str, idle_s: float, **kw: object) -> OnDemandModel:
    return _model(name, state=Residency.RESIDENT, gpu=gpu, idle_s=idle_s, **kw)  # type: ignore[arg-type]


TWO_GPUS = (("g0", "n0", "l40s"), ("g1", "n1", "l40s"))


@pytest.mark.unit
def test_a_requested_cold_model_loads_on_a_free_gpu_with_its_explanation() -> None:
    models = [_model("m", queued=3), _resident("r", "g0", idle_s=5.0)]
    verdict = decide_residency("m", models, _snapshot({"g0": "r"}, *TWO_GPUS), CONFIG)
    assert verdict.action is ResidencyAction.LOAD and verdict.gpu_uuids == ("g1",)
    assert verdict.reason is DecisionReason.LOAD_ON_DEMAND
    assert "3 requests wait" in verdict.explanation and "g1" in verdict.explanation


@pytest.mark.unit
def test_a_cold_model_nobody_asks_for_stays_cold() -> None:
    verdict = decide_residency("m", [_model("m")], _snapshot({}, *TWO_GPUS), CONFIG)
    assert verdict.action is ResidencyAction.HOLD and verdict.reason is DecisionReason.COLD


@pytest.mark.unit
def test_the_least_recently_used_idle_model_is_evicted_for_a_waiting_one() -> None:
    held = {"g0": "old", "g1": "recent"}
    models = [
        _model("m", queued=2),
        _resident("old", "g0", idle_s=600.0),
        _resident("recent", "g1", idle_s=120.0),
    ]
    snap = _snapshot(held, *TWO_GPUS)
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
    verdict = decide_residency("r", models, _snapshot({"g0": "r"}, TWO_GPUS[0]), CONFIG)
    assert verdict.action is ResidencyAction.HOLD
    waiting = decide_residency("m", models, _snapshot({"g0": "r"}, TWO_GPUS[0]), CONFIG)
    assert waiting.reason is DecisionReason.WAITING_FOR_ROOM and waiting.placement is not None
    assert waiting.placement.evictions == ()


@pytest.mark.unit
def test_a_model_idle_less_than_cold_after_is_kept() -> None:
    models = [_model("m", queued=2), _resident("r", "g0", idle_s=30.0)]
    verdict = decide_residency("r", models, _snapshot({"g0": "r"}, TWO_GPUS[0]), CONFIG)
    assert verdict.action is ResidencyAction.HOLD and verdict.reason is DecisionReason.RESIDENT


@pytest.mark.unit
def test_two_waiting_models_never_take_the_same_gpu_in_one_round() -> None:
    models = [_model("a", queued=5), _model("b", queued=1)]
    snap = _snapshot({}, TWO_GPUS[0])
    first = decide_residency("a", models, snap, CONFIG)
    second = decide_residency("b", models, snap, CONFIG)
    assert first.action is ResidencyAction.LOAD and second.action is ResidencyAction.HOLD


@pytest.mark.unit
def test_a_big_model_goes_first_and_a_small_one_packs_onto_the_small_gpu() -> None:
    gpus = (("big-gpu", "n0", "h100-sxm"), ("small-gpu", "n1", "l40s"))
    models = [_model("tiny", queued=9), _model("huge", BIG, queued=1)]
    snap = _snapshot({}, *gpus)
    assert decide_residency("huge", models, snap, CONFIG).gpu_uuids == ("big-gpu",)
    assert decide_residency("tiny", models, snap, CONFIG).gpu_uuids == ("small-gpu",)


@pytest.mark.unit
def test_pin_and_anti_affinity_restrict_the_gpus_and_affinity_prefers_a_node() -> None:
    gpus = (("g0", "n0", "l40s"), ("g0b", "n0", "l40s"), ("g1", "n1", "l40s"))
    peer = _resident("peer", "g0", idle_s=1.0)
    snap = _snapshot({"g0": "peer"}, *gpus)
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
    snap4 = _snapshot({"g0": "peer", "g2b": "peer2"}, *gpus4)
    assert decide_residency("m", [free, peer, peer2], snap4, CONFIG).gpu_uuids == ("g0b",)
    assert decide_residency("m", [near, peer, peer2], snap4, CONFIG).gpu_uuids == ("g2",)


@pytest.mark.unit
def test_a_model_in_transition_holds() -> None:
    loading = _model("m", state=Residency.LOADING, gpu="g0", queued=4)
    verdict = decide_residency("m", [loading], _snapshot({"g0": "m"}, *TWO_GPUS), CONFIG)
    assert verdict.action is ResidencyAction.HOLD
    assert verdict.reason is DecisionReason.TRANSITION_IN_FLIGHT
