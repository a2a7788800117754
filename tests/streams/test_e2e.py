"""End to end: the simulated seed cluster (time-compressed) → real broker → stream worker.

The first preemption of block A (t = 02:00) must be answered within 40 simulated seconds (the
article's figure) by an explained decision that moves the deployment off the preempted GPUs;
``audit replay`` must reach the same decisions offline and ``audit tail`` must print them.
"""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from flexpipe.config import FlexPipeConfig
from flexpipe.envelope import Envelope
from flexpipe.schemas import ClusterEvent, ClusterEventType
from sim.catalog import with_scenario
from sim.fleet import SimFleet
from sim.scenario import SEED_FRAGMENTED, load_scenario
from streams.audit import replay_topics, tail
from streams.deployments import resolve_deployments
from streams.harness import wait_for
from streams.replay import Replayer
from tests.streams.feed import Feeder, decisions, start_worker, worker_config

pytestmark = pytest.mark.e2e

SPEED = 10.0  # simulated seconds per wall second
PREEMPT_S = 7200.0  # the seed scenario's first preemption (02:00)
WINDOW_S = (PREEMPT_S - 40.0, PREEMPT_S + 60.0)


async def _paced(feeder: Feeder, envs: Iterable[Envelope[Any]], speed: float) -> dict[int, float]:
    """Publish instant by instant at ``speed``; returns wall time per published instant."""
    by_instant: dict[int, list[Envelope[Any]]] = {}
    for e in envs:
        by_instant.setdefault(e.event_time_ms, []).append(e)
    published: dict[int, float] = {}
    start_wall = time.monotonic()
    first = min(by_instant) if by_instant else 0
    for t_ms in sorted(by_instant):
        delay = start_wall + (t_ms - first) / 1000 / speed - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        await feeder.publish(by_instant[t_ms])
        published[t_ms] = time.time()
    return published


async def test_seed_cluster_preemption_is_answered_within_40_simulated_seconds(
    kafka_cfg: FlexPipeConfig, tmp_path: Path
) -> None:
    scenario = load_scenario(SEED_FRAGMENTED)
    cfg = with_scenario(worker_config(kafka_cfg, ()), scenario)
    fleet = SimFleet(scenario, seed=7, sample_interval_s=1.0, launch_interval_s=5.0)
    epoch_ms = scenario.epoch_ms
    worker = start_worker(cfg, tmp_path, "e2e")
    try:
        async with Feeder(cfg) as feeder:
            await asyncio.to_thread(wait_for, lambda: bool(worker.metrics()), 60, "the worker")
            await feeder.publish(fleet.events(0.0, 1.0))  # agents start: NODE_UP, first samples
            window = list(fleet.events(*WINDOW_S))
            preempt = next(e for e in window if _is_preemption(e))
            assert preempt.event_time_ms == epoch_ms + PREEMPT_S * 1000
            published = await _paced(feeder, window, SPEED)

            def answered() -> bool:
                return any(_answer(e, preempt.event_time_ms) for e, _ in _sync_decisions(cfg))

            await asyncio.to_thread(wait_for, answered, 60, "a decision answering the preemption")
        decided = await decisions(cfg)
        out = io.StringIO()
        printed = await tail(cfg, from_beginning=True, limit=len(decided), out=out)
        catalog, deployments = resolve_deployments(cfg)
        report, undecodable = await replay_topics(cfg, Replayer(cfg, catalog, deployments))
    finally:
        worker.stop()

    answer, record = next((e, r) for e, r in decided if _answer(e, preempt.event_time_ms))
    d = answer.payload
    taken = set(preempt.payload.gpu_uuids)
    assert d.decision is not None
    target = set(d.decision.to_plan.gpu_uuids)
    assert d.deployment == "chat-70b" and d.forced and d.reason == "forced_infeasible"
    assert not taken & target, "the new plan still uses preempted GPUs"
    assert "not live" in d.explanation and "preempt on node-a1" in d.explanation
    # Within 40 simulated seconds, by the decision's own clock and by the wall clock × speed.
    decided_at_s = d.context.now_s - epoch_ms / 1000
    assert decided_at_s - PREEMPT_S <= 40.0
    wall_s = record.timestamp / 1000 - published[preempt.event_time_ms]
    assert wall_s * SPEED <= 40.0, f"{wall_s:.2f} wall s × {SPEED} > 40 simulated s"
    # The person's view and the offline replay.
    assert printed == len(decided) and d.decision_id in out.getvalue()
    assert report.same, report
    assert report.compared == len(decided) and undecodable == 0


def _is_preemption(e: Envelope[Any]) -> bool:
    return isinstance(e.payload, ClusterEvent) and e.payload.type is ClusterEventType.PREEMPT


def _answer(e: Envelope[Any], preempt_ms: int) -> bool:
    d = e.payload
    return d.deployment == "chat-70b" and e.event_time_ms >= preempt_ms and d.to_plan_id is not None


def _sync_decisions(cfg: FlexPipeConfig) -> list[tuple[Envelope[Any], Any]]:
    return asyncio.run(decisions(cfg))
