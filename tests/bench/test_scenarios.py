"""Unit: the benchmark's own scenario files load, and steady-boundary is what its header says —
chat-13b's noisy load crosses gearbox's own plan boundary at every phase (the world where
hysteresis has something to hold), while steady-noisy's never does."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from bench.sim.oracle import Interval, interval_load, interval_requests
from flexpipe.config import FlexPipeConfig
from gearbox.ranking import rank_candidates
from runtime.deployment import RuntimeSettings
from runtime.host import RuntimeHost
from sim.catalog import with_scenario
from sim.loadgen import scenario_trace
from sim.scenario import SCENARIO_DIR, load_scenario
from sim.world import World

pytestmark = pytest.mark.unit

SEED = 3  # any seed: the phases' means, not one trace's noise, decide the top plans


@pytest.mark.parametrize("path", sorted(SCENARIO_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_scenario_file_loads(path: Path) -> None:
    scenario = load_scenario(path)
    assert scenario.deployments and scenario.duration_s > 0


@cache
def top_gpus_by_phase(name: str, deployment: str) -> tuple[int, ...]:
    """GPUs of gearbox's top-ranked plan for each 10-minute phase's true load (whole cluster
    free), the ranking the scenario's header quotes."""
    scenario = load_scenario(SCENARIO_DIR / f"{name}.yaml")
    trace = scenario_trace(scenario, scenario.duration_s, SEED)
    cfg = with_scenario(FlexPipeConfig(), scenario)
    names = sorted(d.name for d in scenario.deployments)
    world = World(cfg, scenario, SEED, RuntimeHost(names, RuntimeSettings()))
    world.observe(0.0)
    topology, blocks = world.topology()
    dep = next(d for d in world.deployments if d.name == deployment)
    out = []
    for start in range(0, int(scenario.duration_s), 600):
        interval = Interval(float(start), float(start + 600))
        load = interval_load(interval_requests(trace[deployment], interval), interval)
        ranked = rank_candidates(
            topology, blocks, dep.model, load, cfg.gearbox, deployment=dep.name
        )
        out.append(ranked[0].plan.num_gpus)
    return tuple(out)


def test_steady_boundary_noise_crosses_gearboxs_plan_boundary_every_phase() -> None:
    gpus = top_gpus_by_phase("steady-boundary", "chat-13b")
    high, low = gpus[0::2], gpus[1::2]  # the phases alternate above and below the mean
    assert min(high) > max(low)  # every high phase above the boundary, every low one below


def test_steady_noisy_noise_never_crosses_a_plan_boundary() -> None:
    assert len(set(top_gpus_by_phase("steady-noisy", "chat-13b"))) == 1
