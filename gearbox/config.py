"""Gearbox configuration: one frozen model per concern, bounds checked at construction.

Each numeric field has a closed range in ``_BOUNDS``; ``__post_init__`` raises ``ValueError``
naming the field, the range and the value. Cost-model constants cite their source.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from enum import StrEnum

from gearbox.serde import Serialisable

__all__ = [
    "DEFAULT_CONFIG",
    "DEFAULT_PLACEMENT_CONFIG",
    "GearboxConfig",
    "PlacementConfig",
    "PlacementStrategy",
    "without_gpu_credit",
]

_GIB = 1024**3
_INF = float("inf")


def _check_bounds(
    obj: GearboxConfig | PlacementConfig, bounds: dict[str, tuple[float, float]]
) -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, str):
            continue  # a choice, not a number: checked on its own
        if f.type in (bool, "bool"):
            if not isinstance(value, bool):
                raise ValueError(f"{f.name}: must be true or false, got {value!r}")
            continue
        lo, hi = bounds[f.name]
        if not lo <= value <= hi:
            raise ValueError(f"{f.name}: must be within [{lo}, {hi}], got {value}")


@dataclass(frozen=True, slots=True)
class GearboxConfig(Serialisable):
    """Knobs of the gear decision: blocks, enumeration, cost model, switch cost, hysteresis."""

    # --- decision ---
    hysteresis: float = 1.4  # switch only when gain > cost × hysteresis (article: 1.3–1.5)
    # NOTE: a switch shows in the load gearbox sees only after the old replicas drain (runtime
    # drain_timeout_s, 60 s by default) and the streams' load window has refilled (load_window_s,
    # 60 s): a cooldown shorter than window + drain judges the next switch on load the last one
    # has not settled, and the plans flap. So cooldown_s >= 60 + 60 s; raise it with either.
    cooldown_s: float = 120.0  # no second voluntary switch sooner (article: >= 90 s)
    reverse_cooldown_factor: float = 2.0  # cooldown multiplier for switching straight back
    failed_target_quarantine_s: float = 900.0  # a rolled-back target is not re-proposed sooner
    gain_horizon_s: float = 300.0  # how long a better plan is expected to pay off
    top_k_candidates: int = 5  # candidates listed in a decision
    # A forced switch also weighs, per settled neighbour, up to this many plans that take some
    # of its GPUs (a handover: it moves first, priced at what it loses; gearbox.joint.Yield);
    # 0 never takes a neighbour's GPUs.
    handover_candidates: int = 4
    # Downshift guard (see gearbox.decide): a voluntary downshift (fewer GPUs and less estimated
    # capacity) needs its estimated TTFT and TBT p95 at or below downshift_slo_margin × the
    # SLOs, since the estimates err low near saturation (a 2-GPU plan judged at 146 of 150 ms);
    # under observed pressure no downshift is taken and freed GPUs earn no credit.
    # NOTE: in the fragmented benchmark (seed 7) it cut the 70B TTFT p95 steady 3.9 s → 582 ms,
    # overall 171 s → 28 s, at the 2nd preemption 189 s → 48 s, but raised the 1st-preemption
    # peak 9.7 s → 16.9 s (the headline peak_p95_ms): holding TP8 through the load dip changed
    # which plan that preemption forced, and under pressure the guard then kept a 12-GPU plan
    # whose estimate was optimistic. False restores the previous behaviour exactly.
    downshift_guard: bool = True
    downshift_slo_margin: float = 0.7
    # With a lookback, a voluntary downshift must also keep its estimated p95s within the margin
    # at the highest demand of the last downshift_lookback_s (gearbox.history.record_demand),
    # not only at this window's: a smaller plan the planner would itself undo at a load it has
    # just served earns its freed GPUs' credit only until that load returns, then pays a second
    # switch and the SLO misses before it. 0 = this window only (the behaviour before).
    # NOTE: in sim/scenarios/steady-boundary.yaml every flap was a downshift gaining only the
    # freed GPUs' credit (2 x 50 tok/s x 300 s = 30,000 tok against a cost of 1,400-8,900)
    # undone 20-45 s into the next high phase (est TTFT p95 2.3-7.8 s on 2 GPUs). 3,600 s there
    # (5 seeds, no oracle): flaps 12 -> 0, vs fixed 0.994 -> 1.000, estimator p95 5.13 -> 0.29,
    # refusals 219 -> 0. Alone it dropped mixed-failures seed 8 from 0.973 to 0.871 of offered:
    # the 7B, forced off node-b1 under pressure (no GPU credit), took all four spare hoppers and
    # the 70B preempted later found none; forced switches now weigh the other deployments'
    # standby (gearbox.joint). Both measured on all four scenarios: bench/HISTORY.md.
    downshift_lookback_s: float = 3600.0
    # A voluntary downshift also needs this long of observed demand (gearbox.history.GearState
    # observed_since_s): at start-up the lookback holds no peak yet, and a plan judged on an
    # empty or light first window is one the first real load undoes. Kubernetes' HPA waits a
    # 300 s scale-down stabilisation window for the same reason. NOTE: without it the demo
    # (sim/scenarios/demo-shift.yaml) dropped assist-7b from four GPUs to one on its first
    # decision, at zero observed load, and ran it over its TTFT SLO from 00:04 until it moved
    # again at 00:05:15; chat-70b went from TP8 to TP2 at 00:00:15 in a CI run and had left
    # the GPUs the 08:00 preemption takes. 0 = no wait (the behaviour before).
    downshift_min_evidence_s: float = 300.0
    history_window_s: float = 3600.0  # samples older than this are dropped
    max_history_samples: int = 240  # per block
    min_shrink_steps: int = 2  # separate shrink events needed before a block counts as shrinking
    min_stability_factor: float = 0.3  # floor of the discount for a steadily shrinking block
    # --- atomic blocks ---
    min_block_link_gbps: float = 10.0  # slower domains are split into per-node blocks
    block_id_jaccard: float = 0.5  # reuse a previous block id at this membership overlap
    # --- enumeration ---
    max_tp: int = 16
    max_pp_stages: int = 4
    min_pp_link_gbps: float = 5.0  # inter-block link needed for pipeline parallelism
    min_pd_link_gbps: float = 10.0  # inter-block link needed for a prefill/decode KV hand-off
    max_pd_prefill_blocks: int = 2  # strongest blocks tried as prefill pools
    # share of GPU memory a plan may use: the runtime's admission watermark (runtime.throttle),
    # past which KV is refused 429, not vLLM's 0.9 — at 0.9 a plan counted on 4.3 GB a GPU of KV
    # the runtime refuses, most of a 70B's on two 80 GB GPUs (fragmented-short seed 8, stop 42)
    memory_utilisation: float = 0.85
    runtime_overhead_bytes: int = 2 * _GIB  # CUDA context, activations, NCCL buffers per GPU
    min_kv_reserve_tokens: int = 4096  # KV a replica must hold at least (sets minimum TP)
    max_batch_sequences: int = 256  # decode batch cap (vLLM max_num_seqs default 256)
    capacity_headroom: float = 1.2  # provision capacity for demand × headroom
    noise_margin: float = 1.1  # latencies are judged at demand × this (<= capacity_headroom)
    # --- cost model (see gearbox.cost for sources) ---
    mfu_prefill: float = 0.5  # prefill model-FLOPs utilisation
    mfu_decode: float = 0.5  # compute utilisation once decode turns compute-bound
    mbu_decode: float = 0.7  # decode memory-bandwidth utilisation
    collective_efficiency: float = 0.8  # achieved share of link bandwidth in all-reduce
    # Fixed costs a roofline misses (0 = pure roofline, the behaviour before they existed);
    # calibrated per engine by `python -m bench.engine`, see gearbox.cost.
    step_overhead_s: float = 0.0  # per stage forward: scheduling, launches, control message
    seq_layer_overhead_s: float = 0.0  # per sequence per layer: attention dispatched per sequence
    roofline_overlap: float = 1.0  # memory/compute overlap: 1 = max(mem, compute), 0 = sum
    # a one-sequence step's weight read relative to a batched one's (matrix-vector kernels)
    single_seq_read_speedup: float = 1.0
    pp_microbatching: bool = True  # decode splits the batch over PP stages (False: one pass)
    ttft_slo_ms: float = 2000.0
    tbt_slo_ms: float = 150.0
    # Chunked prefill (Sarathi-Serve, Agrawal et al. 2024): a unified replica's iteration
    # prefills at most the prompt tokens that take this share of the TBT SLO (at least
    # gearbox.cost.MIN_PREFILL_CHUNK_TOKENS), a long prompt over several iterations, so the
    # decode steps riding with them stay near the SLO; 0 = whole prompts. Half the SLO leaves
    # the other half to the decode step the chunk rides with (gearbox.cost: fused iterations).
    prefill_chunk_tbt_share: float = 0.5
    slo_weight: float = 0.5  # share of served tokens lost at zero SLO attainment
    backlog_drain_s: float = 60.0  # queued requests count as demand spread over this time
    # NOTE: replica capacities are memoised per (prompt, output) profile; a window mean that
    # drifts by a token every tick would re-enumerate every plan from scratch (most of a
    # decision's time). Means are costed in steps of this many tokens (about 1 % of typical
    # profiles); what the decision reports (load, digest) keeps the observed means. 1 = whole.
    profile_step_tokens: int = 16
    idle_gpu_value_tok_s: float = 50.0  # value of a GPU handed back, so low load scales down
    max_latency_ms: float = 3_600_000.0  # saturated estimates are capped here
    # --- online correction of the TTFT estimate (see gearbox.correction) ---
    correction_gain: float = 0.1  # weight of a tick's observed/model ratio (0 = never learn)
    correction_half_life_s: float = 1800.0  # a factor without new data halves its log this fast
    correction_min_samples: int = 20  # ticks whose window holds fewer TTFT samples are ignored
    # bounds of a learned factor; their ranges keep 1 (the model itself) inside, so a factor
    # decaying toward 1 never leaves them
    correction_min_factor: float = 0.25
    correction_max_factor: float = 4.0
    # NOTE: the load window (60 s) still holds the old plan's and the hand-over's requests
    # for a while after a switch; learning from them would blame the new plan.
    correction_settle_s: float = 90.0  # no learning this soon after a switch
    # A tick teaches the queues' service rate instead of the TTFT factor when a service-rate
    # change of under this × the TTFT factor's (in log terms) explains it (gearbox.correction);
    # 0.2 trusts the service rate ~5× more (log 1.3 / log 4: a roofline throughput off by tens
    # of per cent, a TTFT p95 off by up to the 4× clamp). 0 = never: the behaviour before.
    # NOTE: off by default. In sim/scenarios/steady-boundary.yaml (seeds 7-11) 0.2 took the
    # estimator error p95 5.4 -> 0.34 and FlexPipe's flaps 12 -> 0, but its goodput vs the fixed
    # plan 0.991 -> 0.966: it then held the 2-GPU plan through the high phases, where the
    # runtime sheds 0.6-4 % of requests at its KV watermark (throttled_watermark), and shed
    # requests left no TTFT sample. They now count beyond every sample (streams.load); 0.2
    # measured again there, seeds 7 / 9, against off: estimator p95 3.39 / 8.61 -> 0.58 / 0.57,
    # flaps 7 / 25 -> 8 / 11, but vs fixed 0.994 / 0.993 -> 0.991 / 0.990 (chat-13b refused
    # 207 / 363 -> 409 / 609 requests). Worse vs fixed than off, so it stays off.
    correction_service_ratio: float = 0.0
    # NOTE: off by default. Since the p95 prompt's prefill and the prefill queue's p95 wait are
    # no longer summed (gearbox.cost), bench.fragmented (seeds 7-11) measured with it on the
    # estimator error p95 fragmented-short 0.602 -> 0.554, mixed-failures 0.520 -> 0.506,
    # steady-boundary 0.281 -> 0.251, steady-noisy 0.330 -> 0.301, medians of goodput, vs fixed
    # and flaps unchanged; but one seed of each of three scenarios took 2 more flaps, and
    # steady-noisy's worst seed fell to 0.998x fixed (target >= 1.0): a target lost, none won.
    ttft_prompt_tail: bool = False  # TTFT p95 from the smoothed prompt tail, M/G/1 (gearbox.cost)
    # NOTE: off by default. In mixed-failures (5 seeds, 606a139) it moved seed 9's 7B at 4,200 s
    # onto a 4-GPU plan whose decode the model put at 8.8 ms (the 2-GPU plan's factor, 3.2,
    # applied to a shape never seen), then onto a prefill/decode plan whose TTFT factor sat at
    # the 4x clamp while 2-5 s were observed: nothing beat it, and the 7B served 0.858 of its
    # offered tokens within SLO (0.996 off). steady-noisy / steady-boundary: goodput as off,
    # estimator p95 0.287 / 0.216.
    correction_tbt: bool = False  # learn a TBT factor like the TTFT one (gearbox.correction)
    # Estimates are made at the load windows' arrival rate and mean lengths smoothed over
    # this time constant (gearbox.correction, ``observe_demand``); 0 = each window's own.
    demand_smoothing_s: float = 120.0
    # --- switch cost (see gearbox.switch for sources) ---
    weight_load_gbps: float = 5.0  # per-GPU weight load rate from local NVMe/page cache
    kv_transfer_efficiency: float = 0.8  # achieved share of the path's bandwidth for KV
    comm_setup_s: float = 0.5  # communicator build + route-table flip
    switch_throughput_loss: float = 0.5  # share of affected throughput lost while handing over
    cold_start_requests: int = 200  # requests until a new replica reaches steady state
    cold_start_slowdown: float = 0.3  # throughput shortfall during those requests

    def __post_init__(self) -> None:
        _check_bounds(self, _GEARBOX_BOUNDS)
        if self.min_pd_link_gbps < self.min_pp_link_gbps:
            raise ValueError(
                "min_pd_link_gbps: must be >= min_pp_link_gbps, since a KV hand-off moves far "
                f"more bytes than activations (got {self.min_pd_link_gbps} < "
                f"{self.min_pp_link_gbps})"
            )
        if self.noise_margin > self.capacity_headroom:
            raise ValueError(
                "noise_margin: must be <= capacity_headroom, or every plan provisioned for the "
                "headroom would look saturated at the load its latency is judged at (got "
                f"{self.noise_margin} > {self.capacity_headroom})"
            )


def without_gpu_credit(config: GearboxConfig) -> GearboxConfig:
    """``config`` with ``idle_gpu_value_tok_s`` = 0, every other field unchanged.

    NOTE: copied rather than rebuilt with ``dataclasses.replace``: 0 is in range and no other
    field changes, so nothing needs validating again — and re-validating would reject the
    deliberately out-of-range ablation config of ``bench.sim.systems.permissive``.
    """
    made = copy.copy(config)
    object.__setattr__(made, "idle_gpu_value_tok_s", 0.0)
    return made


_GEARBOX_BOUNDS: dict[str, tuple[float, float]] = {
    "hysteresis": (1.3, 1.5),
    "cooldown_s": (0.0, 86_400.0),
    "reverse_cooldown_factor": (1.0, 10.0),
    "failed_target_quarantine_s": (0.0, 86_400.0),
    "gain_horizon_s": (1.0, 86_400.0),
    "top_k_candidates": (1, 50),
    "handover_candidates": (0, 50),
    "profile_step_tokens": (1, 4096),
    "downshift_guard": (0, 1),
    "downshift_slo_margin": (0.01, 1.0),
    "downshift_lookback_s": (0.0, 7 * 86_400.0),
    "downshift_min_evidence_s": (0.0, 86_400.0),
    "history_window_s": (60.0, 7 * 86_400.0),
    "max_history_samples": (3, 100_000),
    "min_shrink_steps": (1, 1000),
    "min_stability_factor": (0.0, 1.0),
    "min_block_link_gbps": (0.0, 10_000.0),
    "block_id_jaccard": (0.01, 1.0),
    "max_tp": (1, 64),
    "max_pp_stages": (1, 16),
    "min_pp_link_gbps": (0.0, 10_000.0),
    "min_pd_link_gbps": (0.0, 10_000.0),
    "max_pd_prefill_blocks": (0, 64),
    "memory_utilisation": (0.1, 1.0),
    "runtime_overhead_bytes": (0, 64 * _GIB),
    "min_kv_reserve_tokens": (0, 10_000_000),
    "max_batch_sequences": (1, 100_000),
    "capacity_headroom": (1.0, 4.0),
    "noise_margin": (1.0, 4.0),
    "mfu_prefill": (0.01, 1.0),
    "mfu_decode": (0.01, 1.0),
    "mbu_decode": (0.01, 1.0),
    "collective_efficiency": (0.01, 1.0),
    "step_overhead_s": (0.0, 10.0),
    "seq_layer_overhead_s": (0.0, 1.0),
    "roofline_overlap": (0.0, 1.0),
    "single_seq_read_speedup": (0.1, 10.0),
    "pp_microbatching": (0, 1),
    "ttft_slo_ms": (1.0, _INF),
    "tbt_slo_ms": (1.0, _INF),
    "prefill_chunk_tbt_share": (0.0, 1.0),
    "slo_weight": (0.0, 1.0),
    "backlog_drain_s": (1.0, 86_400.0),
    "idle_gpu_value_tok_s": (0.0, _INF),
    "max_latency_ms": (1.0, _INF),
    "correction_gain": (0.0, 1.0),
    "correction_half_life_s": (1.0, 7 * 86_400.0),
    "correction_min_samples": (1, 1_000_000),
    "correction_min_factor": (0.01, 1.0),
    "correction_max_factor": (1.0, 100.0),
    "correction_settle_s": (0.0, 86_400.0),
    "correction_service_ratio": (0.0, 1.0),
    "ttft_prompt_tail": (0, 1),
    "correction_tbt": (0, 1),
    "demand_smoothing_s": (0.0, 86_400.0),
    "weight_load_gbps": (0.01, 10_000.0),
    "kv_transfer_efficiency": (0.01, 1.0),
    "comm_setup_s": (0.0, 600.0),
    "switch_throughput_loss": (0.0, 1.0),
    "cold_start_requests": (0, 1_000_000),
    "cold_start_slowdown": (0.0, 1.0),
}


class PlacementStrategy(StrEnum):
    """Which feasible GPU a new replica goes to."""

    SPREAD = "spread"  # best score (affinity, free memory after, idle compute): the article's
    PACK = "pack"  # best fit: least room left under the watermark, big empty GPUs kept whole


@dataclass(frozen=True, slots=True)
class PlacementConfig(Serialisable):
    """Knobs of multi-model placement (filter → score → anti-affinity → evict → scale)."""

    memory_k: float = 1.3  # KV safety factor in model_size + k × batch × seq × kv_bytes
    weight_affinity: float = 0.5  # score weight: GPU already holds the model
    weight_free_memory: float = 0.3  # score weight: free / total memory after placement
    weight_utilisation: float = 0.2  # score weight: 1 - compute utilisation
    max_models_per_gpu: int = 4  # concurrency cap: resident models per GPU
    oom_watermark: float = 0.85  # reject placements that push a GPU past this fill (pre-OOM)
    eviction_reload_factor: float = 3.0  # evict only if time to next request > reload × this
    cold_after_s: float = 1800.0  # a model idle this long is cold (eviction candidate)
    strategy: PlacementStrategy = PlacementStrategy.SPREAD  # among feasible GPUs
    # scale-out: another replica when the requests a model's replicas refused for capacity or
    # left waiting over the window reach this share of its arrivals (and at least
    # eviction_reload_factor of them: a stray refusal does not buy a load)
    scale_out_unmet_share: float = 0.05
    # scale-out stops at the larger of these two: a fixed number of replicas, or this share of
    # the GPUs the model may use (its pin domain and anti-affinity allow) — one hot model never
    # takes more than half the fleet, and a large fleet's top model is not held to a small one's
    # count (bench/HISTORY.md, 2026-12-04, stop 40: on farm's 12 GPUs the top model under Zipf
    # popularity carries about a third of the load, and at 4 replicas it refused the long
    # prompts of 7.6 % of the offered tokens). 0: the fixed number alone
    max_replicas_per_model: int = 4
    max_replica_share: float = 0.5
    # a model's last replica in use may be drained for a model whose waiting demand is
    # eviction_reload_factor times its own (gearbox.placement's displace rule); False: only idle
    # models are ever evicted (the article's rule)
    displace_in_use: bool = True
    # sequences of a model's nominal length (× memory_k) an on-demand replica's VMM floor
    # guarantees it on a shared GPU beyond its weights and overhead (gearbox.residency's
    # kv_floor_tokens). 0: none — every replica's KV competes under the GPU's one watermark, so a
    # long prompt may use room a quiet neighbour is not using (bench/HISTORY.md, 2026-12-04,
    # stop 39: the footprint's 8 held it off and bought no requests within the SLOs)
    kv_floor_batch: int = 0

    def __post_init__(self) -> None:
        _check_bounds(self, _PLACEMENT_BOUNDS)
        try:
            # NOTE: a scenario file gives the strategy as a plain string
            object.__setattr__(self, "strategy", PlacementStrategy(self.strategy))
        except ValueError:
            raise ValueError(
                f"strategy: must be one of {', '.join(s.value for s in PlacementStrategy)}, "
                f"got {self.strategy!r}"
            ) from None
        total = self.weight_affinity + self.weight_free_memory + self.weight_utilisation
        if abs(total - 1.0) > 1e-6:
            raise ValueError(
                f"weight_affinity: the three score weights must sum to 1 so scores stay in "
                f"[0, 1] and stay comparable across configs, got a sum of {total}"
            )


_PLACEMENT_BOUNDS: dict[str, tuple[float, float]] = {
    "memory_k": (1.0, 4.0),
    "weight_affinity": (0.0, 1.0),
    "weight_free_memory": (0.0, 1.0),
    "weight_utilisation": (0.0, 1.0),
    "max_models_per_gpu": (1, 1024),
    "oom_watermark": (0.1, 1.0),
    "eviction_reload_factor": (1.0, 1000.0),
    "cold_after_s": (0.0, 7 * 86_400.0),
    "scale_out_unmet_share": (0.0, 1.0),
    "max_replicas_per_model": (1, 1024),
    "max_replica_share": (0.0, 1.0),
    "kv_floor_batch": (0, 1024),
}

DEFAULT_CONFIG = GearboxConfig()
DEFAULT_PLACEMENT_CONFIG = PlacementConfig()
