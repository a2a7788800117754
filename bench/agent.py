"""Agent cost: CPU per 1,000 GPU samples and the publisher's maximum rate, on the real broker.

``python -m bench.agent`` runs the simulated backend through the agent's own code path (sample →
delta filter → envelope → bounded publisher → idempotent acks=all producer) and measures this
process's CPU time. The baseline in the same run publishes the same envelopes one
``send_and_wait`` at a time, as a naive agent would; the ratio shows what batching buys.
Goals: ≤ 50 ms CPU per 1,000 samples; ≥ 20,000 events/s.
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry

from bench.common import bench_broker, print_result
from flexpipe import envelope
from flexpipe.config import FlexPipeConfig
from flexpipe.kafka import create_topics, make_producer, running
from flexpipe.topics import Topic, topic_name
from probes.agent import Agent, AgentClock, AgentMetrics
from probes.delta import DeltaFilter
from probes.publisher import BufferedPublisher, PublisherMetrics
from sim.cluster import SimCluster, SimGpuSampler
from sim.scenario import SEED_FRAGMENTED, load_scenario

NUM_SAMPLES = 40_000
NUM_PUBLISH = 200_000
NUM_NAIVE = 3_000


async def cpu_per_1000_samples(cfg: FlexPipeConfig) -> float:
    """Process CPU ms per 1,000 samples sampled, encoded and acknowledged by the broker."""
    scenario = load_scenario(SEED_FRAGMENTED)
    cluster = SimCluster(scenario, seed=1)
    registry = CollectorRegistry()
    publisher = BufferedPublisher(lambda: make_producer(cfg), PublisherMetrics(registry))
    t = [0.0]
    clock = AgentClock(lambda: t[0], 0.0, scenario.epoch_ms)
    # a ~0 heartbeat: every sample is published, the worst case for the agent's cost.
    agent = Agent(
        cfg, "node-a1", SimGpuSampler(cluster, "node-a1"), None, publisher,
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


async def main_async(cfg: FlexPipeConfig) -> dict[str, float]:
    await create_topics(cfg)
    cpu_ms = await cpu_per_1000_samples(cfg)
    payloads = _payloads(NUM_PUBLISH)
    naive = await naive_publish_per_s(cfg, payloads[:NUM_NAIVE])
    ours = await max_publish_per_s(cfg, payloads)
    return {
        "cpu_ms_per_1000_samples": round(cpu_ms, 2),
        "max_publish_per_s": round(ours),
        "naive_publish_per_s": round(naive),
        "publish_speedup_vs_naive": round(ours / naive, 1),
        "goal_cpu_ms_per_1000_samples": 50,
        "goal_publish_per_s": 20_000,
    }


def main() -> None:
    """Run the benchmark and print the table and the JSON line."""
    with bench_broker("agent") as cfg:
        result = asyncio.run(main_async(cfg))
    print(f"agent CPU per 1,000 samples : {result['cpu_ms_per_1000_samples']:8.1f} ms (goal ≤ 50)")
    print(
        f"publisher max rate          : {result['max_publish_per_s']:8d} events/s (goal ≥ 20,000)"
    )
    print(f"naive send_and_wait baseline: {result['naive_publish_per_s']:8d} events/s "
          f"({result['publish_speedup_vs_naive']}× slower)")  # fmt: skip
    print_result(result)


if __name__ == "__main__":
    main()
