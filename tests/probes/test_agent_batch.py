"""The agent's per-node batching: one message per node per round, carrying what per-GPU
messages would have carried."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from flexpipe import envelope
from flexpipe.config import load_config
from flexpipe.schemas import GpuSample, KernelLaunches, NodeSamples
from flexpipe.topics import Topic, topic_name
from probes.agent import Agent, AgentClock, AgentMetrics
from probes.delta import DeltaFilter
from probes.publisher import BufferedPublisher, PublisherMetrics
from sim.cluster import SimCluster, SimGpuSampler, SimLaunchCounter
from sim.scenario import SEED_FRAGMENTED, load_scenario

pytestmark = pytest.mark.unit
NODE = "node-a1"


def _agent(batch: bool) -> tuple[Agent, BufferedPublisher, list[float]]:
    cfg = load_config()
    scenario = load_scenario(SEED_FRAGMENTED)
    cluster = SimCluster(scenario, seed=3)
    registry = CollectorRegistry()

    def no_broker() -> object:
        raise AssertionError("the test never sends")

    publisher = BufferedPublisher(no_broker, PublisherMetrics(registry))  # type: ignore[arg-type]
    t = [10.0]
    clock = AgentClock(lambda: t[0], 0.0, scenario.epoch_ms)
    agent = Agent(
        cfg, NODE, SimGpuSampler(cluster, NODE), SimLaunchCounter(cluster, NODE), publisher,
        AgentMetrics(registry), clock, DeltaFilter(heartbeat_s=15.0), batch_per_node=batch,
    )  # fmt: skip
    return agent, publisher, t


def _queued(publisher: BufferedPublisher) -> list[tuple[str, bytes, object]]:
    out = []
    while len(publisher):
        item = publisher._buffer.popleft()
        out.append((item.topic, item.key, envelope.decode(item.value).payload))
    return out


def test_a_sample_round_is_one_node_message_with_every_gpu_sample() -> None:
    per_gpu, per_gpu_publisher, _ = _agent(batch=False)
    batched, batched_publisher, _ = _agent(batch=True)
    per_gpu.sample_once()
    batched.sample_once()
    singles = [p for _, _, p in _queued(per_gpu_publisher) if isinstance(p, GpuSample)]
    batches = [q for q in _queued(batched_publisher) if isinstance(q[2], NodeSamples)]
    [(topic, key, payload)] = batches  # cluster events (if any) go out as before
    cfg = load_config()
    assert (topic, key) == (topic_name(cfg, Topic.NODE), NODE.encode())
    assert isinstance(payload, NodeSamples)
    assert len(singles) >= 2
    assert payload.samples == tuple(singles)


def test_nothing_changed_nothing_sent_and_launch_drains_batch_too() -> None:
    agent, publisher, t = _agent(batch=True)
    agent.sample_once()
    _queued(publisher)
    t[0] += 1.0  # within the heartbeat, nothing moved: no message at all
    agent.sample_once()
    assert [p for _, _, p in _queued(publisher) if isinstance(p, NodeSamples)] == []
    t[0] += 1.0
    agent.drain_launches()
    queued = _queued(publisher)
    assert len(queued) <= 1
    for _, _, payload in queued:
        assert isinstance(payload, NodeSamples) and payload.samples == ()
        assert all(isinstance(item, KernelLaunches) for item in payload.launches)
