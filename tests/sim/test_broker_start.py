"""Integration: a job cancelled while its local broker starts leaves no broker behind."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import pytest

from flexpipe.config import load_config
from flexpipe.kafka_local import LocalKafka
from sim.run import dedicated_broker

pytestmark = pytest.mark.integration


async def test_cancel_during_the_start_stops_the_broker_once_it_is_up() -> None:
    # SIGTERM and Ctrl-C reach `flexpipe up` as a cancellation; one that arrived while the broker
    # started in its thread used to leave that broker running with nobody to stop it.
    cfg = load_config(env={})
    name = f"test-cancel-{uuid.uuid4().hex[:8]}"
    local = LocalKafka(cfg.local_kafka, name=name)

    async def job() -> None:
        async with dedicated_broker(cfg, name):
            raise AssertionError("cancelled before the broker was up: never reached")

    task = asyncio.create_task(job())
    deadline = time.monotonic() + 60
    while local.status().pid is None:  # the broker process exists, its start not yet returned
        assert time.monotonic() < deadline, "the broker never began to start"
        await asyncio.sleep(0.05)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(task, 120)
    assert task.cancelled()
    assert not local.status().running, "the cancelled job left its broker running"
