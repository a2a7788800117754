"""The simulated cluster: timeline semantics, NVML/eBPF-shaped output, determinism."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from flexpipe import envelope
from flexpipe.errors import ValidationError
from flexpipe.schemas import INTER_DOMAIN_ID, ClusterEventType, GpuSample
from probes.base import GpuSampler, LaunchCounter
from sim.cluster import Origin, SimCluster, SimGpuSampler, SimLaunchCounter
from sim.scenario import load_scenario, parse_scenario
from sim.spec import Scenario
from tests.fixtures.scenarios.builders import tiny, tiny_raw

pytestmark = pytest.mark.unit

A1 = [f"GPU-sim-A-node-a1-{i}" for i in range(4)]
A2 = [f"GPU-sim-A-node-a2-{i}" for i in range(4)]


def make_cluster(*timeline: dict[str, Any], seed: int = 7) -> SimCluster:
    """The tiny cluster (chat at tp4 on node-a1) with the given timeline."""
    return SimCluster(tiny(*timeline), seed)


def by_uuid(samples: list[GpuSample]) -> dict[str, GpuSample]:
    return {s.gpu_uuid: s for s in samples}


def test_backends_satisfy_the_agent_protocols() -> None:
    cluster = make_cluster()
    sampler: GpuSampler = SimGpuSampler(cluster, "node-a1")
    counter: LaunchCounter = SimLaunchCounter(cluster, "node-a1")
    assert (sampler.name, counter.name) == ("sim", "sim")
    sampler.close()
    sampler.close()  # idempotent
    counter.close()
    with pytest.raises(ValidationError):
        SimGpuSampler(cluster, "node-zz")


def test_startup_reports_nodes_with_domains_and_isolated_gpus() -> None:
    cluster = make_cluster()
    events = cluster.advance_to(0.0)
    ups = [te.event for te in events if te.event.type is ClusterEventType.NODE_UP]
    assert [e.node for e in ups] == ["node-a1", "node-a2", "node-c1", "node-c2"]
    assert [(d.domain_id, d.link) for d in ups[0].domains] == [
        ("A", "nvlink"),
        (INTER_DOMAIN_ID, "ethernet"),
    ]
    assert ups[0].domains[0].bandwidth_gbps == 900.0
    isolated = [te.event for te in events if te.event.type is ClusterEventType.GPU_ISOLATED]
    assert [(e.node, e.gpu_uuids) for e in isolated] == [("node-c2", ("GPU-sim-C-node-c2-1",))]
    sampler = SimGpuSampler(cluster, "node-c2")
    assert [e.type for e in sampler.poll_events(0.0)] == [
        ClusterEventType.NODE_UP,
        ClusterEventType.GPU_ISOLATED,
    ]
    assert [s.healthy for s in sampler.sample(0.0)] == [True, False]


def test_samples_carry_nvml_fields_consistent_with_load() -> None:
    cluster = make_cluster()
    busy = by_uuid(SimGpuSampler(cluster, "node-a1").sample(1.0))[A1[0]]
    idle = by_uuid(SimGpuSampler(cluster, "node-a2").sample(1.0))[A2[0]]
    assert busy.name == "sim big" and busy.gpu_class == "big" and busy.domain == "A"
    assert busy.index == 0 and busy.mig_mode is False and busy.nvlink_active_links == 18
    assert busy.memory_used_bytes + busy.memory_free_bytes + (busy.memory_reserved_bytes or 0) == (
        busy.memory_total_bytes
    )
    assert (
        len(busy.processes) == 1 and busy.processes[0].used_memory_bytes == busy.memory_used_bytes
    )
    # 7B bf16 weights over tp4 are ~3.5 GB per GPU, plus KV, context and workspace
    assert busy.memory_used_bytes > 3.5e9
    assert (busy.sm_util_pct or 0) > 5 and (busy.power_w or 0) > (idle.power_w or 0)
    assert (idle.sm_util_pct, idle.memory_used_bytes, idle.processes) == (0.0, 0, ())
    # every sample is a valid payload on the wire
    env = envelope.make(busy, event_time_ms=1, source="node-a1/sim", seq=1)
    assert envelope.decode(envelope.encode(env)).payload == busy


def test_preemption_takes_gpus_until_release() -> None:
    cluster = make_cluster(
        {"t_s": 100, "type": "preempt", "domain": "A", "gpus": ["node-a1:2", "node-a2:0"]},
        {"t_s": 200, "type": "release", "domain": "A", "preemption": "preempt-0"},
    )
    sampler = SimGpuSampler(cluster, "node-a1")
    before = by_uuid(sampler.sample(99.0))
    assert cluster.is_schedulable(A1[2]) and cluster.is_schedulable(A2[0])
    events = cluster.advance_to(100.0)
    assert [(te.event.type, te.event.node, te.event.gpu_uuids) for te in events] == [
        (ClusterEventType.PREEMPT, "node-a1", (A1[2],)),
        (ClusterEventType.PREEMPT, "node-a2", (A2[0],)),
    ]
    assert {te.origin for te in events} == {Origin.AGENT}
    assert not cluster.is_schedulable(A1[2]) and not cluster.is_schedulable(A2[0])
    assert cluster.reservations() == {"preempt-0": (A1[2], A2[0])}
    during = by_uuid(sampler.sample(101.0))
    taken = during[A1[2]]
    assert taken.processes[0].pid != before[A1[2]].processes[0].pid  # the tenant's job
    assert cluster.processes(A1[2]) == (taken.processes[0].pid,)
    assert taken.memory_used_bytes > 0.9 * taken.memory_total_bytes
    assert (taken.sm_util_pct or 0) >= 90
    # the rest of the tp4 replica stalls: weights stay resident, no work
    assert during[A1[0]].sm_util_pct == 0.0 and during[A1[0]].memory_used_bytes > 3e9
    cluster.advance_to(200.0)
    assert cluster.is_schedulable(A1[2]) and cluster.reservations() == {}
    after = by_uuid(sampler.sample(201.0))
    assert after[A1[2]].processes[0].pid not in {
        before[A1[2]].processes[0].pid,
        taken.processes[0].pid,
    }  # the worker restarted
    assert (after[A1[0]].sm_util_pct or 0) > 5


def test_count_preemption_picks_by_seed_and_release_frees_oldest_first() -> None:
    timeline = (
        {"t_s": 10, "type": "preempt", "domain": "A", "count": 3, "id": "first"},
        {"t_s": 20, "type": "preempt", "domain": "A", "count": 2, "id": "second"},
        {"t_s": 30, "type": "release", "domain": "A", "count": 4},
    )
    picks = {}
    for seed in range(6):
        cluster = make_cluster(*timeline, seed=seed)
        cluster.advance_to(20.0)
        picks[seed] = cluster.reservations()
        assert len(picks[seed]["first"]) == 3 and len(picks[seed]["second"]) == 2
        assert not set(picks[seed]["first"]) & set(picks[seed]["second"])
        cluster.advance_to(30.0)
        assert cluster.reservations() == {"second": picks[seed]["second"][1:]}
    assert len({tuple(p["first"]) for p in picks.values()}) > 1  # the seed decides
    again = make_cluster(*timeline, seed=3)
    again.advance_to(20.0)
    assert again.reservations() == picks[3]


def test_node_failure_stops_samples_until_recovery() -> None:
    cluster = make_cluster(
        {"t_s": 50, "type": "node_failure", "node": "node-a1"},
        {"t_s": 80, "type": "node_recovery", "node": "node-a1"},
    )
    sampler, counter = SimGpuSampler(cluster, "node-a1"), SimLaunchCounter(cluster, "node-a1")
    sampler.poll_events(0.0)
    counter.drain(49.0)
    assert len(sampler.sample(49.0)) == 4 and counter.drain(49.5)
    down = cluster.advance_to(50.0)
    assert [(te.origin, te.event.type) for te in down] == [
        (Origin.SCHEDULER, ClusterEventType.NODE_DOWN)
    ]
    assert sampler.sample(51.0) == [] and counter.drain(51.0) == []
    assert sampler.poll_events(51.0) == []  # a dead agent says nothing
    assert cluster.schedulable_gpus("A") == tuple(A2)
    assert [e.type for e in sampler.poll_events(80.0)] == [ClusterEventType.NODE_UP]
    assert len(sampler.sample(81.0)) == 4 and cluster.is_node_up("node-a1")


def test_xids_mark_samples_and_fatal_ones_make_the_gpu_unhealthy() -> None:
    cluster = make_cluster(
        {"t_s": 10, "type": "xid", "gpu": "node-c1:0", "code": 13},
        {"t_s": 20, "type": "xid", "gpu": "node-c1:0", "code": 48},
        {"t_s": 30, "type": "xid", "gpu": "node-c1:1", "code": 79},
        {"t_s": 40, "type": "restore", "gpu": "node-c1:0"},
    )
    sampler = SimGpuSampler(cluster, "node-c1")
    sampler.poll_events(0.0)
    first = sampler.sample(10.0)[0]
    assert first.xid_errors == (13,) and first.healthy
    assert sampler.sample(11.0)[0].xid_errors == ()  # recoverable: reported once
    events = sampler.poll_events(30.0)
    assert [(e.type, e.xid) for e in events] == [
        (ClusterEventType.XID, 13),
        (ClusterEventType.XID, 48),
        (ClusterEventType.XID, 79),
    ]
    dbe, off_bus = sampler.sample(31.0)
    assert (dbe.healthy, dbe.xid_errors, dbe.ecc_uncorrected) == (False, (48,), 1)
    assert (off_bus.healthy, off_bus.sm_util_pct, off_bus.power_w) == (False, None, None)
    assert not cluster.is_schedulable(off_bus.gpu_uuid)
    assert [e.type for e in sampler.poll_events(40.0)] == [ClusterEventType.GPU_RESTORED]
    assert sampler.sample(41.0)[0].healthy


def test_isolation_and_link_change_are_reported() -> None:
    cluster = make_cluster(
        {"t_s": 5, "type": "isolate", "gpu": "node-a2:1", "reason": "flaky NVLink port"},
        {"t_s": 6, "type": "link", "domain": "A", "bandwidth_gbps": 300},
    )
    sampler = SimGpuSampler(cluster, "node-a2")
    sampler.poll_events(0.0)
    isolated, link = sampler.poll_events(6.0)
    assert isolated.type is ClusterEventType.GPU_ISOLATED and isolated.detail == "flaky NVLink port"
    assert link.type is ClusterEventType.LINK and link.domains[0].bandwidth_gbps == 300
    assert not cluster.is_schedulable(A2[1])


def test_launch_counts_follow_load_and_tenants() -> None:
    cluster = make_cluster({"t_s": 10, "type": "preempt", "domain": "A", "gpus": ["node-a2:3"]})
    a1, a2 = SimLaunchCounter(cluster, "node-a1"), SimLaunchCounter(cluster, "node-a2")
    assert a1.drain(0.0) == [] and a2.drain(0.0) == []  # probe attach
    counts = a1.drain(1.0)
    assert [c.gpu_uuid for c in counts] == A1
    worker = counts[0].processes[0]
    assert worker.comm == "sim-chat" and worker.graph_launches > 0
    assert counts[0].interval_s == 1.0 and counts[0].launches == worker.launches > 0
    assert worker.mem_alloc_bytes > 0 and worker.mem_alloc_bytes % (2 * 2**20) == 0
    assert a2.drain(1.0) == []  # idle GPUs launch nothing
    a2.drain(10.0)
    (tenant,) = a2.drain(10.2)
    assert tenant.gpu_uuid == A2[3] and tenant.processes[0].comm == "sim-tenant-job"
    assert tenant.launches_per_s == pytest.approx(3500, rel=0.1)


def test_place_moves_a_deployment() -> None:
    cluster = make_cluster()
    cluster.place("chat", [A2])
    assert cluster.placement("chat") == (tuple(A2),)
    assert all(cluster.processes(u) for u in A2) and not any(cluster.processes(u) for u in A1)
    assert (by_uuid(SimGpuSampler(cluster, "node-a2").sample(1.0))[A2[0]].sm_util_pct or 0) > 5
    with pytest.raises(ValidationError):
        cluster.place("chat", [["GPU-nope"]])
    with pytest.raises(ValidationError):
        cluster.place("nope", [A2])


def _trace(scenario: Scenario, seed: int) -> list[object]:
    cluster = SimCluster(scenario, seed)
    sampler, counter = SimGpuSampler(cluster, "node-a1"), SimLaunchCounter(cluster, "node-a1")
    out: list[object] = []
    for t in range(0, 120, 3):
        out.extend(sampler.sample(float(t)))
        out.extend(counter.drain(float(t)))
        out.extend(sampler.poll_events(float(t)))
    return out


def test_same_seed_same_numbers_other_seed_other_numbers() -> None:
    scenario = tiny({"t_s": 60, "type": "preempt", "domain": "A", "count": 2})
    assert _trace(scenario, 1) == _trace(scenario, 1)
    assert _trace(scenario, 1) != _trace(scenario, 2)


def test_a_preallocating_engine_reports_its_gpus_full_before_they_are_busy() -> None:
    raw = tiny_raw()
    raw["deployments"]["chat"]["memory_utilisation"] = 0.9
    held = SimCluster(parse_scenario(raw, source="tiny"), 7)
    plain = make_cluster()
    for cluster, least, most in ((held, 0.9, 1.0), (plain, 0.0, 0.9)):
        samples = by_uuid(SimGpuSampler(cluster, "node-a1").sample(0.0))
        used = [samples[u].memory_used_bytes / samples[u].memory_total_bytes for u in A1]
        assert all(least <= share < most for share in used), used
    with pytest.raises(ValidationError, match="memory_utilisation"):
        raw["deployments"]["chat"]["memory_utilisation"] = 1.5
        parse_scenario(raw, source="tiny")


def test_on_demand_models_sharing_a_gpu_each_show_in_its_memory_and_processes() -> None:
    fixture = Path(__file__).parents[1] / "fixtures" / "scenarios" / "on-demand-small.yaml"
    cluster = SimCluster(load_scenario(fixture), seed=7)
    node = cluster.scenario.nodes[0]
    uuid = node.gpus[0].uuid
    sampler = SimGpuSampler(cluster, node.name)
    cluster.place("m1", [[uuid]])
    alone = by_uuid(sampler.sample(1.0))[uuid]
    cluster.place("m2", [[uuid]])
    shared = by_uuid(sampler.sample(2.0))[uuid]
    assert len(alone.processes) == 1 and len(shared.processes) == 2
    assert shared.memory_used_bytes == sum(p.used_memory_bytes or 0 for p in shared.processes)
    assert shared.memory_used_bytes >= 2 * alone.memory_used_bytes * 0.99  # both models' memory
    cluster.place("m1", [])  # an eviction frees that model's process and memory only
    after = by_uuid(sampler.sample(3.0))[uuid]
    assert [p.pid for p in after.processes] == [shared.processes[1].pid]
