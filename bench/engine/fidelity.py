"""Cost-model fidelity: gearbox's step-time formulas against measured steps, and the fit."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

from bench.engine.measure import Sample
from gearbox.config import DEFAULT_CONFIG, GearboxConfig
from gearbox.cost import pipeline_decode_cycle_s, pipeline_prefill_s, replica_shape
from gearbox.types import GpuClass, LinkClass
from runtime.engine.torch.config import LlamaConfig
from runtime.engine.torch.plans import make_plan

_GRID = [round(0.02 * 1.25**i, 4) for i in range(18)]  # 0.02 .. ~0.9
_LATENCIES_US = [10.0 * 1.5**i for i in range(16)]  # 10 us .. ~4 ms


def predict(
    s: Sample, cfg: LlamaConfig, gpu: GpuClass, link: LinkClass, config: GearboxConfig
) -> float:
    """Gearbox's time for the sample's step on its plan."""
    plan = make_plan(s.plan, cfg.num_layers, s.plan, model_name=cfg.name, gpu=gpu, link=link)
    shape = replica_shape(plan, dict.fromkeys(plan.gpu_uuids, gpu.memory_bytes))
    model = cfg.model_spec()
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


def fit(
    samples: Sequence[Sample], cfg: LlamaConfig, gpu: GpuClass, link: LinkClass
) -> tuple[GearboxConfig, LinkClass]:
    """Grid-fit the efficiency constants on ``samples``, one group of constants at a time:
    prefill MFU on single-rank prefills, decode MBU/MFU on single-rank decodes, then the
    collective efficiency and link latency on multi-rank samples."""
    config = DEFAULT_CONFIG

    def err(subset: Sequence[Sample], c: GearboxConfig, lk: LinkClass) -> float:
        return mape(predict_all(subset, cfg, gpu, lk, c), [s.step_s for s in subset])

    single_p = [s for s in samples if s.plan == "tp1" and s.phase == "prefill"]
    single_d = [s for s in samples if s.plan == "tp1" and s.phase == "decode"]
    multi = [s for s in samples if s.plan != "tp1"]
    if single_p:
        best = min(
            _GRID, key=lambda v: err(single_p, dataclasses.replace(config, mfu_prefill=v), link)
        )
        config = dataclasses.replace(config, mfu_prefill=best)
    if single_d:
        mbu, mfu = min(
            itertools.product(_GRID, _GRID),
            key=lambda v: err(
                single_d, dataclasses.replace(config, mbu_decode=v[0], mfu_decode=v[1]), link
            ),
        )
        config = dataclasses.replace(config, mbu_decode=mbu, mfu_decode=mfu)
    if multi:
        ce, lat = min(
            itertools.product(_GRID, _LATENCIES_US),
            key=lambda v: err(
                multi,
                dataclasses.replace(config, collective_efficiency=v[0]),
                dataclasses.replace(link, latency_us=v[1]),
            ),
        )
        config = dataclasses.replace(config, collective_efficiency=ce)
        link = dataclasses.replace(link, latency_us=lat)
    return config, link
