"""On-demand models end to end in process: the stream's step (the replay's, which the live
decider shares), the runtime host and the simulated cluster on one simulated clock
(:class:`sim.world.World`, no broker), on four models that share two GPUs; and the eviction
check of ``flexpipe up``'s summary."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from flexpipe.config import FlexPipeConfig
from flexpipe.errors import ValidationError
from flexpipe.schemas import GearTransition, PhaseStatus, TransitionPhase
from gearbox.decisions import DecisionReason, Trigger
from gearbox.plans import DeploymentPlan
from runtime.host import RuntimeHost
from runtime.types import Reason
from runtime.worker import runtime_settings
from sim.catalog import with_scenario
from sim.loadgen import generate, rates_from_workload
from sim.ondemand import MemorySample, evicted_with_active, packing_figures
from sim.scenario import load_scenario, parse_scenario, scenario_path
from sim.spec import Scenario
from sim.world import World

SCENARIO = Path(__file__).parents[1] / "fixtures" / "scenarios" / "on-demand-small.yaml"
HOLD_S = 120.0
RUN_S = 420.0


def _packed() -> Scenario:
    """The fixture with up to four models per GPU (two of its 7B models fit in one's 85 %)."""
    raw = yaml.safe_load(SCENARIO.read_text())
    raw["placement"]["max_models_per_gpu"] = 4
    return parse_scenario(raw)


def _run(
    scenario: Scenario | None = None,
) -> tuple[World, Counter[str], dict[str, list[tuple[float, float]]], list[Any]]:
    """Four models, two GPUs, ``RUN_S`` simulated seconds: requests submitted at their arrival,
    the runtime ticked and pumped every second, serving reported every 5 s, the stream stepping
    every 15 s; the outcomes (``most_models_on_a_gpu``: the most processes the simulated cluster
    ran on one GPU), each request's span and the transition records with their time."""
    scenario = scenario or load_scenario(SCENARIO)
    cfg = with_scenario(FlexPipeConfig(), scenario)
    names = [d.name for d in cfg.deployments]
    host = RuntimeHost(
        names,
        runtime_settings(cfg.runtime),
        models=cfg.catalog.model_specs(),
        hold_s=dict.fromkeys(names, HOLD_S),
    )
    world = World(cfg, scenario, 7, host)
    world.start({}, 0.0)
    arrivals = sorted(
        (
            (r, d.name)
            for d in scenario.deployments
            for r in generate(
                rates_from_workload(d.workload), seed=7, duration_s=RUN_S, prefix=d.name
            )
        ),
        key=lambda a: (a[0].arrival_s, a[1]),
    )
    outcomes: Counter[str] = Counter()
    spans: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    started: dict[str, tuple[str, float]] = {}
    records: list[Any] = []
    i, t = 0, 0.0
    while t < RUN_S:
        world.observe(t)
        while i < len(arrivals) and arrivals[i][0].arrival_s <= t:
            request, name = arrivals[i]
            i += 1
            admission = host.runtimes[name].submit(request, t)
            outcomes[str(admission.reason)] += 1
            if admission.admitted:
                started[request.request_id] = (name, request.arrival_s)
        host.tick(t)
        for name in names:
            pumped = world.pump(name, t)
            records += [(t, rec) for rec in pumped.records]
            for done in pumped.completions:
                dep, arrival = started.pop(done.request_id)
                spans[dep].append((arrival, done.finish_s))
                outcomes["completed"] += 1
            for request_id, why in pumped.refused:
                dep, arrival = started.pop(request_id)
                spans[dep].append((arrival, t))
                outcomes[f"refused:{why}"] += 1
        if t % 5 == 0:
            world.report(t)
        if t % 15 == 0:
            for out in world.decision_step(Trigger.TIMER, t):
                outcomes[f"decision:{out.decision.reason}"] += 1
        most = max(len(world.fleet.cluster.processes(g.uuid)) for g in scenario.gpus)
        outcomes["most_models_on_a_gpu"] = max(outcomes["most_models_on_a_gpu"], most)
        t += 1.0
    return world, outcomes, spans, records


@pytest.mark.integration
def test_four_models_on_two_gpus_load_on_demand_and_evict_only_idle_models() -> None:
    world, outcomes, spans, records = _run()
    done: Counter[str] = Counter()
    for _, rec in records:
        if rec.phase is TransitionPhase.DONE and rec.plan is not None:
            done[f"{rec.deployment}:{'load' if rec.plan.replicas else 'evict'}"] += 1
    # every model was loaded; the later two only once the first two were evicted
    assert all(done[f"m{k}:load"] >= 1 for k in (1, 2, 3, 4)), done
    assert done["m1:evict"] >= 1 and done["m2:evict"] >= 1, done
    # by either rule: m1 and m2 fall quiet at 120 s; m3's and m4's requests wait from 150 s, so
    # the queue rule may let them go before they are 60 s cold
    evictions = (DecisionReason.EVICT_COLD, DecisionReason.EVICT_QUEUE)
    assert sum(outcomes[f"decision:{why}"] for why in evictions) >= 2, outcomes
    # a request for a cold model is held for its load, then served
    assert outcomes[str(Reason.HELD_FOR_LOAD)] > 0, outcomes
    assert all(spans[f"m{k}"] for k in (1, 2, 3, 4)), outcomes
    assert outcomes[f"refused:{Reason.MODEL_LOADING}"] == 0, outcomes
    assert world.host.pool.oom_events == 0
    assert evicted_with_active(records, spans) == []


@pytest.mark.integration
def test_with_room_for_two_the_models_share_gpus_and_nothing_runs_out_of_memory() -> None:
    world, outcomes, spans, records = _run(_packed())
    loads = [r for _, r in records if r.phase is TransitionPhase.DONE and r.plan is not None]
    assert {r.deployment for r in loads if r.plan is not None and r.plan.replicas} == {
        "m1",
        "m2",
        "m3",
        "m4",
    }
    assert outcomes["most_models_on_a_gpu"] == 2, outcomes  # packed, and never three 7Bs
    assert all(spans[f"m{k}"] for k in (1, 2, 3, 4)), outcomes
    assert world.host.pool.oom_events == 0 and evicted_with_active(records, spans) == []
    assert all(rt.core.engine_oom_events == 0 for rt in world.host.runtimes.values())
    assert outcomes[f"refused:{Reason.MODEL_LOADING}"] == 0, outcomes


@pytest.mark.unit
def test_packing_figures_are_time_shares_over_the_samples() -> None:
    samples = [
        MemorySample(0.0, 0.0, 0.0, (0, 1, 2, 0)),
        MemorySample(30.0, 0.0, 0.0, (1, 1, 3, 0)),
    ]
    figures = packing_figures(samples)
    assert figures["gpu_time_share_by_models"] == {"0": 0.375, "1": 0.375, "2": 0.125, "3": 0.125}
    assert figures["packed_share_of_serving_gpu_time"] == 0.4  # 2 of 5 serving GPU-samples
    assert figures["max_models_per_gpu"] == 3
    assert packing_figures([])["packed_share_of_serving_gpu_time"] is None


def _record(
    seq: int, phase: TransitionPhase, status: PhaseStatus, plan: DeploymentPlan | None = None
) -> GearTransition:
    return GearTransition("m", seq, f"m:{seq}", phase, status, "old", "new", plan=plan)


@pytest.mark.unit
def test_an_eviction_with_a_request_through_its_switch_is_counted() -> None:
    empty = DeploymentPlan("m", "llama-2-7b", ())
    transitions = [
        (100.0, _record(5, TransitionPhase.SWITCH, PhaseStatus.STARTED)),
        (103.0, _record(5, TransitionPhase.SWITCH, PhaseStatus.COMPLETED)),
        (104.0, _record(5, TransitionPhase.DONE, PhaseStatus.COMPLETED, empty)),
    ]
    assert evicted_with_active(transitions, {"m": [(90.0, 99.0), (101.0, 120.0)]}) == []
    assert evicted_with_active(transitions, {"m": [(95.0, 110.0)]}) == ["m #5"]


@pytest.mark.unit
def test_the_shipped_many_models_scenario_is_24_on_demand_models_on_12_gpus() -> None:
    scenario = load_scenario(scenario_path("many-models"))
    assert len(scenario.deployments) == 24 and len(scenario.gpus) == 12
    assert all(d.on_demand and d.plan is None for d in scenario.deployments)
    cfg = with_scenario(FlexPipeConfig(), scenario)
    assert {d.residency for d in cfg.deployments} == {"on_demand"}
    assert cfg.placement.cold_after_s == 60.0


@pytest.mark.unit
@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"plan": {"block": "C"}}, "deployments.m1.plan"),
        ({"on_demand": {"affinity": ["nobody"]}}, "deployments.m1.on_demand"),
        ({"on_demand": {"pin": "Z"}}, "deployments.m1.on_demand.pin"),
    ],
)
def test_a_bad_on_demand_entry_names_its_key(change: dict[str, Any], field: str) -> None:
    raw = yaml.safe_load(SCENARIO.read_text())
    raw["deployments"]["m1"].update(change)
    with pytest.raises(ValidationError) as err:
        parse_scenario(raw)
    assert err.value.field == field


@pytest.mark.unit
def test_a_bad_placement_knob_names_the_section() -> None:
    raw = yaml.safe_load(SCENARIO.read_text())
    raw["placement"]["oom_watermark"] = 7
    with pytest.raises(ValidationError) as err:
        parse_scenario(raw)
    assert err.value.field == "placement" and "oom_watermark" in err.value.reason


def _flooded() -> Scenario:
    """m1 alone, flooded with long prompts from 10 s to 200 s, then quiet: one replica's GPU
    hits the watermark; the other GPU is free."""
    raw = yaml.safe_load(SCENARIO.read_text())
    m1 = raw["deployments"]["m1"]
    m1["workload"] = {
        "chat": {"arrival_rps": 6.0, "prompt_tokens_mean": 4000, "output_tokens_mean": 200},
        "phases": [
            {"start_s": 0, "end_s": 10, "multiplier": 0},
            {"start_s": 10, "end_s": 200},
            {"start_s": 200, "end_s": 600, "multiplier": 0},
        ],
    }
    raw["deployments"] = {"m1": m1}
    return parse_scenario(raw)


@pytest.mark.integration
def test_a_flooded_model_scales_out_to_a_second_gpu_and_back_when_quiet() -> None:
    world, outcomes, spans, records = _run(_flooded())
    replicas = [len(rec.plan.replicas) for _, rec in records if rec.phase is TransitionPhase.DONE]
    assert outcomes[str(Reason.THROTTLED_WATERMARK)] > 0, outcomes  # one replica was not enough
    assert replicas == [1, 2, 1], replicas  # loaded, a second GPU, back to one once quiet
    # once each: no scale-in while the flood lasted, no scale-out again after it
    assert outcomes[f"decision:{DecisionReason.SCALE_OUT}"] == 1, outcomes
    assert outcomes[f"decision:{DecisionReason.SCALE_IN}"] == 1, outcomes
    assert world.host.pool.oom_events == 0
    assert evicted_with_active(records, spans) == []
