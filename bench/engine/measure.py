"""Measurements on the torch engine: machine figures, step times per plan, KV migration."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from runtime.engine.base import SeqSpec
from runtime.engine.torch.config import LlamaConfig
from runtime.engine.torch.engine import TorchEngine, TorchEngineConfig
from runtime.engine.torch.plans import make_plan
from runtime.engine.torch.shift import admit_all, run_to_completion
from runtime.engine.torch.tokens import TokenLedger

MB = 1024**2


@dataclass(frozen=True, slots=True)
class Machine:
    """Single-thread figures of this host (the "GPU" of the CPU reference engine)."""

    gflops: float  # float32 matmul, one thread
    memcpy_gbps: float  # large contiguous copy, GB/s (read + write counted once)
    read_gbps: float  # large contiguous read (a sum), GB/s: what a decode step's weight read does


@dataclass(frozen=True, slots=True)
class Sample:
    """One measured step."""

    plan: str
    phase: str  # "prefill", "decode" or "allreduce" (``TorchEngine.probe_allreduce``)
    batch: int  # sequences (an all-reduce probe: all-reduces run back to back)
    tokens: int  # prompt length (prefill), context length (decode) or rows (all-reduce)
    step_s: float  # device time: the ranks' busy (CPU) time, see TorchEngine.last_device_s
    wall_s: float  # the driver's wall time for the same steps


def _best(fn: object, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return min(times)


def machine() -> Machine:
    """Matmul throughput, memcpy and read bandwidth, one thread (best of repeats)."""
    torch.set_num_threads(1)
    # NOTE: the peak is the best of a few GEMM shapes (square and the bench model's MLP-down);
    # one 512² shape alone read 60-95 GFLOP/s between runs and below what prefill achieved
    rates = []
    for m, k, n in ((512, 512, 512), (1024, 1024, 1024), (256, 1408, 512)):
        a, b = torch.randn(m, k), torch.randn(k, n)
        rates.append(2 * m * k * n / _best(lambda a=a, b=b: a @ b, 20) / 1e9)
    src, dst = torch.randn(64 * MB // 4), torch.zeros(64 * MB // 4)
    # NOTE: 30 repeats of a few ms each: best-of-5 read 3.3-8.8 GB/s between runs beside a
    # neighbour, and a low figure pins the fitted efficiencies at their bound of 1
    cp_s = _best(lambda: dst.copy_(src), 30)
    read_s = _best(lambda: src.sum(), 30)
    return Machine(max(rates), 64 * MB / cp_s / 1e9, 64 * MB / read_s / 1e9)


def memcpy_gbps(num_bytes: int) -> float:
    """Plain copy of ``num_bytes`` contiguous bytes, GB/s (the migration baseline)."""
    # NOTE: a zeroed (touched) destination, like the KV pools: an empty one page-faults
    src, dst = torch.randn(max(1, num_bytes // 4)), torch.zeros(max(1, num_bytes // 4))
    return num_bytes / _best(lambda: dst.copy_(src), 10) / 1e9


def start(
    kind: str,
    cfg: LlamaConfig,
    source: str,
    ledger: TokenLedger,
    settings: TorchEngineConfig,
    prefix: str | None = None,
) -> TorchEngine:
    """A loaded, connected engine or an error naming the plan."""
    engine = TorchEngine(
        make_plan(kind, cfg.num_layers, prefix or kind, model_name=cfg.name),
        cfg,
        source,
        ledger,
        settings=settings,
    )
    for index in range(len(engine.plan.stages)):
        result = engine.load_shard(index, 0.0)
        if not result.ok:
            raise RuntimeError(f"{kind}: load failed: {result.detail}")
    if not engine.build_comm_groups(0.0).ok:
        raise RuntimeError(f"{kind}: process group failed")
    return engine


def step_times(
    engines: dict[str, TorchEngine],
    prompt_lens: list[int],
    batches: list[int],
    context: int,
    rounds: int,
    max_rounds: int | None = None,
    settle: float = 0.02,
    probe_rows: tuple[int, ...] = (),
) -> tuple[list[Sample], int]:
    """Prefill of one prompt per length and one decode step per batch size, for every plan, in
    at least ``rounds`` interleaved rounds (each visits every plan and point once, the plans in
    rotated order); each point's time is the fastest of the rounds. Rounds go on, up to
    ``max_rounds``, while the last ``rounds // 3`` rounds still lowered some point's fastest
    time by more than ``settle`` (a share): on a busy host a few rounds may all be disturbed.
    Returns the samples and the number of rounds kept.

    NOTE: interleaved so that a neighbour's load on this shared host falls on every plan alike
    instead of on whichever plan was being measured then. The step time is device time (the
    ranks' CPU time, as a CUDA event times a kernel on a GPU), not the driver's wall time: a
    neighbour's busy loop takes the core from a rank mid-step and doubled the wall time of a
    TP2 step, which no cost model of the device can predict. Even CPU time swings (a decode
    step 7.5-23 ms over seven rounds beside two busy loops: steal and cache misses count as the
    rank's time), but only upwards, so the fastest round is the least-disturbed estimate
    (timeit's advice); medians kept half the swing. Wall time is kept beside it (``wall_s``)."""
    kinds = list(engines)
    times: dict[tuple[str, str, int, int], list[tuple[float, float]]] = {}
    n = 0
    r = -1
    window = max(1, rounds // 3)
    while True:
        r += 1
        if r > rounds and (r > (max_rounds or rounds) or _settled(times, window, settle)):
            break
        # round 0 warms every shape up and is not kept
        for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
            engine = engines[kind]
            for length in prompt_lens:
                n += 1
                admit_all(engine, [SeqSpec(f"{kind}-p{n}", length, 1)])
                engine.step(0.0)
                if r:
                    times.setdefault((kind, "prefill", 1, length), []).append(
                        (engine.last_device_s, engine.last_iteration_s)
                    )
            for batch in batches:
                n += 1
                admit_all(engine, [SeqSpec(f"{kind}-d{n}-{i}", context, 3) for i in range(batch)])
                engine.step(0.0)  # prefill them all
                engine.step(0.0)  # a first decode step, unmeasured (attends over context + 1)
                engine.step(0.0)  # the measured one (context + 2)
                if r:
                    times.setdefault((kind, "decode", batch, context + 2), []).append(
                        (engine.last_device_s, engine.last_iteration_s)
                    )
                run_to_completion([engine])
            if any(stage.tp > 1 for stage in engine.plan.stages):
                calls = 2 * max(stage.num_layers for stage in engine.plan.stages)
                for rows in probe_rows:
                    probed = engine.probe_allreduce(rows, calls)
                    if r:
                        times.setdefault((kind, "allreduce", calls, rows), []).append(probed)
    samples = [
        Sample(kind, phase, batch, tokens, min(d for d, _ in ts), min(w for _, w in ts))
        for (kind, phase, batch, tokens), ts in times.items()
    ]
    return samples, r - 1


def _settled(
    times: dict[tuple[str, str, int, int], list[tuple[float, float]]], window: int, settle: float
) -> bool:
    """Whether no point's fastest device time fell by more than ``settle`` in the last
    ``window`` rounds."""
    for ts in times.values():
        before = min(d for d, _ in ts[:-window])
        if min(d for d, _ in ts[-window:]) < before * (1 - settle):
            return False
    return True


@dataclass(frozen=True, slots=True)
class MicroGain:
    """One step of a PP plan, one packed batch against micro-batches (fastest of rounds)."""

    phase: str  # "prefill" (``batch`` prompts in one step) or "decode"
    batch: int
    device_s: tuple[float, float]  # (one packed batch, micro-batched), see Sample.step_s
    wall_s: tuple[float, float]  # the driver's wall time of the same steps


def microbatch_times(
    unsplit: TorchEngine, split: TorchEngine, batch: int, prompt: int, rounds: int
) -> list[MicroGain]:
    """Prefill of ``batch`` prompts of ``prompt`` tokens in one step, then one decode step of
    them, on the same plan without and with micro-batches, in interleaved rounds."""
    times: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for r in range(rounds + 1):  # round 0 warms up and is not kept
        for index in (1, 0) if r % 2 else (0, 1):  # alternate which runs first
            engine = (unsplit, split)[index]
            tag = f"mb{index}-{r}"
            admit_all(engine, [SeqSpec(f"{tag}-{k}", prompt, 2) for k in range(batch)])
            for phase in ("prefill", "decode"):
                engine.step(0.0)
                if r:
                    times.setdefault((phase, index), []).append(
                        (engine.last_device_s, engine.last_iteration_s)
                    )
            run_to_completion([engine])
    return [
        MicroGain(
            phase,
            batch,
            (min(d for d, _ in times[(phase, 0)]), min(d for d, _ in times[(phase, 1)])),
            (min(w for _, w in times[(phase, 0)]), min(w for _, w in times[(phase, 1)])),
        )
        for phase in ("prefill", "decode")
    ]
