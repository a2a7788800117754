"""Prometheus metrics of the stream processors, registered on a registry passed in."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gearbox.decisions import CandidateSummary
from gearbox.types import LoadSnapshot

__all__ = ["StreamsMetrics"]

_LATENCY_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0, 15.0, 60.0,
)  # fmt: skip


class StreamsMetrics:
    """Everything the stream exports; label values are StrEnum values or entity names."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.events = Counter(
            "flexpipe_streams_events",
            "Valid events folded, by kind (every sample counts)",
            ["kind"],
            registry=registry,
        )
        self.duplicates = Counter(
            "flexpipe_streams_duplicates",
            "Redelivered events dropped by (source, seq)",
            ["kind"],
            registry=registry,
        )
        self.late = Counter(
            "flexpipe_streams_late_events",
            "Events older than their hopping window could hold",
            ["window"],
            registry=registry,
        )
        self.dead_letters = Counter(
            "flexpipe_streams_dead_letters",
            "Messages sent to the dead-letter topic",
            ["reason", "topic"],
            registry=registry,
        )
        self.decision_latency = Histogram(
            "flexpipe_streams_decision_latency_seconds",
            "Trigger's event time to the decision acknowledged by the broker",
            ["trigger"],
            buckets=_LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.decision_processing = Histogram(
            "flexpipe_streams_decision_processing_seconds",
            "Trigger received by this worker to the decision acknowledged",
            ["trigger"],
            buckets=_LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.forced_stage = Histogram(
            "flexpipe_streams_topology_stage_seconds",
            "Where a topology decision's time went: fold (a cluster event's event time to its"
            " fold, every applied event), and for the deployments whose plan it disturbed, wait"
            " (folded to its step's start: debounce, the round before, earlier steps), step,"
            " publish (step's end to the broker's acknowledgement)",
            ["stage"],
            buckets=_LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.cluster_peeked = Counter(
            "flexpipe_streams_cluster_peeked",
            "Cluster events folded by the worker's own cluster consumer, ahead of faust's delivery",
            registry=registry,
        )
        self.decisions = Counter(
            "flexpipe_streams_decisions",
            "Decisions published, by outcome and trigger",
            ["reason", "trigger"],
            registry=registry,
        )
        self.tick_failures = Counter(
            "flexpipe_streams_tick_failures",
            "Decision runs that raised, by path (periodic tick, trigger batch, debounced trigger)",
            ["path"],
            registry=registry,
        )
        self.resumed_partitions = Counter(
            "flexpipe_streams_resumed_partitions",
            "Input partitions the worker resumed because faust left them paused after recovery",
            registry=registry,
        )
        self.skipped = Counter(
            "flexpipe_streams_triggers_skipped",
            "Triggers not decided: already decided (replay), or worker not ready",
            ["why"],
            registry=registry,
        )
        self.current_plan = Gauge(
            "flexpipe_streams_current_plan",
            "1 for the plan each deployment currently runs (as the stream assumes it)",
            ["deployment", "plan_id", "source"],
            registry=registry,
        )
        self.current_plan_gpus = Gauge(
            "flexpipe_streams_current_plan_gpus",
            "GPUs of each deployment's current plan",
            ["deployment"],
            registry=registry,
        )
        self.blocks = Gauge(
            "flexpipe_streams_blocks", "Atomic blocks at the last decision", registry=registry
        )
        self.block_gpus = Gauge(
            "flexpipe_streams_block_gpus",
            "GPUs per atomic block at the last decision",
            ["block", "domain"],
            registry=registry,
        )
        self.view_gpus = Gauge(
            "flexpipe_streams_view_gpus",
            "GPUs in this worker's cluster view, by state",
            ["state"],
            registry=registry,
        )
        self.table_keys = Gauge(
            "flexpipe_streams_table_keys",
            "Keys held in each table on this worker (recovered from changelogs on start)",
            ["table"],
            registry=registry,
        )
        self.ttft_correction = Gauge(
            "flexpipe_streams_ttft_correction",
            "Learned factor on the modelled TTFT p95 of each deployment's current plan (1 = model)",
            ["deployment"],
            registry=registry,
        )
        self.ttft_estimate = Gauge(
            "flexpipe_streams_ttft_p95_estimate_seconds",
            "Gearbox's TTFT p95 estimate for each deployment's current plan (model × correction)",
            ["deployment"],
            registry=registry,
        )
        self.ttft_observed = Gauge(
            "flexpipe_streams_ttft_p95_observed_seconds",
            "TTFT p95 over every sample of the load window, requests refused for want of room "
            "counted beyond all of them (0 = no samples); only a lower bound, the largest "
            "sample, when flexpipe_streams_ttft_p95_censored is 1",
            ["deployment"],
            registry=registry,
        )
        self.ttft_refused = Gauge(
            "flexpipe_streams_ttft_refused_requests",
            "Requests of the load window refused for want of room (watermark, OOM risk, queue "
            "full), counted in the observed TTFT p95 as beyond every sample",
            ["deployment"],
            registry=registry,
        )
        self.ttft_censored = Gauge(
            "flexpipe_streams_ttft_p95_censored",
            "1 when over 5 % of the load window's requests were refused for want of room, so "
            "the observed TTFT p95 is only a lower bound",
            ["deployment"],
            registry=registry,
        )
        self.clock = Gauge(
            "flexpipe_streams_clock_seconds", "The stream's event-time clock", registry=registry
        )
        self.ready = Gauge(
            "flexpipe_streams_ready",
            "1 once the view caught up and the warm-up passed",
            registry=registry,
        )
        self._plan_labels: dict[str, tuple[str, str, str]] = {}
        self._block_labels: set[tuple[str, str]] = set()

    def set_plan(self, deployment: str, plan_id: str | None, source: str, num_gpus: int) -> None:
        """Show ``plan_id`` as the deployment's current plan (the previous label is removed)."""
        old = self._plan_labels.pop(deployment, None)
        if old is not None:
            self.current_plan.remove(*old)
        labels = (deployment, plan_id or "none", source)
        self.current_plan.labels(*labels).set(1)
        self._plan_labels[deployment] = labels
        self.current_plan_gpus.labels(deployment).set(num_gpus)

    def set_ttft(
        self, deployment: str, current: CandidateSummary | None, load: LoadSnapshot
    ) -> None:
        """Show the current plan's TTFT estimate and correction beside the observed p95 (and
        the refusals it counts); without a current plan only the observation."""
        self.ttft_observed.labels(deployment).set(load.window_ttft_p95_ms / 1000.0)
        self.ttft_refused.labels(deployment).set(load.num_ttft_refused)
        self.ttft_censored.labels(deployment).set(int(load.window_ttft_p95_censored))
        if current is not None:
            self.ttft_correction.labels(deployment).set(current.ttft_correction)
            self.ttft_estimate.labels(deployment).set(current.est_ttft_p95_ms / 1000.0)

    def set_blocks(self, blocks: list[tuple[str, str, int]]) -> None:
        """Replace the per-block gauges with (block id, domain, GPUs) rows."""
        wanted = {(b, d) for b, d, _ in blocks}
        for labels in self._block_labels - wanted:
            self.block_gpus.remove(*labels)
        for block, domain, num in blocks:
            self.block_gpus.labels(block, domain).set(num)
        self._block_labels = wanted
        self.blocks.set(len(blocks))
