"""Fuzz against the real broker: 1,000 malformed messages mixed into valid traffic.

Every valid message is folded, every bad one lands in the dead-letter topic with a reason and
its origin, the counts are exact, and the worker is still running afterwards.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from flexpipe import envelope
from flexpipe.config import DeploymentConfig, FlexPipeConfig
from flexpipe.topics import Topic, topic_name
from streams.audit import read_topics
from streams.harness import wait_for
from tests.streams.builders import (
    T0_MS,
    cluster_envelopes,
    env,
    heartbeats,
    make_launches,
    make_load,
    make_sample,
)
from tests.streams.feed import TOPIC_OF, Feeder, key_of, start_worker, worker_config

pytestmark = pytest.mark.integration

NUM_BAD = 1000
ROUNDS = 60
Mutation = Callable[[random.Random], tuple[Topic, bytes | None, bytes | None]]


def _valid_sample(rng: random.Random) -> bytes:
    return envelope.encode(env(make_sample(f"gpu-{rng.randrange(9)}"), T0_MS, "fuzz", 1))


def _mutations() -> list[Mutation]:
    def sample_dict(rng: random.Random) -> dict[str, object]:
        out: dict[str, object] = orjson.loads(_valid_sample(rng))
        return out

    def edit(change: Callable[[dict[str, object]], object]) -> Mutation:
        def mutate(rng: random.Random) -> tuple[Topic, bytes | None, bytes | None]:
            d = sample_dict(rng)
            change(d)
            return Topic.GPU, b"gpu-0", orjson.dumps(d)

        return mutate

    def payload(d: dict[str, object]) -> dict[str, object]:
        p = d["payload"]
        assert isinstance(p, dict)
        return p

    far_future = round(time.time() * 1000) + 86_400_000
    return [
        lambda rng: (Topic.GPU, b"gpu-0", rng.randbytes(rng.randint(1, 200))),
        lambda rng: (Topic.CLUSTER, b"n", _valid_sample(rng)[: rng.randint(1, 100)]),
        lambda rng: (Topic.GPU, b"gpu-0", None),  # tombstone
        lambda rng: (Topic.LAUNCHES, b"gpu-0", b"[" * 5000 + b"]" * 5000),
        lambda rng: (
            Topic.GPU,
            b"gpu-0",
            b'{"v":1,"kind":"gpu.sample","payload":{"name":"\xff\xfe"}}',
        ),
        lambda rng: (Topic.GPU, b"gpu-0", b'{"v":1,"kind":"gpu.sample","event_time_ms":NaN}'),
        edit(lambda d: d.update(v=2)),
        edit(lambda d: d.update(kind="gpu.telepathy")),
        edit(lambda d: d.pop("seq")),
        edit(lambda d: payload(d).update(memory_total_bytes="80GB")),
        edit(lambda d: payload(d).pop("gpu_uuid")),
        edit(lambda d: payload(d).update(surprise=1)),
        edit(lambda d: d.update(event_time_ms=far_future)),
        # Valid envelopes that do not belong: wrong key, wrong topic, unknown deployment.
        lambda rng: (Topic.GPU, b"someone-else", _valid_sample(rng)),
        lambda rng: (Topic.SERVING, b"gpu-0", _valid_sample(rng)),
        lambda rng: (Topic.SERVING, b"ghost", envelope.encode(env(make_load("ghost")))),
    ]


def _valid_traffic() -> list[tuple[Topic, bytes, bytes]]:
    envs = list(cluster_envelopes())
    for r in range(1, ROUNDS + 1):
        t = T0_MS + 1000 * r
        envs += heartbeats(t, 1000 * r)
        envs.append(env(make_launches("GPU-A-node-a1-0", 50 + r), t, "node-a1/ebpf", r))
        envs.append(env(make_load("chat", arrivals=r), t, "runtime-1", r))
    return [(TOPIC_OF[e.kind], key_of(e), envelope.encode(e)) for e in envs]


async def test_malformed_messages_are_dead_lettered_and_valid_ones_all_folded(
    kafka_cfg: FlexPipeConfig, tmp_path: Path
) -> None:
    deployments = (DeploymentConfig(name="chat", model="llama-2-7b", block="A", tp=2),)
    cfg = worker_config(kafka_cfg, deployments)
    rng = random.Random(20250106)
    mutations = _mutations()
    bad = [rng.choice(mutations)(rng) for _ in range(NUM_BAD)]
    valid = _valid_traffic()
    # Interleave at random, keeping the valid messages in their order.
    stream: list[tuple[bool, tuple[Topic, bytes | None, bytes | None]]] = [(True, v) for v in valid]
    for b in bad:
        stream.insert(rng.randrange(len(stream) + 1), (False, b))

    worker = start_worker(cfg, tmp_path, "fuzz")
    try:
        sent_bad: set[tuple[str, int, int]] = set()
        async with Feeder(cfg) as feeder:
            # NOTE: the worker creates its topics; publish once they exist.
            await asyncio.to_thread(wait_for, lambda: bool(worker.metrics()), 60, "the worker")
            pending = []
            for is_valid, (topic, key, value) in stream:
                fut = await feeder.producer.send(topic_name(cfg, topic), value, key=key)
                pending.append((is_valid, topic, fut))
            for is_valid, topic, fut in pending:
                meta = await fut
                if not is_valid:
                    sent_bad.add((topic_name(cfg, topic), meta.partition, meta.offset))

        def counts() -> tuple[float, float]:
            m = worker.metrics()
            folded = sum(v for k, v in m.items() if k.startswith("flexpipe_streams_events_total"))
            dead = sum(
                v for k, v in m.items() if k.startswith("flexpipe_streams_dead_letters_total")
            )
            return folded, dead

        await asyncio.to_thread(
            wait_for, lambda: counts() == (len(valid), NUM_BAD), 90, f"counts {counts()}"
        )
        records = [r for _, r in await read_topics(cfg, [topic_name(cfg, Topic.DEADLETTER)])]
        assert worker.alive
        await asyncio.to_thread(worker.wait_ready, 30)  # still deciding, not just alive
    finally:
        worker.stop()
    assert worker.proc is not None and worker.proc.returncode == 0, worker.log_tail()
    letters = [orjson.loads(r.value) for r in records]
    assert len(letters) == NUM_BAD
    assert all(letter["reason"] and letter["detail"] is not None for letter in letters)
    assert {(d["topic"], d["partition"], d["offset"]) for d in letters} == sent_bad
    reasons = {d["reason"] for d in letters}
    assert {"not_json", "empty", "invalid_field", "key_mismatch", "wrong_topic"} <= reasons
    assert {
        "unsupported_version",
        "unknown_kind",
        "future_event_time",
        "unknown_deployment",
    } <= reasons
