"""`flexpipe audit tail` and `flexpipe audit replay`: the decisions topic for a person.

``tail`` follows the decisions topic and prints each decision with its explanation. ``replay``
reads the recorded telemetry topics and the decisions topic to their current ends, re-decides
every recorded decision offline through the same core (:mod:`streams.replay`) and reports
whether it reaches the same outcomes; the deployments, catalog and gearbox knobs it re-decides
with are the config's (``deployments``, ``catalog``, ``gearbox``), as the worker's were.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import textwrap
import time
from datetime import UTC, datetime
from typing import Any, TextIO

from aiokafka import AIOKafkaConsumer, TopicPartition

from flexpipe import envelope
from flexpipe.config import FlexPipeConfig
from flexpipe.envelope import Envelope
from flexpipe.errors import ValidationError
from flexpipe.kafka import make_consumer
from flexpipe.schemas import GearDecision
from flexpipe.topics import Topic, topic_name
from streams.deployments import resolve_deployments
from streams.replay import Replayer, ReplayReport, compare
from streams.step import LoggedDecision

__all__ = ["format_decision", "read_topics", "replay_topics", "run_audit", "tail"]

INPUT_TOPICS = (
    Topic.GPU,
    Topic.LAUNCHES,
    Topic.SERVING,
    Topic.CLUSTER,
    Topic.TRANSITIONS,
    Topic.CONTROL,
)
WRAP = 100


def _when(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")


def format_decision(env: Envelope[GearDecision]) -> str:
    """A decision as a few lines for a person."""
    d = env.payload
    arrow = f"{d.from_plan_id or '∅'} → {d.to_plan_id}" if d.to_plan_id else "hold"
    forced = " [forced]" if d.forced else ""
    head = f"{_when(env.event_time_ms)}  {d.decision_id}  {d.reason} ({d.trigger}){forced}  {arrow}"
    body = textwrap.fill(d.explanation, WRAP, initial_indent="    ", subsequent_indent="    ")
    return f"{head}\n{body}"


async def _partitions(consumer: AIOKafkaConsumer, topic: str) -> list[TopicPartition]:
    for _ in range(50):
        parts = consumer.partitions_for_topic(topic)
        if parts:
            return [TopicPartition(topic, p) for p in sorted(parts)]
        await consumer._client.force_metadata_update()  # NOTE: no public refresh in aiokafka
        await asyncio.sleep(0.1)
    return []


async def tail(
    cfg: FlexPipeConfig,
    *,
    from_beginning: bool = False,
    deployment: str | None = None,
    limit: int | None = None,
    idle_exit_s: float | None = None,
    out: TextIO = sys.stdout,
    as_json: bool = False,
) -> int:
    """Print decisions as they arrive; returns how many were printed."""
    topic = topic_name(cfg, Topic.DECISIONS)
    consumer = make_consumer(cfg, group_id=None, auto_offset_reset="latest")
    await consumer.start()
    printed = 0
    try:
        tps = await _partitions(consumer, topic)
        consumer.assign(tps)
        if from_beginning:
            await consumer.seek_to_beginning(*tps)
        else:
            await consumer.seek_to_end(*tps)
        last = time.monotonic()
        while limit is None or printed < limit:
            batch = await consumer.getmany(timeout_ms=200)
            records = sorted(
                (r for rs in batch.values() for r in rs), key=lambda r: (r.timestamp, r.offset)
            )
            for rec in records:
                shown = _show(rec.value, deployment, as_json)
                if shown is not None:
                    print(shown, file=out, flush=True)
                    printed += 1
                    last = time.monotonic()
            if idle_exit_s is not None and time.monotonic() - last > idle_exit_s:
                break
    finally:
        await consumer.stop()
    return printed


def _show(raw: bytes | None, deployment: str | None, as_json: bool) -> str | None:
    try:
        env = envelope.decode(raw)
    except ValidationError as exc:
        return f"(unreadable message on the decisions topic: {exc})"
    if not isinstance(env.payload, GearDecision):
        return None
    if deployment is not None and env.payload.deployment != deployment:
        return None
    return (raw or b"").decode() if as_json else format_decision(env)


async def read_topics(cfg: FlexPipeConfig, topics: list[str]) -> list[tuple[str, Any]]:
    """Every record of ``topics`` up to their end offsets now, as (topic, record)."""
    consumer = make_consumer(cfg, group_id=None)
    await consumer.start()
    try:
        tps = [tp for t in topics for tp in await _partitions(consumer, t)]
        if not tps:
            return []
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        end = await consumer.end_offsets(tps)
        out: list[tuple[str, Any]] = []
        pending = {tp for tp, off in end.items() if off > 0}
        while pending:
            batch = await consumer.getmany(timeout_ms=500, max_records=20_000)
            for tp, records in batch.items():
                out += [(tp.topic, r) for r in records if r.offset < end[tp]]
            pending = {tp for tp in pending if await consumer.position(tp) < end[tp]}
        return out
    finally:
        await consumer.stop()


async def replay_topics(cfg: FlexPipeConfig, replayer: Replayer) -> tuple[ReplayReport, int]:
    """Replay the recorded topics; returns the report and how many inputs did not decode."""
    inputs = await read_topics(cfg, [topic_name(cfg, t) for t in INPUT_TOPICS])
    envs: list[tuple[int, int, Envelope[Any]]] = []
    bad = 0
    for i, (_, rec) in enumerate(inputs):
        try:
            env = envelope.decode(rec.value)
        except ValidationError:
            bad += 1
            continue
        envs.append((env.event_time_ms, i, env))
    envs.sort(key=lambda e: (e[0], e[1]))
    recorded: list[LoggedDecision] = []
    for _, rec in await read_topics(cfg, [topic_name(cfg, Topic.DECISIONS)]):
        try:
            env = envelope.decode(rec.value)
        except ValidationError:
            continue
        if isinstance(env.payload, GearDecision):
            recorded.append(LoggedDecision(env.event_time_ms, env.payload))
    return compare(replayer, [e for _, _, e in envs], recorded), bad


def _print_report(report: ReplayReport, bad: int, out: TextIO) -> None:
    verdict = "SAME decisions" if report.same else "DIFFERENT decisions"
    print(
        f"audit replay: {verdict}: {report.matched}/{report.compared} recorded decisions "
        f"reached again ({report.not_replayed} for unknown deployments skipped, "
        f"{bad} undecodable inputs ignored)",
        file=out,
    )
    for m in report.mismatches:
        cause = "same inputs: logic differs" if m.same_inputs else "inputs differ"
        print(f"  {m.decision_id}: recorded {m.recorded}; replay {m.replayed} ({cause})", file=out)


def run_audit(args: argparse.Namespace, cfg: FlexPipeConfig, out: TextIO = sys.stdout) -> int:
    """The `flexpipe audit` subcommand."""
    if args.action == "tail":
        asyncio.run(
            tail(
                cfg,
                from_beginning=args.from_beginning,
                deployment=args.deployment,
                limit=args.limit,
                idle_exit_s=args.idle_exit_s,
                out=out,
                as_json=args.json,
            )
        )
        return 0
    catalog, deployments = resolve_deployments(cfg)
    report, bad = asyncio.run(replay_topics(cfg, Replayer(cfg, catalog, deployments)))
    _print_report(report, bad, out)
    return 0 if report.same else 1
