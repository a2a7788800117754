"""Cost-model fidelity: gearbox's step-time formulas against measured steps, and the fit."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.engine.measure import Sample
from gearbox.config import DEFAULT_CONFIG, GearboxConfig
from gearbox.cost import pipeline_decode_cycle_s, pipeline_prefill_s, replica_shape
from gearbox.model import ModelSpec
from gearbox.types import GpuClass, LinkClass
from runtime.engine.torch.config import F32_BYTES, LlamaConfig
from runtime.engine.torch.plans import make_plan

_GRID = [round(0.02 * 1.25**i, 4) for i in range(18)] + [1.0]  # 0.02 .. ~0.9, 1
_LATENCIES_US = [10.0 * 1.5**i for i in range(16)]  # 10 us .. ~4 ms
_OVERLAP = [0.0, 0.25, 0.5, 0.75, 1.0]
_STEP_OVERHEAD_S = [0.0] + [1e-4 * 1.5**i for i in range(14)]  # 0, 0.1 .. ~19 ms
_SEQ_LAYER_OVERHEAD_S = [0.0] + [5e-6 * 1.5**i for i in range(16)]  # 0, 5 us .. ~2 ms
_SPEEDUP = [round(1.15**i, 3) for i in range(12)]  # 1 .. ~4.7


def engine_spec(cfg: LlamaConfig, phase: str, head_tp: int = 1) -> ModelSpec:
    """The model as gearbox should count it for one phase of this engine's steps, the LM head
    on a stage of ``head_tp`` ranks.

    NOTE: a correction of gearbox's count, applied here: gearbox charges 2·N FLOPs (and N
    weights read) per token with N all parameters, but the embedding table is a lookup (no
    FLOPs, a few rows read) and the LM head runs only on the sampled rows — one per sequence.
    A prefill token therefore spends the layers' parameters (the prompt's one head row is
    2·V·h FLOPs per sequence, under 1 % of a 32-token prompt here); a decode token, one per
    sequence, spends the layers' and the head's. Uncorrected, the fitted prefill and decode
    efficiencies pin at their bound of 1 (the model counts work the engine never does).
    The head is replicated, not vocab-parallel: its TP leader reads and multiplies all of it,
    where gearbox divides every parameter by TP, so a decode step on TP ``head_tp`` counts the
    head ``head_tp`` times (gearbox's 1/TP share of that is one whole head).
    """
    spec = cfg.model_spec()
    embeddings = cfg.vocab_size * cfg.hidden_size
    head = 0 if cfg.tie_word_embeddings else embeddings
    spent = spec.num_params - embeddings - head
    if phase == "decode":
        spent += embeddings * head_tp  # the head's V·h, shared with the table when tied
    return dataclasses.replace(spec, num_params=spent)


def predict(
    s: Sample, cfg: LlamaConfig, gpu: GpuClass, link: LinkClass, config: GearboxConfig
) -> float:
    """Gearbox's time for the sample's step on its plan."""
    plan = make_plan(s.plan, cfg.num_layers, s.plan, model_name=cfg.name, gpu=gpu, link=link)
    shape = replica_shape(plan, dict.fromkeys(plan.gpu_uuids, gpu.memory_bytes))
    model = engine_spec(cfg, s.phase, plan.stages[-1].tp)
    if s.phase == "prefill":
        return pipeline_prefill_s(shape.prefill, shape.pp_link, model, s.tokens, config)[0]
    return pipeline_decode_cycle_s(
        shape.decode_pipeline, shape.pp_link, model, s.batch, float(s.tokens), config
    )


def predict_all(
    samples: Sequence[Sample],
    cfg: LlamaConfig,
    gpu: GpuClass,
    link: LinkClass,
    config: GearboxConfig,
) -> list[float]:
    """Predictions in sample order."""
    return [predict(s, cfg, gpu, link, config) for s in samples]


def mape(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Mean absolute percentage error."""
    return sum(abs(p - m) / m for p, m in zip(predicted, measured, strict=True)) / len(measured)


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman rank correlation (average ranks for ties)."""

    def ranks(xs: Sequence[float]) -> list[float]:
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        out = [0.0] * len(xs)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    var = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return cov / var if var else 0.0


@dataclass(frozen=True, slots=True)
class MeasuredCollective:
    """A TP group's all-reduce as gearbox's ring model needs it, from timed all-reduces alone
    (``TorchEngine.probe_allreduce``): two message sizes give the per-byte slope (the achieved
    bandwidth) and the intercept (the fixed cost per all-reduce)."""

    group_size: int
    calls: int  # all-reduces run back to back per probe (a forward's: two per layer)
    small_rows: int
    small_s: float  # device time of one all-reduce of ``small_rows`` × hidden (probe / calls)
    large_rows: int
    large_s: float  # the same of ``large_rows``
    latency_us: float  # gearbox's per-ring-step latency: intercept / 2(p−1)
    efficiency: float  # achieved share of the link's bandwidth (gearbox's collective_efficiency)


def measured_collective(
    probes: Sequence[Sample], cfg: LlamaConfig, link: LinkClass, group_size: int
) -> MeasuredCollective:
    """Gearbox's link latency and collective efficiency that reproduce the probed all-reduces
    of the fewest and the most rows (``Sample.tokens``; ``Sample.batch`` all-reduces each):
    t(bytes) = 2(p−1)/p · bytes / (bandwidth · efficiency) + 2(p−1) · latency, as in
    ``gearbox.cost.allreduce_s``. The efficiency is held within its configured bounds; a
    larger message that probed no slower than the small one reads as efficiency 1."""
    small = min(probes, key=lambda s: s.tokens)
    large = max(probes, key=lambda s: s.tokens)
    steps = 2 * (group_size - 1)

    def volume(rows: int) -> float:
        return steps / group_size * rows * cfg.hidden_size * F32_BYTES

    small_s, large_s = small.step_s / small.batch, large.step_s / large.batch
    per_byte = (large_s - small_s) / max(1.0, volume(large.tokens) - volume(small.tokens))
    full = 1.0 / (link.bandwidth_gbps * 1e9)  # seconds per byte at the link's bandwidth
    efficiency = min(1.0, max(0.01, full / per_byte)) if per_byte > 0 else 1.0
    fixed_s = max(0.0, small_s - volume(small.tokens) * full / efficiency)
    return MeasuredCollective(
        group_size,
        small.batch,
        small.tokens,
        small_s,
        large.tokens,
        large_s,
        fixed_s / steps * 1e6,
        efficiency,
    )


_Params = tuple[GearboxConfig, LinkClass]


def _with(params: _Params, name: str, value: float) -> _Params:
    config, link = params
    if name == "latency_us":
        return config, dataclasses.replace(link, latency_us=value)
    changes: dict[str, Any] = {name: value}
    return dataclasses.replace(config, **changes), link


def _err(samples: Sequence[Sample], params: _Params, cfg: LlamaConfig, gpu: GpuClass) -> float:
    return mape(predict_all(samples, cfg, gpu, params[1], params[0]), [s.step_s for s in samples])


def _descend(
    samples: Sequence[Sample],
    grids: dict[str, list[float]],
    params: _Params,
    cfg: LlamaConfig,
    gpu: GpuClass,
    rounds: int = 4,
) -> _Params:
    """Coordinate descent of MAPE on ``samples`` over the named fields, one grid at a time."""
    for _ in range(rounds):
        for name, grid in grids.items():
            params = min(
                (_with(params, name, v) for v in grid), key=lambda p: _err(samples, p, cfg, gpu)
            )
    return params


_PER_RANK = {
    "mfu_prefill": _GRID,
    "mbu_decode": _GRID,
    "mfu_decode": _GRID,
    "step_overhead_s": _STEP_OVERHEAD_S,
    "seq_layer_overhead_s": _SEQ_LAYER_OVERHEAD_S,
    "roofline_overlap": _OVERLAP,
    "single_seq_read_speedup": _SPEEDUP,
}
_COLLECTIVE = {"collective_efficiency": _GRID, "latency_us": _LATENCIES_US}


# starting values of the per-sequence-layer overhead (0, ~0.09 and ~0.19 ms, on its grid)
_SEQ_STARTS = (0.0, _SEQ_LAYER_OVERHEAD_S[8], _SEQ_LAYER_OVERHEAD_S[10])


def fit(
    samples: Sequence[Sample],
    cfg: LlamaConfig,
    gpu: GpuClass,
    link: LinkClass,
    base: GearboxConfig = DEFAULT_CONFIG,
    *,
    fit_collective: bool = True,
    seq_starts: Sequence[float] = _SEQ_STARTS,
) -> tuple[GearboxConfig, LinkClass]:
    """Fit the cost model's constants on ``samples``: the per-rank ones (prefill MFU, decode
    MBU/MFU, the per-step and per-sequence-layer overheads, the roofline overlap, the
    one-sequence read speed-up) on the single-rank samples, the collective efficiency and link
    latency on the multi-rank ones (unless ``fit_collective`` is False: then ``link`` and
    ``base`` carry measured figures), then all of them together on every sample — only there
    do the per-sequence overhead (not divided by TP) and decode compute (divided by TP)
    separate. From several starts (roofline overlap × per-sequence-layer overhead)."""
    single = [s for s in samples if s.plan == "tp1"]
    multi = [s for s in samples if s.plan != "tp1"]
    # NOTE: several starts: from the defaults alone the descent sticks at full overlap,
    # where a tiny decode MFU mimics the per-sequence cost
    starts = [
        (dataclasses.replace(base, roofline_overlap=o, seq_layer_overhead_s=q), link)
        for o in (0.0, 0.5, 1.0)
        for q in seq_starts
    ]
    # NOTE: TP1 alone cannot tell a per-sequence cost TP does not divide (attention dispatched
    # sequence by sequence) from decode compute it does, so its first descent holds the
    # overhead at the start's value; the joint descent moves it. From 0 alone it never left 0
    # (coordinate steps cannot trade it against decode MFU), and TP2's decode slope per
    # sequence came out half the measured one (0.55 vs 1.08 ms), its held-out steps low
    first = {k: v for k, v in _PER_RANK.items() if k != "seq_layer_overhead_s"}
    fits = []
    for params in starts:
        if single:
            params = _descend(single, first, params, cfg, gpu)
        if multi and fit_collective:
            ce_lat = itertools.product(_GRID, _LATENCIES_US)
            params = min(
                (
                    _with(_with(params, "collective_efficiency", c), "latency_us", v)
                    for c, v in ce_lat
                ),
                key=lambda p: _err(multi, p, cfg, gpu),
            )
        grids = _PER_RANK | _COLLECTIVE if fit_collective else _PER_RANK
        fits.append(_descend(samples, grids, params, cfg, gpu, rounds=3))
    return min(fits, key=lambda p: _err(samples, p, cfg, gpu))


@dataclass(frozen=True, slots=True)
class SplitFit:
    """One calibration split: the fitted constants and their predictions of the held-out steps."""

    config: GearboxConfig
    link: LinkClass
    calib_mape: float  # held-in error
    held: tuple[Sample, ...]
    predicted: tuple[float, ...]  # of ``held``, in order

    @property
    def held_mape(self) -> float:
        """Held-out error."""
        return mape(self.predicted, [s.step_s for s in self.held])

    @property
    def spearman(self) -> float:
        """Rank correlation of predicted and measured held-out steps."""
        return spearman(self.predicted, [s.step_s for s in self.held])


def fit_split(
    calib: Sequence[Sample],
    held: Sequence[Sample],
    cfg: LlamaConfig,
    gpu: GpuClass,
    link: LinkClass,
    base: GearboxConfig,
    *,
    fit_collective: bool,
) -> SplitFit:
    """Fit on ``calib`` (see ``fit``) and predict ``held``."""
    config, fitted = fit(calib, cfg, gpu, link, base, fit_collective=fit_collective)
    calib_mape = _err(calib, (config, fitted), cfg, gpu)
    predicted = tuple(predict_all(held, cfg, gpu, fitted, config))
    return SplitFit(config, fitted, calib_mape, tuple(held), predicted)
