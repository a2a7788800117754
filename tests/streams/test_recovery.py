"""Crash and rebalance, with real subprocess workers against the real broker.

* kill -9 mid-run, restart: the tables come back from their changelogs and no decision id (and
  no trigger) appears twice on the decisions topic; every deployment's sequence stays 1..n.
* two workers share the deployments (each decided by one worker); one leaves; the other takes
  over without a duplicate or a gap.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from flexpipe.config import FlexPipeConfig
from flexpipe.envelope import Envelope
from flexpipe.schemas import GearDecision, PlanSource
from streams.harness import wait_for
from tests.streams.builders import T0_MS
from tests.streams.feed import (
    Feeder,
    assert_ids_unique_and_contiguous,
    decisions,
    deployments_on_every_partition,
    start_worker,
    worker_config,
)

pytestmark = pytest.mark.e2e


def _decided(worker_metrics: dict[str, float]) -> float:
    return sum(
        v for k, v in worker_metrics.items() if k.startswith("flexpipe_streams_decisions_total")
    )


async def test_kill_9_then_restart_recovers_tables_and_never_duplicates_a_decision(
    kafka_cfg: FlexPipeConfig, tmp_path: Path
) -> None:
    cfg = worker_config(kafka_cfg, deployments_on_every_partition(kafka_cfg.topics.partitions))
    first = start_worker(cfg, tmp_path, "w1")
    stop = asyncio.Event()
    try:
        async with Feeder(cfg) as feeder:
            await asyncio.to_thread(wait_for, lambda: bool(first.metrics()), 60, "worker w1")
            await feeder.cluster()
            feeding = asyncio.create_task(feeder.run(stop, T0_MS))
            await asyncio.to_thread(
                wait_for, lambda: _decided(first.metrics()) >= 12, 60, "decisions from w1"
            )
            first.kill()  # mid-run: decisions, table writes and telemetry all in flight
            stop.set()
            t_ms = await feeding
            second = start_worker(cfg, tmp_path, "w2")
            try:
                # Tables are back from their changelogs before any new event arrives.
                def recovered() -> bool:
                    m = second.metrics()
                    return all(
                        m.get(f'flexpipe_streams_table_keys{{table="{t}"}}', 0) > 0
                        for t in ("gpus", "nodes", "plans", "cursors", "gear_state")
                    )

                await asyncio.to_thread(wait_for, recovered, 90, "w2's tables to recover")
                stop.clear()
                feeding = asyncio.create_task(feeder.run(stop, t_ms))
                await asyncio.to_thread(
                    wait_for, lambda: _decided(second.metrics()) >= 12, 90, "decisions from w2"
                )
                stop.set()
                await feeding
            finally:
                second.stop()
    finally:
        stop.set()
        first.kill()
    decided = await decisions(cfg)
    seqs = assert_ids_unique_and_contiguous(decided)
    assert len(seqs) == len(cfg.deployments)
    sources = [e.source for e, _ in decided]
    assert "streams/w1" in sources and "streams/w2" in sources
    # The restarted worker carried on from the recovered plans rather than starting afresh.
    after = [e for e, _ in decided if e.source == "streams/w2"]
    assert all(e.payload.context.plan_source is not PlanSource.NONE for e in after)


async def test_two_workers_share_deployments_and_survive_one_leaving(
    kafka_cfg: FlexPipeConfig, tmp_path: Path
) -> None:
    cfg = worker_config(kafka_cfg, deployments_on_every_partition(kafka_cfg.topics.partitions))
    a = start_worker(cfg, tmp_path, "wa")
    b = start_worker(cfg, tmp_path, "wb")
    stop = asyncio.Event()
    try:
        async with Feeder(cfg) as feeder:
            await asyncio.to_thread(
                wait_for, lambda: bool(a.metrics()) and bool(b.metrics()), 60, "both workers"
            )
            await feeder.cluster()
            feeding = asyncio.create_task(feeder.run(stop, T0_MS))
            await asyncio.to_thread(
                wait_for,
                lambda: _decided(a.metrics()) >= 4 and _decided(b.metrics()) >= 4,
                90,
                "decisions from both workers",
            )
            # Both counts can pass 4 while one worker still holds every partition (the other's
            # first decisions came before the joining rebalance): wait until, after the later
            # worker's first decision, both have decided on the topic.
            deadline = time.monotonic() + 90
            while True:
                shared = await decisions(cfg)
                if {s for o in _owners_once_settled(shared).values() for s in o} == set(SOURCES):
                    break
                owners = _owners_once_settled(shared)
                assert time.monotonic() < deadline, f"not both deciding after rebalance: {owners}"
                await asyncio.sleep(0.5)
            b.stop()  # a clean leave: the group rebalances and wa takes every partition
            left_ms = round(time.time() * 1000)
            await asyncio.to_thread(
                wait_for,
                lambda: _decided(a.metrics()) >= _decided_before(shared, "streams/wa") + 12,
                90,
                "wa to take over",
            )
            stop.set()
            await feeding
    finally:
        stop.set()
        a.stop()
        b.stop()
    decided = await decisions(cfg)
    assert_ids_unique_and_contiguous(decided)
    owners = _owners_once_settled(shared)
    assert all(len(o) == 1 for o in owners.values()), f"a deployment had two deciders: {owners}"
    late = {e.payload.deployment for e, r in decided if r.timestamp > left_ms}
    assert {e.source for e, r in decided if r.timestamp > left_ms} == {"streams/wa"}
    assert late == {d.name for d in cfg.deployments}


SOURCES = ("streams/wa", "streams/wb")


def _owners_once_settled(
    shared: list[tuple[Envelope[GearDecision], Any]],
) -> dict[str, set[str]]:
    """Who decided each deployment from the later worker's first decision on.

    A worker that joins late takes partitions over from the first, so ownership is judged once
    both had decided, i.e. after the joining rebalance settled.
    """
    firsts = [min((r.timestamp for e, r in shared if e.source == s), default=None) for s in SOURCES]
    if None in firsts:
        return {}
    settled_ms = max(t for t in firsts if t is not None)
    owners: dict[str, set[str]] = {}
    for e, r in shared:
        if r.timestamp >= settled_ms:
            owners.setdefault(e.payload.deployment, set()).add(e.source)
    return owners


def _decided_before(shared: list[tuple[Envelope[GearDecision], Any]], source: str) -> float:
    return float(sum(1 for e, _ in shared if e.source == source))
