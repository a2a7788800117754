"""Multi-model scheduling benchmark: round-robin versus gearbox placement with pre-OOM throttling.

The second source article's case, as a seeded discrete-event simulation with a simulated clock:
4 large-memory (80 GB) and 8 small (24 GB) GPUs serve a farm of 24 models (1.5B to 34B) under
bursty per-model traffic with cluster-wide long-prompt spikes; some models go cold, others arrive
late and need room. Both systems replay the same requests on the same simulator
(:mod:`bench.mm.core`), built from the product's own code: ``gearbox.place_model`` and
``gearbox.dead_memory``, the runtime's ``check_watermark`` and ``ReservationManager`` (VMM), the
runtime's ``ReplicaTiming`` for service and load times and its ``SimGpuPool`` for physical
memory. Only placement, routing/admission and eviction differ (:mod:`bench.mm.systems`).

Prints a table with the article's figures beside ours, writes the deterministic result to
``bench/results/multimodel.json`` (sorted keys; no wall-clock values), then prints LAST one JSON
line: that same result plus ``wall_s``.

Run: ``python -m bench.multimodel`` (``--seed``, ``--duration-s``, ``--load-scale``, ``--out``;
``--out -`` writes no file).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.mm.core import Simulator, System
from bench.mm.scenario import Scenario, build_scenario
from bench.mm.systems import GearboxSystem, RoundRobinSystem
from gearbox.config import PlacementConfig

__all__ = ["main", "results_text", "run_benchmark"]

DEFAULT_SEED = 7
DEFAULT_DURATION_S = 5400.0  # 1.5 h: long enough for tidal models to go cold (30 min idle)
RESULTS_PATH = Path(__file__).resolve().parent / "results" / "multimodel.json"
UTIL_TARGET = 2.0  # ours / round-robin
DEAD_TARGET = 0.10  # share of cluster memory

SystemFactory = Callable[[Simulator], System]


def _run_system(
    scenario: Scenario, factory: SystemFactory, placement: PlacementConfig
) -> dict[str, object]:
    sim = Simulator(scenario, placement)
    metrics = sim.run(factory(sim))
    capacity = sum(g.total_memory_bytes for g in scenario.cluster.gpus)
    return metrics.summary(capacity, len(scenario.cluster.gpus), scenario.duration_s)


def _ratio(ours: object, theirs: object) -> float:
    assert isinstance(ours, int | float) and isinstance(theirs, int | float)
    return round(ours / theirs, 6) if theirs else 0.0


def run_benchmark(
    seed: int = DEFAULT_SEED,
    duration_s: float = DEFAULT_DURATION_S,
    load_scale: float = 1.0,
    placement: PlacementConfig | None = None,
) -> dict[str, object]:
    """Run both systems on one scenario; the result is a plain, deterministic dict."""
    placement = placement or PlacementConfig()
    scenario = build_scenario(seed, duration_s, load_scale)
    rr = _run_system(scenario, RoundRobinSystem, placement)
    ours = _run_system(scenario, GearboxSystem, placement)
    result: dict[str, object] = {
        "bench": "multimodel",
        "seed": seed,
        "duration_s": duration_s,
        "load_scale": load_scale,
        "scenario": {
            "num_requests": len(scenario.requests),
            "num_models": len(scenario.models),
            "num_gpus": len(scenario.cluster.gpus),
            "num_long_prompt_requests": sum(r.long_prompt for r in scenario.requests),
            "spikes_s": [list(s) for s in scenario.spikes],
        },
        "systems": {"round_robin": rr, "gearbox": ours},
        "oom_rr": rr["oom_events"],
        "oom_ours": ours["oom_events"],
        "util_rr": rr["busy_frac"],
        "util_ours": ours["busy_frac"],
        "util_ratio": _ratio(ours["busy_frac"], rr["busy_frac"]),
        "mem_util_ratio": _ratio(ours["mem_util"], rr["mem_util"]),
        "served_tokens_ratio": _ratio(ours["served_tokens"], rr["served_tokens"]),
        "dead_memory_frac_rr": rr["dead_frac"],
        "dead_memory_frac_ours": ours["dead_frac"],
        "evicted_with_active": ours["evicted_with_active"],
        "evicted_with_active_rr": rr["evicted_with_active"],
    }
    result["targets"] = _targets(result)
    return result


def _targets(result: dict[str, object]) -> dict[str, bool]:
    util_ratio, dead = result["util_ratio"], result["dead_memory_frac_ours"]
    assert isinstance(util_ratio, float) and isinstance(dead, float)
    return {
        "zero_oom_ours": result["oom_ours"] == 0,
        "rr_shows_oom": isinstance(result["oom_rr"], int) and result["oom_rr"] > 0,
        "util_ratio_ge_2": util_ratio >= UTIL_TARGET,
        "dead_memory_lt_10pct": dead < DEAD_TARGET,
        "no_eviction_with_active": result["evicted_with_active"] == 0,
    }


def results_text(result: dict[str, object]) -> str:
    """The results file's content: sorted keys, stable formatting."""
    return json.dumps(result, sort_keys=True, indent=2) + "\n"


def _pct(value: object) -> str:
    return f"{float(value):.1%}" if isinstance(value, int | float) else str(value)


def _num(value: object) -> str:
    return f"{value:.0f}" if isinstance(value, float) else str(value)


def _pair(first: str, second: str) -> Callable[[dict[str, object]], str]:
    return lambda s: f"{_num(s[first])} / {_num(s[second])}"


def _p50_p95(s: dict[str, object]) -> str:
    return f"{s['latency_p50_s']:.2f} / {s['latency_p95_s']:.2f}"


# label, how a system's summary shows, the article's figures for round-robin and for ours
_ROWS: tuple[tuple[str, Callable[[dict[str, object]], str], str, str], ...] = (
    ("OOM events (process crashes)", lambda s: _num(s["oom_events"]), "OOMs", "0"),
    ("requests lost to OOM", lambda s: _num(s["failed_oom"]), "", ""),
    ("429 rejections", lambda s: _num(s["rejected_429"]), "", "429, no crash"),
    ("timed out (queue / no instance)", lambda s: _num(s["timed_out"]), "", ""),
    ("served share of requests", lambda s: _pct(s["served_share"]), "", ""),
    ("served tokens / s", lambda s: _num(s["served_tok_s"]), "", ""),
    ("compute util (busy, served)", lambda s: _pct(s["busy_frac"]), "< 30 %", ""),
    ("memory util (served work)", lambda s: _pct(s["mem_util"]), "", ""),
    ("dead memory / cluster memory", lambda s: _pct(s["dead_frac"]), "15–25 %", "< 10 %"),
    ("dead memory / free memory", lambda s: _pct(s["dead_share"]), "", ""),
    ("model loads (incl. reloads)", lambda s: _num(s["loads"]), "", ""),
    ("evictions / with active reqs", _pair("evictions", "evicted_with_active"), "", "0 active"),
    ("latency p50 / p95 s", _p50_p95, "", ""),
)


def format_table(result: dict[str, object]) -> str:
    """Both systems side by side with the article's figures, then the ratios and targets."""
    systems = result["systems"]
    assert isinstance(systems, dict)
    rr, ours = systems["round_robin"], systems["gearbox"]
    header = f"{'metric':32} {'round-robin':>13} {'ours':>13}  " + (
        f"{'article: RR':>11} {'article: ours':>14}"
    )
    lines = [header, "-" * len(header)]
    for label, show, article_rr, article_ours in _ROWS:
        lines.append(
            f"{label:32} {show(rr):>13} {show(ours):>13}  {article_rr:>11} {article_ours:>14}"
        )
    lines.append(
        f"ours / round-robin: compute util {result['util_ratio']:.2f}× (target ≥ "
        f"{UTIL_TARGET:.0f}×), memory util {result['mem_util_ratio']:.2f}×, served tokens "
        f"{result['served_tokens_ratio']:.2f}×"
    )
    targets = result["targets"]
    assert isinstance(targets, dict)
    verdicts = ", ".join(f"{k}={'met' if v else 'MISSED'}" for k, v in targets.items())
    lines.append(f"targets: {verdicts}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run, print the table, write the results file, print the JSON line last."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--duration-s", type=float, default=DEFAULT_DURATION_S)
    parser.add_argument("--load-scale", type=float, default=1.0)
    parser.add_argument("--out", default=str(RESULTS_PATH), help="results file, '-' for none")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    result = run_benchmark(args.seed, args.duration_s, args.load_scale)
    wall_s = time.perf_counter() - started
    print(format_table(result))
    print(f"wall time {wall_s:.1f} s (not part of the results file)")
    if args.out != "-":
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(results_text(result))
    print(json.dumps({**result, "wall_s": round(wall_s, 3)}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
