"""Planner benchmark: enumeration + scoring time against cluster size.

Builds synthetic fragmented clusters of 8, 32, 64 and 128 atomic blocks (16 GPUs per block on
average: H100 NVLink domains, A100 RDMA fabrics, mixed 48 GB PCIe groups, with uneven free memory
and a few failed GPUs), then times ``build_blocks`` + ``rank_candidates`` for a 70B-class model at
a load proportional to the cluster. Caches are cleared before every timed call (cold) and a
second series reuses them (warm). Prints a table (replica options enumerated, distinct candidate
deployments ranked, replicas in the best one, timings), then LAST one JSON line. The figures are
compared within the run: ``growth_ratio`` is time per block at 128 blocks over time per block at
8 (<= 1 means growth no worse than linear in blocks).

Run: ``python -m bench.planner`` (``--repeats N`` to change the sample count).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

from gearbox import (
    MODEL_70B_GQA,
    Domain,
    GearboxConfig,
    Gpu,
    LoadSnapshot,
    TopologySnapshot,
    available_memory,
    build_blocks,
    clear_caches,
    enumerate_options,
    rank_candidates,
)
from gearbox.presets import GPU_CLASSES, LINK_CLASSES
from gearbox.scoring import request_profile

SIZES = (8, 32, 64, 128)
NOW_S = 10_000.0
_LAYOUTS = (
    ("nvlink", ("h100-sxm",) * 16, 8),
    ("rdma", ("a100-80g",) * 16, 4),
    ("pcie", ("l40s",) * 8 + ("a6000-48g",) * 8, 4),
)


def make_cluster(num_blocks: int, seed: int = 7) -> TopologySnapshot:
    """A fragmented cluster of ``num_blocks`` domains (one atomic block each)."""
    rng = random.Random(seed)
    gpus: list[Gpu] = []
    domains: list[Domain] = []
    for b in range(num_blocks):
        link, classes, per_node = _LAYOUTS[b % len(_LAYOUTS)]
        domain_id = f"d{b:03d}"
        domains.append(Domain(domain_id, LINK_CLASSES[link]))
        for i, name in enumerate(classes):
            cls = GPU_CLASSES[name]
            free = cls.memory_bytes * rng.choice((1.0, 1.0, 0.95, 0.9, 0.6))
            gpus.append(
                Gpu(
                    uuid=f"{domain_id}-g{i:02d}",
                    node=f"{domain_id}-n{i // per_node}",
                    gpu_class=cls,
                    domain=domain_id,
                    total_memory_bytes=cls.memory_bytes,
                    free_memory_bytes=int(free),
                    healthy=rng.random() > 0.02,
                    schedulable=True,
                    utilisation=rng.random() * 0.3,
                    last_seen_s=NOW_S - rng.random() * 20,
                )
            )
    return TopologySnapshot(NOW_S, tuple(gpus), tuple(domains), LINK_CLASSES["rdma"])


def make_load(num_blocks: int) -> LoadSnapshot:
    """About a quarter of the cluster's modelled capacity."""
    return LoadSnapshot(
        now_s=NOW_S,
        arrival_rate_rps=1.5 * num_blocks,
        mean_prompt_tokens=1000.0,
        mean_output_tokens=200.0,
        active_sequences=40 * num_blocks,
        active_kv_tokens=40 * num_blocks * 1100,
    )


def _time_ms(fn: Callable[[], object], repeats: int, cold: bool) -> list[float]:
    samples = []
    for _ in range(repeats):
        if cold:
            clear_caches()
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return samples


def run(repeats: int) -> list[dict[str, float | int]]:
    """Time every cluster size; one row per size."""
    config = GearboxConfig()
    rows: list[dict[str, float | int]] = []
    for size in SIZES:
        snapshot, load = make_cluster(size), make_load(size)

        def plan(snapshot: TopologySnapshot = snapshot, load: LoadSnapshot = load) -> object:
            blocks = build_blocks(snapshot, config)
            return rank_candidates(snapshot, blocks, MODEL_70B_GQA, load, config, deployment="b")

        blocks = build_blocks(snapshot, config)
        ranked = rank_candidates(snapshot, blocks, MODEL_70B_GQA, load, config, deployment="b")
        prompt, output = request_profile(load, config)
        free = available_memory(snapshot, frozenset())
        options = enumerate_options(blocks, snapshot, MODEL_70B_GQA, prompt, output, free, config)
        cold = _time_ms(plan, repeats, cold=True)
        warm = _time_ms(plan, repeats, cold=False)
        rows.append(
            {
                "blocks": size,
                "gpus": len(snapshot.gpus),
                "options": len(options),
                "candidates": len(ranked),
                "replicas_best": len(ranked[0].plan.replicas) if ranked else 0,
                "median_ms": statistics.median(cold),
                "p90_ms": sorted(cold)[int(0.9 * (len(cold) - 1))],
                "warm_median_ms": statistics.median(warm),
            }
        )
    return rows


def main() -> None:
    """Print the table, then the JSON summary line (last)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    rows = run(args.repeats)
    header = f"{'blocks':>6} {'gpus':>5} {'options':>7} {'deploys':>7} {'replicas':>8} "
    header += f"{'median ms':>10} "
    print(header + f"{'p90 ms':>8} {'warm ms':>8} {'ms/block':>9}")
    for r in rows:
        print(
            f"{r['blocks']:>6} {r['gpus']:>5} {r['options']:>7} {r['candidates']:>7} "
            f"{r['replicas_best']:>8} "
            f"{r['median_ms']:>10.2f} {r['p90_ms']:>8.2f} {r['warm_median_ms']:>8.2f} "
            f"{r['median_ms'] / r['blocks']:>9.3f}"
        )
    by_size = {int(r["blocks"]): r for r in rows}
    ref = by_size[64]
    per_block = {s: by_size[s]["median_ms"] / s for s in SIZES}
    summary = {
        "bench": "planner",
        "blocks": ref["blocks"],
        "gpus": ref["gpus"],
        "median_ms": round(float(ref["median_ms"]), 3),
        "warm_median_ms": round(float(ref["warm_median_ms"]), 3),
        "median_ms_by_blocks": {str(s): round(float(by_size[s]["median_ms"]), 3) for s in SIZES},
        "options_by_blocks": {str(s): by_size[s]["options"] for s in SIZES},
        # time per block at 128 blocks over time per block at 8: <= 1 means at most linear
        "growth_ratio": round(per_block[128] / per_block[8], 3),
        "growth_ratio_64_vs_32": round(per_block[64] / per_block[32], 3),
        "goal_ms": 20.0,
    }
    print(json.dumps(summary, sort_keys=True))


if __name__ == "__main__":
    main()
