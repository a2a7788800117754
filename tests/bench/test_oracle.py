"""Unit: the fragmented benchmark's oracle — its intervals and worlds, that it is the limit of
every system on the same trace, that it shifts at event times for free, and that it ranks plans
by the ground truth rather than by gearbox's estimates."""

from __future__ import annotations

import dataclasses
import itertools
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from bench.sim.des import RunResult, Simulation
from bench.sim.metrics import DeploymentMetrics, Utilisation, combined
from bench.sim.oracle import (
    MAX_INTERVAL_S,
    Interval,
    Oracle,
    Scored,
    _disjoint,
    _joint_order,
    interval_load,
    interval_requests,
    intervals,
    segment_scenario,
)
from bench.sim.report import headline, run_problems, targets
from bench.sim.systems import SYSTEMS
from flexpipe.config import FlexPipeConfig
from gearbox.plans import ExecutionPlan, StageRole
from gearbox.ranking import rank_candidates
from runtime.deployment import RuntimeSettings
from runtime.host import RuntimeHost
from runtime.types import Completion, RequestKind
from sim.catalog import with_scenario
from sim.cluster import SimCluster
from sim.loadgen import scenario_trace
from sim.scenario import SEED_FRAGMENTED, load_scenario
from sim.spec import Scenario
from sim.truth import GroundTruth
from sim.world import World

pytestmark = pytest.mark.unit

SHORT = Path(__file__).resolve().parents[1] / "fixtures" / "scenarios" / "fragmented-short.yaml"
SEED, DURATION_S = 1, 600.0
PREEMPTED = {f"GPU-sim-A-node-a1-{i}" for i in (4, 5, 6, 7)}  # the fixture's preemption


@dataclasses.dataclass(frozen=True, slots=True)
class SlowClass(GroundTruth):
    """A world where one GPU class is far slower than gearbox's cost model says."""

    slow: str = "hopper-80g"

    def efficiency(self, plan: ExecutionPlan, phase: str) -> float:
        """8x the estimate on any plan with a stage of the slow class, the estimate elsewhere."""
        return 8.0 if any(s.gpu_class.name == self.slow for s in plan.stages) else 1.0


@cache
def short() -> Scenario:
    return load_scenario(SHORT)


def truth() -> GroundTruth:
    return GroundTruth(SEED, 0.3)


@cache
def oracle_run() -> tuple[RunResult, list[Any]]:
    trace = scenario_trace(short(), DURATION_S, SEED)
    oracle = Oracle(short(), trace, seed=SEED, duration_s=DURATION_S, truth=truth())
    return oracle.run()


@cache
def system_run(key: str) -> RunResult:
    system = next(s for s in SYSTEMS if s.key == key)
    trace = scenario_trace(short(), DURATION_S, SEED)
    return Simulation(system, short(), trace, seed=SEED, duration_s=DURATION_S, truth=truth()).run()


def goodput(result: RunResult) -> int:
    return sum(m.goodput_tokens for m in result.metrics.values())


def test_intervals_cut_at_every_event_and_phase_edge() -> None:
    cuts = [(i.start_s, i.end_s) for i in intervals(short(), short().duration_s)]
    # preemption at 300 s, busy phase from 600 s, release at 900 s
    assert cuts == [(0.0, 300.0), (300.0, 600.0), (600.0, 900.0), (900.0, 1200.0)]
    seed = load_scenario(SEED_FRAGMENTED)
    parts = intervals(seed, seed.duration_s)
    assert parts[0].start_s == 0.0 and parts[-1].end_s == seed.duration_s
    assert all(a.end_s == b.start_s for a, b in itertools.pairwise(parts))
    assert max(p.length_s for p in parts) <= MAX_INTERVAL_S
    assert {ev.t_s for ev in seed.timeline} <= {p.start_s for p in parts}


def test_an_interval_world_starts_as_the_whole_run_is_then() -> None:
    scenario = load_scenario(SEED_FRAGMENTED)  # preemptions by count: GPUs picked by the seed
    names = [d.name for d in scenario.deployments]
    whole = SimCluster(scenario, 7)
    for interval in intervals(scenario, scenario.duration_s):
        whole.advance_to(interval.start_s)
        part = SimCluster(segment_scenario(scenario, interval, names, interval.length_s), 7)
        part.advance_to(0.0)
        assert part.schedulable_gpus() == whole.schedulable_gpus(), interval


def test_the_oracle_is_the_limit_of_every_system_on_the_same_trace() -> None:
    result, _ = oracle_run()
    best = goodput(result)
    for system in SYSTEMS:
        run = system_run(system.key)
        assert run.offered_tokens == result.offered_tokens  # the same requests
        assert goodput(run) <= best, system.key
    assert best > goodput(system_run("fixed"))  # the fixed plan loses the 70B when preempted


def test_the_oracle_shifts_at_the_event_for_free() -> None:
    result, choices = oracle_run()
    assert [c.interval for c in choices] == [Interval(0.0, 300.0), Interval(300.0, 600.0)]
    assert result.transitions == [] and result.decisions == []  # no transition to pay for
    during = choices[1].plans["chat-70b"]
    assert during is not None and not during.gpu_uuids & PREEMPTED
    big = result.metrics["chat-70b"]
    assert sum(big.rejections.values()) == 0
    assert big.completions[5] > 0  # served in the minute the GPUs went
    fixed = system_run("fixed").metrics["chat-70b"]
    assert sum(fixed.rejections.values()) > 0 and fixed.completions[6] == 0


def test_the_oracle_ranks_plans_by_the_ground_truth_not_by_gearbox() -> None:
    only_70b = dataclasses.replace(
        short(), deployments=tuple(d for d in short().deployments if d.name == "chat-70b")
    )
    trace = scenario_trace(only_70b, 300.0, SEED)
    oracle = Oracle(only_70b, trace, seed=SEED, duration_s=300.0, truth=SlowClass(SEED, 0.0))
    interval = Interval(0.0, 300.0)
    chosen = oracle.choose(interval).plans["chat-70b"]
    assert chosen is not None
    classes = {s.gpu_class.name for r in chosen.replicas for s in r.stages}
    assert "hopper-80g" not in classes  # 8x slower in this world, whatever the estimator says
    # gearbox, on the same GPUs and the same true load, prefers the class the world slows down
    cfg = with_scenario(FlexPipeConfig(), only_70b)
    world = World(cfg, only_70b, SEED, RuntimeHost(["chat-70b"], RuntimeSettings()))
    world.fleet.cluster.place("chat-70b", [])
    world.observe(0.0)
    topology, blocks = world.topology()
    load = interval_load(interval_requests(trace["chat-70b"], interval), interval)
    dep = world.deployments[0]
    top = rank_candidates(topology, blocks, dep.model, load, cfg.gearbox, deployment=dep.name)[0]
    assert "hopper-80g" in {s.gpu_class.name for r in top.plan.replicas for s in r.stages}
    assert top.plan.plan_id != chosen.plan_id


def test_the_oracles_run_is_what_its_search_ranked() -> None:
    # The run is put together from each deployment's own run of its chosen plan (the search
    # simulated those to their end), not simulated again: its goodput is the ranking's figure.
    result, choices = oracle_run()
    for name, metrics in result.metrics.items():
        assert metrics.goodput_tokens == sum(c.goodput_tokens[name] for c in choices), name
    trace = scenario_trace(short(), DURATION_S, SEED)
    oracle = Oracle(short(), trace, seed=SEED, duration_s=DURATION_S, truth=truth())
    choice = choices[1]
    together = oracle.simulate(choice.interval, choice.plans)  # the same plans served together
    for name, run in choice.runs.items():
        assert run.metrics[name].goodput_tokens == together.metrics[name].goodput_tokens
        assert run.utilisation.sampled_s == together.utilisation.sampled_s
    held = sum(run.utilisation.held_gpu_s for run in choice.runs.values())
    assert held == pytest.approx(together.utilisation.held_gpu_s)


def test_utilisation_side_by_side_adds_what_runs_hold_and_counts_the_cluster_once() -> None:
    a, b = Utilisation(), Utilisation()
    a.add(60.0, 5.0, {"g1": (10, 80, 1.0)}, (2.0, 7.0), 4)
    b.add(60.0, 5.0, {"g2": (30, 80, 1.0), "g3": (5, 80, 1.0)}, (1.0, 3.0), 4)
    both = Utilisation.side_by_side([a, b])
    assert both.held_gpu_s == 15.0 and both.memory_used_byte_s == 45 * 5.0
    assert (both.busy_gpu_s, both.model_flops) == (3.0, 10.0)
    assert (both.cluster_gpu_s, both.sampled_s) == (20.0, 5.0)
    assert both.gpus_by_minute == {1: 3}
    b.add(65.0, 5.0, {}, (0.0, 0.0), 4)  # a longer span is not side by side
    with pytest.raises(ValueError, match="same span"):
        Utilisation.side_by_side([a, b])


def _done(rid: str, at_s: float) -> Completion:
    return Completion(rid, "r", None, 100, 11, at_s, at_s + 0.5, at_s + 1.5)


def test_intervals_combine_on_the_whole_runs_clock() -> None:
    first, second = (
        DeploymentMetrics(ttft_slo_s=2.0, tbt_slo_s=0.15),
        DeploymentMetrics(ttft_slo_s=2.0, tbt_slo_s=0.15, clock_offset_s=300.0),
    )
    first.on_completion(_done("a", 10.0), RequestKind.CHAT)
    second.on_completion(_done("b", 10.0), RequestKind.CHAT)  # at 310 s on the run's clock
    both = combined([first, second])
    assert dict(both.completions) == {0: 1, 5: 1}
    assert both.goodput_tokens == 2 * 111 and both.good_requests == 2
    assert sorted(both.ttft) == [0, 5]


def _system(goodput_tokens: int) -> dict[str, Any]:
    return {
        "label": "x",
        "goodput_tokens": goodput_tokens,
        "goodput_of_offered": goodput_tokens / 1000,
        "tokens": goodput_tokens,
        "deployments": {"big": {"completions": 1, "preemptions": [], "goodput_of_offered": 0.5}},
        "decision_delay_s": 0.0,
        "utilisation": {},
        "shifts": [],
        "estimator_error": {"p95": None, "median": None},
        "flaps": {"flaps": 0},
        "rejections": 0,
    }


def test_headline_and_a_system_above_the_oracle_is_a_problem() -> None:
    systems = {
        "fixed": _system(500),
        "flexpipe": _system(900),
        "no_hysteresis": _system(950),
        "oracle": _system(920),
    }
    head = headline(systems, "big", None, 0.3)
    assert head["goodput_vs_oracle"] == round(900 / 920, 4)
    assert head["oracle_goodput_of_offered"] == 0.92
    problems = run_problems(systems, [])
    assert len(problems) == 1 and problems[0].startswith("no_hysteresis:")


def test_the_oracles_own_post_preemption_ratio_is_reported_beside_flexpipes() -> None:
    def preempted(before_ms: float, after_ms: float) -> dict[str, object]:
        event = {"ttft_p95_before_ms": before_ms, "ttft_p95_after_ms": after_ms}
        return {"completions": 1, "preemptions": [event], "goodput_of_offered": 0.5}

    systems = {"fixed": _system(500), "no_hysteresis": _system(800)}
    systems["flexpipe"] = _system(900) | {"deployments": {"big": preempted(500.0, 1200.0)}}
    systems["oracle"] = _system(920) | {"deployments": {"big": preempted(500.0, 1250.0)}}
    head = headline(systems, "big", None, 0.3)
    assert head["post_preemption_ttft_p95_ratio"] == 2.4
    assert head["oracle_post_preemption_ttft_p95_ratio"] == 2.5
    after = next(t for t in targets(head) if t["target"] == "post_preemption_ttft_p95_ratio")
    # missed, and said to be out of the oracle's reach too (the bound is not moved)
    assert after["met"] is False and "oracle's own ratio is 2.5" in after["note"]
    systems["oracle"] = _system(920) | {"deployments": {"big": preempted(500.0, 900.0)}}
    after = next(
        t
        for t in targets(headline(systems, "big", None, 0.3))
        if t["target"] == "post_preemption_ttft_p95_ratio"
    )
    assert after["met"] is False and "note" not in after


def test_an_interval_after_a_release_can_load_onto_the_released_gpus() -> None:
    trace = scenario_trace(short(), short().duration_s, SEED)
    oracle = Oracle(short(), trace, seed=SEED, duration_s=short().duration_s, truth=truth())
    interval = Interval(900.0, 960.0)  # preempted at 300 s and released at 900 s: both at t=0
    # NOTE: a plain replica: a split's handoff may refuse a few of a 60-s interval's requests
    plan = next(
        p
        for p in oracle.candidates(interval)["chat-70b"]
        if p.gpu_uuids >= PREEMPTED
        and all(s.role is StageRole.UNIFIED for r in p.replicas for s in r.stages)
    )
    run = oracle.simulate(interval, {"chat-70b": plan})
    assert run.violations == []
    assert sum(run.metrics["chat-70b"].completions.values()) > 0
    assert not sum(run.metrics["chat-70b"].rejections.values())


def test_no_oracle_runs_every_other_system_and_leaves_the_oracle_out() -> None:
    from bench.fragmented import HEADLINE_SYSTEMS, jobs_for

    with_oracle = jobs_for(Path("s.yaml"), [7, 8], 600.0, 0.3, all_systems=False)
    without = jobs_for(Path("s.yaml"), [7, 8], 600.0, 0.3, all_systems=False, oracle=False)
    assert [j for j in with_oracle if j[0] != "oracle"] == without
    assert {j[0] for j in with_oracle if j[2] == 8} == set(HEADLINE_SYSTEMS)


def test_the_lazy_search_picks_what_simulating_every_candidate_picks() -> None:
    trace = scenario_trace(short(), DURATION_S, SEED)
    oracle = Oracle(short(), trace, seed=SEED, duration_s=DURATION_S, truth=truth())
    interval = Interval(300.0, 600.0)  # the preemption's: both deployments, GPUs gone
    every: dict[str, list[Scored]] = {}
    for name, plans in oracle.candidates(interval).items():
        runs = [oracle.simulate(interval, {name: p}).metrics[name].goodput_tokens for p in plans]
        every[name] = [Scored(None, 0)] + [
            Scored.of(p, g) for p, g in zip(plans, runs, strict=True)
        ]
    best = max((c for c in itertools.product(*every.values()) if _disjoint(c)), key=_joint_order)
    choice = oracle.choose(interval)
    assert list(choice.plans.values()) == [s.plan for s in best]
    assert list(choice.goodput_tokens.values()) == [s.goodput_tokens for s in best]
    assert choice.candidates == {n: len(s) - 1 for n, s in every.items()}
    assert sum(choice.simulated.values()) < sum(choice.candidates.values())


def test_a_run_advanced_in_steps_ends_as_a_whole_run() -> None:
    # The oracle's search advances candidates' runs in steps and pauses them; a stepped run
    # must end in exactly the state of a run in one go (it is the same events in order).
    trace = scenario_trace(short(), DURATION_S, SEED)
    oracle = Oracle(short(), trace, seed=SEED, duration_s=DURATION_S, truth=truth())
    interval = Interval(300.0, 600.0)
    plans = oracle.candidates(interval)["chat-70b"]
    plan = plans[len(plans) // 2]
    whole = oracle.simulate(interval, {"chat-70b": plan})
    stepped = oracle.simulation(interval, {"chat-70b": plan})
    stepped.start()
    steps = 0
    while not stepped.advance(stepped.clock_s + 7.0):
        steps += 1
        metrics = stepped.metrics["chat-70b"]
        # the search's bound: offered tokens less those settled outside the goodput
        offered = sum(r.total_tokens for r in oracle._arrivals("chat-70b", interval))
        assert metrics.goodput_tokens <= offered - stepped.lost_tokens["chat-70b"]
    assert steps > 10
    again = stepped.result()
    assert again.metrics["chat-70b"] == whole.metrics["chat-70b"]
    assert again.utilisation == whole.utilisation
    assert again.transitions == whole.transitions and again.unfinished == whole.unfinished


def test_the_oracle_also_tries_splits_that_decode_on_part_of_a_block() -> None:
    # gearbox pairs each block's biggest option only; a live cluster's other deployments can
    # leave a split half a block, so the oracle, given every GPU, must try those too
    trace = scenario_trace(short(), DURATION_S, SEED)
    oracle = Oracle(short(), trace, seed=SEED, duration_s=DURATION_S, truth=truth())
    sizes: dict[tuple[str, str], set[int]] = {}
    for plan in oracle.candidates(Interval(0.0, DURATION_S))["chat-70b"]:
        for replica in plan.replicas:
            roles = {s.role: s for s in replica.stages}
            prefill, decode = roles.get(StageRole.PREFILL), roles.get(StageRole.DECODE)
            if prefill is not None and decode is not None:
                key = (prefill.block_id, decode.block_id)
                sizes.setdefault(key, set()).add(len(decode.gpu_uuids))
    assert sizes, "no split among the candidates"
    assert any(len(s) > 1 for s in sizes.values()), sizes


def test_the_oracle_tries_one_replica_on_every_copy_of_a_shape() -> None:
    # the world's per-step jitter is drawn per replica (its GPUs), so the same shape runs at
    # its own speed on each copy: a system on the second copy must not beat the oracle's first
    trace = scenario_trace(short(), DURATION_S, SEED)
    oracle = Oracle(short(), trace, seed=SEED, duration_s=DURATION_S, truth=truth())
    singles: dict[tuple[str, ...], set[tuple[str, ...]]] = {}
    for plan in oracle.candidates(Interval(0.0, DURATION_S))["chat-70b"]:
        if len(plan.replicas) == 1:
            (replica,) = plan.replicas
            shape = tuple(f"{s.block_id[0]}/tp{s.tp}/{s.role.value}" for s in replica.stages)
            singles.setdefault(shape, set()).add(tuple(sorted(replica.gpu_uuids)))
    block_a_tp4 = singles[("A/tp4/unified",)]
    assert len(block_a_tp4) == 3, block_a_tp4  # 12 hoppers: three TP4 copies, each tried
    assert len({u for gpus in block_a_tp4 for u in gpus}) == 12
