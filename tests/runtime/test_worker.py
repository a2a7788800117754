"""Integration: an in-process runtime worker against the real broker.

Decisions arrive on the decisions topic, every phase lands on the compacted transitions topic,
preemptions arrive as cluster events, serving load goes out, and the HTTP API answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from flexpipe import envelope
from flexpipe.config import FlexPipeConfig
from flexpipe.kafka import partition_for
from flexpipe.schemas import (
    ClusterEvent,
    ClusterEventType,
    ControlAction,
    ControlCommand,
    PhaseStatus,
    ServingLoad,
    TransitionPhase,
)
from flexpipe.topics import Topic, topic_name
from runtime.journal import read_to_end
from runtime.worker import RuntimeWorker
from tests.runtime.builders import DEPLOYMENT, make_decision, make_plan, make_replica
from tests.runtime.kafka_helpers import publish, transition_partitions, transitions, wait_for
from tests.runtime.logcheck import validate_log

pytestmark = pytest.mark.integration

TOKEN = "it-token"
A0 = make_replica(["GPU-A0"])
B0 = make_replica(["GPU-B0"], domain="B", gpu_class="a100-80g", link="rdma")
C0 = make_replica(["GPU-C0"], domain="C", gpu_class="l40s", link="pcie")


def worker_cfg(cfg: FlexPipeConfig, **overrides: Any) -> FlexPipeConfig:
    """The test config with a fast runtime clock and short phases."""
    runtime = cfg.runtime.model_copy(
        update={
            "deployments": (DEPLOYMENT,),
            "http_port": 0,
            "control_token": TOKEN,
            "sim_speed": 20.0,
            "tick_s": 0.01,
            "canary_s": 1.0,
            "retry_backoff_s": 0.5,
            "drain_timeout_s": 10.0,
            "serving_publish_s": 6.0,  # runtime s: 0.3 wall s at 20x
            **overrides,
        }
    )
    return cfg.model_copy(update={"runtime": runtime})


@pytest.fixture
async def worker(kafka_cfg: FlexPipeConfig) -> AsyncIterator[RuntimeWorker]:
    async with RuntimeWorker(worker_cfg(kafka_cfg, canary_s=20.0)) as w:
        yield w


def _status(w: RuntimeWorker) -> dict[str, Any]:
    return w.status()["deployments"][DEPLOYMENT]


async def _place(w: RuntimeWorker, seq: int, plan: Any, from_id: str | None = None) -> None:
    await publish(
        w.cfg, Topic.DECISIONS, make_decision(seq, plan, from_plan_id=from_id), DEPLOYMENT
    )
    await wait_for(
        lambda: _status(w)["serving_plan_id"] == plan.plan_id and _status(w)["transition"] is None,
        30,
        f"plan {plan.plan_id} serving",
    )


async def _complete(session: aiohttp.ClientSession, w: RuntimeWorker, **body: Any) -> Any:
    async with session.post(f"{w.http_url}/v1/completions", json=body) as resp:
        return resp.status, await resp.json()


async def test_decisions_become_persisted_transitions(worker: RuntimeWorker) -> None:
    cfg = worker.cfg
    await _place(worker, 1, make_plan(A0))
    async with aiohttp.ClientSession() as session:
        status, body = await _complete(session, worker, prompt_tokens=400, max_tokens=20)
    assert status == 200 and body["plan_id"] == make_plan(A0).plan_id
    # A stale decision (same sequence) is fenced off; a newer one shifts gear.
    await publish(cfg, Topic.DECISIONS, make_decision(1, make_plan(B0)), DEPLOYMENT)
    await _place(worker, 2, make_plan(B0), make_plan(A0).plan_id)
    log = await transitions(cfg, DEPLOYMENT)
    assert validate_log(log) == []
    assert [r.transition_seq for r in log if r.phase is TransitionPhase.DONE] == [1, 2]
    assert all(r.plan is not None and r.plan.plan_id == r.to_plan_id for r in log)
    # keyed deployment/seq, but in the deployment's partition: its stream worker folds them
    partitions = cfg.topics.partitions
    assert await transition_partitions(cfg) == {DEPLOYMENT: {partition_for(DEPLOYMENT, partitions)}}
    metrics = await _metrics(worker)
    assert 'outcome="ignored_stale"' in metrics
    loads = [
        envelope.decode(v).payload
        for _, v in await read_to_end(cfg, topic_name(cfg, Topic.SERVING))
    ]
    assert any(isinstance(x, ServingLoad) and x.arrivals >= 1 for x in loads)


async def _metrics(w: RuntimeWorker) -> str:
    async with aiohttp.ClientSession() as session, session.get(f"{w.http_url}/metrics") as r:
        return await r.text()


async def test_gpus_preempted_during_switch_roll_back_to_the_old_plan(
    worker: RuntimeWorker,
) -> None:
    cfg = worker.cfg
    old = make_plan(A0)
    await _place(worker, 1, old)
    await publish(
        cfg, Topic.DECISIONS, make_decision(2, make_plan(B0), from_plan_id=old.plan_id), DEPLOYMENT
    )
    await wait_for(
        lambda: (_status(worker)["transition"] or {}).get("phase") == "switch", 30, "switch"
    )
    preempt = ClusterEvent(ClusterEventType.PREEMPT, "node-b1", ("GPU-B0",), detail="tenant")
    await publish(cfg, Topic.CLUSTER, preempt, "node-b1")
    await wait_for(lambda: _status(worker)["transition"] is None, 30, "rollback")
    log = await transitions(cfg, DEPLOYMENT)
    switch = [(r.status, r.attempt) for r in log if r.transition_seq == 2 and r.phase == "switch"]
    assert switch == [
        (PhaseStatus.STARTED, 1),
        (PhaseStatus.FAILED, 1),
        (PhaseStatus.STARTED, 2),
        (PhaseStatus.FAILED, 2),
        (PhaseStatus.STARTED, 3),
        (PhaseStatus.FAILED, 3),
    ]
    assert log[-1].phase is TransitionPhase.ROLLED_BACK and validate_log(log) == []
    assert _status(worker)["serving_plan_id"] == old.plan_id
    async with aiohttp.ClientSession() as session:
        status, body = await _complete(session, worker, prompt_tokens=100, max_tokens=5)
    assert status == 200 and body["replica_id"] == A0.plan_id


async def test_long_prompt_burst_gets_429s_and_no_oom(kafka_cfg: FlexPipeConfig) -> None:
    async with RuntimeWorker(worker_cfg(kafka_cfg)) as w:
        await _place(w, 1, make_plan(C0))  # one 48 GB GPU
        async with aiohttp.ClientSession() as session:
            burst = [
                _complete(session, w, prompt_tokens=12_000, max_tokens=800, request_id=f"l{i}")
                for i in range(40)
            ]
            results = await asyncio.gather(*burst)
            statuses = [s for s, _ in results]
            assert statuses.count(429) > 0 and statuses.count(200) > 0
            reasons = {b["error"]["reason"] for s, b in results if s == 429}
            assert reasons == {"throttled_watermark"}
            status, _ = await _complete(session, w, prompt_tokens=50, max_tokens=5)
            assert status == 200  # still serving
        st = _status(w)
        assert st["sim_oom_events"] == 0 and st["engine_oom_events"] == 0
        assert st["invariant_violations"] == []


async def test_control_endpoint_publishes_on_the_control_topic(worker: RuntimeWorker) -> None:
    cfg = worker.cfg
    async with aiohttp.ClientSession() as session:
        url = f"{worker.http_url}/control/downshift"
        async with session.post(url, json={"reason": "drill"}) as resp:
            assert resp.status == 401
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with session.post(url, json={"reason": "drill"}, headers=headers) as resp:
            assert resp.status == 202
    commands = [
        envelope.decode(v).payload
        for _, v in await read_to_end(cfg, topic_name(cfg, Topic.CONTROL))
    ]
    assert commands == [
        ControlCommand(DEPLOYMENT, ControlAction.EMERGENCY_DOWNSHIFT, None, "http", "drill")
    ]
