"""The memory-tight model farm: the second article's regime, for ``--scenario farm``.

Decided from the article's description before any system ran on it (nothing here was tuned to
a result):

* **Cluster**: 12 GPUs of three sizes — 4 × A100 80 GB (two NVLink nodes), 4 × L40S 48 GB and
  4 × A10 24 GB (one PCIe node each); 608 GiB in all.
* **Catalogue that does not fit statically**: 28 models from BERT-class encoders (0.2 and
  0.7 GB) through 1.5B, 3B, 7B and 13B to five that only an 80 GB card holds — three
  70B-class models served in 8-bit (64 GiB of weights; the article's 140 GB multimodal model
  needs two GPUs, which this one-GPU-per-instance simulator cannot place, so its 8-bit
  70B-class sibling stands in) and two 34B in bf16. Five single-card models for four 80 GB
  cards, and weights + runtime overhead alone (≈ 576 GiB with the wanted replicas left out)
  over a static deployment's 90 % cap of the cluster (547 GiB).
* **Heavy-tailed popularity that shifts**: in each 15-minute phase 20 of the 28 models get
  traffic, their shares Zipf(1.1) by rank; the other 8 get none (tenants and batch jobs come and
  go, so models go cold). The first ranking is a seeded shuffle; at each phase boundary 6
  seeded swaps of two ranks move models up, down, in and out.
* **Bursts**: on top of its phase share every model's traffic is the base scenario's
  quiet ↔ burst process (4× rate in bursts of ~2 min every ~10 min), and the cluster-wide
  long-prompt spikes apply to the generative models.
* **Load around capacity**: each phase's total rate is set so the offered work, in GPU-seconds
  at a batch of 8 on each model's smallest fitting GPU class (the runtime's own timing model),
  averages ``FARM_LOAD`` × the cluster's GPU-seconds (bursts above, quiet stretches below).
  This is computed from the scenario alone, never from a system's run.
"""

from __future__ import annotations

import dataclasses
import random

from bench.mm.scenario import (
    CODELLAMA_34B,
    LLAMA2_13B,
    LONG_PROMPT_TOKENS,
    MAX_OUTPUT_TOKENS,
    NEVER_S,
    QWEN2_1_5B,
    QWEN2_5_3B,
    ModelProfile,
    Scenario,
    SimRequest,
    TrafficProfile,
    cluster_of,
    in_spike,
    lognormal_int,
    mmpp_arrivals,
    spike_windows,
)
from gearbox.config import GearboxConfig
from gearbox.model import ModelSpec
from gearbox.plans import ExecutionPlan, Stage, StageRole
from gearbox.presets import LINK_CLASSES, MODEL_7B_MHA, MODEL_70B_GQA
from gearbox.types import Gpu, TopologySnapshot
from runtime.timing import ReplicaTiming

__all__ = [
    "FARM_DURATION_S",
    "FARM_LOAD",
    "build_farm",
    "farm_catalogue",
    "make_farm_cluster",
    "offered_gpu_load",
    "request_gpu_s",
]

FARM_DURATION_S = 3600.0  # 4 phases; a model off for two phases goes cold (30 min)
FARM_LOAD = 1.0  # mean offered GPU-seconds per cluster GPU-second
PHASE_S = 900.0  # popularity holds for a phase
ACTIVE_MODELS = 20  # models with traffic in a phase; the rest get none
ZIPF_S = 1.1  # popularity exponent over the active ranks
SWAPS_PER_PHASE = 6  # rank swaps at each phase boundary
COST_BATCH = 8  # the batch the offered-load estimate prices a request at
BURST_FACTOR = 4.0  # burst rate / quiet rate
MEAN_QUIET_S, MEAN_BURST_S = 600.0, 120.0
ENCODER_MAX_TOKENS = 512  # a BERT-class model's position limit

# Shapes from the published config.json files; the 70B in 8-bit weights and KV (FP8 serving).
LLAMA2_70B_FP8 = dataclasses.replace(MODEL_70B_GQA, name="llama-2-70b-fp8", dtype_bytes=1)
BERT_BASE = ModelSpec("bert-base", 109_482_240, 12, 768, 12, 12, 64)
BERT_LARGE = ModelSpec("bert-large", 335_141_888, 24, 1024, 16, 16, 64)

# name, spec, replicas, placement batch, placement context, mean prompt, mean output
_FARM: tuple[tuple[str, ModelSpec, int, int, int, int, int], ...] = (
    *((f"chat-70b-{c}", LLAMA2_70B_FP8, 1, 2, 4096, 1000, 300) for c in "ab"),
    ("vision-70b", LLAMA2_70B_FP8, 1, 2, 4096, 1500, 300),
    ("code-34b", CODELLAMA_34B, 1, 2, 4096, 1500, 200),
    ("chat-34b", CODELLAMA_34B, 1, 2, 4096, 800, 300),
    *((f"{r}-13b", LLAMA2_13B, 2, 4, 2048, 800, 200) for r in ("chat", "rag", "summ")),
    *((f"{r}-7b", MODEL_7B_MHA, 2, 4, 2048, 600, 200) for r in ("chat", "rag", "agent", "sql")),
    *((f"{r}-7b", MODEL_7B_MHA, 2, 4, 2048, 600, 200) for r in ("mail", "doc", "qa", "trans")),
    *((f"tools-3b-{c}", QWEN2_5_3B, 1, 8, 2048, 800, 150) for c in "abc"),
    *((f"assist-1.5b-{c}", QWEN2_1_5B, 1, 8, 2048, 400, 120) for c in "abc"),
    *((f"cls-base-{c}", BERT_BASE, 1, 8, ENCODER_MAX_TOKENS, 128, 1) for c in "abc"),
    *((f"cls-large-{c}", BERT_LARGE, 1, 8, ENCODER_MAX_TOKENS, 128, 1) for c in "abc"),
)


def make_farm_cluster() -> TopologySnapshot:
    """4 × A100 80 GB on 2 NVLink nodes, 4 × L40S 48 GB and 4 × A10 24 GB on PCIe nodes."""
    return cluster_of(
        (
            ("a100-0", "a100-80g", "nvlink-a100", 2),
            ("a100-1", "a100-80g", "nvlink-a100", 2),
            ("l40s-0", "l40s", "pcie-local", 4),
            ("a10-0", "a10-24g", "pcie-local", 4),
        )
    )


def _is_encoder(spec: ModelSpec) -> bool:
    """A BERT-class model: short inputs, one output token (classification, embedding)."""
    return spec.name.startswith("bert")


def farm_catalogue() -> tuple[ModelProfile, ...]:
    """The 28 models; ``traffic`` holds request shapes and the burst process (rates: 0 here)."""
    return tuple(
        ModelProfile(
            name,
            spec,
            replicas,
            batch,
            context,
            TrafficProfile(
                0.0,
                0.0,
                MEAN_QUIET_S,
                MEAN_BURST_S,
                prompt,
                output,
                0.0 if _is_encoder(spec) else 0.5,
            ),
        )
        for name, spec, replicas, batch, context, prompt, output in _FARM
    )


def _rankings(seed: int, names: list[str], num_phases: int) -> list[list[str]]:
    """Each phase's models by popularity: a seeded shuffle, then seeded swaps per phase."""
    rng = random.Random(f"{seed}:farm:popularity")
    ranking = list(names)
    rng.shuffle(ranking)
    out = [list(ranking)]
    for _ in range(1, num_phases):
        for _ in range(SWAPS_PER_PHASE):
            i, j = rng.sample(range(len(ranking)), 2)
            ranking[i], ranking[j] = ranking[j], ranking[i]
        out.append(list(ranking))
    return out


def _shares(ranking: list[str]) -> dict[str, float]:
    """Zipf shares of the active ranks; 0 for the rest."""
    weights = [1.0 / (rank + 1) ** ZIPF_S for rank in range(ACTIVE_MODELS)]
    total = sum(weights)
    shares = {name: 0.0 for name in ranking}
    for name, weight in zip(ranking[:ACTIVE_MODELS], weights, strict=True):
        shares[name] = weight / total
    return shares


def _home_gpu(profile: ModelProfile, cluster: TopologySnapshot, config: GearboxConfig) -> Gpu:
    """A GPU of the smallest class that holds the model's placement footprint (weights,
    runtime overhead, KV of its placement batch)."""
    need = (
        profile.spec.weight_bytes
        + config.runtime_overhead_bytes
        + profile.batch_size * profile.seq_len_tokens * profile.spec.kv_bytes_per_token
    )
    fits = [g for g in cluster.gpus if g.total_memory_bytes >= need]
    return min(fits, key=lambda g: g.total_memory_bytes)


def request_gpu_s(profile: ModelProfile, cluster: TopologySnapshot, config: GearboxConfig) -> float:
    """GPU-seconds of a mean-shaped request at ``COST_BATCH`` on the model's home GPU class."""
    gpu = _home_gpu(profile, cluster, config)
    stage = Stage(
        gpu.domain, gpu.domain, (gpu.uuid,), 0, profile.spec.num_layers, StageRole.UNIFIED,
        gpu.gpu_class, LINK_CLASSES["pcie-local"],
    )  # fmt: skip
    timing = ReplicaTiming.build(ExecutionPlan(profile.name, (stage,)), profile.spec, config)
    traffic = profile.traffic
    context = traffic.mean_prompt_tokens + traffic.mean_output_tokens / 2
    decode_s = timing.decode_cycle_s(COST_BATCH, context) / COST_BATCH
    return timing.prefill_s(traffic.mean_prompt_tokens) + traffic.mean_output_tokens * decode_s


def _mean_burst_factor() -> float:
    """Time-average rate multiplier of the quiet ↔ burst process."""
    return (MEAN_QUIET_S + BURST_FACTOR * MEAN_BURST_S) / (MEAN_QUIET_S + MEAN_BURST_S)


def _phase_rates(
    models: tuple[ModelProfile, ...],
    shares: dict[str, float],
    cost_s: dict[str, float],
    num_gpus: int,
    load: float,
) -> dict[str, float]:
    """Each model's quiet rate in the phase, so the mean offered GPU load is ``load``."""
    gpu_s_per_request = sum(shares[m.name] * cost_s[m.name] for m in models)
    total_rps = load * num_gpus / (gpu_s_per_request * _mean_burst_factor())
    return {m.name: shares[m.name] * total_rps for m in models}


def _model_requests(
    seed: int,
    profile: ModelProfile,
    phase_rates: list[float],
    duration_s: float,
    spikes: tuple[tuple[float, float], ...],
) -> list[SimRequest]:
    """The model's requests over every phase (one RNG per model, phases in order)."""
    rng = random.Random(f"{seed}:farm:{profile.name}")
    traffic = profile.traffic
    encoder = _is_encoder(profile.spec)
    max_prompt = ENCODER_MAX_TOKENS if encoder else LONG_PROMPT_TOKENS[0]
    max_tokens = traffic.mean_output_tokens if encoder else MAX_OUTPUT_TOKENS
    out: list[SimRequest] = []
    for phase, rate in enumerate(phase_rates):
        window = dataclasses.replace(
            traffic,
            quiet_rps=rate,
            burst_rps=rate * BURST_FACTOR,
            active_from_s=phase * PHASE_S,
            active_until_s=min(duration_s, (phase + 1) * PHASE_S),
        )
        for t in mmpp_arrivals(rng, window, duration_s) if rate > 0 else []:
            long_prompt = in_spike(t, spikes) and rng.random() < traffic.long_prompt_share
            if long_prompt:
                prompt = rng.randint(*LONG_PROMPT_TOKENS)
            else:
                prompt = lognormal_int(rng, traffic.mean_prompt_tokens, 0.6, 16, max_prompt)
            output = lognormal_int(rng, traffic.mean_output_tokens, 0.6, 1, max_tokens)
            out.append(
                SimRequest(
                    f"{profile.name}/{len(out)}", profile.name, round(t, 6), prompt, output,
                    long_prompt, max_tokens,
                )
            )  # fmt: skip
    return out


def build_farm(seed: int, duration_s: float = FARM_DURATION_S, load_scale: float = 1.0) -> Scenario:
    """The farm scenario for ``seed``; ``load_scale`` multiplies ``FARM_LOAD``."""
    cluster = make_farm_cluster()
    config = GearboxConfig()
    models = farm_catalogue()
    cost_s = {m.name: request_gpu_s(m, cluster, config) for m in models}
    num_phases = max(1, -int(-duration_s // PHASE_S))
    rankings = _rankings(seed, [m.name for m in models], num_phases)
    rates = [
        _phase_rates(models, _shares(r), cost_s, len(cluster.gpus), FARM_LOAD * load_scale)
        for r in rankings
    ]
    spikes = spike_windows(seed, duration_s)
    requests = [
        r
        for m in models
        for r in _model_requests(seed, m, [p[m.name] for p in rates], duration_s, spikes)
    ]
    requests.sort(key=lambda r: (r.arrival_s, r.request_id))
    # NOTE: profiles carry each model's time-average rates so the catalogue states its load.
    factor = BURST_FACTOR / num_phases
    models = tuple(
        dataclasses.replace(
            m,
            traffic=dataclasses.replace(
                m.traffic,
                quiet_rps=round(sum(p[m.name] for p in rates) / num_phases, 6),
                burst_rps=round(sum(p[m.name] for p in rates) * factor, 6),
                active_until_s=NEVER_S,
            ),
        )
        for m in models
    )
    popularity = tuple(tuple(r[:ACTIVE_MODELS]) for r in rankings)
    return Scenario(seed, duration_s, cluster, models, spikes, tuple(requests), popularity)


def offered_gpu_load(scenario: Scenario, config: GearboxConfig) -> float:
    """The scenario's requests priced as ``request_gpu_s`` / the cluster's GPU-seconds.

    The same estimate for every scenario, so their loads compare (1.0: around capacity).
    """
    cost_s = {m.name: request_gpu_s(m, scenario.cluster, config) for m in scenario.models}
    demand_s = sum(cost_s[r.model_name] for r in scenario.requests)
    return demand_s / (len(scenario.cluster.gpus) * scenario.duration_s)
