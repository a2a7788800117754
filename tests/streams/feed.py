"""Integration helpers: publish envelopes to their topics, read topics back, configure workers."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaProducer

from flexpipe import envelope
from flexpipe.config import DeploymentConfig, FlexPipeConfig
from flexpipe.envelope import Envelope
from flexpipe.kafka import make_producer
from flexpipe.schemas import ClusterEvent, ClusterEventType, GearDecision, Kind
from flexpipe.topics import Topic, topic_name
from gearbox.decisions import Trigger
from streams.audit import read_topics
from streams.harness import WorkerProcess
from streams.readers import partition_for
from streams.step import TRIGGER_RANK
from tests.streams.builders import SMALL_CLUSTER, T0_MS, cluster_envelopes, env, heartbeats

TOPIC_OF: dict[Kind, Topic] = {
    Kind.GPU_SAMPLE: Topic.GPU,
    Kind.KERNEL_LAUNCHES: Topic.LAUNCHES,
    Kind.SERVING_LOAD: Topic.SERVING,
    Kind.CLUSTER_EVENT: Topic.CLUSTER,
    Kind.GEAR_TRANSITION: Topic.TRANSITIONS,
    Kind.CONTROL_COMMAND: Topic.CONTROL,
}


def key_of(e: Envelope[Any]) -> bytes:
    """The entity key a well-behaved producer uses."""
    p = e.payload
    for attr in ("gpu_uuid", "deployment", "node"):
        if hasattr(p, attr):
            return str(getattr(p, attr)).encode()
    raise ValueError(f"no key for {type(p).__name__}")


def worker_config(
    cfg: FlexPipeConfig, deployments: tuple[DeploymentConfig, ...], **streams: Any
) -> FlexPipeConfig:
    """``cfg`` (the test's broker and topic prefix) with ``deployments`` and a stream section
    for subprocess workers."""
    section = cfg.streams.model_copy(
        update={
            "warmup_s": 0.0,
            "session_timeout_s": 6.0,
            "loglevel": "info",
            **streams,
        }
    )
    intervals = cfg.intervals.model_copy(update={"decision_s": 10.0})
    return cfg.model_copy(
        update={"streams": section, "intervals": intervals, "deployments": deployments}
    )


def deployments_on_every_partition(
    num_partitions: int, per_partition: int = 1
) -> tuple[DeploymentConfig, ...]:
    """7B deployments named so that each partition owns ``per_partition`` of them."""
    names: list[str] = []
    counts = [0] * num_partitions
    i = 0
    while any(c < per_partition for c in counts):
        name = f"dep-{i}"
        p = partition_for(name, num_partitions)
        if counts[p] < per_partition:
            counts[p] += 1
            names.append(name)
        i += 1
    # NOTE: single-GPU hints on block B leave block A to the planner: every decision is cheap.
    return tuple(
        DeploymentConfig(name=n, model="llama-2-7b", block="B", tp=1, arrival_rps=1.0)
        for n in names
    )


class Feeder:
    """Publishes envelopes to the topics their kind belongs on."""

    def __init__(self, cfg: FlexPipeConfig) -> None:
        self.cfg = cfg
        self.producer: AIOKafkaProducer = make_producer(cfg, linger_ms=2)
        self.seq = 10_000

    async def __aenter__(self) -> Feeder:
        await self.producer.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.producer.stop()

    async def publish(self, envs: Iterable[Envelope[Any]]) -> None:
        """Send and wait for every acknowledgement."""
        futures = [
            await self.producer.send(
                topic_name(self.cfg, TOPIC_OF[e.kind]), envelope.encode(e), key=key_of(e)
            )
            for e in envs
        ]
        await asyncio.gather(*futures)

    async def send_raw(
        self, topic: Topic, key: bytes | None, value: bytes | None
    ) -> tuple[int, int]:
        """Send one raw message; returns its (partition, offset)."""
        meta = await (await self.producer.send(topic_name(self.cfg, topic), value, key=key))
        return meta.partition, meta.offset

    async def cluster(self, t_ms: int = T0_MS) -> None:
        """The small cluster's NODE_UPs and first samples."""
        await self.publish(cluster_envelopes(t_ms))

    async def beat(self, t_ms: int) -> None:
        """One heartbeat sample per GPU."""
        self.seq += 100
        await self.publish(heartbeats(t_ms, self.seq))

    async def topology(self, t_ms: int, preempt: bool) -> None:
        """Preempt (or release) the last B node's GPUs: a topology change for every deployment."""
        node = SMALL_CLUSTER[-1][3]
        gpus = tuple(f"GPU-B-{node}-{i}" for i in range(2))
        kind = ClusterEventType.PREEMPT if preempt else ClusterEventType.RELEASE
        self.seq += 1
        await self.publish([env(ClusterEvent(kind, node, gpus), t_ms, "scheduler/test", self.seq)])

    async def run(
        self, stop: asyncio.Event, t_ms: int, step_ms: int = 3000, period_s: float = 0.2
    ) -> int:
        """Heartbeats advancing event time by ``step_ms`` every ``period_s`` wall seconds, with a
        topology change every tenth round, until ``stop``; returns the last event time."""
        rounds = 0
        while not stop.is_set():
            t_ms += step_ms
            await self.beat(t_ms)
            if rounds % 10 == 9:
                await self.topology(t_ms, preempt=(rounds // 10) % 2 == 0)
            rounds += 1
            await asyncio.sleep(period_s)
        return t_ms


async def decisions(cfg: FlexPipeConfig) -> list[tuple[Envelope[GearDecision], Any]]:
    """Every decision on the decisions topic, with its record."""
    out = []
    for _, rec in await read_topics(cfg, [topic_name(cfg, Topic.DECISIONS)]):
        e = envelope.decode(rec.value)
        assert isinstance(e.payload, GearDecision)
        out.append((e, rec))
    return out


def assert_ids_unique_and_contiguous(
    decided: list[tuple[Envelope[GearDecision], Any]],
) -> dict[str, list[int]]:
    """No decision id twice; each deployment's sequence numbers are 1..n; triggers move on."""
    ids = [e.payload.decision_id for e, _ in decided]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    assert not duplicates, f"decision ids published twice: {duplicates}"
    seqs: dict[str, list[int]] = {}
    triggers: dict[str, list[tuple[int, int]]] = {}
    for e, _ in sorted(decided, key=lambda d: d[0].payload.seq):
        seqs.setdefault(e.payload.deployment, []).append(e.payload.seq)
        rank = TRIGGER_RANK[Trigger(e.payload.trigger)]
        triggers.setdefault(e.payload.deployment, []).append((e.event_time_ms, rank))
    for name, ss in seqs.items():
        assert ss == list(range(1, len(ss) + 1)), f"{name}: sequence numbers {ss}"
        ts = triggers[name]
        assert ts == sorted(set(ts)), f"{name}: a trigger was decided twice: {ts}"
    return seqs


def start_worker(cfg: FlexPipeConfig, tmp: Path, name: str) -> WorkerProcess:
    """A subprocess worker (not yet ready)."""
    return WorkerProcess(cfg, tmp, name).start()
