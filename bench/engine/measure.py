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


@dataclass(frozen=True, slots=True)
class Sample:
    """One measured step."""

    plan: str
    phase: str  # "prefill" or "decode"
    batch: int
    tokens: int  # prompt length (prefill) or context length (decode)
    step_s: float


def _best(fn: object, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return min(times)


def machine() -> Machine:
    """Matmul throughput and memcpy bandwidth, one thread."""
    torch.set_num_threads(1)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    mm_s = _best(lambda: a @ b, 20)
    src, dst = torch.randn(64 * MB // 4), torch.empty(64 * MB // 4)
    cp_s = _best(lambda: dst.copy_(src), 5)
    return Machine(2 * 512**3 / mm_s / 1e9, 64 * MB / cp_s / 1e9)


def memcpy_gbps(num_bytes: int) -> float:
    """Plain copy of ``num_bytes`` contiguous bytes, GB/s (the migration baseline)."""
    src, dst = torch.randn(max(1, num_bytes // 4)), torch.empty(max(1, num_bytes // 4))
    return num_bytes / _best(lambda: dst.copy_(src), 5) / 1e9


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
    engine: TorchEngine,
    kind: str,
    prompt_lens: list[int],
    batches: list[int],
    context: int,
    repeats: int,
) -> list[Sample]:
    """Prefill of one prompt per length; decode steps at each batch size (fastest of repeats).

    NOTE: the fastest, not the median: on a shared host other processes only ever add time, so
    the minimum is the least-disturbed estimate of the step (timeit's advice); medians of three
    swung a decode step 50 % between runs while a neighbour was busy."""
    out: list[Sample] = []
    n = 0
    for length in prompt_lens:
        times = []
        for _ in range(repeats):
            n += 1
            admit_all(engine, [SeqSpec(f"{kind}-p{n}", length, 1)])
            engine.step(0.0)
            times.append(engine.last_iteration_s)
        out.append(Sample(kind, "prefill", 1, length, min(times)))
    for batch in batches:
        n += 1
        admit_all(engine, [SeqSpec(f"{kind}-d{n}-{i}", context, repeats + 2) for i in range(batch)])
        engine.step(0.0)  # prefill them all
        times = []
        for _ in range(repeats):
            engine.step(0.0)
            times.append(engine.last_iteration_s)
        run_to_completion([engine])
        out.append(Sample(kind, "decode", batch, context + 1, min(times)))
    return out
