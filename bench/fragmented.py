"""Fragmented-cluster benchmark: the article's evaluation, simulated, against its figures.

Runs the seed scenario (blocks A 12 / B 9 / C 6 GPUs, a 7B and a 70B deployment, chat plus
long-input summarisation with a daily swing, 8 simulated hours, three preemptions on block A)
through the product's own loop on simulated time (:mod:`bench.sim.des`, :mod:`sim.world`),
for six systems in the same run: the fixed TP8@A baseline, static replicas with round-robin
routing, FlexPipe, and three FlexPipe ablations (no hysteresis/cooldown, replay-only hand-over,
no prefill/decode split). Same trace, seeds and cost model for all.

Writes ``bench/results/<scenario>.json`` (sorted keys, rounded floats, no wall-clock figures:
the same seed gives the same bytes) and ``<scenario>.png``; prints the side-by-side table with
the article's figures, the targets met or missed, the wall time, what broke (then it exits 1:
a runtime invariant, a deployment that completed nothing, no decision after a preemption), and
LAST one JSON line — the results file's ``summary``.

Run: ``python -m bench.fragmented [--scenario PATH] [--seed N] [--duration S] [--workers N]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import print_result
from bench.sim.report import (
    ARTICLE,
    SYSTEM_ORDER,
    headline,
    run_problems,
    table,
    targets,
    targets_text,
)
from sim.scenario import SEED_FRAGMENTED, load_scenario
from sim.spec import Scenario

RESULTS_DIR = Path(__file__).with_name("results")
DEFAULT_SEED = 7
# Most expensive first, so two workers finish together.
RUN_ORDER = ("flexpipe", "no_hysteresis", "replay_only", "no_pd_split", "static_rr", "fixed")


def run_system(job: tuple[str, str, int, float]) -> tuple[str, dict[str, Any], float]:
    """One system end to end (in a worker process): its summary and the CPU seconds it took."""
    started = time.process_time()  # printed only, never part of the results
    key, scenario_path, seed, duration_s = job
    from bench.sim.des import Simulation
    from bench.sim.summary import system_summary
    from bench.sim.systems import SYSTEMS
    from sim.loadgen import scenario_trace

    scenario = load_scenario(scenario_path)
    system = next(s for s in SYSTEMS if s.key == key)
    trace = scenario_trace(scenario, duration_s, seed)
    result = Simulation(system, scenario, trace, seed=seed, duration_s=duration_s).run()
    summary = system_summary(result, scenario, duration_s)
    return key, summary, time.process_time() - started


def run_all(
    scenario_path: Path, seed: int, duration_s: float, workers: int
) -> tuple[dict[str, dict[str, Any]], dict[str, float]]:
    """Every system, in ``workers`` spawned processes with a fixed hash seed; also the CPU
    seconds each took."""
    jobs = [(key, str(scenario_path), seed, duration_s) for key in RUN_ORDER]
    # NOTE: children start fresh interpreters with PYTHONHASHSEED=0, so even set iteration in
    # any code they run is the same in every run: results depend on the seed alone.
    previous = os.environ.get("PYTHONHASHSEED")
    os.environ["PYTHONHASHSEED"] = "0"
    try:
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            done = {k: (v, cpu) for k, v, cpu in pool.imap_unordered(run_system, jobs, chunksize=1)}
    finally:
        if previous is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = previous
    return {key: done[key][0] for key in SYSTEM_ORDER}, {k: done[k][1] for k in SYSTEM_ORDER}


def results_name(scenario: Scenario, duration_s: float) -> str:
    """``<scenario>``, or ``<scenario>-<duration>s`` for a shortened run."""
    if duration_s >= scenario.duration_s:
        return scenario.name
    return f"{scenario.name}-{int(duration_s)}s"


def model_deployments(scenario: Scenario) -> tuple[str, str | None]:
    """(deployment of the largest model, of the smallest) — the 70B and 7B of the article."""
    ranked = sorted(scenario.deployments, key=lambda d: (-d.model.params_b, d.name))
    return ranked[0].name, (ranked[-1].name if len(ranked) > 1 else None)


def build_results(
    scenario: Scenario, seed: int, duration_s: float, systems: dict[str, Any]
) -> dict[str, Any]:
    """The results file's content (deterministic: no wall-clock figures)."""
    big, small = model_deployments(scenario)
    head = headline(systems, big, small)
    preemptions = [e["t_s"] for e in systems["fixed"]["deployments"][big]["preemptions"]]
    return {
        "scenario": scenario.name,
        "deployments": {"large_model": big, "small_model": small},
        "seed": seed,
        "duration_s": duration_s,
        "article": ARTICLE,
        "summary": head,
        "targets": targets(head),
        "preemptions_s": preemptions,
        "systems": systems,
    }


def write_outputs(out_dir: Path, name: str, results: dict[str, Any]) -> tuple[Path, Path]:
    """The JSON results and the PNG timeline."""
    from bench.sim.plot import write_png

    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{name}.json"
    json_path.write_text(json.dumps(results, sort_keys=True, indent=1) + "\n", encoding="utf-8")
    png_path = out_dir / f"{name}.png"
    order = [n for n in results["deployments"].values() if n is not None]
    write_png(png_path, results["systems"], results["preemptions_s"], order)
    return json_path, png_path


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(prog="python -m bench.fragmented", description=__doc__)
    parser.add_argument("--scenario", type=Path, default=SEED_FRAGMENTED)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--duration", type=float, default=None, help="simulated seconds")
    parser.add_argument("--workers", type=int, default=2, help="processes (results unchanged)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run, write, print; the last line is the summary JSON."""
    args = parse_args(argv)
    scenario = load_scenario(args.scenario)
    duration_s = min(args.duration or scenario.duration_s, scenario.duration_s)
    started = time.perf_counter()  # wall clock: printed only, never written to the results
    systems, cpu_s = run_all(args.scenario, args.seed, duration_s, max(1, args.workers))
    wall_s = time.perf_counter() - started
    results = build_results(scenario, args.seed, duration_s, systems)
    json_path, png_path = write_outputs(args.out, results_name(scenario, duration_s), results)
    print(f"scenario {scenario.name}, seed {args.seed}, {duration_s / 3600:.2f} simulated h")
    big, small = model_deployments(scenario)
    print(table(systems, big, small))
    print("targets:")
    print(targets_text(results["targets"]))
    print(f"wrote {json_path} and {png_path}")
    print(f"wall: {wall_s:.1f} s for {len(systems)} systems on {args.workers} workers")
    print("cpu s per system: " + ", ".join(f"{k} {v:.1f}" for k, v in cpu_s.items()))
    problems = run_problems(systems, results["preemptions_s"])
    for problem in problems:
        print(f"FAILED: {problem}")
    print_result(results["summary"])
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
