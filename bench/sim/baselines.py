"""What only the baselines have: round-robin routing and the static layout over every block.

Both run on the product's runtime (same admission, VMM, transitions); only the router's order
of candidates and the starting plans differ.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gearbox import DeploymentPlan, ExecutionPlan, GearboxConfig, Stage, StageRole
from gearbox.blocks import AtomicBlock
from gearbox.candidates import limiting_class
from gearbox.cost import min_tp_for_memory
from gearbox.types import TopologySnapshot
from runtime.router import RouteChoice, Router
from runtime.types import Request
from sim.spec import Scenario
from streams.deployments import Deployment


class RoundRobinRouter(Router):
    """The static baseline's router: routable replicas in rotating order, load ignored.

    Ownership, queues and roles are the product router's; only the order of candidates differs,
    so a full or throttled replica is still skipped the way the serving core skips it.
    """

    def __init__(self, canary_share: float = 0.1) -> None:
        super().__init__(canary_share)
        self._next = 0

    def candidates(self, request: Request, now_s: float) -> tuple[RouteChoice, ...]:
        """Every routable replica, starting one further along on each call."""
        ranked = super().candidates(request, now_s)
        if not ranked:
            return ranked
        ordered = sorted(ranked, key=lambda c: c.replica_id)
        start = self._next % len(ordered)
        self._next += 1
        return tuple(ordered[start:] + ordered[:start])


def static_layout(
    scenario: Scenario,
    deployments: Sequence[Deployment],
    starting: Mapping[str, DeploymentPlan],
    topology: TopologySnapshot,
    blocks: Sequence[AtomicBlock],
    config: GearboxConfig,
) -> dict[str, DeploymentPlan]:
    """Static replicas over all blocks: the starting plans plus every other live GPU, node by
    node.

    Rule (no tuning, stated so anyone can check it): each node's GPUs left free go to the
    deployment holding the fewest GPUs so far among those whose model fits there (ties: the
    larger model), as single-stage replicas of the smallest TP degree that fits its memory;
    GPUs left over go the same way to the other deployments.
    """
    held = {d.name: starting[d.name].num_gpus if d.name in starting else 0 for d in deployments}
    taken = {u for plan in starting.values() for u in plan.gpu_uuids}
    live = {g.uuid for g in topology.gpus if topology.gpu_is_live(g)}
    groups: dict[str, list[list[str]]] = {d.name: [] for d in deployments}
    for node in scenario.nodes:
        free = [g.uuid for g in node.gpus if g.uuid not in taken and g.uuid in live]
        while free:
            choice = _node_choice(topology, deployments, free, held, config)
            if choice is None:
                break
            name, tp = choice
            count = len(free) // tp * tp
            groups[name].extend(free[i : i + tp] for i in range(0, count, tp))
            held[name] += count
            free = free[count:]
    block_of = {u: b.block_id for b in blocks for u in b.gpu_uuids}
    plans = {}
    for dep in deployments:
        extra = tuple(_replica(dep, g, topology, block_of) for g in groups[dep.name])
        base = starting[dep.name].replicas if dep.name in starting else ()
        plans[dep.name] = DeploymentPlan(dep.name, dep.model.name, base + extra)
    return plans


def _replica(
    dep: Deployment, group: Sequence[str], topology: TopologySnapshot, block_of: Mapping[str, str]
) -> ExecutionPlan:
    """One stage with every layer, TP over ``group``."""
    by_uuid = {g.uuid: g for g in topology.gpus}
    gpus = [by_uuid[u] for u in group]
    domain = gpus[0].domain
    stage = Stage(
        block_of.get(gpus[0].uuid, domain),
        domain,
        tuple(group),
        0,
        dep.model.num_layers,
        StageRole.UNIFIED,
        limiting_class([g.gpu_class for g in gpus]),
        topology.domain_link(domain),
    )
    return ExecutionPlan(dep.model.name, (stage,), None)


def _node_choice(
    topology: TopologySnapshot,
    deployments: Sequence[Deployment],
    free: Sequence[str],
    held: Mapping[str, int],
    config: GearboxConfig,
) -> tuple[str, int] | None:
    """(deployment, TP degree) for the next GPUs of a node, or None when no model fits."""
    by_uuid = {g.uuid: g for g in topology.gpus}
    memory = min(by_uuid[u].gpu_class.memory_bytes for u in free)
    fits = []
    for dep in deployments:
        least = min_tp_for_memory(memory, dep.model, config)
        sizes = [tp for tp in dep.model.valid_tp_sizes(len(free)) if tp >= least]
        if sizes:
            fits.append((held[dep.name], -dep.model.weight_bytes, dep.name, sizes[0]))
    if not fits:
        return None
    _, _, name, tp = min(fits)
    return name, tp
