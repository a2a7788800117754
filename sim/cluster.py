"""Simulated node-agent backend ("sim"): a fragmented GPU cluster driven by a scenario file.

:class:`SimCluster` is a deterministic state machine over simulated time: it applies the scenario's
timeline (preemptions, releases, node failures, XIDs, isolation) and derives every GPU's memory,
utilisation, power and temperature from the deployments' load plus seeded noise. Nothing here reads
the wall clock; the same scenario and seed give the same numbers in any process (no ``hash()``,
no set iteration, RNGs seeded from strings, which Python hashes with SHA-512).

:class:`SimGpuSampler` and :class:`SimLaunchCounter` implement :mod:`probes.base`'s protocols for
one node, so one simulated agent per node looks exactly like a real NVML + eBPF agent: a failed
node stops sampling (consumers notice the missing heartbeat), XIDs appear in samples and as
cluster events. Everything simulated is called so: backend ``name="sim"``, device names
``sim <class>``, process names ``sim-*``.

Load model (relative accuracy only, in the spirit of the article's estimates): a deployment's
arrivals follow its workload spec and are split over its serving replicas by compute capacity;
prefill and decode FLOPs over the replica's dense bf16 peak at 45 % MFU, plus decode steps
reading weights and KV from HBM, give the busy fraction NVML reports as SM utilisation. A replica
that lost a GPU (preempted, failed, isolated) stalls; its workers restart when its GPUs are all
schedulable again, as a fixed-plan deployment under an orchestrator would. :meth:`SimCluster.place`
moves a deployment (what the runtime calls after a gear shift).
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from flexpipe.errors import ValidationError
from flexpipe.schemas import (
    FATAL_XIDS,
    INTER_DOMAIN_ID,
    ClusterEvent,
    ClusterEventType,
    DomainInfo,
    GpuSample,
    KernelLaunches,
)
from gearbox.starting import hint_groups
from sim.gpu_load import (
    GpuLoad,
    GpuState,
    Reservation,
    Worker,
    build_launches,
    build_sample,
    replica_load,
)
from sim.spec import (
    Isolate,
    LinkChange,
    LinkSpec,
    NodeFailure,
    NodeRecovery,
    Preempt,
    Release,
    Restore,
    Scenario,
    TimelineEvent,
    Xid,
)

_ECC_XIDS = frozenset({48, 94, 95})  # uncorrectable ECC
_RETIRE_XIDS = frozenset({63, 64})  # row remapping / page retirement


class Origin(enum.StrEnum):
    """Who reports a cluster event: the node's own agent, or the cluster scheduler."""

    AGENT = "agent"  # everything a live node's agent can see or is told about its GPUs
    SCHEDULER = "scheduler"  # NODE_DOWN: the dead node's agent cannot say it


@dataclass(frozen=True, slots=True)
class TimedEvent:
    """A cluster event at its simulated time, with who would publish it."""

    t_s: float
    origin: Origin
    event: ClusterEvent


class SimCluster:
    """The whole simulated cluster; advance it with :meth:`advance_to`, read it with samplers."""

    def __init__(self, scenario: Scenario, seed: int) -> None:
        self.scenario = scenario
        self.seed = seed
        self.now_s = 0.0
        self._rng = random.Random(f"flexpipe-sim:{seed}:timeline")
        self._gpus = {g.uuid: GpuState(g, scenario.gpu_class(g.gpu_class)) for g in scenario.gpus}
        self._nodes = {n.name: n for n in scenario.nodes}
        self._down: dict[str, bool] = {n: False for n in self._nodes}
        self._bandwidth = {d.id: scenario.link(d.link).bandwidth_gbps for d in scenario.domains}
        self._deployments = {d.name: d for d in scenario.deployments}
        self._placement: dict[str, tuple[tuple[str, ...], ...]] = self._initial_placement()
        # GPU → its serving processes: one, or several on-demand models' sharing its memory
        self._workers: dict[str, tuple[Worker, ...]] = {}
        self._reservations: dict[str, Reservation] = {}  # insertion order = age
        self._next_pid = 4100
        self._applied = 0
        self._agent_queues: dict[str, list[ClusterEvent]] = {n: [] for n in self._nodes}
        self._load_cache: tuple[float, dict[tuple[str, str], GpuLoad]] | None = None
        self._reconcile()
        self._pending: list[TimedEvent] = []
        self._startup_events()

    # ---- queries ----------------------------------------------------------------------------

    def is_node_up(self, node: str) -> bool:
        """Whether ``node`` is alive."""
        return not self._down[node]

    def is_schedulable(self, gpu_uuid: str) -> bool:
        """Up, healthy, not isolated and not held by another tenant's reservation."""
        g = self._gpus[gpu_uuid]
        return not (self._down[g.spec.node] or g.isolated or g.fatal or g.reservation)

    def schedulable_gpus(self, domain: str | None = None) -> tuple[str, ...]:
        """Schedulable GPU uuids in scenario order, optionally of one domain."""
        return tuple(
            u
            for u, g in self._gpus.items()
            if (domain is None or g.spec.domain == domain) and self.is_schedulable(u)
        )

    def reservations(self) -> dict[str, tuple[str, ...]]:
        """Live tenant reservations: id → GPU uuids, oldest first."""
        return {r.id: tuple(r.gpus) for r in self._reservations.values()}

    def placement(self, deployment: str) -> tuple[tuple[str, ...], ...]:
        """A deployment's replicas as GPU uuid groups."""
        return self._placement[deployment]

    def processes(self, gpu_uuid: str) -> tuple[int, ...]:
        """Pids holding memory on a GPU (worker or tenant job)."""
        g, workers = self._gpus[gpu_uuid], self._workers.get(gpu_uuid, ())
        tenant = g.reservation.job_pid(g.spec.index) if g.reservation else None
        return tuple(p for p in (tenant, *(w.pid for w in workers)) if p)

    # ---- driving ----------------------------------------------------------------------------

    def advance_to(self, t_s: float) -> list[TimedEvent]:
        """Apply every timeline event at or before ``t_s``; return the cluster events they caused.

        Events a live node's agent would report are also queued for that node's
        :class:`SimGpuSampler`. Moving backwards is a no-op: the simulation only runs forward.
        """
        out, self._pending = self._pending, []
        timeline = self.scenario.timeline
        while self._applied < len(timeline) and timeline[self._applied].t_s <= t_s:
            ev = timeline[self._applied]
            self._applied += 1
            out.extend(self._timed(ev.t_s, e) for e in self._apply(ev))
            self._reconcile()
        self.now_s = max(self.now_s, t_s)
        return out

    def _timed(self, t_s: float, ev: ClusterEvent) -> TimedEvent:
        if ev.type is ClusterEventType.NODE_DOWN:
            return TimedEvent(t_s, Origin.SCHEDULER, ev)
        if not self._down[ev.node]:  # a dead agent reports nothing
            self._agent_queues[ev.node].append(ev)
        return TimedEvent(t_s, Origin.AGENT, ev)

    def place(self, deployment: str, replicas: Sequence[Sequence[str]]) -> None:
        """Move a deployment onto ``replicas`` (GPU uuid groups); workers restart there."""
        if deployment not in self._deployments:
            raise ValidationError("deployment", f"unknown deployment {deployment!r}")
        for i, group in enumerate(replicas):
            for uuid in group:
                if uuid not in self._gpus:
                    raise ValidationError(f"replicas[{i}]", f"unknown GPU {uuid!r}")
        self._placement[deployment] = tuple(tuple(g) for g in replicas)
        self._reconcile()

    def take_agent_events(self, node: str) -> list[ClusterEvent]:
        """Agent-origin events of ``node`` not yet taken (what its agent would have observed)."""
        out, self._agent_queues[node] = self._agent_queues[node], []
        return out

    # ---- timeline semantics -----------------------------------------------------------------

    def _apply(self, ev: TimelineEvent) -> list[ClusterEvent]:
        if isinstance(ev, Preempt):
            return self._preempt(ev)
        if isinstance(ev, Release):
            return self._release(ev)
        if isinstance(ev, NodeFailure | NodeRecovery):
            return self._node_change(ev.node, down=isinstance(ev, NodeFailure))
        if isinstance(ev, LinkChange):
            self._bandwidth[ev.domain] = ev.bandwidth_gbps
            info = (self._domain_info(ev.domain),)
            nodes = [n.name for n in self.scenario.domain(ev.domain).nodes]
            return [ClusterEvent(ClusterEventType.LINK, n, domains=info) for n in nodes]
        g = self._gpus[ev.gpu]
        if isinstance(ev, Xid):
            return self._xid(g, ev.code)
        g.isolated = isinstance(ev, Isolate)
        if isinstance(ev, Restore):  # reset or replaced: fatal state and die history gone
            g.fatal, g.temp_c = (), None
        kind = ClusterEventType.GPU_ISOLATED if g.isolated else ClusterEventType.GPU_RESTORED
        detail = ev.reason if isinstance(ev, Isolate) else "back in the pool"
        return [ClusterEvent(kind, g.spec.node, (ev.gpu,), detail=detail)]

    def _preempt(self, ev: Preempt) -> list[ClusterEvent]:
        if ev.gpus:
            taken = [u for u in ev.gpus if self._gpus[u].reservation is None]
        else:
            free = list(self.schedulable_gpus(ev.domain))
            picked = set(self._rng.sample(free, min(ev.count, len(free))))
            taken = [u for u in free if u in picked]  # scenario order, never set order
        resv = Reservation(ev.id, self._new_pid(), taken)
        self._reservations[ev.id] = resv
        for uuid in taken:
            self._gpus[uuid].reservation = resv
        detail = f"reservation {ev.id} takes {len(taken)} of {ev.count} requested GPUs"
        return self._per_node(ClusterEventType.PREEMPT, taken, detail)

    def _release(self, ev: Release) -> list[ClusterEvent]:
        freed: list[str] = []
        if ev.preemption is not None:
            freed = self._reservations.pop(ev.preemption).gpus
        else:
            want = ev.count or 0
            for resv in [r for r in self._reservations.values() if self._in(r, ev.domain)]:
                while resv.gpus and len(freed) < want:  # oldest reservation first
                    freed.append(resv.gpus.pop(0))
                if not resv.gpus:
                    del self._reservations[resv.id]
        for uuid in freed:
            self._gpus[uuid].reservation = None
        return self._per_node(ClusterEventType.RELEASE, freed, f"{len(freed)} GPUs released")

    def _in(self, resv: Reservation, domain: str) -> bool:
        return bool(resv.gpus) and self._gpus[resv.gpus[0]].spec.domain == domain

    def _node_change(self, node: str, *, down: bool) -> list[ClusterEvent]:
        self._down[node] = down
        for spec in self._nodes[node].gpus:  # a reboot loses die history and unread XIDs
            g = self._gpus[spec.uuid]
            g.temp_c, g.pending_xids = None, []
        kind = ClusterEventType.NODE_DOWN if down else ClusterEventType.NODE_UP
        return [ClusterEvent(kind, node) if down else self._node_up(node)]

    def _xid(self, g: GpuState, code: int) -> list[ClusterEvent]:
        fatal = code in FATAL_XIDS
        if fatal:
            g.fatal = (*g.fatal, code)
        else:
            g.pending_xids.append(code)
        g.ecc_uncorrected += code in _ECC_XIDS
        g.retired_pages += code in _RETIRE_XIDS
        detail = "fatal: GPU needs a reset" if fatal else "recoverable"
        return [
            ClusterEvent(ClusterEventType.XID, g.spec.node, (g.spec.uuid,), xid=code, detail=detail)
        ]

    def _per_node(
        self, kind: ClusterEventType, uuids: list[str], detail: str
    ) -> list[ClusterEvent]:
        by_node: dict[str, list[str]] = {}
        for uuid in uuids:
            by_node.setdefault(self._gpus[uuid].spec.node, []).append(uuid)
        return [ClusterEvent(kind, node, tuple(us), detail=detail) for node, us in by_node.items()]

    def _startup_events(self) -> None:
        self._pending = [self._timed(0.0, self._node_up(n)) for n in self._nodes]
        for node in self._nodes.values():
            isolated = tuple(g.uuid for g in node.gpus if g.isolated)
            if isolated:
                kind = ClusterEventType.GPU_ISOLATED
                ev = ClusterEvent(kind, node.name, isolated, detail="isolated at start")
                self._pending.append(self._timed(0.0, ev))

    def _node_up(self, node: str) -> ClusterEvent:
        domains = (self._domain_info(self._nodes[node].domain), self._inter_domain_info())
        return ClusterEvent(ClusterEventType.NODE_UP, node, domains=domains)

    def _domain_info(self, domain: str) -> DomainInfo:
        return DomainInfo(domain, self.scenario.domain(domain).link, self._bandwidth[domain])

    def _inter_domain_info(self) -> DomainInfo:
        link = self.scenario.link(self.scenario.inter_domain_link)
        return DomainInfo(INTER_DOMAIN_ID, link.name, link.bandwidth_gbps)

    # ---- placement and load -----------------------------------------------------------------

    def _initial_placement(self) -> dict[str, tuple[tuple[str, ...], ...]]:
        """Each deployment on its hint's GPUs by the one starting rule
        (:func:`gearbox.starting.hint_groups`); a hint that does not fit starts unplaced."""
        available = {
            d.id: [g.uuid for g in d.gpus if not g.isolated] for d in self.scenario.domains
        }
        groups = hint_groups(((d.name, d.plan) for d in self.scenario.deployments), available)
        return {name: chosen or () for name, chosen in groups.items()}

    def _wanted(self) -> dict[str, list[tuple[str, int]]]:
        """(deployment, replica) of the processes each placed, schedulable GPU runs.

        On-demand deployments share a GPU, one process each (the runtime's inventory lets their
        memory shares coexist); any other deployment owns its GPUs whole: the last placed wins.
        """
        wanted: dict[str, list[tuple[str, int]]] = {}
        for name, groups in self._placement.items():
            shares = self._deployments[name].on_demand
            for r, group in enumerate(groups):
                for uuid in group:
                    if not self.is_schedulable(uuid):
                        continue
                    held = wanted.setdefault(uuid, [])
                    if not (shares and all(self._deployments[d].on_demand for d, _ in held)):
                        held.clear()
                    held.append((name, r))
        return wanted

    def _reconcile(self) -> None:
        """Workers exist exactly on placed, schedulable GPUs (restarted with a new pid)."""
        wanted = self._wanted()
        for uuid in list(self._workers):
            keep = tuple(
                w for w in self._workers[uuid] if (w.deployment, w.replica) in wanted.get(uuid, ())
            )
            if keep:
                self._workers[uuid] = keep
            else:
                del self._workers[uuid]
        for uuid, keys in wanted.items():
            have = {(w.deployment, w.replica): w for w in self._workers.get(uuid, ())}
            workers = []
            for name, r in keys:
                worker = have.get((name, r))
                if worker is None:
                    group = self._placement[name][r]
                    dep = self._deployments[name]
                    held = dep.memory_utilisation * self._gpus[uuid].cls.memory_total_bytes
                    weights = dep.model.weight_bytes / len(group)
                    worker = Worker(self._new_pid(), name, r, weights, len(group), held)
                workers.append(worker)
            self._workers[uuid] = tuple(workers)
        self._load_cache = None

    def _new_pid(self) -> int:
        self._next_pid += 7  # NOTE: spaced like real pids; only determinism matters
        return self._next_pid

    def _loads(self, t_s: float) -> dict[tuple[str, str], GpuLoad]:
        """Load of every serving replica on each of its GPUs, by (GPU, deployment), at ``t_s``.

        Arrival rates are held for a whole simulated second (launch drains come five times as
        often as samples and the load curve is smooth), so the cache is per second.
        """
        t_s = float(math.floor(t_s))
        if self._load_cache is not None and self._load_cache[0] == t_s:
            return self._load_cache[1]
        loads: dict[tuple[str, str], GpuLoad] = {}
        for name, groups in self._placement.items():
            # NOTE: a replica missing a worker stalls; the router sends its share elsewhere,
            # by compute capacity, as queue-length routing would on average.
            serving = [g for g in groups if g and all(self._runs(u, name) for u in g)]
            classes = [[self._gpus[u].cls for u in g] for g in serving]
            caps = [len(c) * min(x.peak_bf16_tflops for x in c) for c in classes]
            for group, cls, cap in zip(serving, classes, caps, strict=True):
                load = replica_load(self._deployments[name], cls, cap / sum(caps), t_s)
                loads.update(dict.fromkeys(((u, name) for u in group), load))
        self._load_cache = (t_s, loads)
        return loads

    def _runs(self, gpu_uuid: str, deployment: str) -> bool:
        return any(w.deployment == deployment for w in self._workers.get(gpu_uuid, ()))

    def _served(
        self, gpu_uuid: str, loads: dict[tuple[str, str], GpuLoad]
    ) -> list[tuple[Worker, GpuLoad | None]]:
        """The GPU's serving processes with their loads, in placement order."""
        return [(w, loads.get((gpu_uuid, w.deployment))) for w in self._workers.get(gpu_uuid, ())]

    def _node_view(self, node: str) -> tuple[list[GpuState], LinkSpec]:
        if node not in self._nodes:
            raise ValidationError("node", f"unknown node {node!r} (known: {sorted(self._nodes)})")
        spec = self._nodes[node]
        link = self.scenario.link(self.scenario.domain(spec.domain).link)
        return [self._gpus[g.uuid] for g in spec.gpus], link


class SimGpuSampler:
    """:class:`probes.base.GpuSampler` for one simulated node: NVML-shaped samples, "sim" name."""

    name = "sim"

    def __init__(self, cluster: SimCluster, node: str) -> None:
        self._cluster = cluster
        self._node = node
        self._gpus, self._link = cluster._node_view(node)
        # One RNG per node and stream: a node's numbers never depend on how others are called.
        self._rng = random.Random(f"flexpipe-sim:{cluster.seed}:{node}:nvml")

    def sample(self, now_s: float) -> list[GpuSample]:
        """Every GPU of the node at ``now_s``; nothing while the node is down."""
        cluster = self._cluster
        cluster.advance_to(now_s)
        if not cluster.is_node_up(self._node):
            return []
        loads = cluster._loads(now_s)
        return [
            build_sample(g, cluster._served(g.spec.uuid, loads), self._link, now_s, self._rng)
            for g in self._gpus
        ]

    def poll_events(self, now_s: float) -> list[ClusterEvent]:
        """Cluster events about this node since the last call (NODE_UP, XID, PREEMPT, ...)."""
        self._cluster.advance_to(now_s)
        return self._cluster.take_agent_events(self._node)

    def close(self) -> None:
        """Nothing to release; idempotent."""


class SimLaunchCounter:
    """:class:`probes.base.LaunchCounter` for one simulated node: eBPF-shaped counts, "sim" name."""

    name = "sim"

    def __init__(self, cluster: SimCluster, node: str) -> None:
        self._cluster = cluster
        self._node = node
        self._gpus, _ = cluster._node_view(node)
        self._rng = random.Random(f"flexpipe-sim:{cluster.seed}:{node}:ebpf")
        self._last_s: float | None = None  # counting starts at the first drain (probe attach)

    def drain(self, now_s: float) -> list[KernelLaunches]:
        """Launches per GPU since the previous drain; GPUs that launched nothing are left out."""
        cluster = self._cluster
        cluster.advance_to(now_s)
        last_s, self._last_s = self._last_s, now_s
        if last_s is None or not cluster.is_node_up(self._node):
            return []
        loads = cluster._loads(now_s)
        out = []
        for g in self._gpus:
            served = cluster._served(g.spec.uuid, loads)
            counts = build_launches(g, served, now_s - last_s, self._rng)
            if counts is not None:
                out.append(counts)
        return out

    def close(self) -> None:
        """Nothing to detach; idempotent."""
