"""Scenario → gearbox types: GPU and link classes, models, topology snapshots, starting plans.

NOTE: ``streams/snapshot.py`` (the stream processor's snapshot builder) does not exist yet, so
this small adapter builds :class:`gearbox.TopologySnapshot` straight from the simulated cluster's
state (:class:`sim.cluster.SimCluster`). What it reads is what the streams would learn from the
agents: which GPUs are schedulable, their class and memory, the domains' links. Free memory is
what the other deployments leave (the caller says what they hold).
The view is refreshed by :meth:`ClusterView.observe` when an agent report would reach the
streams, so decisions see the cluster with the telemetry's delay.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from flexpipe.errors import ValidationError
from gearbox import (
    DeploymentPlan,
    Domain,
    ExecutionPlan,
    GearboxConfig,
    Gpu,
    GpuClass,
    LinkClass,
    ModelSpec,
    Stage,
    StageRole,
    TopologySnapshot,
    build_blocks,
    split_layers,
)
from gearbox.candidates import limiting_class
from gearbox.cost import min_tp_for_memory
from gearbox.presets import MODEL_ALIASES
from sim.cluster import SimCluster
from sim.spec import DeploymentSpec, GpuClassSpec, LinkSpec, Scenario


def gpu_class(spec: GpuClassSpec) -> GpuClass:
    """The scenario's GPU class as gearbox sees it."""
    return GpuClass(
        spec.name, spec.peak_bf16_tflops, spec.memory_total_bytes, spec.memory_bandwidth_gbps
    )


def link_class(spec: LinkSpec) -> LinkClass:
    """The scenario's link class as gearbox sees it (GB/s per GPU, µs)."""
    return LinkClass(spec.name, spec.bandwidth_gbps, spec.latency_us)


def model_of(dep: DeploymentSpec) -> ModelSpec:
    """The gearbox model a scenario deployment serves."""
    model = MODEL_ALIASES.get(dep.model.preset)
    if model is None:
        known = ", ".join(sorted(MODEL_ALIASES))
        raise ValidationError(
            f"deployments.{dep.name}.model",
            f"preset {dep.model.preset!r} has no gearbox model shape (known: {known})",
        )
    return model


class ClusterView:
    """The scenario's hardware in gearbox terms, read off a live :class:`SimCluster`."""

    def __init__(self, scenario: Scenario, cluster: SimCluster) -> None:
        self.scenario = scenario
        self.cluster = cluster
        classes = {c.name: gpu_class(c) for c in scenario.gpu_classes}
        self.gpu_class_of = {g.uuid: classes[g.gpu_class] for g in scenario.gpus}
        self.node_of = {g.uuid: g.node for g in scenario.gpus}
        self.domain_of = {g.uuid: g.domain for g in scenario.gpus}
        self.domains = tuple(
            Domain(d.id, link_class(scenario.link(d.link))) for d in scenario.domains
        )
        self.inter_domain_link = link_class(scenario.link(scenario.inter_domain_link))
        self.uuids = tuple(g.uuid for g in scenario.gpus)
        self.schedulable: frozenset[str] = frozenset()
        self.observe()

    def observe(self) -> None:
        """The streams learn the cluster's current state (an agent report reached them).

        Snapshots show the state as of the last observation, not the simulated truth: a
        preemption is invisible to the decision loop until the agent reports it.
        """
        self.schedulable = frozenset(self.cluster.schedulable_gpus())

    def link_of(self, domain_id: str) -> LinkClass:
        """The link inside a domain."""
        return next(d.link for d in self.domains if d.domain_id == domain_id)

    def snapshot(self, now_s: float, used_bytes: Mapping[str, int]) -> TopologySnapshot:
        """Every GPU at ``now_s``; ``used_bytes`` is what other deployments hold on a GPU."""
        gpus = []
        for uuid in self.uuids:
            cls = self.gpu_class_of[uuid]
            free = max(0, cls.memory_bytes - used_bytes.get(uuid, 0))
            gpus.append(
                Gpu(
                    uuid=uuid,
                    node=self.node_of[uuid],
                    gpu_class=cls,
                    domain=self.domain_of[uuid],
                    total_memory_bytes=cls.memory_bytes,
                    free_memory_bytes=free,
                    healthy=True,  # unhealthy and isolated GPUs are not schedulable either
                    schedulable=uuid in self.schedulable,
                    utilisation=0.0,
                    last_seen_s=now_s,
                )
            )
        return TopologySnapshot(now_s, tuple(gpus), self.domains, self.inter_domain_link)

    def block_ids(self, config: GearboxConfig) -> dict[str, str]:
        """GPU uuid → gearbox atomic-block id at t=0 (labels for hand-built plans)."""
        blocks = build_blocks(self.snapshot(0.0, {}), config)
        return {u: b.block_id for b in blocks for u in b.gpu_uuids}

    def replica(
        self, model: ModelSpec, groups: Sequence[Sequence[str]], block_of: Mapping[str, str]
    ) -> ExecutionPlan:
        """A replica of ``len(groups)`` pipeline stages, TP over each group, layers split evenly."""
        count = len(groups)
        split = split_layers(model.num_layers, [1.0] * count, [model.num_layers] * count)
        if split is None:
            raise ValidationError("plan.pp", f"cannot split {model.num_layers} layers that way")
        stages, start = [], 0
        for group, layers in zip(groups, split, strict=True):
            domain = self.domain_of[group[0]]
            stages.append(
                Stage(
                    block_of[group[0]],
                    domain,
                    tuple(group),
                    start,
                    start + layers,
                    StageRole.UNIFIED,
                    limiting_class([self.gpu_class_of[u] for u in group]),
                    self.link_of(domain),
                )
            )
            start += layers
        pp_link = None
        if len(stages) > 1:
            domains = {s.domain_id for s in stages}
            pp_link = self.link_of(stages[0].domain_id) if len(domains) == 1 else None
            pp_link = pp_link or self.inter_domain_link
        return ExecutionPlan(model.name, tuple(stages), pp_link)


def starting_plan(
    view: ClusterView, dep: DeploymentSpec, block_of: Mapping[str, str]
) -> DeploymentPlan:
    """The scenario's starting plan of ``dep``: its GPU groups as the simulated cluster placed
    them."""
    model = model_of(dep)
    tp = dep.plan.tp
    replicas = []
    for group in view.cluster.placement(dep.name):
        stages = [group[i : i + tp] for i in range(0, len(group), tp)]
        replicas.append(view.replica(model, stages, block_of))
    return DeploymentPlan(dep.name, model.name, tuple(replicas))


def static_layout(
    view: ClusterView,
    deployments: Sequence[DeploymentSpec],
    block_of: Mapping[str, str],
    config: GearboxConfig,
) -> dict[str, DeploymentPlan]:
    """Static replicas over all blocks: the starting plans plus every other GPU, node by node.

    Rule (no tuning, stated so anyone can check it): each node's GPUs left free at t=0 go to the
    deployment holding the fewest GPUs so far among those whose model fits there (ties: the
    larger model), as replicas of the smallest TP degree that fits its memory; GPUs left over
    go the same way to the other deployments.
    """
    plans = {d.name: starting_plan(view, d, block_of) for d in deployments}
    held = {name: plan.num_gpus for name, plan in plans.items()}
    taken = {u for plan in plans.values() for u in plan.gpu_uuids}
    groups: dict[str, list[list[str]]] = {d.name: [] for d in deployments}
    for node in view.scenario.nodes:
        free = [
            g.uuid for g in node.gpus if g.uuid not in taken and view.cluster.is_schedulable(g.uuid)
        ]
        while free:
            choice = _node_choice(view, deployments, free, held, config)
            if choice is None:
                break
            name, tp = choice
            count = len(free) // tp * tp
            groups[name].extend(free[i : i + tp] for i in range(0, count, tp))
            held[name] += count
            free = free[count:]
    for dep in deployments:
        model = model_of(dep)
        extra = tuple(view.replica(model, [g], block_of) for g in groups[dep.name])
        base = plans[dep.name]
        plans[dep.name] = DeploymentPlan(dep.name, model.name, base.replicas + extra)
    return plans


def _node_choice(
    view: ClusterView,
    deployments: Sequence[DeploymentSpec],
    free: Sequence[str],
    held: Mapping[str, int],
    config: GearboxConfig,
) -> tuple[str, int] | None:
    """(deployment, TP degree) for the next GPUs of a node, or None when no model fits."""
    memory = min(view.gpu_class_of[u].memory_bytes for u in free)
    fits = []
    for dep in deployments:
        model = model_of(dep)
        least = min_tp_for_memory(memory, model, config)
        sizes = [tp for tp in model.valid_tp_sizes(len(free)) if tp >= least]
        if sizes:
            fits.append((held[dep.name], -model.weight_bytes, dep.name, sizes[0]))
    if not fits:
        return None
    _, _, name, tp = min(fits)
    return name, tp
