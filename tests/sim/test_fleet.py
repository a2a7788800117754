"""The simulated fleet as one envelope stream: order, sources, determinism, pacing."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections import Counter
from typing import Any

import pytest

from flexpipe import envelope
from flexpipe.envelope import Envelope
from flexpipe.schemas import ClusterEventType, Kind, SampleReason
from sim.fleet import SCHEDULER_SOURCE, SimFleet, paced
from sim.scenario import SEED_FRAGMENTED, load_scenario
from tests.fixtures.scenarios.builders import tiny

pytestmark = pytest.mark.unit

TEN_MINUTES_S = 600.0


def encoded(fleet: SimFleet, t0_s: float, t1_s: float) -> bytes:
    return b"\n".join(envelope.encode(env) for env in fleet.events(t0_s, t1_s))


def test_same_seed_gives_a_byte_identical_stream() -> None:
    seed = load_scenario(SEED_FRAGMENTED)
    first = encoded(SimFleet(seed, seed=11), 0.0, TEN_MINUTES_S)
    assert first == encoded(SimFleet(seed, seed=11), 0.0, TEN_MINUTES_S)
    assert first != encoded(SimFleet(seed, seed=12), 0.0, TEN_MINUTES_S)


def test_windows_concatenate_to_the_whole() -> None:
    scenario = tiny({"t_s": 30, "type": "preempt", "domain": "A", "count": 2})
    split = SimFleet(scenario, seed=3)
    parts = encoded(split, 0.0, 45.5) + b"\n" + encoded(split, 45.5, 90.0)
    assert parts == encoded(SimFleet(scenario, seed=3), 0.0, 90.0)
    with pytest.raises(ValueError):
        next(split.events(10.0, 20.0))


def test_a_window_abandoned_midway_is_not_replayed() -> None:
    fleet = SimFleet(tiny(), seed=3)
    window = fleet.events(0.0, 60.0)
    first = next(window)
    with pytest.raises(ValueError):
        next(fleet.events(0.0, 10.0))
    later = list(fleet.events(30.0, 31.0))
    assert later and all(e.event_time_ms >= first.event_time_ms + 30_000 for e in later)


def test_stream_is_ordered_sequenced_and_valid() -> None:
    scenario = tiny(
        {"t_s": 12.5, "type": "xid", "gpu": "node-c1:0", "code": 13},
        {"t_s": 20, "type": "node_failure", "node": "node-a2"},
    )
    envs = list(SimFleet(scenario, seed=1).events(0.0, 40.0))
    times = [e.event_time_ms for e in envs]
    assert times == sorted(times) and times[0] == scenario.epoch_ms
    last_seq: dict[str, int] = {}
    for env in envs:
        assert env.seq > last_seq.get(env.source, 0)
        last_seq[env.source] = env.seq
        assert envelope.decode(envelope.encode(env)) == env  # schema-valid on the wire
    nodes = {f"{n.name}/sim" for n in scenario.nodes}
    assert set(last_seq) == nodes | {SCHEDULER_SOURCE}
    xid = next(e for e in envs if e.kind is Kind.CLUSTER_EVENT and e.payload.type == "xid")
    assert (xid.source, xid.event_time_ms) == ("node-c1/sim", scenario.epoch_ms + 12_500)


def test_node_failure_silences_the_node_and_recovery_restarts_it() -> None:
    scenario = tiny(
        {"t_s": 20, "type": "node_failure", "node": "node-a2"},
        {"t_s": 60, "type": "node_recovery", "node": "node-a2"},
    )
    envs = list(SimFleet(scenario, seed=1).events(0.0, 70.0))
    a2 = [e for e in envs if e.source == "node-a2/sim"]
    silent = [e for e in a2 if 20_000 <= e.event_time_ms - scenario.epoch_ms < 60_000]
    assert silent == []
    (down,) = [e for e in envs if e.source == SCHEDULER_SOURCE]
    assert down.payload.type is ClusterEventType.NODE_DOWN and down.payload.node == "node-a2"
    back = [e for e in a2 if e.event_time_ms - scenario.epoch_ms == 60_000]
    assert back[0].payload.type is ClusterEventType.NODE_UP
    reasons = {e.payload.reason for e in back if e.kind is Kind.GPU_SAMPLE}
    assert reasons == {SampleReason.INITIAL}  # a restarted agent publishes everything


def test_quiet_gpus_heartbeat_every_fifteen_seconds() -> None:
    envs = SimFleet(tiny(), seed=1, launch_interval_s=None).events(0.0, 61.0)
    per_gpu = Counter(e.payload.gpu_uuid for e in envs if e.kind is Kind.GPU_SAMPLE)
    assert len(per_gpu) == 12
    assert all(n >= 5 for n in per_gpu.values())  # t = 0, 15, 30, 45, 60 at least


def test_seed_preemption_appears_at_its_event_time() -> None:
    scenario = load_scenario(SEED_FRAGMENTED)
    fleet = SimFleet(scenario, seed=1, launch_interval_s=None)
    envs = list(fleet.events(7190.0, 7210.0))  # the gap before 7190 s is simulated silently
    preempts = [e for e in envs if e.kind is Kind.CLUSTER_EVENT]
    assert [(e.source, e.payload.type, len(e.payload.gpu_uuids)) for e in preempts] == [
        ("node-a1/sim", ClusterEventType.PREEMPT, 4)
    ]
    assert preempts[0].event_time_ms == scenario.epoch_ms + 7_200_000
    assert not fleet.cluster.is_schedulable("GPU-sim-A-node-a1-4")


class FakeClock:
    """A monotonic clock that only moves when the code under test sleeps."""

    def __init__(self) -> None:
        self.now_s = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now_s

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now_s += seconds


def _at(event_time_ms: int) -> Envelope[Any]:
    return Envelope(kind=Kind.GPU_SAMPLE, event_time_ms=event_time_ms, source="s", seq=1, payload=0)


def test_paced_plays_event_time_at_speed() -> None:
    clock = FakeClock()
    envs = [_at(0), _at(60_000), _at(60_000), _at(180_000)]
    assert list(paced(envs, speed=60, clock=clock, sleep=clock.sleep)) == envs
    assert clock.sleeps == pytest.approx([1.0, 2.0])  # one simulated minute per wall second


def test_paced_does_not_sleep_when_late_or_unbounded() -> None:
    clock = FakeClock()
    late = paced([_at(0), _at(1000)], speed=1, clock=clock, sleep=clock.sleep)
    next(late)
    clock.now_s += 5.0  # the consumer took 5 s
    next(late)
    assert clock.sleeps == []
    list(paced([_at(0), _at(10**9)], speed=math.inf, clock=clock, sleep=clock.sleep))
    assert clock.sleeps == []
    with pytest.raises(ValueError):
        list(paced([_at(0)], speed=0))


_DIGEST_SCRIPT = """
import hashlib
from flexpipe import envelope
from sim.fleet import SimFleet
from sim.scenario import load_scenario
from sim.scenario import SEED_FRAGMENTED
fleet = SimFleet(load_scenario(SEED_FRAGMENTED), seed=5)
digest = hashlib.sha256()
for env in fleet.events(14390.0, 14420.0):
    digest.update(envelope.encode(env))
print(digest.hexdigest())
"""


def test_stream_does_not_depend_on_the_process_hash_seed() -> None:
    # NOTE: string hashing is randomised per process; a stream that used hash() or set order
    # would differ here. The window spans the seed's second preemption, picked by seed.
    digests = set()
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        run = subprocess.run(
            [sys.executable, "-c", _DIGEST_SCRIPT], env=env, capture_output=True, text=True
        )
        assert run.returncode == 0, run.stderr
        digests.add(run.stdout.strip())
    assert len(digests) == 1
