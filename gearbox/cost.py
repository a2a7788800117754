"""Cost model: time, memory and capacity of one replica, and its latency at a given load.

Relative accuracy is the goal — decisions compare plans on the same formulas. Sources:

* FLOPs: forward pass ≈ 2·N FLOPs per token plus attention 2·n_layer·n_ctx·d_attn per token for
  QKᵀ and again for ·V (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", Table 1).
  A causal prefill of n tokens therefore costs 2·N·n + 2·n_layer·n²·d_attn.
* Prefill runs at ``mfu_prefill`` (0.5) of bf16 peak: large-GEMM inference prefill and training
  reach 40–60 % model-FLOPs utilisation (Chowdhery et al. 2022, PaLM, 46 % MFU; Agrawal et al.
  2024, Sarathi-Serve, prefill is compute-bound).
* Decode is memory-bound at small batch: every step reads the stage's weight shard and the batch's
  KV (Pope et al. 2022, "Efficiently Scaling Transformer Inference", §2). Achieved memory
  bandwidth utilisation ``mbu_decode`` (0.7) follows Databricks, "LLM Inference Performance
  Engineering: Best Practices" (2023), which measures 60–70 % MBU. At large batch the step turns
  compute-bound (``mfu_decode`` 0.5); the step takes the larger of the two times.
* Tensor parallelism costs two all-reduces of the activations per layer (Shoeybi et al. 2019,
  Megatron-LM, §3). Ring all-reduce: 2(p−1)/p · bytes / bandwidth + 2(p−1)·latency (Patarasuk &
  Yuan 2009); achieved bandwidth is ``collective_efficiency`` (0.8) of line rate, the nccl-tests
  "busbw" ratio for large messages.
* Pipeline parallelism: a step is bounded by the slowest stage once micro-batches fill the
  pipeline, and by the sum of stages (a bubble) when the batch has fewer sequences than stages
  (Huang et al. 2019, GPipe; Narayanan et al. 2021, bubble (p−1)/m). Activations of
  tokens × hidden × dtype bytes cross the inter-stage link.
* Fixed costs (calibrated, 0 by default): each stage forward pays ``step_overhead_s`` (host-side
  scheduling, kernel launches, the control message — the CPU overhead vLLM hides with CUDA
  graphs), and each sequence pays ``seq_layer_overhead_s`` per layer where attention is
  dispatched sequence by sequence over a ragged batch (the torch reference engine; a batched
  paged-attention kernel makes it ~0). ``pp_microbatching`` False models an engine that passes
  one packed batch through the stages in turn (a decode cycle is then one full pass).
  ``roofline_overlap`` below 1 adds (1 − overlap) × the smaller of memory and compute time to
  the larger (a single CPU thread does not overlap them); prefill, taken as compute-bound, then
  also pays that share of reading its weight shard once. ``single_seq_read_speedup`` (1 by
  default) speeds the weight read of a one-sequence decode step: BLAS libraries run a one-row
  product as a matrix-vector kernel and pack the weights for a matrix-matrix one (measured with
  torch on one CPU thread: 1 row 0.41 ms, 2 rows 0.85 ms, 16 rows 2.5 ms for the bench model's
  layer shapes), so a batch of one reads its weights faster than the batched line predicts.
* Queueing (stated approximation): a continuously batching replica has ``max_batch`` sequence
  slots sharing its service rate μ (requests/s at full batch) — an M/M/c queue with c = max_batch.
  Its probability of waiting is the exact Erlang C formula (Kleinrock 1975, Queueing Systems I,
  §3.5), so P(wait) = ρ for c = 1, and the M/M/c wait tail is P(W > t) = P(wait)·e^(−(μ−λ)t). A
  new prompt then queues for the prefill pipeline, an M/M/1 server busy λ × occupancy of the
  time, P(W > t) = ρ·e^(−(μ−λ)t) (ibid., §3.4). TTFT p95 = prefill latency (+ KV hand-off) +
  both p95 waits (a conservative sum; with a prompt tail, see below). (The Halfin–Whitt
  heavy-traffic approximation used before is a many-server limit: at c = 1 and ρ = 0.02 it gives
  P(wait) 0.23 instead of 0.02, a phantom p95 wait on an idle prefill server of every estimate;
  see ``_erlang_c``.)
* Heavy-tailed prompts (when the load gives their p95 and spread): the TTFT p95 is set by the
  long prompts, not the mean one, so the latency term is the prefill of the window's p95 prompt;
  and a queue of uneven prefills waits longer than an exponential one of the same mean. The
  prefill queue is then M/G/1 with the Allen–Cunneen correction (Allen 1990, Probability,
  Statistics and Queueing Theory, §6; exact for M/G/1's mean wait by Pollaczek–Khinchine): the
  conditional wait scales by (1 + c²)/2, c² the squared coefficient of variation of the prefill
  time — the prompts' c² × (slope × mean / prefill time of the mean)², the slope read between the
  mean and the p95 prompt (fixed costs do not vary with length). A long prompt holds the
  prefill server for its whole prefill, chunked or not (chunks of one prompt run in turn).
  The two are not summed at their p95s: the TTFT p95 is the larger of the p95 prompt's prefill
  and a mean prompt's prefill plus the queue's p95 wait — the long prompts set it at light
  load, the queue near saturation. Their sum (the p95 prompt waiting at the wait's p95) is a
  rarer request than the p95 one; in bench.fragmented (fragmented-short, seeds 7–11) it put
  the 7B's estimate 1.3–2.1× over the observed at 37–55 % utilisation of a one-GPU plan, where
  the observed TTFT p95 barely moved with the load.
  The decode-slot queue keeps exponential service (the output spread is not reported).
* Iterations (the engine's schedule: runtime.engine.sim): a prompt starts its prefill at the
  end of the decode iteration in progress; on a unified replica the iteration that carries the
  prefill also decodes the running batch, and its first token comes out at that iteration's end.
  TTFT p95 adds the iteration in progress at its p95 (uniform residual, busy with the
  probability a Poisson batch of the Little's-law mean is non-empty). Without it the 7B on two
  hoppers in mixed-failures (seed 7) was estimated 12 ms against 40–55 ms observed, and the
  learned correction, carried from the plan before, took ~25 min to close the gap.
* Fused iterations (vLLM's mixed batches; Sarathi-Serve's "decode-maximal batching", Agrawal
  et al. 2024): the prompt tokens and the running batch's decode tokens go through one forward
  pass, so the weights are read once for both. The prompts' side is compute (their prefill plus
  the decode tokens' FLOPs, costed as a prefill of that many tokens); the decode step's is
  mostly the weight and KV read; the iteration takes the longer of the two plus
  (1 − ``roofline_overlap``) of the shorter (``fused_iteration_s``). Unified capacity follows
  the engine kept full, which prefills greedily: per request, prompt ÷ chunk fused iterations
  (each a chunk's prefill plus the batch's decode compute, against a decode step; one whole
  prompt without chunking) and the rest of its output ÷ batch iterations decode-only. A chunk
  short against the prompts needs an iteration per chunk, each paying a decode step (the 70B
  on a 12-GPU A100/L40S pipeline, chunk at the 256-token floor). Measured against the engine
  kept full (exponential prompts and outputs), this is within 9 % at prompts of ~800 tokens
  on a 7B/13B/70B, and up to 43 % over at prompts of 6,000 on one GPU (the quadratic attention
  of the long tail's prefills, which a mean-length prompt does not pay). The torch engine packs
  its prompts and decodes into one launch too (runtime.engine.torch).
* TBT p95 = the decode step at the Little's-law batch, plus one prefill stall when at least 5 %
  of steps carry a new prompt (continuous batching stalls decode on prefill — Sarathi-Serve;
  disaggregated decode does not — Zhong et al. 2024, DistServe): the fused iteration's excess
  over the decode step.
* Chunked prefill (Sarathi-Serve): a unified replica prefills at most ``prefill_chunk_tokens``
  per iteration, so the stall is one chunk's, not a whole long prompt's; a prompt of n chunks
  spans n fused iterations, each its share of the prefill plus the batch's decode compute
  against a decode step (its prefill alone while nothing decodes).
* Utilisation is capped at 0.99, so saturated estimates stay finite (and ``max_latency_ms``
  caps them).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

from gearbox.config import GearboxConfig
from gearbox.model import ModelSpec
from gearbox.plans import ExecutionPlan, Stage
from gearbox.types import GpuClass, LinkClass

__all__ = [
    "ReplicaCapacity",
    "ReplicaEstimate",
    "ReplicaShape",
    "StageShape",
    "allreduce_s",
    "clear_caches",
    "estimate_replica",
    "fused_iteration_s",
    "layer_time_s",
    "max_layers_fitting",
    "memory_bucket",
    "min_tp_for_memory",
    "pipeline_decode_cycle_s",
    "pipeline_prefill_s",
    "prefill_latency_s",
    "prefill_scv",
    "replica_capacity",
    "replica_shape",
    "stage_decode_s",
    "stage_kv_capacity_tokens",
    "stage_prefill_s",
]

_GB = 1e9
_TFLOP = 1e12
_US = 1e-6
_MEMORY_BUCKET_BYTES = 256 * 1024**2
_P95_TAIL = 0.05
_MAX_UTILISATION = 0.99
_ERLANG_RECURSION_MAX_SERVERS = 64  # above: the Poisson-tail series (see _erlang_c)
_SPLIT_REFERENCE_BATCH = 16


@dataclass(frozen=True, slots=True)
class StageShape:
    """What the cost model needs of a stage; equal shapes cost the same (memo key)."""

    gpu_class: GpuClass
    tp: int
    num_layers: int
    tp_link: LinkClass
    available_bytes: int  # smallest per-GPU memory the plan may use, before memory_utilisation


@dataclass(frozen=True, slots=True)
class ReplicaShape:
    """A replica reduced to stage shapes and links."""

    prefill: tuple[StageShape, ...]  # the unified pipeline when not disaggregated
    decode: tuple[StageShape, ...]  # empty when not disaggregated
    pp_link: LinkClass | None
    handoff_link: LinkClass | None

    @property
    def decode_pipeline(self) -> tuple[StageShape, ...]:
        """Stages that run decode."""
        return self.decode or self.prefill


@dataclass(frozen=True, slots=True)
class ReplicaCapacity:
    """A replica's load-independent figures for one request profile."""

    feasible: bool  # weights plus the KV reserve fit on every GPU
    max_batch: int  # decode sequences whose full context fits in KV memory
    capacity_rps: float  # requests per second at max_batch
    prefill_latency_s: float  # one prompt through the prefill pipeline, hand-off included
    prefill_occupancy_s: float  # time a prompt holds the prefill pipeline's bottleneck
    unloaded_tbt_s: float  # decode step of a single sequence (latency floor)


@dataclass(frozen=True, slots=True)
class ReplicaEstimate:
    """A replica's steady state at a given arrival rate."""

    capacity_rps: float
    capacity_tok_s: float  # prompt + output tokens per second at capacity
    served_tok_s: float  # tokens per second actually served at this load
    ttft_p95_ms: float
    tbt_p95_ms: float


def allreduce_s(num_bytes: float, group_size: int, link: LinkClass, efficiency: float) -> float:
    """Ring all-reduce time: 2(p−1)/p · bytes / (bandwidth · efficiency) + 2(p−1) · latency."""
    if group_size <= 1:
        return 0.0
    steps = 2 * (group_size - 1)
    volume = steps / group_size * num_bytes
    return volume / (link.bandwidth_gbps * _GB * efficiency) + steps * link.latency_us * _US


def _layer_share(model: ModelSpec, num_layers: int) -> float:
    return num_layers / model.num_layers


def stage_prefill_s(
    shape: StageShape, model: ModelSpec, num_tokens: float, config: GearboxConfig
) -> float:
    """Prefill of ``num_tokens`` (one prompt) through one stage.

    FLOPs / (tp · peak · MFU) plus two all-reduces of the activations per layer, plus the
    fixed costs (one forward, one sequence).
    """
    flops = (
        2 * model.num_params * _layer_share(model, shape.num_layers) * num_tokens
        + 2 * shape.num_layers * num_tokens**2 * model.attention_dim
    )
    compute_s = flops / (shape.tp * shape.gpu_class.peak_bf16_tflops * _TFLOP * config.mfu_prefill)
    activation_bytes = num_tokens * model.hidden_size * model.dtype_bytes
    comm_s = (
        2
        * shape.num_layers
        * allreduce_s(activation_bytes, shape.tp, shape.tp_link, config.collective_efficiency)
    )
    weights_s = (
        model.weight_bytes
        * _layer_share(model, shape.num_layers)
        / shape.tp
        / (shape.gpu_class.memory_bandwidth_gbps * _GB * config.mbu_decode)
    )
    compute_s += (1.0 - config.roofline_overlap) * weights_s
    fixed_s = config.step_overhead_s + shape.num_layers * config.seq_layer_overhead_s
    return compute_s + comm_s + fixed_s


def stage_decode_s(
    shape: StageShape, model: ModelSpec, batch: float, context_tokens: float, config: GearboxConfig
) -> float:
    """One decode step of ``batch`` sequences: max(memory, compute) time + 2 all-reduces/layer
    + the fixed costs.

    Memory time reads the stage's weight shard and the batch's KV shard at mbu × bandwidth.
    """
    share = _layer_share(model, shape.num_layers)
    weight_bytes = model.weight_bytes * share
    if batch <= 1:
        weight_bytes /= config.single_seq_read_speedup
    read_bytes = (weight_bytes + batch * context_tokens * model.kv_bytes_per_token * share) / (
        shape.tp
    )
    memory_s = read_bytes / (shape.gpu_class.memory_bandwidth_gbps * _GB * config.mbu_decode)
    flops = (
        2 * model.num_params * share * batch
        + 4 * shape.num_layers * batch * context_tokens * model.attention_dim
    ) / shape.tp
    compute_s = flops / (shape.gpu_class.peak_bf16_tflops * _TFLOP * config.mfu_decode)
    activation_bytes = batch * model.hidden_size * model.dtype_bytes
    comm_s = (
        2
        * shape.num_layers
        * allreduce_s(activation_bytes, shape.tp, shape.tp_link, config.collective_efficiency)
    )
    fixed_s = config.step_overhead_s + shape.num_layers * batch * config.seq_layer_overhead_s
    busy_s = max(memory_s, compute_s) + (1.0 - config.roofline_overlap) * min(memory_s, compute_s)
    return busy_s + comm_s + fixed_s


def _usable_bytes(available_bytes: int, config: GearboxConfig) -> float:
    return available_bytes * config.memory_utilisation - config.runtime_overhead_bytes


def stage_kv_capacity_tokens(shape: StageShape, model: ModelSpec, config: GearboxConfig) -> int:
    """Tokens of KV the stage can hold after its weight shard; negative when weights do not fit."""
    share = _layer_share(model, shape.num_layers)
    free_per_gpu = _usable_bytes(shape.available_bytes, config) - model.weight_bytes * share / (
        shape.tp
    )
    return math.floor(free_per_gpu * shape.tp / (model.kv_bytes_per_token * share))


def max_layers_fitting(
    available_bytes: int, tp: int, model: ModelSpec, config: GearboxConfig
) -> int:
    """Most layers a TP group can hold with its share of the KV reserve (for PP split caps)."""
    per_layer = (
        model.weight_bytes + config.min_kv_reserve_tokens * model.kv_bytes_per_token
    ) / model.num_layers
    return max(0, math.floor(_usable_bytes(available_bytes, config) * tp / per_layer))


def min_tp_for_memory(available_bytes: int, model: ModelSpec, config: GearboxConfig) -> int:
    """Smallest TP degree whose per-GPU share of weights plus the KV reserve fits.

    Per GPU: (weights + min_kv_reserve_tokens × kv_bytes_per_token) / tp + runtime overhead
    <= available × memory_utilisation. Returns a huge number when even a large group cannot fit.
    """
    usable = _usable_bytes(available_bytes, config)
    if usable <= 0:
        return 1 << 30
    need = model.weight_bytes + config.min_kv_reserve_tokens * model.kv_bytes_per_token
    return max(1, math.ceil(need / usable))


def layer_time_s(
    gpu_class: GpuClass,
    tp: int,
    link: LinkClass,
    model: ModelSpec,
    prompt_tokens: int,
    output_tokens: int,
    config: GearboxConfig,
) -> float:
    """Time one layer spends on one request (prefill + its share of decode at a batch of 16).

    Used to split layers across pipeline stages in proportion to each stage's speed.
    """
    shape = StageShape(gpu_class, tp, 1, link, 0)
    context = prompt_tokens + output_tokens / 2
    decode = stage_decode_s(shape, model, _SPLIT_REFERENCE_BATCH, context, config)
    return stage_prefill_s(shape, model, prompt_tokens, config) + output_tokens * decode / (
        _SPLIT_REFERENCE_BATCH
    )


def _transfer_s(num_bytes: float, link: LinkClass | None) -> float:
    if link is None:
        return 0.0
    return num_bytes / (link.bandwidth_gbps * _GB) + link.latency_us * _US


def pipeline_prefill_s(
    stages: tuple[StageShape, ...],
    pp_link: LinkClass | None,
    model: ModelSpec,
    num_tokens: float,
    config: GearboxConfig,
) -> tuple[float, float]:
    """(latency, bottleneck occupancy) of one prompt through a pipeline of stages."""
    times = [stage_prefill_s(s, model, num_tokens, config) for s in stages]
    hop = _transfer_s(num_tokens * model.hidden_size * model.dtype_bytes, pp_link)
    latency = sum(times) + hop * (len(stages) - 1)
    occupancy = max(*times, hop)
    return latency, occupancy


@functools.lru_cache(maxsize=65_536)
def pipeline_decode_cycle_s(
    stages: tuple[StageShape, ...],
    pp_link: LinkClass | None,
    model: ModelSpec,
    batch: int,
    context_tokens: float,
    config: GearboxConfig,
) -> float:
    """Time for all ``batch`` sequences to advance one token (= TBT without prefill stalls).

    The batch is cut into min(stages, batch) micro-batches (one with ``pp_microbatching``
    False); a cycle is bounded by one full pass
    (sum of stages and hops) and by micro-batches × the bottleneck stage. With fewer sequences
    than stages the pass dominates: that is the pipeline bubble.
    """
    num_micro = max(1, min(len(stages), batch)) if config.pp_microbatching else 1
    micro = math.ceil(batch / num_micro)
    times = [stage_decode_s(s, model, micro, context_tokens, config) for s in stages]
    hop = _transfer_s(micro * model.hidden_size * model.dtype_bytes, pp_link)
    full_pass = sum(times) + hop * (len(stages) - 1)
    return max(full_pass, num_micro * max(*times, hop))


def _handoff_s(
    link: LinkClass, model: ModelSpec, prompt_tokens: int, config: GearboxConfig
) -> float:
    return (
        prompt_tokens
        * model.kv_bytes_per_token
        / (link.bandwidth_gbps * _GB * config.kv_transfer_efficiency)
        + link.latency_us * _US
    )


@functools.lru_cache(maxsize=65_536)
def prefill_latency_s(
    shape: ReplicaShape, model: ModelSpec, prompt_tokens: int, config: GearboxConfig
) -> tuple[float, float]:
    """(latency, bottleneck occupancy) of one ``prompt_tokens`` prompt through the replica's
    prefill pipeline, the KV hand-off included in the latency (memoised)."""
    latency, occupancy = pipeline_prefill_s(
        shape.prefill, shape.pp_link, model, prompt_tokens, config
    )
    if shape.handoff_link is not None:
        latency += _handoff_s(shape.handoff_link, model, prompt_tokens, config)
    return latency, occupancy


def prefill_scv(
    shape: ReplicaShape,
    model: ModelSpec,
    prompt_tokens: int,
    tail_prompt_tokens: int,
    prompt_scv: float,
    config: GearboxConfig,
) -> float:
    """Squared coefficient of variation of the prefill server's occupancy, from the prompts'
    (module notes): prompts' c² × (slope × mean / occupancy of the mean)²."""
    if tail_prompt_tokens <= prompt_tokens:
        return prompt_scv
    _, mean_s = prefill_latency_s(shape, model, prompt_tokens, config)
    _, tail_s = prefill_latency_s(shape, model, tail_prompt_tokens, config)
    slope = (tail_s - mean_s) / (tail_prompt_tokens - prompt_tokens)
    return prompt_scv * (slope * prompt_tokens / mean_s) ** 2 if mean_s > 0 else prompt_scv


MIN_PREFILL_CHUNK_TOKENS = 256  # below this a chunk's GEMMs stop being compute-bound
_CHUNK_UNIT = 64  # chunk sizes are multiples of the timing's token bucket
_MAX_CHUNK_UNITS = 512  # 32,768 tokens: no prompt here is longer


@functools.lru_cache(maxsize=16_384)
def prefill_chunk_tokens(shape: ReplicaShape, model: ModelSpec, config: GearboxConfig) -> int:
    """Prompt tokens a unified replica prefills per iteration (chunked prefill, module notes):
    the most, in 64-token steps, whose prefill takes at most ``prefill_chunk_tbt_share`` of the
    TBT SLO, and at least ``MIN_PREFILL_CHUNK_TOKENS``. 0 = whole prompts: a prefill/decode
    split replica (its decode never waits on a prefill) or a share of 0 (memoised)."""
    if shape.handoff_link is not None or config.prefill_chunk_tbt_share <= 0:
        return 0
    budget_s = config.prefill_chunk_tbt_share * config.tbt_slo_ms / 1e3

    def fits(units: int) -> bool:
        return prefill_latency_s(shape, model, units * _CHUNK_UNIT, config)[0] <= budget_s

    lo, hi = 0, _MAX_CHUNK_UNITS  # fits(lo) or lo == 0; the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return max(MIN_PREFILL_CHUNK_TOKENS, lo * _CHUNK_UNIT)


def fused_iteration_s(prefill_s: float, decode_s: float, config: GearboxConfig) -> float:
    """An iteration that prefills and decodes in one forward pass (module notes): ``prefill_s``
    the prompt tokens' time plus the decode tokens' compute, ``decode_s`` the decode step alone
    (mostly reading weights and KV); the two overlap as compute and memory time do."""
    longer, shorter = max(prefill_s, decode_s), min(prefill_s, decode_s)
    return longer + (1.0 - config.roofline_overlap) * shorter


def chunked_prefill_steps(prompt_tokens: int, chunk_tokens: int) -> int:
    """Iterations a prompt's prefill spans (1 with whole prompts, ``chunk_tokens`` 0)."""
    if chunk_tokens <= 0:
        return 1
    return max(1, -(-prompt_tokens // chunk_tokens))


@functools.lru_cache(maxsize=65_536)
def replica_capacity(
    shape: ReplicaShape,
    model: ModelSpec,
    prompt_tokens: int,
    output_tokens: int,
    config: GearboxConfig,
) -> ReplicaCapacity:
    """Batch capacity by memory, service rate at that batch and prefill latency (memoised)."""
    reserve = max(config.min_kv_reserve_tokens, prompt_tokens)
    kv_tokens = min(stage_kv_capacity_tokens(s, model, config) for s in shape.decode_pipeline)
    prefill_kv = min(stage_kv_capacity_tokens(s, model, config) for s in shape.prefill)
    max_batch = min(config.max_batch_sequences, kv_tokens // (prompt_tokens + output_tokens))
    if kv_tokens < reserve or prefill_kv < reserve or max_batch < 1:
        return ReplicaCapacity(False, 0, 0.0, 0.0, 0.0, 0.0)
    latency, occupancy = pipeline_prefill_s(
        shape.prefill, shape.pp_link, model, prompt_tokens, config
    )
    context = prompt_tokens + output_tokens / 2
    decode_stages = shape.decode_pipeline
    cycle = pipeline_decode_cycle_s(decode_stages, shape.pp_link, model, max_batch, context, config)
    decode_iterations = output_tokens / max_batch  # a request's share of the batch's steps
    if shape.handoff_link is None:
        # NOTE: a prompt's tokens fill whole iterations, a chunk each (fused, module notes): its
        # prefill is not spread thin over the batch's decode-only iterations, which overlap
        # nothing. Spreading it overstated a 7B's capacity on one A100 by 40 % (11.4 rps against
        # 8.0 served by the engine kept full, prompts ~800, outputs ~200).
        chunk = prefill_chunk_tokens(shape, model, config)
        carrying = prompt_tokens / chunk if chunk else 1.0  # iterations a prompt's tokens fill
        _, decode_compute_s = pipeline_prefill_s(
            shape.prefill, shape.pp_link, model, max_batch, config
        )
        fused = fused_iteration_s(occupancy / carrying + decode_compute_s, cycle, config)
        decode_only = max(0.0, decode_iterations - carrying)
        capacity = 1.0 / (carrying * fused + decode_only * cycle)
    else:
        handoff = _handoff_s(shape.handoff_link, model, prompt_tokens, config)
        latency += handoff
        capacity = min(1.0 / occupancy, 1.0 / (decode_iterations * cycle), 1.0 / handoff)
    unloaded = pipeline_decode_cycle_s(decode_stages, shape.pp_link, model, 1, context, config)
    return ReplicaCapacity(True, max_batch, capacity, latency, occupancy, unloaded)


def _erlang_c(servers: int, offered: float) -> float:
    """P(wait) of an M/M/c queue with ``servers`` = c servers and offered load ``offered`` =
    a = λ/μ₁ = c·ρ Erlangs (ρ < 1): Erlang C = c·B / (c − a·(1 − B)), B the Erlang B blocking
    probability, computed exactly — 1 − P(wait) rounding aside — in one of two ways:

    * c ≤ ``_ERLANG_RECURSION_MAX_SERVERS``: the stable recursion B₀ = 1,
      B_k = a·B_{k−1} / (k + a·B_{k−1}) (c steps; every step stays in (0, 1], no factorials);
    * larger c: B = p(c) / (1 − p(c)·T), p(c) = e^(−a)·a^c / c! the Poisson pmf (from ``lgamma``)
      and T = Σ_{n≥1} Π_{i≤n} a/(c+i) the Poisson tail over p(c), summed until a term adds
      < 1e-13: it needs min(~30/(1−ρ), ~√(60·c)) terms (≈ 120 at c = 256, ρ = 0.99; ≈ 2,500 at
      c = 10⁵), where the recursion needs c — a few µs per call at the default 256 decode slots,
      against ~25 µs for the recursion (measured with timeit, 2-core machine). The two agree to
      1e-11 (relative) at c = 1 … 5,000, ρ = 0.01 … 0.99.

    No Halfin–Whitt: its P(wait) ≈ 1/(1 + β·Φ(β)/φ(β)), β = (1−ρ)·√c (Halfin & Whitt 1981) is a
    many-server limit — 0.23 instead of 0.02 at c = 1, ρ = 0.02 — and at c = 64 … 256 its p95
    wait is still off by up to 1.6 … 0.4 % of one sequence's service time; its error shrinks like
    1/√c, more slowly than one more server lowers P(wait) (~1/c), so a switch-over to it at any c
    makes P(wait) rise with one server more. The exact series costs little enough to need none.
    """
    if servers <= _ERLANG_RECURSION_MAX_SERVERS:
        blocking = 1.0
        for k in range(1, servers + 1):
            blocking = offered * blocking / (k + offered * blocking)
    else:
        log_pmf = servers * math.log(offered) - offered - math.lgamma(servers + 1)
        pmf = math.exp(log_pmf)  # 0 on underflow: then P(wait) is ~0 as well
        term, tail, k = 1.0, 0.0, servers
        while True:
            k += 1
            term *= offered / k
            tail += term
            if term < 1e-13 * tail:
                break
        blocking = pmf / (1.0 - pmf * tail)
    return servers * blocking / (servers - offered * (1.0 - blocking))


def _wait_p95_s(arrival_rps: float, service_rps: float, servers: int, scv: float = 1.0) -> float:
    """p95 wait of an M/G/c queue (total service rate ``service_rps``, service times' squared
    coefficient of variation ``scv``; 1 = M/M/c): exact Erlang C P(wait) (``_erlang_c``), tail
    P(W > t) = P(wait)·e^(−(μ−λ)t), the conditional wait scaled by (1 + scv)/2 (Allen–Cunneen).
    For c = 1: ρ·e^(−(1−ρ)μt), zero while ρ ≤ 5 %."""
    rho = min(arrival_rps / service_rps, _MAX_UTILISATION)
    if rho <= 0:
        return 0.0
    p_wait = _erlang_c(servers, servers * rho)
    if p_wait <= _P95_TAIL:
        return 0.0
    return math.log(p_wait / _P95_TAIL) * (1 + scv) / 2 / (service_rps * (1 - rho))


def _busy(decoding: float) -> float:
    """Probability a decode batch of Poisson size, mean ``decoding``, is not empty."""
    return 1.0 - math.exp(-decoding)


def _iteration_wait_p95_s(decoding: float, cycle_s: float) -> float:
    """What a prompt waits for the decode iteration in progress when it arrives, at the p95
    (module notes). ``decoding`` is the mean number of sequences decoding (Little's law)."""
    busy = _busy(decoding)
    if busy <= _P95_TAIL:
        return 0.0
    return cycle_s * (1.0 - _P95_TAIL / busy)  # the residual of a step is uniform over it


def estimate_replica(
    shape: ReplicaShape,
    model: ModelSpec,
    prompt_tokens: int,
    output_tokens: int,
    arrival_rps: float,
    config: GearboxConfig,
    *,
    tail_prompt_tokens: int | None = None,
    prompt_scv: float = 1.0,
) -> ReplicaEstimate:
    """Throughput and TTFT/TBT p95 of a replica receiving ``arrival_rps`` (see module notes).

    ``tail_prompt_tokens`` (the prompts' p95) and ``prompt_scv`` (their squared coefficient of
    variation) describe heavy-tailed lengths; by default every prompt is the mean one and
    prefill times are exponential. Capacity and TBT always use the mean.

    NOTE: memoised on every input (a decision step asks for the same replica at the same rate
    several times: each replica of a shape, the idle and loaded ends of the service-rate
    solve — 77 % of the calls in the 8-hour benchmark's first hour). ``typed`` keeps an int
    rate apart from the equal float; −0.0, equal to 0.0 as a key but not in every result's
    sign, is computed afresh.
    """
    args = (
        shape, model, prompt_tokens, output_tokens, arrival_rps, config, tail_prompt_tokens,
        prompt_scv,
    )  # fmt: skip
    if any(v == 0.0 and math.copysign(1.0, v) < 0.0 for v in (arrival_rps, prompt_scv)):
        return _estimate_replica.__wrapped__(*args)
    return _estimate_replica(*args)


@functools.lru_cache(maxsize=65_536, typed=True)
def _estimate_replica(
    shape: ReplicaShape,
    model: ModelSpec,
    prompt_tokens: int,
    output_tokens: int,
    arrival_rps: float,
    config: GearboxConfig,
    tail_prompt_tokens: int | None,
    prompt_scv: float,
) -> ReplicaEstimate:
    """:func:`estimate_replica`, memoised (its inputs positional, every one in the key)."""
    cap = replica_capacity(shape, model, prompt_tokens, output_tokens, config)
    tokens_per_request = prompt_tokens + output_tokens
    if not cap.feasible:
        return ReplicaEstimate(0.0, 0.0, 0.0, config.max_latency_ms, config.max_latency_ms)
    mu, lam = cap.capacity_rps, min(arrival_rps, cap.capacity_rps)
    context = prompt_tokens + output_tokens / 2
    stages = shape.decode_pipeline
    batch = 1
    for _ in range(4):  # Little's law fixed point: batch = λ · output · cycle(batch)
        cycle = pipeline_decode_cycle_s(stages, shape.pp_link, model, batch, context, config)
        batch = min(cap.max_batch, max(1, round(lam * output_tokens * cycle)))
    cycle = pipeline_decode_cycle_s(stages, shape.pp_link, model, batch, context, config)
    decoding = lam * output_tokens * cycle  # sequences decoding, Little's law
    chunk = prefill_chunk_tokens(shape, model, config)
    unified = shape.handoff_link is None
    unified_busy = unified and _busy(decoding) > _P95_TAIL
    # the batch's decode tokens' compute in a fused iteration (unified replicas only)
    decode_compute_s = prefill_latency_s(shape, model, batch, config)[0] if unified else 0.0

    def prefill_span_s(prompt: int, latency_s: float) -> float:
        # NOTE: each of a prompt's chunks rides an iteration that decodes the batch (fused).
        if not unified_busy:
            return latency_s
        n = chunked_prefill_steps(prompt, chunk)
        return n * fused_iteration_s(latency_s / n + decode_compute_s, cycle, config)

    mean_prefill_s = prefill_span_s(prompt_tokens, cap.prefill_latency_s)
    prefill_s, scv = mean_prefill_s, prompt_scv
    if tail_prompt_tokens is not None:
        tail_s, _ = prefill_latency_s(shape, model, tail_prompt_tokens, config)
        prefill_s = prefill_span_s(tail_prompt_tokens, tail_s)
        scv = prefill_scv(shape, model, prompt_tokens, tail_prompt_tokens, prompt_scv, config)
    prefill_wait_s = _wait_p95_s(lam, 1.0 / cap.prefill_occupancy_s, 1, scv)
    if tail_prompt_tokens is not None:
        # NOTE: the p95 prompt's prefill and the queue's p95 wait are not added: a prompt at
        # the length p95 that also waits at the wait p95 is a ~1-in-400 request (module notes)
        queued_s = mean_prefill_s + prefill_wait_s
        prefill_wait_s = max(0.0, queued_s - prefill_s)
    wait_s = _wait_p95_s(lam, mu, cap.max_batch) + prefill_wait_s
    stall = 0.0
    if unified:
        carried = cap.prefill_occupancy_s
        if chunk and prompt_tokens > chunk:
            carried, _ = prefill_latency_s(shape, model, chunk, config)
        stall = fused_iteration_s(carried + decode_compute_s, cycle, config) - cycle
        stall *= min(1.0, lam * cycle / _P95_TAIL)
    iteration_s = _iteration_wait_p95_s(decoding, cycle)
    return ReplicaEstimate(
        capacity_rps=mu,
        capacity_tok_s=mu * tokens_per_request,
        served_tok_s=lam * tokens_per_request,
        ttft_p95_ms=min(config.max_latency_ms, (prefill_s + wait_s + iteration_s) * 1e3),
        tbt_p95_ms=min(config.max_latency_ms, (cycle + stall) * 1e3),
    )


def memory_bucket(available_bytes: int) -> int:
    """Round memory down to 256 MiB so near-identical GPUs share memo entries (conservative)."""
    return available_bytes - available_bytes % _MEMORY_BUCKET_BYTES


def _stage_shape(stage: Stage, available: Mapping[str, int]) -> StageShape:
    least = memory_bucket(min(available.get(u, 0) for u in stage.gpu_uuids))
    return StageShape(stage.gpu_class, stage.tp, stage.num_layers, stage.tp_link, least)


def replica_shape(plan: ExecutionPlan, available: Mapping[str, int]) -> ReplicaShape:
    """Reduce a plan to shapes; ``available`` maps GPU uuid → bytes the plan may use."""
    if plan.is_disaggregated:
        prefill = tuple(_stage_shape(s, available) for s in plan.prefill_stages)
        decode = tuple(_stage_shape(s, available) for s in plan.decode_stages)
        return ReplicaShape(prefill, decode, plan.pp_link, plan.kv_handoff_link)
    unified = tuple(_stage_shape(s, available) for s in plan.stages)
    return ReplicaShape(unified, (), plan.pp_link, None)


def clear_caches() -> None:
    """Drop the cost memos (they are pure; clearing only costs time). Used by benchmarks."""
    pipeline_decode_cycle_s.cache_clear()
    prefill_latency_s.cache_clear()
    prefill_chunk_tokens.cache_clear()
    replica_capacity.cache_clear()
    _estimate_replica.cache_clear()
