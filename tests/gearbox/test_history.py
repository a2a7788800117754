"""Fragment history and the stability discount."""

from __future__ import annotations

import pytest

from gearbox import (
    DEFAULT_CONFIG,
    AtomicBlock,
    BlockHistory,
    GearboxConfig,
    GearState,
    record_blocks,
    stability_factor,
)
from gearbox.presets import LINK_CLASSES


def _block(size: int, block_id: str = "blk") -> AtomicBlock:
    uuids = tuple(f"g{i:02d}" for i in range(size))
    return AtomicBlock(block_id, "D", LINK_CLASSES["nvlink"], uuids, ("n",))


def _history(
    sizes: list[int], step_s: float = 60.0, config: GearboxConfig = DEFAULT_CONFIG
) -> BlockHistory:
    history = BlockHistory()
    for i, size in enumerate(sizes):
        history = record_blocks(history, [_block(size)] if size else [], i * step_s, config)
    return history


@pytest.mark.unit
def test_record_appends_and_marks_vanished_blocks() -> None:
    history = _history([8, 8, 0])
    assert [s.num_gpus for s in history.samples("blk")] == [8, 8, 0]


@pytest.mark.unit
def test_window_and_sample_cap() -> None:
    config = GearboxConfig(history_window_s=120.0, max_history_samples=3)
    history = _history([8, 8, 8, 8, 8], config=config)
    assert [s.t_s for s in history.samples("blk")] == [120.0, 180.0, 240.0]


@pytest.mark.unit
def test_stable_and_growing_blocks_are_not_discounted() -> None:
    assert stability_factor(_history([8, 8, 8, 8]), "blk", DEFAULT_CONFIG) == 1.0
    assert stability_factor(_history([4, 6, 8]), "blk", DEFAULT_CONFIG) == 1.0
    assert stability_factor(BlockHistory(), "unknown", DEFAULT_CONFIG) == 1.0


@pytest.mark.unit
def test_one_preemption_is_an_event_not_a_trend() -> None:
    assert stability_factor(_history([12, 12, 12, 6]), "blk", DEFAULT_CONFIG) == 1.0


@pytest.mark.unit
def test_steady_shrink_is_discounted_to_the_projected_share() -> None:
    factor = stability_factor(_history([16, 15, 14, 13, 12]), "blk", DEFAULT_CONFIG)
    # slope −1 GPU per 60 s; over the 300 s horizon 12 → 7, so 7/12 remains
    assert factor == pytest.approx(7 / 12)
    fast = stability_factor(_history([16, 14, 12, 10, 8]), "blk", DEFAULT_CONFIG)
    assert fast == DEFAULT_CONFIG.min_stability_factor


@pytest.mark.unit
def test_gear_state_round_trips() -> None:
    state = GearState(
        blocks=(_block(4),),
        history=_history([8, 7, 6]),
        last_switch_s=12.5,
        last_from_plan_id="dp-a",
        last_to_plan_id="dp-b",
    )
    assert GearState.from_dict(state.to_dict()) == state


@pytest.mark.unit
def test_frequent_decisions_sample_unchanged_blocks_once_per_spacing_and_every_change() -> None:
    config = GearboxConfig(history_window_s=600.0, max_history_samples=10)  # one per 60 s
    history = BlockHistory()
    for i, size in enumerate([8, 8, 8, 7, 7, 8]):  # decisions 5 s apart
        history = record_blocks(history, [_block(size)], i * 5.0, config)
    assert [(s.t_s, s.num_gpus) for s in history.samples("blk")] == [
        (0.0, 8),
        (15.0, 7),
        (25.0, 8),
    ]
    history = record_blocks(history, [_block(8)], 84.0, config)  # 59 s after the last one
    assert len(history.samples("blk")) == 3
    history = record_blocks(history, [_block(8)], 85.0, config)
    assert [s.t_s for s in history.samples("blk")][-1] == 85.0
    # every 5 s for an hour: the cap holds the window's last 10 minutes, not its last 50 s
    for i in range(18, 720):
        history = record_blocks(history, [_block(8)], i * 5.0, config)
    times = [s.t_s for s in history.samples("blk")]
    assert len(times) == 10 and times[-1] - times[0] >= 500.0
