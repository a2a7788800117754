"""Latency histograms per simulated minute, request counters and GPU utilisation.

Latencies go into log-spaced histograms (2 % wide buckets, so a quantile is within 2 % of the
exact one) keyed by minute: TTFT per completed request, at the minute its first token came out
(what a dashboard shows then); TBT per generated token — every decode iteration contributes its
duration once per sequence it advanced, so quantiles are over inter-token gaps, prefill stalls
included. Utilisation is integrated over the run from samples of the GPUs a system holds (any
replica installed on them, serving, loading or draining): memory = bytes allocated in the
simulated pool (weights, runtime overhead, KV) over their capacity; compute = model FLOPs done
(2·params per token plus attention) over their peak bf16 FLOP/s — a model-FLOPs utilisation;
``busy_fraction`` is the share of time their engines were inside an iteration. SLO goodput
counts the prompt + output tokens of completed requests whose TTFT and mean inter-token gap
(first token to finish over output tokens − 1) are within the deployment's SLOs.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from runtime.types import CAPACITY_REFUSALS, Admission, Completion, RequestKind

_LOG_RATIO = math.log(1.02)
_MIN_MS = 1e-3
Histogram = dict[int, float]  # bucket index → weight


def bucket_of(value_ms: float) -> int:
    """Bucket index of a latency in milliseconds."""
    return math.floor(math.log(max(value_ms, _MIN_MS)) / _LOG_RATIO)


def bucket_value_ms(index: int) -> float:
    """Geometric middle of a bucket."""
    return math.exp((index + 0.5) * _LOG_RATIO)


def merge(histograms: Iterable[Histogram]) -> Histogram:
    """Sum of histograms."""
    out: Histogram = defaultdict(float)
    for h in histograms:
        for index, weight in h.items():
            out[index] += weight
    return dict(out)


def weight(histogram: Histogram) -> float:
    """Total weight (samples)."""
    return sum(histogram.values())


def censored_quantile_ms(histogram: Histogram, q: float, beyond: int) -> tuple[float | None, bool]:
    """The ``q`` quantile of the histogram's samples plus ``beyond`` samples larger than any of
    them (requests refused for want of room, as :mod:`streams.load` counts them), and whether
    it is only a lower bound: when its rank falls among those ``beyond``, the largest sample's
    value (``None`` without samples) — the quantile lies past it."""
    total = weight(histogram)
    target = q * (total + max(0, beyond))
    if target <= total:
        return quantile_ms(histogram, target / total if total > 0 else q), False
    return (bucket_value_ms(max(histogram)) if histogram else None), beyond > 0


def quantile_ms(histogram: Histogram, q: float) -> float | None:
    """The ``q`` quantile (nearest rank on weights), ``None`` when empty."""
    total = weight(histogram)
    if total <= 0:
        return None
    target = q * total
    seen = 0.0
    for index in sorted(histogram):
        seen += histogram[index]
        if seen >= target:
            return bucket_value_ms(index)
    return bucket_value_ms(max(histogram))


@dataclass
class DeploymentMetrics:
    """One deployment's latencies and counters (also the engines' :class:`DecodeObserver`)."""

    ttft: dict[int, Histogram] = field(default_factory=lambda: defaultdict(dict))
    tbt: dict[int, Histogram] = field(default_factory=lambda: defaultdict(dict))
    arrivals: Counter[int] = field(default_factory=Counter)
    rejected: Counter[int] = field(default_factory=Counter)
    completions: Counter[int] = field(default_factory=Counter)
    tokens: Counter[int] = field(default_factory=Counter)  # prompt + output of completions
    rejections: Counter[str] = field(default_factory=Counter)
    # per minute: requests refused for want of room (runtime.types.CAPACITY_REFUSALS)
    capacity_refused: Counter[int] = field(default_factory=Counter)
    chat_ttft: Histogram = field(default_factory=dict)
    summarisation_ttft: Histogram = field(default_factory=dict)
    replays: int = 0
    # SLO goodput: a request counts when its TTFT and its mean gap between output tokens are
    # within the deployment's SLOs; its prompt + output tokens are then goodput.
    ttft_slo_s: float = float("inf")
    tbt_slo_s: float = float("inf")
    goodput_tokens: int = 0
    good_requests: int = 0
    missed_ttft: int = 0  # completed requests over the TTFT SLO
    missed_tbt: int = 0  # completed requests over the TBT SLO (TTFT within)
    # Added to every time before it is keyed by minute: a run simulating a slice of a longer
    # one (the oracle's intervals) records on the longer run's clock.
    clock_offset_s: float = 0.0
    _step_buckets: dict[float, int] = field(default_factory=dict)

    def _minute(self, t_s: float) -> int:
        return int((t_s + self.clock_offset_s) // 60.0)

    def on_decode(self, end_s: float, step_s: float, tokens: int) -> None:
        """``tokens`` inter-token gaps of ``step_s`` (decode observer)."""
        h = self.tbt[self._minute(end_s)]
        index = self._step_buckets.get(step_s)
        if index is None:  # step times repeat (memoised timing): bucket each value once
            index = self._step_buckets[step_s] = bucket_of(step_s * 1000.0)
        h[index] = h.get(index, 0.0) + tokens

    def on_admission(self, admission: Admission, arrival_s: float) -> None:
        """A submitted request, admitted or not."""
        minute = self._minute(arrival_s)
        self.arrivals[minute] += 1
        if not admission.admitted:
            self.on_refused(admission.reason, arrival_s)

    def on_refused(self, reason: str, t_s: float) -> None:
        """A request refused: at arrival, or later (held, or past its TTFT deadline)."""
        minute = self._minute(t_s)
        self.rejected[minute] += 1
        self.rejections[str(reason)] += 1
        if reason in CAPACITY_REFUSALS:
            self.capacity_refused[minute] += 1

    def on_completion(self, done: Completion, kind: RequestKind) -> None:
        """A finished request."""
        index = bucket_of(done.ttft_s * 1000.0)
        h = self.ttft[self._minute(done.first_token_s)]
        h[index] = h.get(index, 0.0) + 1.0
        by_kind = self.chat_ttft if kind is RequestKind.CHAT else self.summarisation_ttft
        by_kind[index] = by_kind.get(index, 0.0) + 1.0
        minute = self._minute(done.finish_s)
        self.completions[minute] += 1
        self.tokens[minute] += done.prompt_tokens + done.output_tokens
        self.replays += done.replays
        gaps = done.output_tokens - 1
        tbt_s = (done.finish_s - done.first_token_s) / gaps if gaps > 0 else 0.0
        if done.ttft_s > self.ttft_slo_s:
            self.missed_ttft += 1
        elif tbt_s > self.tbt_slo_s:
            self.missed_tbt += 1
        else:
            self.good_requests += 1
            self.goodput_tokens += done.prompt_tokens + done.output_tokens

    def window(self, series: Mapping[int, Histogram], start_s: float, end_s: float) -> Histogram:
        """Histograms of the minutes starting in ``[start_s, end_s)``, merged."""
        return merge(series[m] for m in _minutes(start_s, end_s) if m in series)

    def refused_in(self, start_s: float, end_s: float) -> int:
        """Capacity refusals in the minutes :meth:`window` covers."""
        refused = self.capacity_refused
        return sum(refused[m] for m in _minutes(start_s, end_s) if m in refused)


def _minutes(start_s: float, end_s: float) -> range:
    """The minutes starting in ``[start_s, end_s)``."""
    return range(math.floor(start_s / 60.0), math.ceil(end_s / 60.0))


def combined(parts: Sequence[DeploymentMetrics]) -> DeploymentMetrics:
    """One deployment's metrics over several runs recorded on one clock (the oracle's
    intervals, each its own run): histograms and counters summed, SLOs from the first."""
    out = DeploymentMetrics()
    if parts:
        out.ttft_slo_s, out.tbt_slo_s = parts[0].ttft_slo_s, parts[0].tbt_slo_s
    for part in parts:
        for mine, theirs in ((out.ttft, part.ttft), (out.tbt, part.tbt)):
            for minute, h in theirs.items():
                mine[minute] = merge((mine.get(minute, {}), h))
        out.chat_ttft = merge((out.chat_ttft, part.chat_ttft))
        out.summarisation_ttft = merge((out.summarisation_ttft, part.summarisation_ttft))
        for counter, more in (
            (out.arrivals, part.arrivals),
            (out.rejected, part.rejected),
            (out.capacity_refused, part.capacity_refused),
            (out.completions, part.completions),
            (out.tokens, part.tokens),
        ):
            counter.update(more)
        out.rejections.update(part.rejections)
        out.replays += part.replays
        out.goodput_tokens += part.goodput_tokens
        out.good_requests += part.good_requests
        out.missed_ttft += part.missed_ttft
        out.missed_tbt += part.missed_tbt
    return out


@dataclass
class Utilisation:
    """GPU-seconds held, and the memory and compute used on them, integrated over a run."""

    held_gpu_s: float = 0.0
    memory_used_byte_s: float = 0.0
    memory_capacity_byte_s: float = 0.0
    busy_gpu_s: float = 0.0
    model_flops: float = 0.0
    peak_flops: float = 0.0  # peak bf16 FLOP/s of the held GPUs × time
    cluster_gpu_s: float = 0.0  # schedulable GPU-seconds of the whole cluster
    sampled_s: float = 0.0
    gpus_by_minute: dict[int, int] = field(default_factory=dict)

    def add(
        self,
        now_s: float,
        dt_s: float,
        held: Mapping[str, tuple[int, int, float]],
        work: tuple[float, float],
        schedulable: int,
    ) -> None:
        """A sample over the last ``dt_s``.

        ``held`` maps each GPU the system holds → (used bytes, capacity bytes, peak FLOP/s);
        ``work`` is (busy GPU-seconds, model FLOPs) done since the previous sample.
        """
        self.held_gpu_s += len(held) * dt_s
        self.memory_used_byte_s += sum(h[0] for h in held.values()) * dt_s
        self.memory_capacity_byte_s += sum(h[1] for h in held.values()) * dt_s
        self.peak_flops += sum(h[2] for h in held.values()) * dt_s
        self.busy_gpu_s += work[0]
        self.model_flops += work[1]
        self.cluster_gpu_s += schedulable * dt_s
        self.sampled_s += dt_s
        self.gpus_by_minute[int(now_s // 60.0)] = len(held)

    def absorb(self, other: Utilisation, minutes: range) -> None:
        """Add another run's integrals (one on the same clock: an oracle interval); its GPU
        counts only for ``minutes``, the interval it stands for (its drain overlaps the next)."""
        self._add_work(other)
        self.cluster_gpu_s += other.cluster_gpu_s
        self.sampled_s += other.sampled_s
        self.gpus_by_minute.update((m, n) for m, n in other.gpus_by_minute.items() if m in minutes)

    def _add_work(self, other: Utilisation) -> None:
        """What ``other`` held and did, added (not the cluster, nor the span sampled)."""
        self.held_gpu_s += other.held_gpu_s
        self.memory_used_byte_s += other.memory_used_byte_s
        self.memory_capacity_byte_s += other.memory_capacity_byte_s
        self.busy_gpu_s += other.busy_gpu_s
        self.model_flops += other.model_flops
        self.peak_flops += other.peak_flops

    @classmethod
    def side_by_side(cls, parts: Sequence[Utilisation]) -> Utilisation:
        """Runs over the same span and samples on disjoint GPUs (an oracle interval's
        deployments, each run alone) as one run: what they hold and do added up, the
        cluster and the span counted once."""
        out = cls(cluster_gpu_s=parts[0].cluster_gpu_s, sampled_s=parts[0].sampled_s)
        for part in parts:
            if (part.cluster_gpu_s, part.sampled_s) != (out.cluster_gpu_s, out.sampled_s):
                raise ValueError("runs side by side must cover the same span of one cluster")
            out._add_work(part)
            for minute, gpus in part.gpus_by_minute.items():
                out.gpus_by_minute[minute] = out.gpus_by_minute.get(minute, 0) + gpus
        return out

    def summary(self) -> dict[str, float]:
        """Utilisation ratios over the run (held GPUs, and the whole schedulable cluster)."""

        def ratio(a: float, b: float) -> float:
            return a / b if b > 0 else 0.0

        return {
            "memory_utilisation": ratio(self.memory_used_byte_s, self.memory_capacity_byte_s),
            "compute_utilisation": ratio(self.model_flops, self.peak_flops),
            "busy_fraction": ratio(self.busy_gpu_s, self.held_gpu_s),
            "mean_gpus_held": ratio(self.held_gpu_s, self.sampled_s),
            "cluster_compute_utilisation": ratio(self.busy_gpu_s, self.cluster_gpu_s),
        }
