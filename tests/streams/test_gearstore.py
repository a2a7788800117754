"""The gear state's two tables: a small record per write, the same state read back."""

from __future__ import annotations

import random
from dataclasses import replace

import orjson

from gearbox.blocks import AtomicBlock
from gearbox.config import DEFAULT_CONFIG
from gearbox.history import BlockHistory, GearState, record_blocks, record_failed_target
from gearbox.types import LinkClass
from streams import codec
from streams.gearstore import GearRecord, GearStore, HistoryBase
from streams.ports import TableName
from tests.streams.fakes import FakeTables

CONFIG = replace(DEFAULT_CONFIG, max_history_samples=40)
# NOTE: decisions this far apart sample every block (gearbox.history.record_blocks)
STEP_S = CONFIG.history_window_s / CONFIG.max_history_samples


NVLINK = LinkClass("nvlink", 450.0, 2.0)


def _blocks(sizes: dict[str, int]) -> tuple[AtomicBlock, ...]:
    return tuple(
        AtomicBlock(b, "d0", NVLINK, tuple(f"{b}-g{i}" for i in range(n)), ("n0",))
        for b, n in sorted(sizes.items())
        if n
    )


def _steps(n: int, seed: int = 7) -> list[GearState]:
    rng = random.Random(seed)
    sizes = {f"b{i:02d}": 8 for i in range(12)}
    gear = GearState()
    out = []
    for step in range(n):
        for b in list(sizes):
            r = rng.random()
            if r < 0.05:
                sizes[b] = max(0, sizes[b] - 1)
            elif r < 0.07:
                sizes[b] += 1
        if rng.random() < 0.05:
            sizes[f"x{step}"] = 4  # a new block
        blocks = _blocks(sizes)
        history = record_blocks(gear.history, blocks, 1000.0 + step * STEP_S, CONFIG)
        gear = replace(gear, blocks=blocks, history=history)
        if step % 17 == 0:
            gear = record_failed_target(gear, f"plan-{step}", 1000.0 + step * STEP_S, CONFIG)
        out.append(gear)
    return out


def test_every_write_reads_back_the_same_state_and_most_writes_are_small() -> None:
    tables = FakeTables()
    store = GearStore(tables)
    sizes = []
    for gear in _steps(200):
        store.store("chat", gear)
        sizes.append(len(tables.data[TableName.GEAR_STATE][b"chat"]))
        # a restarted worker: a fresh store over the same tables
        assert GearStore(tables).load("chat") == gear
        assert store.load("chat") == gear
    full = len(orjson.dumps(_steps(200)[-1]))  # the whole state, as one value was written
    assert tables.writes[TableName.BLOCK_HISTORY] < 200 / 5
    assert sorted(sizes)[len(sizes) // 2] < full / 2


def test_a_crash_between_the_base_and_its_record_keeps_the_newer_history() -> None:
    tables = FakeTables()
    steps = _steps(80)
    store = GearStore(tables)
    for gear in steps[:-1]:
        store.store("chat", gear)
    record = tables.data[TableName.GEAR_STATE][b"chat"]
    epoch = codec.loads(GearRecord, record).epoch
    newer = HistoryBase(epoch + 1, steps[-1].history)
    tables.set(TableName.BLOCK_HISTORY, b"chat", codec.dumps(newer))
    back = GearStore(tables).load("chat")
    assert back is not None
    assert back.history == steps[-1].history and back.blocks == steps[-2].blocks


def test_absent_and_empty() -> None:
    tables = FakeTables()
    assert GearStore(tables).load("chat") is None
    GearStore(tables).store("chat", GearState())
    assert GearStore(tables).load("chat") == GearState()
    assert codec.loads(GearRecord, tables.data[TableName.GEAR_STATE][b"chat"]).state.history == (
        BlockHistory()
    )
