"""Prometheus metrics of a runtime worker, on a registry the worker owns (no global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from flexpipe.schemas import GearTransition


class RuntimeMetrics:
    """The gear as a monitored object: plan, phase, durations, migration queue, admissions."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "flexpipe_runtime_requests",
            "Requests by admission outcome (reason as in the HTTP body)",
            ["deployment", "reason"],
            registry=r,
        )
        self.transitions = Counter(
            "flexpipe_runtime_transition_records",
            "Transition records persisted, by phase and status",
            ["deployment", "phase", "status"],
            registry=r,
        )
        self.phase_seconds = Histogram(
            "flexpipe_runtime_phase_seconds",
            "Duration of completed or failed phases (runtime clock)",
            ["deployment", "phase"],
            buckets=(0.1, 0.5, 1, 2, 5, 10, 20, 40, 80, 160),
            registry=r,
        )
        self.decisions = Counter(
            "flexpipe_runtime_decisions",
            "Decisions by outcome (started, ignored_stale, rolled_back, ...)",
            ["deployment", "outcome"],
            registry=r,
        )
        self.serving_plan = Gauge(
            "flexpipe_runtime_serving_plan_info",
            "1 for the deployment plan in the route table",
            ["deployment", "plan_id"],
            registry=r,
        )
        self.in_transition = Gauge(
            "flexpipe_runtime_transition_phase",
            "1 for the phase the running transition is in",
            ["deployment", "phase"],
            registry=r,
        )
        self.migration_queue = Gauge(
            "flexpipe_runtime_migration_queue",
            "Sequences waiting for or in KV hand-over",
            ["deployment"],
            registry=r,
        )
        self.owned = Gauge(
            "flexpipe_runtime_owned_sequences",
            "Sequences owned by replicas",
            ["deployment"],
            registry=r,
        )
        self.kv_bytes = Gauge(
            "flexpipe_runtime_kv_bytes", "KV bytes held by engines", ["deployment"], registry=r
        )
        # NOTE: a gauge set from the serving core's running count (a counter would need the
        # increments; the core keeps the total, as it does for OOM events)
        self.preemptions = Gauge(
            "flexpipe_runtime_kv_preemptions",
            "Running sequences preempted for KV pages and recomputed later (paged admission)",
            ["deployment"],
            registry=r,
        )
        self.oom = Gauge(
            "flexpipe_runtime_oom_events",
            "Simulated-GPU allocations refused at the memory limit (should stay 0)",
            registry=r,
        )

    def on_record(self, record: GearTransition) -> None:
        """Count a persisted transition record."""
        self.transitions.labels(record.deployment, record.phase, record.status).inc()
        if record.duration_ms is not None and record.status != "started":
            self.phase_seconds.labels(record.deployment, record.phase).observe(
                record.duration_ms / 1000.0
            )

    def set_serving_plan(self, deployment: str, plan_id: str | None, previous: str | None) -> None:
        """Move the plan-info gauge to the new plan."""
        if previous is not None and previous != plan_id:
            self.serving_plan.remove(deployment, previous)
        if plan_id is not None:
            self.serving_plan.labels(deployment, plan_id).set(1)

    def set_phase(self, deployment: str, phase: str | None) -> None:
        """One-hot gauge of the running phase (all zero when idle)."""
        for name in ("prepare", "switch", "cleanup"):
            self.in_transition.labels(deployment, name).set(1 if name == phase else 0)
