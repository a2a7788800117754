"""Torch engine benchmark: cost-model fidelity, KV migration bandwidth, real shifts.

Run: ``python -m bench.engine`` (``--quick`` for fewer samples). On this host it

1. measures the machine (single-thread matmul GFLOP/s, memcpy and read GB/s, best of repeats,
   before and after the steps): the "GPU class" the cost model is given — the machine
   calibration figure;
2. measures prefill and decode step times of TP1, TP2 and PP2 plans across prompt lengths and
   batch sizes — device time (the ranks' CPU time), the fastest of interleaved rounds (see
   ``measure.step_times``) — and, in the same rounds, TP2's all-reduces alone (as many back to
   back as a step runs, of 1 row and of the longest prompt's rows: ``fidelity.measured_collective``:
   link latency and collective efficiency, reported as measured); fits gearbox's constants
   (``mfu_prefill``, ``mbu_decode``, ``mfu_decode``, ``step_overhead_s``,
   ``seq_layer_overhead_s``, ``roofline_overlap``, ``single_seq_read_speedup``,
   ``collective_efficiency`` and the link latency) on a subset —
   for every plan, the smallest and the largest prompt, and decode batches of 1, 2 and the
   largest: two sizes per plan and phase identify each size-linear term's slope (efficiency,
   bandwidth) and intercept (fixed cost, latency); a batch of one runs its products as
   matrix-vector kernels, faster than the batched line through 2..16 (``gearbox.cost``), so it
   is a third decode point; TP1 beside TP2 separates what TP divides from what it does not —
   and reports the held-in error (``step_time_mape_calib``), the held-out error on every
   interior point (prompts 64 and 128, batches 4, 6, 8, 12)
   (``step_time_mape``) and the rank correlation of predicted and measured times
   (``plan_rank_spearman``); the baseline is the same prediction with gearbox's default
   constants; the same split with the measured collective fed in instead of fitted
   (``step_time_mape_measured_link``: TP2's all-reduces alone cost about half of what a TP2
   step pays beyond its share of the work, so it predicts TP2 low), the earlier split (all of
   TP1, the smallest point of each other plan, ``step_time_mape_tp1_split``), the split
   without the batch of 2 (``step_time_mape_endpoints``) and this split fitted on the
   driver's wall times (``step_time_mape_wall``) are reported beside it. The PP plan here runs
   one packed batch per step (``pp_microbatches=1``, gearbox's ``pp_microbatching=False``):
   gearbox models a pipeline kept full across steps, which a step-synchronous engine is not;
   gearbox's per-token count of the embedding table and LM head is corrected in
   ``fidelity.engine_spec`` (the head runs on one row per sequence, whole on the TP leader);
3. times PP2's steps with micro-batches against one packed batch (``pp2_microbatch_*``);
4. migrates active sequences' KV from TP2 to TP1 and compares its bandwidth with a plain
   memcpy of the same bytes (``migration_bw_frac_of_memcpy``), and the shift's CPU time in the
   driver (every sequence migrates: the copies are all its work) with gearbox's predicted
   switch duration (``switch_cost_error``; on wall time ``switch_cost_error_wall``);
5. runs the five shift kinds on a tiny model with migrated and replayed sequences and counts
   those whose tokens equal the single-process reference (``token_exact_shifts``).

Prints the figures, then one JSON line last; exits 1 naming each missed target.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass

import torch

from bench.engine.fidelity import (
    MeasuredCollective,
    SplitFit,
    fit_split,
    mape,
    measured_collective,
    predict_all,
)
from bench.engine.measure import Machine, Sample, machine, microbatch_times, start, step_times
from bench.engine.shifts import migration_run, token_exact_runs
from gearbox.config import DEFAULT_CONFIG
from gearbox.types import GpuClass, LinkClass
from runtime.engine.torch.config import LlamaConfig
from runtime.engine.torch.engine import TorchEngine, TorchEngineConfig
from runtime.engine.torch.plans import GIB
from runtime.engine.torch.tokens import TokenLedger

BENCH_MODEL = LlamaConfig(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1408,
    num_layers=4,
    num_heads=8,
    num_kv_heads=4,
    name="bench-llama-16m",
)
SOURCE = "random:11"
PLANS = ("tp1", "tp2", "pp2")
# NOTE: a fact of the measured engines, not a fitted constant: PP passes one packed batch
ENGINE_FACTS = dataclasses.replace(DEFAULT_CONFIG, pp_microbatching=False)
FITTED = (
    "mfu_prefill",
    "mbu_decode",
    "mfu_decode",
    "step_overhead_s",
    "seq_layer_overhead_s",
    "roofline_overlap",
    "single_seq_read_speedup",
)
TARGETS = {
    "token_exact_shifts": (">=", 5),
    "token_mismatches": ("<=", 0),
    "migration_bw_frac_of_memcpy": (">=", 0.5),
    "step_time_mape": ("<=", 0.10),
    "plan_rank_spearman": (">=", 0.95),
    "switch_cost_error": ("<=", 0.25),
}


def _missed(result: dict[str, float]) -> list[str]:
    out = []
    for name, (op, bound) in TARGETS.items():
        value = result[name]
        ok = value >= bound if op == ">=" else value <= bound
        if not ok:
            out.append(f"{name}={value:.3g} (target {op} {bound})")
    return out


@dataclass(frozen=True, slots=True)
class _Fits:
    """The calibration split's fit and the comparisons reported beside it."""

    main: SplitFit  # every constant fitted on the calibration split, the collective's too
    measured_link: SplitFit  # the same split, the collective measured (``coll``), not fitted
    coll: MeasuredCollective  # TP2's all-reduces timed alone
    num_calib: int
    wall: SplitFit  # the main split fitted on the driver's wall times
    tp1_split: SplitFit  # the earlier split: all of TP1, the smallest point of the others
    endpoints: SplitFit  # the main split without the batch of 2


def _fits(
    samples: list[Sample], lens: list[int], batches: list[int], gpu: GpuClass, link0: LinkClass
) -> _Fits:
    steps = [s for s in samples if s.phase != "allreduce"]
    calib = [
        s
        for s in steps
        if (s.phase == "prefill" and s.tokens in (lens[0], lens[-1]))
        or (s.phase == "decode" and s.batch in (batches[0], batches[1], batches[-1]))
    ]
    tp1_calib = [
        s
        for s in steps
        if s.plan == "tp1"
        or (s.tokens == lens[0] and s.phase == "prefill")
        or (s.batch == batches[0] and s.phase == "decode")
    ]

    def split(chosen: list[Sample], pool: list[Sample] = steps) -> SplitFit:
        rest = [s for s in pool if s not in chosen]
        return fit_split(chosen, rest, BENCH_MODEL, gpu, link0, ENGINE_FACTS, fit_collective=True)

    coll = measured_collective(
        [s for s in samples if s.phase == "allreduce" and s.plan == "tp2"], BENCH_MODEL, link0, 2
    )
    measured_link = fit_split(
        calib,
        [s for s in steps if s not in calib],
        BENCH_MODEL,
        gpu,
        dataclasses.replace(link0, latency_us=coll.latency_us),
        dataclasses.replace(ENGINE_FACTS, collective_efficiency=coll.efficiency),
        fit_collective=False,
    )
    walled = [dataclasses.replace(s, step_s=s.wall_s) for s in steps]
    return _Fits(
        main=split(calib),
        measured_link=measured_link,
        coll=coll,
        num_calib=len(calib),
        wall=split([w for w, s in zip(walled, steps, strict=True) if s in calib], walled),
        tp1_split=split(tp1_calib),
        endpoints=split([s for s in calib if s.phase == "prefill" or s.batch != batches[1]]),
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 when every target is met."""
    parser = argparse.ArgumentParser(prog="python -m bench.engine")
    parser.add_argument("--quick", action="store_true", help="fewer lengths and repeats")
    parser.add_argument(
        "--samples-out", metavar="PATH", help="write the measured steps here (JSON) to refit"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    m = machine()
    print(
        f"machine: {m.gflops:.1f} GFLOP/s fp32 matmul (1 thread), {m.memcpy_gbps:.2f} GB/s "
        f"memcpy, {m.read_gbps:.2f} GB/s read"
    )
    lens = [32, 64, 128] if args.quick else [32, 64, 128, 256]
    batches = [1, 2, 4, 8] if args.quick else [1, 2, 4, 6, 8, 12, 16]
    rounds = 3 if args.quick else 9
    max_rounds = 3 if args.quick else 21
    settings = TorchEngineConfig(
        num_blocks=512, block_size=16, max_batch=32, max_prefill_tokens=4096, pp_microbatches=1
    )
    engines: dict[str, TorchEngine] = {}
    try:
        for kind in (*PLANS, "pp2-mb"):
            ledger = TokenLedger(BENCH_MODEL.vocab_size)
            # NOTE: the micro-batched engine splits every pass (no token floor), so the figure
            # is the split's effect on decode too
            knobs = (
                dataclasses.replace(settings, pp_microbatches=0, pp_microbatch_min_tokens=1)
                if kind == "pp2-mb"
                else settings
            )
            engines[kind] = start(
                kind.removesuffix("-mb"), BENCH_MODEL, SOURCE, ledger, knobs, kind
            )
        micro = microbatch_times(engines["pp2"], engines.pop("pp2-mb"), batches[-1], 64, rounds)
        samples, kept = step_times(
            engines, lens, batches, 64, rounds, max_rounds, probe_rows=(1, lens[-1])
        )
    finally:
        for engine in engines.values():
            engine.close()
    if args.samples_out:
        with open(args.samples_out, "w", encoding="utf-8") as out:
            json.dump([dataclasses.asdict(s) for s in samples], out)
    # the machine again after the steps, each figure its best: a neighbour only lowers them
    again = machine()
    m = Machine(
        max(m.gflops, again.gflops),
        max(m.memcpy_gbps, again.memcpy_gbps),
        max(m.read_gbps, again.read_gbps),
    )
    print(f"step times: fastest of {kept} rounds (at least {rounds}, at most {max_rounds})")
    print(
        f"machine, best of before and after the steps: {m.gflops:.1f} GFLOP/s, "
        f"{m.memcpy_gbps:.2f} GB/s memcpy, {m.read_gbps:.2f} GB/s read"
    )
    gpu = GpuClass("cpu-host", m.gflops / 1000, 16 * GIB, m.read_gbps)
    link0 = LinkClass("shm", m.memcpy_gbps, 50.0)
    fits = _fits(samples, lens, batches, gpu, link0)
    main_fit, coll = fits.main, fits.coll
    config, held = main_fit.config, main_fit.held
    measured = [s.step_s for s in held]
    baseline = predict_all(held, BENCH_MODEL, gpu, link0, DEFAULT_CONFIG)
    print(
        f"{'plan':5} {'phase':8} {'batch':>5} {'tokens':>6} {'device_ms':>10} "
        f"{'predicted_ms':>12} {'wall_ms':>8}"
    )
    for s, p in zip(held, main_fit.predicted, strict=True):
        print(
            f"{s.plan:5} {s.phase:8} {s.batch:5d} {s.tokens:6d} {s.step_s * 1e3:10.2f} "
            f"{p * 1e3:12.2f} {s.wall_s * 1e3:8.2f}"
        )
    fitted = {k: float(getattr(config, k)) for k in FITTED}
    print(
        f"calibrated on {fits.num_calib} samples: {fitted}, link latency "
        f"{main_fit.link.latency_us:.0f} us (fitted)"
    )
    print(
        f"TP2 all-reduce measured alone ({coll.calls} back to back, as many as a step runs; "
        f"fastest of the rounds): {coll.small_s * 1e6:.0f} us per all-reduce of "
        f"{coll.small_rows} row, {coll.large_s * 1e6:.0f} us of {coll.large_rows}: link latency "
        f"{coll.latency_us:.0f} us, collective efficiency {coll.efficiency:.3f} (measured) vs "
        f"{main_fit.link.latency_us:.0f} us, {config.collective_efficiency:.3f} fitted; the "
        f"measured pair fed to the fit instead: held-out MAPE {fits.measured_link.held_mape:.3f}, "
        f"Spearman {fits.measured_link.spearman:.3f}"
    )
    print(
        f"held-in MAPE {main_fit.calib_mape:.3f}, held-out MAPE {main_fit.held_mape:.3f}; "
        f"baseline (gearbox defaults) held-out MAPE {mape(baseline, measured):.3f}; "
        f"on wall times (fitted the same way) held-out MAPE {fits.wall.held_mape:.3f}; "
        f"the earlier split (TP1 + smallest points) held-out MAPE {fits.tp1_split.held_mape:.3f}; "
        f"calibrated without the batch of 2, held-out MAPE {fits.endpoints.held_mape:.3f}"
    )
    gains = {g.phase: g for g in micro}
    for g in micro:
        print(
            f"PP2 {g.phase} of {g.batch} sequences: one packed batch {g.device_s[0] * 1e3:.2f} ms "
            f"device ({g.wall_s[0] * 1e3:.2f} ms wall), micro-batched "
            f"{g.device_s[1] * 1e3:.2f} ms device ({g.wall_s[1] * 1e3:.2f} ms wall)"
        )
    mig = migration_run(BENCH_MODEL, SOURCE, settings, gpu, main_fit.link, config, m)
    print(
        f"KV migration: {mig.bytes / 1e6:.1f} MB in {mig.migrate_s * 1e3:.1f} ms = "
        f"{mig.bw_gbps:.2f} GB/s vs memcpy {mig.memcpy_gbps:.2f} GB/s; "
        f"shift {mig.shift_cpu_s * 1e3:.1f} ms CPU ({mig.shift_s * 1e3:.1f} ms wall) "
        f"vs gearbox predicted {mig.predicted_s * 1e3:.1f} ms"
    )
    exact, mismatches, kinds = token_exact_runs()
    print(
        f"token-exact shifts: {exact}/{len(kinds)} ({', '.join(kinds)}), "
        f"mismatched tokens {mismatches}"
    )
    result: dict[str, float] = {
        "machine_gflops": round(m.gflops, 2),
        "machine_memcpy_gbps": round(m.memcpy_gbps, 3),
        "machine_read_gbps": round(m.read_gbps, 3),
        "step_time_mape": round(main_fit.held_mape, 4),
        "step_time_mape_calib": round(main_fit.calib_mape, 4),
        "step_time_mape_baseline": round(mape(baseline, measured), 4),
        "step_time_mape_measured_link": round(fits.measured_link.held_mape, 4),
        "step_time_mape_wall": round(fits.wall.held_mape, 4),
        "step_time_mape_tp1_split": round(fits.tp1_split.held_mape, 4),
        "step_time_mape_endpoints": round(fits.endpoints.held_mape, 4),
        "step_time_rounds": kept,
        **{
            f"pp2_microbatch_{kind}_speedup_{phase}": round(
                getattr(gains[phase], f"{kind}_s")[0] / getattr(gains[phase], f"{kind}_s")[1], 3
            )
            for phase in ("prefill", "decode")
            for kind in ("device", "wall")
        },
        "plan_rank_spearman": round(main_fit.spearman, 4),
        "plan_rank_spearman_measured_link": round(fits.measured_link.spearman, 4),
        "migration_bw_gbps": round(mig.bw_gbps, 3),
        "migration_bw_frac_of_memcpy": round(mig.bw_gbps / mig.memcpy_gbps, 4),
        "shift_s": round(mig.shift_cpu_s, 5),
        "shift_wall_s": round(mig.shift_s, 5),
        "predicted_switch_s": round(mig.predicted_s, 5),
        "switch_cost_error": round(abs(mig.shift_cpu_s - mig.predicted_s) / mig.shift_cpu_s, 4),
        "switch_cost_error_wall": round(abs(mig.shift_s - mig.predicted_s) / mig.shift_s, 4),
        "token_exact_shifts": exact,
        "token_mismatches": mismatches,
        **{f"fit_{k}": float(f"{v:.4g}") for k, v in fitted.items()},  # the overheads are us
        "allreduce_small_us": round(coll.small_s * 1e6, 1),
        "allreduce_large_us": round(coll.large_s * 1e6, 1),
        "measured_link_latency_us": round(coll.latency_us, 1),
        "measured_collective_efficiency": round(coll.efficiency, 4),
        "fit_link_latency_us": round(main_fit.link.latency_us, 1),
        "fit_collective_efficiency": round(config.collective_efficiency, 4),
    }
    missed = _missed(result)
    for line in missed:
        print(f"MISSED: {line}", file=sys.stderr)
    print(json.dumps({**result, "ok": not missed, "missed": missed}))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
