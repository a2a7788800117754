"""Counters and time integrals one simulated system accumulates, and their summary.

Definitions (the same for every system):

* ``busy_frac`` — compute utilisation: the time-average share of GPUs busy with *served* work, a
  GPU being busy while an engine step of a request that later completes runs on it (the
  ``nvidia-smi`` "GPU utilisation" notion: kernel time, not FLOP efficiency). Work of requests
  that time out or are lost to an eviction does not count; recomputation after a preemption
  does (the GPU was busy with it).
* ``useful_frac`` — useful utilisation: GPU-seconds of work that delivered tokens / (GPUs ×
  duration). A request that completes contributes its first prefill and, of every engine step it
  ran in, an equal share of the step's decode time (time before a time-sliced GPU stretched it).
  Not counted: the prefill that recomputes a preempted sequence's context (``recompute_frac``),
  model loads (``load_frac``), and the shares of requests that never completed (timed out,
  evicted, unfinished). It is a share of GPU time, as ``busy_frac`` is; it does not credit a
  bigger batch (a step at batch 1 that delivers one token a sequence counts in full).
* ``engine_frac`` — GPU-seconds of every engine step, served or not, recompute included / (GPUs
  × duration); ``recompute_frac`` its recompute prefill part; ``load_frac`` — GPU-seconds spent
  loading weights (every load and reload) / (GPUs × duration), counted in neither figure above.
* ``tokens_per_busy_gpu_s`` — served tokens per busy GPU-second: how much the busy time bought
  (spreading a model thin keeps more GPUs busy at smaller batches).
* ``mem_util`` — memory utilisation by served work: the time-average of (weights of ready
  instances + KV of requests that complete, over their service) / cluster memory.
* ``goodput_req_s`` — requests served within gearbox's default SLOs (TTFT ≤ ``ttft_slo_ms``,
  mean time between tokens ≤ ``tbt_slo_ms``) per simulated second; ``slo_attainment`` is their
  share of all arrivals (rejected, timed out and unfinished ones count as misses).
* ``goodput_tok_per_gpu_s`` — goodput utilisation: prompt + output tokens of requests served
  within those SLOs per GPU-second of the cluster (GPUs × duration). Unlike ``busy_frac`` and
  ``useful_frac`` it does not rise when the same work runs in smaller batches, and GPU time lost
  to loads, recompute, idle memory-stranded cards or SLO misses earns nothing.
* ``dead_frac`` — time-average of gearbox's ``dead_memory`` dead bytes / cluster memory, sampled
  every tick (the article's "share of cluster memory"); ``dead_share`` is the same report's dead
  / free.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

__all__ = ["Metrics", "percentile", "union_length_s"]


def union_length_s(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``[start, end)`` intervals."""
    total, cur_start, cur_end = 0.0, 0.0, -1.0
    for start, end in sorted(intervals):
        if start > cur_end:
            total += max(0.0, cur_end - cur_start)
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    return total + max(0.0, cur_end - cur_start)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (0 for an empty list)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


@dataclass
class Metrics:
    """What one system did during one run."""

    arrivals: int = 0
    served_requests: int = 0
    served_tokens: int = 0
    rejected: Counter[str] = field(default_factory=Counter)  # 429s etc. by reason
    timed_out: int = 0  # waited past the queue timeout (no instance, or queue too slow)
    failed_evicted: int = 0  # held by an instance when it was evicted
    failed_loads: int = 0  # model loads refused by physical memory
    oom_events: int = 0  # allocations refused by the physical memory
    preemptions: int = 0  # running sequences preempted for KV (recomputed when resumed)
    unfinished: int = 0  # still in the system when the run ended
    loads: int = 0  # model loads, reloads after an eviction included
    evictions: int = 0
    evicted_with_active: int = 0  # evicted while holding running or queued requests (must be 0)
    placement_queued: int = 0  # placement attempts that found no GPU
    scale_outs: int = 0  # replicas added beyond a model's catalogue count (ours only)
    scale_ins: int = 0  # extra replicas given back idle (ours only)
    busy: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # gpu → served spans
    useful_gpu_s: float = 0.0  # GPU time of work that delivered tokens (see useful_frac)
    step_gpu_s: float = 0.0  # GPU time of every engine step
    recompute_gpu_s: float = 0.0  # its prefill of preempted sequences' context, computed before
    load_gpu_s: float = 0.0  # weight loads, reloads included
    kv_byte_s: float = 0.0  # ∫ KV bytes of served requests dt
    weight_byte_s: float = 0.0  # ∫ weight bytes of ready instances dt
    dead_frac_sum: float = 0.0
    dead_share_sum: float = 0.0
    dead_samples: int = 0
    latency_s: list[float] = field(default_factory=list)  # served requests: arrival → finish
    ttft_s: list[float] = field(default_factory=list)  # served requests: arrival → first token
    tbt_s: list[float] = field(default_factory=list)  # served requests: mean time between tokens
    goodput_requests: int = 0  # served within the TTFT and TBT SLOs
    goodput_tokens: int = 0  # their prompt + output tokens

    def summary(self, capacity_bytes: int, num_gpus: int, duration_s: float) -> dict[str, object]:
        """Plain, rounded figures (deterministic: no wall-clock values)."""
        busy_s = sum(union_length_s(spans) for spans in self.busy.values())
        samples = max(1, self.dead_samples)
        figures: dict[str, object] = {
            "arrivals": self.arrivals,
            "served_requests": self.served_requests,
            "served_tokens": self.served_tokens,
            "served_share": self.served_requests / self.arrivals if self.arrivals else 0.0,
            "rejected_429": sum(n for reason, n in self.rejected.items() if reason != "too_long"),
            "rejected_by_reason": dict(sorted(self.rejected.items())),
            "timed_out": self.timed_out,
            "failed_evicted": self.failed_evicted,
            "failed_loads": self.failed_loads,
            "oom_events": self.oom_events,
            "preemptions": self.preemptions,
            "unfinished": self.unfinished,
            "loads": self.loads,
            "evictions": self.evictions,
            "evicted_with_active": self.evicted_with_active,
            "placement_queued": self.placement_queued,
            "scale_outs": self.scale_outs,
            "scale_ins": self.scale_ins,
            "busy_frac": busy_s / (num_gpus * duration_s),
            "tokens_per_busy_gpu_s": self.served_tokens / busy_s if busy_s else 0.0,
            "useful_frac": self.useful_gpu_s / (num_gpus * duration_s),
            "engine_frac": self.step_gpu_s / (num_gpus * duration_s),
            "recompute_frac": self.recompute_gpu_s / (num_gpus * duration_s),
            "load_frac": self.load_gpu_s / (num_gpus * duration_s),
            "mem_util": (self.kv_byte_s + self.weight_byte_s) / (capacity_bytes * duration_s),
            "dead_frac": self.dead_frac_sum / samples,
            "dead_share": self.dead_share_sum / samples,
            "latency_p50_s": percentile(self.latency_s, 50),
            "latency_p95_s": percentile(self.latency_s, 95),
            "ttft_p95_s": percentile(self.ttft_s, 95),
            "tbt_p95_s": percentile(self.tbt_s, 95),
            "goodput_requests": self.goodput_requests,
            "goodput_req_s": self.goodput_requests / duration_s,
            "goodput_tok_s": self.goodput_tokens / duration_s,
            "goodput_tok_per_gpu_s": self.goodput_tokens / (num_gpus * duration_s),
            "slo_attainment": self.goodput_requests / self.arrivals if self.arrivals else 0.0,
            "served_tok_s": self.served_tokens / duration_s,
        }
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in figures.items()}
