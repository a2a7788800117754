"""Integration (subprocess): ``kill -9`` the runtime worker inside each phase, restart it.

The worker holds the second transition at a pause point inside the phase (test hook
``--pause-in``), carrying live sequences; the test kills it with SIGKILL, starts a fresh process
and checks: exactly one plan serves, every sequence the ownership journal held is owned exactly
once and then finishes (none lost, none doubled), and the transitions log is consistent.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from flexpipe.config import FlexPipeConfig
from flexpipe.schemas import TransitionPhase
from flexpipe.topics import Topic
from tests.runtime.builders import DEPLOYMENT, make_decision, make_plan, make_replica
from tests.runtime.kafka_helpers import journal_unfinished, publish, transitions, wait_for
from tests.runtime.logcheck import validate_log
from tests.runtime.worker_process import WorkerProcess

pytestmark = pytest.mark.integration

NUM_SEQUENCES = 10
OLD = make_plan(make_replica(["GPU-A0"]))
NEW = make_plan(make_replica(["GPU-B0"], domain="B", gpu_class="a100-80g", link="rdma"))


@contextlib.asynccontextmanager
async def running(cfg: FlexPipeConfig, *extra: str) -> AsyncIterator[WorkerProcess]:
    worker = WorkerProcess(cfg, *extra)
    try:
        await worker.ready()
        yield worker
    finally:
        worker.stop()


async def _status(session: aiohttp.ClientSession, url: str, ownership: bool = False) -> Any:
    query = "?ownership=1" if ownership else ""
    async with session.get(f"{url}/status{query}") as resp:
        return (await resp.json())["deployments"][DEPLOYMENT]


async def _fire(session: aiohttp.ClientSession, url: str, i: int) -> None:
    # Long outputs (about 2 wall seconds at 20x) so sequences are still live at the kill.
    body = {"prompt_tokens": 500, "max_tokens": 8000, "request_id": f"crash-{i}"}
    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            await resp.read()


async def _kill_inside(cfg: FlexPipeConfig, phase: TransitionPhase) -> set[str]:
    """Place OLD, load it, shift towards NEW, SIGKILL the worker held inside ``phase``.

    Returns the sequences the ownership journal holds as in flight after the kill.
    """
    first = WorkerProcess(cfg, "--pause-in", str(phase), "--pause-from-seq", "2")
    background: list[asyncio.Task[None]] = []
    try:
        url = await first.ready()
        async with aiohttp.ClientSession() as session:
            await publish(cfg, Topic.DECISIONS, make_decision(1, OLD), DEPLOYMENT)

            async def placed() -> bool:
                st = await _status(session, url)
                return bool(st["serving_plan_id"] == OLD.plan_id and st["transition"] is None)

            await wait_for(placed, 30, "first plan serving")
            background = [asyncio.create_task(_fire(session, url, i)) for i in range(NUM_SEQUENCES)]

            async def journaled() -> bool:
                return len(await journal_unfinished(cfg, DEPLOYMENT)) == NUM_SEQUENCES

            await wait_for(journaled, 30, "sequences journaled")
            decision = make_decision(2, NEW, from_plan_id=OLD.plan_id)
            await publish(cfg, Topic.DECISIONS, decision, DEPLOYMENT)

            async def held() -> bool:
                st = await _status(session, url)
                return bool(st["executor"].get("paused") and st["transition"]["phase"] == phase)

            await wait_for(held, 30, f"worker held in {phase}")
            first.kill9()
    finally:
        first.stop()
        for task in background:
            task.cancel()
    return {r.request_id for r in await journal_unfinished(cfg, DEPLOYMENT)}


@pytest.mark.parametrize(
    "phase", [TransitionPhase.PREPARE, TransitionPhase.SWITCH, TransitionPhase.CLEANUP]
)
async def test_kill_9_inside_a_phase_then_restart(
    kafka_cfg: FlexPipeConfig, phase: TransitionPhase
) -> None:
    cfg = kafka_cfg
    in_flight = await _kill_inside(cfg, phase)
    assert in_flight, "the killed worker carried live sequences"
    expected = NEW if phase is TransitionPhase.CLEANUP else OLD
    async with running(cfg) as second, aiohttp.ClientSession() as session:
        st = await _status(session, second.url, ownership=True)
        assert st["serving_plan_id"] == expected.plan_id  # exactly one plan in the route table
        assert st["invariant_violations"] == []
        still = {r.request_id for r in await journal_unfinished(cfg, DEPLOYMENT)}
        owned = set(st["ownership"]) | set(st["unplaced"])
        assert in_flight <= owned | (in_flight - still), "a journaled sequence was lost"
        assert set(st["ownership"].values()) <= {r.plan_id for r in expected.replicas}

        async def settled() -> bool:
            return bool((await _status(session, second.url))["transition"] is None)

        await wait_for(settled, 30, "recovered transition settled")
        st = await _status(session, second.url)
        assert st["routable_replicas"] == [r.plan_id for r in expected.replicas]
        assert st["routable_outside_plan"] == []

        async def drained() -> bool:
            return not await journal_unfinished(cfg, DEPLOYMENT)

        await wait_for(drained, 60, "every recovered sequence finished", poll_s=0.3)
    log = await transitions(cfg, DEPLOYMENT)
    assert validate_log(log) == []
    seq2 = [r for r in log if r.transition_seq == 2]
    assert phase in {r.phase for r in seq2}
    assert seq2[-1].phase is (
        TransitionPhase.DONE if phase is TransitionPhase.CLEANUP else TransitionPhase.ROLLED_BACK
    )
