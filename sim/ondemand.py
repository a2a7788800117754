"""On-demand models in a `flexpipe up` run: what the load saw, and the checks it adds.

A scenario whose deployments are ``on_demand`` (``sim/scenarios/many-models.yaml``) is served by
loads and evictions the stream decides (:mod:`gearbox.residency`). :class:`OnDemandLedger`
follows every request the load generator offered — its span from arrival to completion or
refusal, its tokens, whether it met its deployment's SLOs — and samples the GPUs' memory and
how many models each GPU holds (several on-demand models share a GPU);
:func:`on_demand_figures` turns that and the transitions read back into ``summary.json``'s
``on_demand`` section and :func:`on_demand_checks` into three invariants:

* ``no_eviction_with_active``: no eviction finished while a request of its model was in flight
  through its whole switch phase (from the freeze of the model's entry to the swap);
* ``no_oom``: no simulated allocation failed at a GPU's memory limit, no engine ran out of KV;
* ``every_requested_model_served``: a model that got requests served at least one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flexpipe.config import FlexPipeConfig
from flexpipe.schemas import GearTransition, PhaseStatus, TransitionPhase
from gearbox.placement import ModelFootprint, dead_memory
from gearbox.types import Gpu, TopologySnapshot
from sim.fleet import SimFleet
from sim.summary import Check, OnDemandInvariant
from streams.deployments import resolve_deployments
from streams.ondemand import footprint, is_on_demand

__all__ = [
    "DEAD_MEMORY_EVERY_S",
    "MemorySample",
    "OnDemandLedger",
    "evicted_with_active",
    "on_demand_checks",
    "on_demand_figures",
    "on_demand_lines",
    "packing_figures",
    "sample_memory",
]

DEAD_MEMORY_EVERY_S = 30.0  # simulated seconds between memory samples


@dataclass(frozen=True, slots=True)
class MemorySample:
    """The schedulable GPUs' memory at one simulated time."""

    t_s: float
    dead_share: float  # of free memory: free memory no model fits in
    stranded_share: float  # of free memory: free memory on GPUs that serve a model
    models_per_gpu: tuple[int, ...]  # models loaded or loading on each schedulable GPU


@dataclass
class OnDemandLedger:
    """Every offered request of the on-demand deployments, and the memory samples."""

    slo_ms: Mapping[str, tuple[float, float]]  # deployment → (TTFT, TBT) SLO
    requests: Counter[str] = field(default_factory=Counter)
    served: Counter[str] = field(default_factory=Counter)
    offered_tokens: Counter[str] = field(default_factory=Counter)
    good_tokens: Counter[str] = field(default_factory=Counter)  # of requests within both SLOs
    refused: Counter[str] = field(default_factory=Counter)  # 429s etc. by reason
    spans: dict[str, list[tuple[float, float]]] = field(default_factory=lambda: defaultdict(list))
    memory: list[MemorySample] = field(default_factory=list)  # every DEAD_MEMORY_EVERY_S

    def offer(self, deployment: str, output_tokens: int) -> None:
        """A request arrived for ``deployment``."""
        self.requests[deployment] += 1
        self.offered_tokens[deployment] += output_tokens

    def finished(
        self,
        deployment: str,
        arrival_s: float,
        finish_s: float,
        ttft_s: float,
        tbt_s: float,
        tokens: int,
    ) -> None:
        """A request completed."""
        self.served[deployment] += 1
        self.spans[deployment].append((arrival_s, finish_s))
        ttft_slo, tbt_slo = self.slo_ms[deployment]
        if ttft_s * 1000.0 <= ttft_slo and tbt_s * 1000.0 <= tbt_slo:
            self.good_tokens[deployment] += tokens

    def refuse(self, deployment: str, arrival_s: float, t_s: float, reason: str) -> None:
        """A request was refused (at once, or after waiting for its model's load)."""
        self.refused[reason] += 1
        if t_s > arrival_s:  # NOTE: it was held: in flight for its model meanwhile
            self.spans[deployment].append((arrival_s, t_s))


def sample_memory(
    worker: Any, fleet: SimFleet, cfg: FlexPipeConfig, footprints: Sequence[ModelFootprint]
) -> MemorySample:
    """The schedulable GPUs' memory now.

    Dead: free memory no model fits in (:func:`gearbox.placement.dead_memory`, the simulated
    GPUs' allocations as free memory). Stranded: free memory on GPUs that serve a model —
    usable by their models' KV, or by another model that fits beside them. Models per GPU:
    the deployments with a replica installed there (loaded, or loading as a shadow).
    """
    now_s = float(worker.now_s())
    classes = cfg.catalog.gpu_class_specs()
    holders: dict[str, set[str]] = defaultdict(set)
    for name, rt in worker.runtimes.items():
        for rid in rt.core.replica_ids():
            for u in rt.core.plan_of(rid).gpu_uuids:
                holders[u].add(name)
    gpus = []
    for spec in fleet.scenario.gpus:
        if not fleet.cluster.is_schedulable(spec.uuid):
            continue
        cls = classes[spec.gpu_class]
        free = max(0, cls.memory_bytes - worker.pool.used_bytes(spec.uuid))
        gpus.append(
            Gpu(
                spec.uuid,
                spec.node,
                cls,
                spec.domain,
                cls.memory_bytes,
                free,
                True,
                True,
                0.0,
                now_s,
            )
        )
    link = cfg.catalog.link_specs()[fleet.scenario.inter_domain_link]
    report = dead_memory(TopologySnapshot(now_s, tuple(gpus), (), link), footprints, cfg.placement)
    stranded = sum(g.free_memory_bytes for g in gpus if g.uuid in holders)
    free = report.free_bytes
    counts = tuple(len(holders.get(g.uuid, ())) for g in gpus)
    return MemorySample(now_s, report.dead_share, stranded / free if free else 0.0, counts)


async def follow_memory(
    worker: Any,
    fleet: SimFleet,
    cfg: FlexPipeConfig,
    footprints: Sequence[ModelFootprint],
    ledger: OnDemandLedger,
    stop: asyncio.Event,
) -> None:
    """Sample the memory every ``DEAD_MEMORY_EVERY_S`` simulated seconds until ``stop``."""
    while not stop.is_set():
        ledger.memory.append(sample_memory(worker, fleet, cfg, footprints))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), DEAD_MEMORY_EVERY_S / worker.clock.speed)


def footprints_of(cfg: FlexPipeConfig) -> list[ModelFootprint]:
    """The on-demand models' placement footprints (as the stream computes them)."""
    _, deployments = resolve_deployments(cfg)
    return [footprint(d, cfg.gearbox) for d in deployments if is_on_demand(d)]


def _switch_windows(
    transitions: Sequence[tuple[float, GearTransition]],
) -> list[tuple[str, int, float, float]]:
    """(deployment, seq, switch started, switch completed) of every finished eviction."""
    started: dict[tuple[str, int], float] = {}
    completed: dict[tuple[str, int], float] = {}
    evicted: set[tuple[str, int]] = set()
    for t_s, rec in transitions:
        key = (rec.deployment, rec.transition_seq)
        if rec.phase is TransitionPhase.SWITCH and rec.status is PhaseStatus.STARTED:
            started[key] = t_s  # NOTE: the last attempt's
        if rec.phase is TransitionPhase.SWITCH and rec.status is PhaseStatus.COMPLETED:
            completed[key] = t_s
        if rec.phase is TransitionPhase.DONE and rec.plan is not None and not rec.plan.replicas:
            evicted.add(key)
    return [
        (d, seq, started[(d, seq)], completed[(d, seq)])
        for d, seq in sorted(evicted)
        if (d, seq) in started and (d, seq) in completed
    ]


def evicted_with_active(
    transitions: Sequence[tuple[float, GearTransition]],
    spans: Mapping[str, Sequence[tuple[float, float]]],
) -> list[str]:
    """Finished evictions during whose whole switch phase a request of the model was in flight
    (arrived before the switch started, ended after it completed), as "deployment #seq"."""
    out = []
    for dep, seq, t0, t1 in _switch_windows(transitions):
        if any(start < t0 and end > t1 for start, end in spans.get(dep, ())):
            out.append(f"{dep} #{seq}")
    return out


def _counts(transitions: Sequence[tuple[float, GearTransition]], names: set[str]) -> dict[str, int]:
    """Finished transitions by kind — from no replica a load, to none an eviction, else a
    scale-out or scale-in by the replica count — and the rolled-back ones."""
    last: dict[tuple[str, int], GearTransition] = {}
    for _, rec in transitions:
        if rec.deployment in names:
            last[(rec.deployment, rec.transition_seq)] = rec
    counts = dict.fromkeys(("loads", "evictions", "scale_outs", "scale_ins", "rolled_back"), 0)
    replicas: dict[str, int] = {}
    for (dep, _), rec in sorted(last.items()):
        if rec.phase is TransitionPhase.ROLLED_BACK:
            counts["rolled_back"] += 1
        if rec.phase is not TransitionPhase.DONE or rec.plan is None:
            continue
        before, after = replicas.get(dep, 0), len(rec.plan.replicas)
        replicas[dep] = after
        if not after:
            counts["evictions"] += 1
        elif before == 0:
            counts["loads"] += 1
        elif after != before:
            counts["scale_outs" if after > before else "scale_ins"] += 1
    return counts


def packing_figures(samples: Sequence[MemorySample]) -> dict[str, Any]:
    """How packed the GPUs were, over the memory samples (equally spaced in simulated time, so
    their means are time-weighted): the share of schedulable-GPU time holding n models, the
    share of serving-GPU time holding two or more, and the most models one GPU held."""
    gpu_time: Counter[int] = Counter()
    packed = serving = 0
    for s in samples:
        gpu_time.update(s.models_per_gpu)
        serving += sum(1 for n in s.models_per_gpu if n >= 1)
        packed += sum(1 for n in s.models_per_gpu if n >= 2)
    total = sum(gpu_time.values())
    return {
        "gpu_time_share_by_models": {
            str(n): round(gpu_time[n] / total, 3) for n in sorted(gpu_time)
        }
        if total
        else {},
        "packed_share_of_serving_gpu_time": round(packed / serving, 3) if serving else None,
        "max_models_per_gpu": max((n for s in samples for n in s.models_per_gpu), default=0),
    }


def on_demand_figures(
    ledger: OnDemandLedger,
    transitions: Sequence[tuple[float, GearTransition]],
    worker: Any,
) -> dict[str, Any]:
    """``summary.json``'s ``on_demand`` section."""
    names = set(ledger.slo_ms)
    evicted = evicted_with_active(transitions, ledger.spans)
    oom = int(worker.pool.oom_events) + sum(
        int(rt.core.engine_oom_events) for rt in worker.runtimes.values()
    )
    samples = ledger.memory
    models = {
        d: {
            "requests": ledger.requests[d],
            "served": ledger.served[d],
            "goodput": round(ledger.good_tokens[d] / ledger.offered_tokens[d], 3)
            if ledger.offered_tokens[d]
            else None,
        }
        for d in sorted(names)
    }
    return {
        **_counts(transitions, names),
        "evicted_with_active": len(evicted),
        "evicted_with_active_detail": evicted,
        "rejections_by_reason": dict(sorted(ledger.refused.items())),
        "oom": oom,
        "dead_memory_share_mean": round(sum(s.dead_share for s in samples) / len(samples), 3)
        if samples
        else None,
        "dead_memory_share_max": round(max(s.dead_share for s in samples), 3) if samples else None,
        "stranded_memory_share_mean": round(
            sum(s.stranded_share for s in samples) / len(samples), 3
        )
        if samples
        else None,
        "packing": packing_figures(samples),
        "goodput": round(
            sum(ledger.good_tokens.values()) / max(1, sum(ledger.offered_tokens.values())), 3
        ),
        "models": models,
    }


def on_demand_lines(figures: Mapping[str, Any]) -> list[str]:
    """The figures as the run's printed summary shows them."""
    f = figures
    worst = sorted(((m["goodput"], d) for d, m in f["models"].items() if m["goodput"] is not None))[
        :3
    ]
    return [
        "",
        f"== on demand: {f['loads']} loads, {f['evictions']} evictions ({f['rolled_back']}"
        f" rolled back), {f['scale_outs']} scale-outs, {f['scale_ins']} scale-ins, evicted with "
        f"a request in flight {f['evicted_with_active']}, OOM {f['oom']}",
        f"   refused by reason: {f['rejections_by_reason'] or 'none'}",
        f"   dead memory share mean {f['dead_memory_share_mean']} max "
        f"{f['dead_memory_share_max']}; stranded on serving GPUs mean "
        f"{f['stranded_memory_share_mean']}",
        f"   packing: GPU time by models held {f['packing']['gpu_time_share_by_models']}; "
        f"serving GPUs holding 2+ models {f['packing']['packed_share_of_serving_gpu_time']}; "
        f"at most {f['packing']['max_models_per_gpu']} models on one GPU",
        f"   goodput {f['goodput']} (lowest: " + ", ".join(f"{d} {g}" for g, d in worst) + ")",
    ]


def on_demand_checks(figures: Mapping[str, Any]) -> tuple[Check, ...]:
    """The three on-demand invariants (see the module docstring) over ``figures``."""
    evicted = figures["evicted_with_active_detail"]
    never = [d for d, m in figures["models"].items() if m["requests"] and not m["served"]]
    return (
        Check(
            OnDemandInvariant.NO_EVICTION_WITH_ACTIVE,
            not evicted,
            f"evicted with a request in flight: {', '.join(evicted)}"
            if evicted
            else f"{figures['evictions']} evictions, none with a request in flight",
        ),
        Check(
            OnDemandInvariant.NO_OOM, figures["oom"] == 0, f"{figures['oom']} out-of-memory events"
        ),
        Check(
            OnDemandInvariant.EVERY_REQUESTED_MODEL_SERVED,
            not never,
            f"requested but never served: {', '.join(never)}"
            if never
            else f"{sum(1 for m in figures['models'].values() if m['requests'])} requested "
            "models, each served",
        ),
    )
