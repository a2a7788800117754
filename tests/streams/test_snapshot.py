"""Snapshots from folded state: schedulability, links, load fallback; hint plans on them."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import orjson
import pytest

from flexpipe.schemas import ClusterEventType, DomainInfo
from gearbox.blocks import build_blocks
from gearbox.config import DEFAULT_CONFIG
from gearbox.presets import MODEL_7B_MHA
from gearbox.starting import PlanHint, natural_key, starting_plan
from gearbox.types import TopologySnapshot
from streams.catalog import default_catalog
from streams.deployments import Deployment
from streams.load import ServingWindows, fold_serving, serving_aggregate
from streams.snapshot import (
    LoadSource,
    NominalLoad,
    TopologyBuilder,
    build_load,
    build_topology,
    snapshot_digest,
)
from streams.state import GpuState, NodeState, fold_cluster_event, fold_gpu_sample
from streams.windows import HoppingWindow
from tests.streams.builders import T0_MS, cluster_envelopes, gpu_uuid, make_event, make_load

pytestmark = pytest.mark.unit

CATALOG = default_catalog()
NOW_S = T0_MS / 1000


def folded() -> tuple[dict[str, GpuState], dict[str, NodeState]]:
    gpus: dict[str, GpuState] = {}
    nodes: dict[str, NodeState] = {}
    for e in cluster_envelopes():
        p = e.payload
        if hasattr(p, "gpu_uuid"):
            state, _ = fold_gpu_sample(gpus.get(p.gpu_uuid), p, e.source, e.seq, e.event_time_ms)
            assert state is not None
            gpus[p.gpu_uuid] = state
        else:
            nodes[p.node], _ = fold_cluster_event(
                nodes.get(p.node), p, e.source, e.seq, e.event_time_ms
            )
    return gpus, nodes


def topology(gpus: dict[str, GpuState], nodes: dict[str, NodeState]) -> TopologySnapshot:
    return build_topology(gpus, nodes, CATALOG, NOW_S, 45.0)


def live(snap: TopologySnapshot) -> set[str]:
    return {g.uuid for g in snap.gpus if snap.gpu_is_live(g)}


def test_all_gpus_live_with_their_domain_links() -> None:
    snap = topology(*folded())
    assert len(live(snap)) == 12
    assert snap.domain_link("A").name == "nvlink" and snap.domain_link("B").name == "rdma"
    assert (
        snap.inter_domain_link.name == "ethernet" and snap.inter_domain_link.bandwidth_gbps == 12.5
    )


def test_reservation_isolation_failure_down_and_timeout_take_gpus_out() -> None:
    gpus, nodes = folded()
    a = [gpu_uuid("A", "node-a1", i) for i in range(4)]
    E = ClusterEventType
    nodes["node-a1"], _ = fold_cluster_event(
        nodes["node-a1"], make_event(E.PREEMPT, "node-a1", (a[0],)), "s", 100, 0
    )
    nodes["node-a1"], _ = fold_cluster_event(
        nodes["node-a1"], make_event(E.GPU_ISOLATED, "node-a1", (a[1],)), "s", 101, 0
    )
    nodes["node-a1"], _ = fold_cluster_event(
        nodes["node-a1"], make_event(E.XID, "node-a1", (a[2],), xid=48), "s", 102, 0
    )
    gpus[a[3]] = replace(gpus[a[3]], timed_out=True)
    nodes["node-b1"], _ = fold_cluster_event(
        nodes["node-b1"], make_event(E.NODE_DOWN, "node-b1"), "s", 103, 0
    )
    snap = topology(gpus, nodes)
    assert live(snap).isdisjoint(a)
    assert not any(
        u in live(snap) for u in (gpu_uuid("B", "node-b1", 0), gpu_uuid("B", "node-b1", 1))
    )
    assert len(live(snap)) == 12 - 4 - 2


def test_slowest_report_wins_and_unknown_class_gets_a_stand_in() -> None:
    gpus, nodes = folded()
    slow = make_event(ClusterEventType.LINK, "node-a2", domains=(DomainInfo("A", "nvlink", 50.0),))
    nodes["node-a2"], _ = fold_cluster_event(nodes["node-a2"], slow, "s", 100, 0)
    uuid = gpu_uuid("A", "node-a1", 0)
    gpus[uuid] = replace(gpus[uuid], gpu_class="mystery-9000")
    snap = topology(gpus, nodes)
    assert snap.domain_link("A").bandwidth_gbps == 50.0
    gpu = next(g for g in snap.gpus if g.uuid == uuid)
    assert (
        gpu.gpu_class.name == "mystery-9000?"
        and gpu.gpu_class.memory_bytes == gpu.total_memory_bytes
    )


def test_load_falls_back_to_nominal_without_reports() -> None:
    window = HoppingWindow(60.0, 10.0)
    nominal = NominalLoad(3.0, 800.0, 250.0)
    empty = serving_aggregate(ServingWindows(), window, NOW_S)
    load, source = build_load(empty, nominal, MODEL_7B_MHA, NOW_S)
    assert source == LoadSource.NOMINAL and load.arrival_rate_rps == 3.0
    state, _ = fold_serving(ServingWindows(), window, make_load(), "w", 1, T0_MS)
    load, source = build_load(serving_aggregate(state, window, NOW_S), nominal, MODEL_7B_MHA, NOW_S)
    assert source == LoadSource.WINDOW and load.arrival_rate_rps == pytest.approx(2.0)
    assert load.active_kv_tokens == 2**30 // MODEL_7B_MHA.kv_bytes_per_token
    assert (load.num_ttft_refused, load.window_ttft_p95_censored) == (0, False)
    # every request of a later report refused for want of room: the p95 is past every sample
    refused = make_load(rejected=20, capacity_refusals=20)
    state, _ = fold_serving(state, window, refused, "w", 2, T0_MS + 5_000)
    load, _ = build_load(serving_aggregate(state, window, NOW_S), nominal, MODEL_7B_MHA, NOW_S)
    assert (load.num_ttft_refused, load.window_ttft_p95_censored) == (20, True)


def dep(name: str, block: str, tp: int, replicas: int = 1) -> Deployment:
    return Deployment(
        name, "llama-2-7b", MODEL_7B_MHA, PlanHint(block, tp, 1, replicas), NominalLoad(1, 100, 100)
    )


def test_hint_plans_take_gpus_in_order_and_skip_earlier_hints() -> None:
    snap = topology(*folded())
    blocks = build_blocks(snap, DEFAULT_CONFIG)
    deps = (dep("first", "A", 4), dep("second", "A", 2, replicas=2))
    first = starting_plan(deps, "first", snap, blocks)
    second = starting_plan(deps, "second", snap, blocks)
    assert first is not None and second is not None
    assert sorted(first.gpu_uuids, key=natural_key) == [
        gpu_uuid("A", "node-a1", i) for i in range(4)
    ]
    assert first.gpu_uuids.isdisjoint(second.gpu_uuids) and second.num_gpus == 4
    assert starting_plan((dep("big", "A", 16),), "big", snap, blocks) is None  # too few GPUs
    assert starting_plan((dep("odd", "A", 3),), "odd", snap, blocks) is None  # 3 ∤ heads
    assert natural_key("node-2") < natural_key("node-10")


def test_incremental_builder_matches_a_fresh_build_as_records_are_replaced() -> None:
    gpus, nodes = folded()
    builder = TopologyBuilder(CATALOG)
    assert builder.build(gpus, nodes, NOW_S, 45.0) == topology(gpus, nodes)
    # a preemption replaces one node record, a sample one GPU record, and a GPU leaves the view
    node = next(iter(nodes.values()))
    victim = next(u for u, g in gpus.items() if g.node == node.node)
    event = make_event(ClusterEventType.PREEMPT, node.node, (victim,))
    nodes[node.node], _ = fold_cluster_event(node, event, "sched", 99, T0_MS + 1)
    other = next(u for u, g in gpus.items() if g.node != node.node)
    gpus[other] = replace(gpus[other], free_memory_bytes=0)
    del gpus[next(u for u in sorted(gpus) if u not in (victim, other))]
    built = builder.build(gpus, nodes, NOW_S + 1, 45.0)
    assert built == build_topology(gpus, nodes, CATALOG, NOW_S + 1, 45.0)
    assert victim not in live(built) and len(built.gpus) == len(gpus)


def test_digest_is_the_hash_of_topology_and_load_together_also_when_the_topology_repeats() -> None:
    snap = topology(*folded())
    load, _ = build_load(
        serving_aggregate(ServingWindows(), HoppingWindow(60.0, 10.0), NOW_S),
        NominalLoad(2.0, 512.0, 128.0),
        MODEL_7B_MHA,
        NOW_S,
    )
    whole = hashlib.sha256(orjson.dumps([snap, load])).hexdigest()[:16]
    assert snapshot_digest(snap, load) == whole
    assert snapshot_digest(snap, load) == whole  # the topology's JSON from the last call
    other = replace(snap, now_s=NOW_S + 1)
    assert (
        snapshot_digest(other, load) == hashlib.sha256(orjson.dumps([other, load])).hexdigest()[:16]
    )
    # NOTE: a later snapshot shares most GPU objects (whose JSON is reused) and replaces one
    moved = replace(snap.gpus[1], utilisation=0.5, last_seen_s=NOW_S + 2)
    later = replace(other, now_s=NOW_S + 2, gpus=(snap.gpus[0], moved, *snap.gpus[2:]))
    expected = hashlib.sha256(orjson.dumps([later, load])).hexdigest()[:16]
    assert snapshot_digest(later, load) == expected
    assert expected != snapshot_digest(replace(later, gpus=snap.gpus), load)
