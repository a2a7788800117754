"""Scenario files: the shipped seed's shape, the loader, and bad entries named by their path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from flexpipe.errors import ValidationError
from sim.scenario import SEED_FRAGMENTED, load_scenario, parse_scenario
from sim.spec import LinkChange, Preempt, Release, Xid, gpu_uuid
from tests.fixtures.scenarios.builders import at, tiny, tiny_raw

pytestmark = pytest.mark.unit

HOUR_S = 3600.0


def test_seed_matches_the_articles_cluster() -> None:
    sc = load_scenario(SEED_FRAGMENTED)
    blocks = {d.id: d for d in sc.domains}
    assert {k: len(d.gpus) for k, d in blocks.items()} == {"A": 12, "B": 9, "C": 6}
    assert {k: d.link for k, d in blocks.items()} == {"A": "nvlink", "B": "rdma", "C": "pcie"}
    memory_gb = {
        k: {sc.gpu_class(g.gpu_class).memory_gb for g in d.gpus} for k, d in blocks.items()
    }
    assert memory_gb == {"A": {80.0}, "B": {80.0}, "C": {48.0}}
    assert len({g.gpu_class for g in blocks["C"].gpus}) > 1  # mixed
    assert any(g.isolated for g in blocks["C"].gpus)  # partly isolated
    assert sc.duration_s == 8 * HOUR_S
    preempts = [ev for ev in sc.timeline if isinstance(ev, Preempt)]
    assert len(preempts) == 3 and {ev.domain for ev in preempts} == {"A"}
    assert any(isinstance(ev, Release) for ev in sc.timeline)
    assert [ev.gpu for ev in sc.timeline if isinstance(ev, Xid)] == ["GPU-sim-C-node-c1-3"]
    # inter-block slower than intra-block
    inter = sc.link(sc.inter_domain_link).bandwidth_gbps
    assert all(sc.link(d.link).bandwidth_gbps > inter for d in sc.domains)
    fastest = max(sc.gpu_classes, key=lambda c: c.peak_bf16_tflops)
    assert {g.gpu_class for g in blocks["A"].gpus} == {fastest.name}
    baseline = sc.deployments[0]
    assert baseline.plan is not None and (baseline.plan.block, baseline.plan.tp) == ("A", 8)
    assert baseline.model.preset == "llama-70b-class"
    assert {d.model.preset for d in sc.deployments} == {"llama-70b-class", "llama-7b-class"}
    assert all(d.workload.phases and d.workload.swing.amplitude > 0 for d in sc.deployments)


def test_tiny_scenario_parses_with_deterministic_uuids() -> None:
    sc = tiny()
    assert [g.uuid for g in sc.domain("C").gpus] == [
        gpu_uuid("C", "node-c1", 0),
        gpu_uuid("C", "node-c1", 1),
        "GPU-sim-C-node-c2-0",
        "GPU-sim-C-node-c2-1",
    ]
    assert [g.isolated for g in sc.domain("C").gpus] == [False, False, False, True]
    assert sc.link("rdma").bandwidth_gbps == 25.0  # defaults present without a links section
    assert sc.epoch_ms == 1_700_000_000_000


def test_load_scenario_reads_yaml_like_parse(tmp_path: Path) -> None:
    events = ({"t_s": 60, "type": "preempt", "domain": "A", "gpus": ["node-a1:1", "node-a1:2"]},)
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(tiny_raw(*events)))
    loaded = load_scenario(path)
    assert loaded.timeline == tiny(*events).timeline
    ev = loaded.timeline[0]
    assert isinstance(ev, Preempt) and ev.count == 2 and ev.id == "preempt-0"
    assert ev.gpus == ("GPU-sim-A-node-a1-1", "GPU-sim-A-node-a1-2")


def test_timeline_event_variants_parse() -> None:
    sc = tiny(
        {"t_s": 10, "type": "preempt", "domain": "A", "count": 3, "id": "r1"},
        {"t_s": 20, "type": "release", "domain": "A", "count": 1},
        {"t_s": 30, "type": "release", "domain": "A", "preemption": "r1"},
        {"t_s": 40, "type": "node_failure", "node": "node-c1"},
        {"t_s": 50, "type": "node_recovery", "node": "node-c1"},
        {"t_s": 60, "type": "xid", "gpu": "node-c1:0", "code": 48},
        {"t_s": 70, "type": "restore", "gpu": "node-c1:0"},
        {"t_s": 80, "type": "isolate", "gpu": "node-a2:3", "reason": "bad port"},
        {"t_s": 90, "type": "link", "domain": "C", "bandwidth_gbps": 4.0},
    )
    kinds = [type(ev).__name__ for ev in sc.timeline]
    assert kinds == [
        "Preempt",
        "Release",
        "Release",
        "NodeFailure",
        "NodeRecovery",
        "Xid",
        "Restore",
        "Isolate",
        "LinkChange",
    ]
    assert sc.timeline[-1] == LinkChange(t_s=90.0, domain="C", bandwidth_gbps=4.0)


def test_workload_multipliers_follow_swing_and_phases() -> None:
    raw = tiny_raw()
    workload = raw["deployments"]["chat"]["workload"]
    workload["swing"] = {"amplitude": 0.5, "period_s": 2000, "peak_s": 0}
    workload["phases"] = [{"start_s": 500, "end_s": 1000, "chat": 2.0, "summarisation": 0.0}]
    wl = parse_scenario(raw).deployments[0].workload
    assert wl.multipliers(0.0) == pytest.approx((1.5, 1.5))  # swing peak, no phase
    assert wl.multipliers(1000.0) == pytest.approx((0.5, 0.5))  # trough; phase ended
    assert wl.multipliers(500.0) == pytest.approx((2.0 * 1.0, 0.0))  # swing at 1.0, in phase


def _preempt(t_s: float, count: int, **extra: Any) -> dict[str, Any]:
    return {"t_s": t_s, "type": "preempt", "domain": "A", "count": count, **extra}


BAD_TIMELINES: list[tuple[list[dict[str, Any]], str]] = [
    ([{"t_s": 1, "type": "explode"}], "timeline[0].type"),
    ([{"t_s": 4000, "type": "node_failure", "node": "node-a1"}], "timeline[0].t_s"),
    ([_preempt(100, 1), _preempt(50, 1)], "timeline[1].t_s"),
    ([{"t_s": 1, "type": "preempt", "domain": "Z", "count": 1}], "timeline[0].domain"),
    ([_preempt(1, 9)], "timeline[0].count"),
    ([_preempt(1, 5), _preempt(2, 4)], "timeline[1].count"),
    ([_preempt(1, 1, cuont=2)], "timeline[0].cuont"),
    ([_preempt(1, 1, gpus=["node-c1:0"])], "timeline[0].gpus[0]"),
    (
        [_preempt(1, 1), {"t_s": 2, "type": "release", "domain": "A", "count": 2}],
        "timeline[1].count",
    ),
    (
        [{"t_s": 2, "type": "release", "domain": "A", "preemption": "nope"}],
        "timeline[0].preemption",
    ),
    ([{"t_s": 1, "type": "xid", "gpu": "node-a1:9", "code": 79}], "timeline[0].gpu"),
    ([{"t_s": 1, "type": "xid", "gpu": "node-a1:0", "code": "79"}], "timeline[0].code"),
    ([{"t_s": 1, "type": "node_recovery", "node": "node-a1"}], "timeline[0].node"),
    ([{"t_s": 1, "type": "restore", "gpu": "node-a1:0"}], "timeline[0].gpu"),
    ([{"t_s": 1, "type": "isolate", "gpu": "node-c2:1"}], "timeline[0].gpu"),
    ([{"type": "node_failure", "node": "node-a1"}], "timeline[0].t_s"),
]


@pytest.mark.parametrize(("timeline", "field"), BAD_TIMELINES)
def test_bad_timeline_entry_is_named(timeline: list[dict[str, Any]], field: str) -> None:
    with pytest.raises(ValidationError) as err:
        parse_scenario(tiny_raw(*timeline), source="bad.yaml")
    assert err.value.field == field
    assert "(in bad.yaml)" in err.value.reason


BAD_ENTRIES: list[tuple[str, Any, str]] = [
    ("name", "", "name"),
    ("duration_s", True, "duration_s"),
    ("durations_s", 10, "durations_s"),
    ("gpu_classes.big.memory_gb", -1, "gpu_classes.big.memory_gb"),
    ("gpu_classes.big.hbm", 1, "gpu_classes.big.hbm"),
    ("domains.A.link", "infiniband", "domains.A.link"),
    ("domains.A.nodes.node-a1.gpus", {"huge": 4}, "domains.A.nodes.node-a1.gpus.huge"),
    ("domains.C.nodes.node-c1.gpus", ["small", "tiny"], "domains.C.nodes.node-c1.gpus[1]"),
    ("domains.C.nodes.node-c2.isolated", [2], "domains.C.nodes.node-c2.isolated[0]"),
    ("domains.C.nodes", {"node-a1": {"gpus": ["small"]}}, "domains.C.nodes.node-a1"),
    ("inter_domain_link", "carrier-pigeon", "inter_domain_link"),
    ("deployments.chat.plan.block", "Z", "deployments.chat.plan.block"),
    ("deployments.chat.plan.replicas", 3, "deployments.chat.plan"),
    ("deployments.chat.model", "gpt-9-class", "deployments.chat.model.params_b"),
    (
        "deployments.chat.workload.chat.arrival_rps",
        -1,
        "deployments.chat.workload.chat.arrival_rps",
    ),
    (
        "deployments.chat.workload.phases",
        [{"start_s": 0, "end_s": 600}, {"start_s": 500, "end_s": 900}],
        "deployments.chat.workload.phases[1].start_s",
    ),
    (
        "deployments.chat.workload.phases",
        [{"start_s": 0, "end_s": 7200}],
        "deployments.chat.workload.phases[0].end_s",
    ),
    (
        "deployments.chat.workload.swing",
        {"amplitude": 1.5},
        "deployments.chat.workload.swing.amplitude",
    ),
]


@pytest.mark.parametrize(("path", "value", "field"), BAD_ENTRIES)
def test_bad_entry_is_named(path: str, value: Any, field: str) -> None:
    with pytest.raises(ValidationError) as err:
        parse_scenario(at(tiny_raw(), path, value))
    assert err.value.field == field


def test_model_too_big_for_the_block_names_tp() -> None:
    raw = tiny_raw()
    raw["deployments"]["chat"]["model"] = "llama-70b-class"
    raw["deployments"]["chat"]["plan"] = {"block": "C", "tp": 2}
    with pytest.raises(ValidationError) as err:
        parse_scenario(raw)
    assert err.value.field == "deployments.chat.plan.tp"


def test_not_a_mapping_is_rejected_at_the_root() -> None:
    with pytest.raises(ValidationError) as err:
        parse_scenario(["not", "a", "scenario"])
    assert err.value.field == ""


def test_unreadable_and_malformed_files_are_validation_errors(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="cannot read"):
        load_scenario(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed\nduration_s: 1\n")
    with pytest.raises(ValidationError, match="not valid YAML at line"):
        load_scenario(broken)
