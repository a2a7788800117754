"""Agent cost: CPU per 1,000 GPU samples and the publisher's maximum rate, on the real broker.

``python -m bench.agent`` runs the agent's own code path with the **NVML backend**
(``probes.nvml.NvmlSampler``: NVML calls → sample → delta filter → envelope → bounded publisher →
idempotent acks=all producer) over an 8-GPU node and measures this process's CPU time. Which
``pynvml`` it ran against is printed (``nvml_backend``):

* ``fake`` (default): the fake ``pynvml`` of the probe tests (``tests/probes/fakes``), the real
  module's structures and error classes without a driver. Its calls cost the fake's Python, not a
  driver's; with ``--call-costs FILE`` each call also busy-waits the time that call took on a real
  GPU (``fake+recorded-costs``), so the figure includes the driver's cost.
* ``real`` (``--nvml real``, on a GPU machine): the installed ``pynvml`` and the node's GPUs;
  ``--record-call-costs FILE`` writes each NVML function's median call time there, for the fake.

Launch counting (eBPF) is not included: it needs a kernel with BPF and root. The baseline in the
same run publishes the same envelopes one ``send_and_wait`` at a time, as a naive agent would; the
ratio shows what batching buys. ``calibration_ms`` times a fixed pure-Python workload
(:mod:`bench.calibrate`). Goals: ≤ 50 ms CPU per 1,000 samples; ≥ 20,000 events/s; the exit
status is 1 naming a missed goal.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from bench.calibrate import calibration_ms
from bench.common import bench_broker, print_result
from flexpipe import envelope
from flexpipe.config import FlexPipeConfig
from flexpipe.kafka import create_topics, make_producer, running
from flexpipe.topics import Topic, topic_name
from probes.agent import Agent, AgentClock, AgentMetrics
from probes.delta import DeltaFilter
from probes.nvml import NvmlSampler
from probes.publisher import BufferedPublisher, PublisherMetrics
from sim.cluster import SimCluster, SimGpuSampler
from sim.scenario import SEED_FRAGMENTED, load_scenario

NUM_SAMPLES = 40_000
NUM_PUBLISH = 200_000
NUM_NAIVE = 3_000
NODE_GPUS = 8


class Costed:
    """A ``pynvml``-like module whose functions busy-wait their recorded real-GPU call time."""

    def __init__(self, module: Any, costs_s: dict[str, float]) -> None:
        self._module = module
        self._costs = costs_s

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        cost = self._costs.get(name)
        if cost is None or not callable(value):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            end = time.perf_counter() + cost
            out = value(*args, **kwargs)
            while time.perf_counter() < end:  # NOTE: a driver call holds the CPU, not a sleep
                pass
            return out

        return call


class Timed:
    """A ``pynvml``-like module recording each function's call times (``--record-call-costs``)."""

    def __init__(self, module: Any) -> None:
        self._module = module
        self.times: dict[str, list[float]] = defaultdict(list)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        if not (name.startswith("nvml") and callable(value)):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return value(*args, **kwargs)
            finally:
                self.times[name].append(time.perf_counter() - start)

        return call

    def medians(self) -> dict[str, float]:
        """Median seconds per call, by function."""
        return {name: statistics.median(t) for name, t in sorted(self.times.items())}


def nvml_module(kind: str, costs: Path | None) -> tuple[Any, str]:
    """The ``pynvml`` to sample through, and its name for the result."""
    if kind == "real":
        return importlib.import_module("pynvml"), "real"
    from tests.probes.fakes.pynvml_fake import FakeGpu, FakeNvml

    gpus = [FakeGpu(uuid=f"GPU-{i:08d}-0000-0000-0000-000000000000") for i in range(NODE_GPUS)]
    fake = FakeNvml(gpus)
    if costs is None:
        return fake, "fake"
    return Costed(fake, json.loads(costs.read_text())), "fake+recorded-costs"


async def cpu_per_1000_samples(cfg: FlexPipeConfig, nvml: Any, record: Path | None = None) -> float:
    """Process CPU ms per 1,000 samples sampled, encoded and acknowledged by the broker."""
    registry = CollectorRegistry()
    publisher = BufferedPublisher(lambda: make_producer(cfg), PublisherMetrics(registry))
    t = [0.0]
    clock = AgentClock(lambda: t[0], 0.0, 1_700_000_000_000)
    timed = Timed(nvml) if record is not None else None
    sampler = NvmlSampler("node-a1", nvml=timed or nvml)
    # a ~0 heartbeat: every sample is published, the worst case for the agent's cost.
    agent = Agent(
        cfg, "node-a1", sampler, None, publisher,
        AgentMetrics(registry), clock, DeltaFilter(heartbeat_s=1e-9),
    )  # fmt: skip
    stop = asyncio.Event()
    sender = asyncio.create_task(publisher.run(stop))
    cpu0 = time.process_time()
    rounds = 0
    while publisher.published + len(publisher) < NUM_SAMPLES:
        t[0] += 1.0
        agent.sample_once()
        rounds += 1
        if rounds % 50 == 0:
            await asyncio.sleep(0)  # let the sender run, as the agent's loop does between ticks
    stop.set()
    await sender
    cpu_s = time.process_time() - cpu0
    sampler.close()
    if timed is not None and record is not None:
        record.write_text(json.dumps(timed.medians(), indent=1, sort_keys=True))
    return cpu_s * 1000 / (publisher.published / 1000)


def _payloads(n: int) -> list[bytes]:
    scenario = load_scenario(SEED_FRAGMENTED)
    sampler = SimGpuSampler(SimCluster(scenario, seed=2), "node-a1")
    out: list[bytes] = []
    t = 0.0
    while len(out) < n:
        t += 1.0
        for s in sampler.sample(t):
            out.append(
                envelope.encode(
                    envelope.make(s, event_time_ms=int(t * 1000), source="b", seq=len(out))
                )
            )
    return out[:n]


async def max_publish_per_s(cfg: FlexPipeConfig, payloads: list[bytes]) -> float:
    """Events/s through the bounded publisher (batched, idempotent, acks=all)."""
    topic = topic_name(cfg, Topic.GPU)
    publisher = BufferedPublisher(
        lambda: make_producer(cfg), PublisherMetrics(CollectorRegistry()), max_buffer=len(payloads)
    )
    keys = [f"GPU-{i % 1000}".encode() for i in range(len(payloads))]
    stop = asyncio.Event()
    t0 = time.perf_counter()
    for key, raw in zip(keys, payloads, strict=True):
        publisher.put(topic, key, raw)
    stop.set()
    await publisher.run(stop)
    return publisher.published / (time.perf_counter() - t0)


async def naive_publish_per_s(cfg: FlexPipeConfig, payloads: list[bytes]) -> float:
    """Baseline: one send_and_wait per event (no linger, so it is not penalised by batching)."""
    topic = topic_name(cfg, Topic.GPU)
    producer = make_producer(cfg, linger_ms=0)
    async with running(producer):
        t0 = time.perf_counter()
        for i, raw in enumerate(payloads):
            await producer.send_and_wait(topic, raw, key=f"GPU-{i % 1000}".encode())
        return len(payloads) / (time.perf_counter() - t0)


async def main_async(cfg: FlexPipeConfig, args: argparse.Namespace) -> dict[str, Any]:
    """Both measurements and the baseline, as the result's fields."""
    await create_topics(cfg)
    nvml, backend = nvml_module(args.nvml, args.call_costs)
    cpu_ms = await cpu_per_1000_samples(cfg, nvml, args.record_call_costs)
    payloads = _payloads(NUM_PUBLISH)
    naive = await naive_publish_per_s(cfg, payloads[:NUM_NAIVE])
    ours = await max_publish_per_s(cfg, payloads)
    return {
        "nvml_backend": backend,
        "cpu_ms_per_1000_samples": round(cpu_ms, 2),
        "max_publish_per_s": round(ours),
        "naive_publish_per_s": round(naive),
        "publish_speedup_vs_naive": round(ours / naive, 1),
        "goal_cpu_ms_per_1000_samples": 50,
        "goal_publish_per_s": 20_000,
        "calibration_ms": calibration_ms(),
    }


def main() -> int:
    """Run the benchmark and print the table and the JSON line; 1 when a goal was missed."""
    parser = argparse.ArgumentParser(prog="python -m bench.agent", description=__doc__)
    parser.add_argument("--nvml", choices=("fake", "real"), default="fake")
    parser.add_argument("--call-costs", type=Path, help="recorded call costs for the fake")
    parser.add_argument("--record-call-costs", type=Path, help="write each call's median time")
    args = parser.parse_args()
    with bench_broker("agent") as cfg:
        result = asyncio.run(main_async(cfg, args))
    print(f"NVML backend                : {result['nvml_backend']}")
    print(f"agent CPU per 1,000 samples : {result['cpu_ms_per_1000_samples']:8.1f} ms (goal ≤ 50)")
    print(
        f"publisher max rate          : {result['max_publish_per_s']:8d} events/s (goal ≥ 20,000)"
    )
    print(f"naive send_and_wait baseline: {result['naive_publish_per_s']:8d} events/s "
          f"({result['publish_speedup_vs_naive']}× slower)")  # fmt: skip
    missed = []
    if result["cpu_ms_per_1000_samples"] > result["goal_cpu_ms_per_1000_samples"]:
        missed.append(f"cpu_ms_per_1000_samples {result['cpu_ms_per_1000_samples']} > 50")
    if result["max_publish_per_s"] < result["goal_publish_per_s"]:
        missed.append(f"max_publish_per_s {result['max_publish_per_s']} < 20000")
    result["missed"] = missed
    for miss in missed:
        print(f"bench.agent: missed: {miss}", file=sys.stderr)
    print_result(result)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
