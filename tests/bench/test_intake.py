"""bench.intake folds what bench.pipeline sends, through the worker's own processor."""

from __future__ import annotations

import asyncio

import pytest

from bench.intake import ROUNDS_PER_S, fold_all, make_processor, messages
from streams.ports import TableName

pytestmark = pytest.mark.unit


def _run(num_gpus: int, rounds: int) -> tuple[float, dict[TableName, dict[bytes, bytes]]]:
    engine, tables = make_processor(2)
    asyncio.run(fold_all(engine, messages(num_gpus, rounds)))
    folded = sum(
        engine.metrics.events.labels(kind)._value.get()
        for kind in ("gpu.sample", "kernel.launches")
    )
    return folded, dict(tables.data)


def test_every_sample_and_launch_report_folds_and_lands_in_the_tables() -> None:
    folded, data = _run(16, 2 * ROUNDS_PER_S)
    assert folded == 16 * 2 * ROUNDS_PER_S
    assert len(data[TableName.GPUS]) == 16 and len(data[TableName.GPU_LOAD]) == 16


def test_same_input_same_table_bytes() -> None:
    assert _run(16, ROUNDS_PER_S)[1] == _run(16, ROUNDS_PER_S)[1]
