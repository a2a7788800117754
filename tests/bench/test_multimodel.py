"""Tests for the multi-model benchmark (``bench.multimodel``): determinism, safety, mechanics."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from bench.mm.core import Simulator
from bench.mm.metrics import Metrics, percentile, union_length_s
from bench.mm.scenario import (
    ModelProfile,
    Scenario,
    SimRequest,
    TrafficProfile,
    build_scenario,
    make_cluster,
)
from bench.mm.systems import GearboxSystem, RoundRobinSystem
from bench.multimodel import main, results_text, run_benchmark
from gearbox.config import PlacementConfig
from gearbox.presets import MODEL_7B_MHA

SHORT_S = 900.0
# NOTE: a short run cannot wait the default 30 min for a model to go cold; shortening it lets
# the tidal models become eviction candidates before the late ones need their room.
SHORT_PLACEMENT = PlacementConfig(cold_after_s=120.0)


def make_single_gpu_scenario(requests: tuple[SimRequest, ...]) -> Scenario:
    """One A10 24 GB, one 7B model, the given requests (no generated traffic)."""
    cluster = make_cluster()
    a10 = next(g for g in cluster.gpus if g.gpu_class.name == "a10-24g")
    traffic = TrafficProfile(0.0, 0.0, 600.0, 120.0, 600, 200, 0.0)
    model = ModelProfile("chat-7b", MODEL_7B_MHA, 1, 4, 2048, traffic)
    return Scenario(0, 400.0, dataclasses.replace(cluster, gpus=(a10,)), (model,), (), requests)


def long_request(n: int, arrival_s: float = 100.0) -> SimRequest:
    """8,000 prompt + 200 output tokens: ~4.3 GB of 7B KV."""
    return SimRequest(f"chat-7b/{n}", "chat-7b", arrival_s, 8000, 200, True)


def run_one(scenario: Scenario, system: str) -> Metrics:
    """Run one system on a scenario with the default placement config."""
    sim = Simulator(scenario, PlacementConfig())
    factory = RoundRobinSystem if system == "rr" else GearboxSystem
    return sim.run(factory(sim))


@pytest.mark.unit
def test_same_seed_gives_byte_identical_results() -> None:
    first = results_text(run_benchmark(3, SHORT_S, placement=SHORT_PLACEMENT))
    second = results_text(run_benchmark(3, SHORT_S, placement=SHORT_PLACEMENT))
    assert first == second
    other = results_text(run_benchmark(4, SHORT_S, placement=SHORT_PLACEMENT))
    assert other != first


@pytest.mark.unit
def test_ours_evicts_only_idle_models_and_never_ooms() -> None:
    result = run_benchmark(3, SHORT_S, placement=SHORT_PLACEMENT)
    ours = result["systems"]["gearbox"]  # type: ignore[index]
    assert ours["evictions"] > 0  # the eviction path ran …
    assert result["evicted_with_active"] == 0  # … and never hit a model with requests
    assert result["oom_ours"] == 0
    assert result["oom_rr"] > 0  # type: ignore[operator]


@pytest.mark.unit
def test_scenario_is_seeded_and_sorted() -> None:
    a, b = build_scenario(5, SHORT_S), build_scenario(5, SHORT_S)
    assert a.requests == b.requests
    assert [r.arrival_s for r in a.requests] == sorted(r.arrival_s for r in a.requests)
    assert build_scenario(6, SHORT_S).requests != a.requests


@pytest.mark.unit
def test_round_robin_overcommit_crashes_the_gpu_process() -> None:
    # Weights + runtime overhead leave ~10 GB: two long requests fit, the third OOMs.
    scenario = make_single_gpu_scenario(tuple(long_request(n) for n in range(3)))
    metrics = run_one(scenario, "rr")
    assert metrics.oom_events == 1
    assert metrics.restarts == 1
    assert metrics.failed_oom == 3  # the victim and the two running beside it
    assert metrics.served_requests == 0


@pytest.mark.unit
def test_ours_throttles_at_the_watermark_instead() -> None:
    # The first long request leaves the GPU at ~77 %; a second would pass the 85 % watermark.
    scenario = make_single_gpu_scenario(tuple(long_request(n) for n in range(3)))
    metrics = run_one(scenario, "ours")
    assert metrics.oom_events == 0
    assert metrics.rejected == {"throttled_watermark": 2}
    assert metrics.served_requests == 1


@pytest.mark.unit
def test_json_line_matches_results_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "multimodel.json"
    assert main(["--seed", "2", "--duration-s", "600", "--out", str(out)]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "wall_s" in last
    required = {"oom_rr", "oom_ours", "util_ratio", "dead_memory_frac_ours", "evicted_with_active"}
    assert required <= set(last)
    del last["wall_s"]
    assert last == json.loads(out.read_text())


@pytest.mark.unit
def test_metric_helpers() -> None:
    assert union_length_s([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == pytest.approx(4.0)
    assert union_length_s([]) == 0.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([], 95) == 0.0
