"""Serving-load window: what a runtime worker reports to the streams for one deployment.

Counters and latency samples accumulate between reports; :meth:`ServingWindow.report` turns them
into a :class:`flexpipe.schemas.ServingLoad` and starts a new window. Pure; time is an input.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flexpipe.latency import histogram
from flexpipe.schemas import ServingLoad
from runtime.types import CAPACITY_REFUSALS, Completion, Reason, Request

MAX_SAMPLES = 4096  # latency samples kept per window (the oldest are dropped beyond it)


def p95(samples: list[float]) -> float | None:
    """The 95th percentile by nearest rank, ``None`` without samples."""
    return weighted_p95(samples, [1] * len(samples))


def weighted_p95(samples: list[float], weights: list[int]) -> float | None:
    """The 95th percentile by nearest rank of ``samples``, each counted ``weights`` times."""
    if not samples:
        return None
    pairs = sorted(zip(samples, weights, strict=True))
    rank, seen = 0.95 * sum(weights), 0
    for value, count in pairs:
        seen += count
        if seen >= rank:
            return value
    return pairs[-1][0]


@dataclass
class ServingWindow:
    """Accumulates one window of serving activity."""

    start_s: float
    arrivals: int = 0
    rejected: int = 0
    capacity_refusals: int = 0  # of ``rejected``: refused for want of room (CAPACITY_REFUSALS)
    prompt_tokens: int = 0
    output_tokens: int = 0
    completions: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0  # running sequences preempted for KV pages (runtime.engine.paging)
    rejections: dict[Reason, int] = field(default_factory=dict)
    ttft_ms: list[float] = field(default_factory=list)
    tbt_ms: list[float] = field(default_factory=list)
    tbt_runs: list[int] = field(default_factory=list)  # iterations each tbt_ms entry stands for
    prompt_lengths: list[int] = field(default_factory=list)  # tokens, for the length histogram

    def on_arrival(self, request: Request, reason: Reason) -> None:
        """Count an arrival and, when refused, its reason."""
        self.arrivals += 1
        self.prompt_tokens += request.prompt_tokens
        if len(self.prompt_lengths) < MAX_SAMPLES:
            self.prompt_lengths.append(request.prompt_tokens)
        if reason not in (Reason.ADMITTED, Reason.HELD_FOR_LOAD, Reason.HELD_FOR_MEMORY):
            self.on_refused(reason)

    def on_refused(self, reason: Reason) -> None:
        """Count a refusal (at arrival, or of a held request later)."""
        self.rejected += 1
        if reason in CAPACITY_REFUSALS:
            self.capacity_refusals += 1
        self.rejections[reason] = self.rejections.get(reason, 0) + 1

    def on_completion(self, done: Completion) -> None:
        """Count a finished request and its time to first token."""
        self.completions += 1
        self.output_tokens += done.output_tokens
        if len(self.ttft_ms) < MAX_SAMPLES:
            self.ttft_ms.append(done.ttft_s * 1000.0)

    def on_step(
        self,
        prefill_tokens: int,
        decode_tokens: int,
        decode_step_s: tuple[float, ...],
        decode_step_runs: tuple[int, ...] = (),
    ) -> None:
        """Count engine work and decode-step durations (time between tokens), each standing
        for ``decode_step_runs`` identical iterations (one each when empty)."""
        self.prefill_tokens += prefill_tokens
        self.decode_tokens += decode_tokens
        room = MAX_SAMPLES - len(self.tbt_ms)
        steps = decode_step_s[:room]
        self.tbt_ms.extend(s * 1000.0 for s in steps)
        # NOTE: a run of identical iterations is one entry but as many gaps between tokens; a
        # p95 over entries would count a prefill-stalled iteration like a run of hundreds
        self.tbt_runs.extend(decode_step_runs[:room] if decode_step_runs else [1] * len(steps))

    def on_preempted(self, count: int) -> None:
        """Count running sequences an engine preempted for KV pages."""
        self.preemptions += count

    def report(
        self,
        deployment: str,
        model: str,
        now_s: float,
        *,
        queue_len: int,
        active_sequences: int,
        kv_bytes: int,
        plan_id: str | None,
    ) -> ServingLoad:
        """The window as a ServingLoad (call :meth:`reset` to start the next one)."""
        window = max(now_s - self.start_s, 1e-9)
        return ServingLoad(
            deployment=deployment,
            model=model,
            window_s=window,
            arrivals=self.arrivals,
            arrival_rate_rps=self.arrivals / window,
            queue_len=queue_len,
            active_sequences=active_sequences,
            prefill_tokens_per_s=self.prefill_tokens / window,
            decode_tokens_per_s=self.decode_tokens / window,
            mean_prompt_tokens=self.prompt_tokens / self.arrivals if self.arrivals else 0.0,
            mean_output_tokens=self.output_tokens / self.completions if self.completions else 0.0,
            ttft_p95_ms=p95(self.ttft_ms),
            tbt_p95_ms=weighted_p95(self.tbt_ms, self.tbt_runs),
            kv_bytes=kv_bytes,
            rejected=self.rejected,
            capacity_refusals=self.capacity_refusals,
            plan_id=plan_id,
            ttft_histogram=histogram(self.ttft_ms),
            prompt_histogram=histogram(self.prompt_lengths),
        )
