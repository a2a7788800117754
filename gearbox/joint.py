"""What the GPUs a switch takes are worth to the other deployments sharing the cluster.

A switch usually picks among several plans that restore its SLOs (a forced one: its plan lost
GPUs; a voluntary one: several worthwhile plans do). The GPUs they take beyond the deployment's
own come out of the cluster's spare pool, and that pool is all another deployment has to fall
back on when its own plan breaks in turn. So the choice charges each plan its **standby loss**:
for every other deployment (a :class:`Neighbour`, at its current demand), the SLO goodput of the
best plan it could restore on the spare GPUs the plan leaves, against the best on the spare pool
with the switching deployment's own GPUs handed back and nothing else taken, over
``gain_horizon_s``. Utilities are the cost model's (:func:`gearbox.ranking.rank_candidates`)
without the freed-GPU credit: a GPU nobody could use is worth nothing here, one another
deployment would need is worth what it would restore there.

Each neighbour is estimated as its own decisions would estimate it: the cost model's figures with
its learned TTFT factors (:mod:`gearbox.correction`, from its :class:`gearbox.history.GearState`;
a shape it never served gets its deployment-wide factor). Plain figures are several-fold
optimistic where its factor says so: in sim/scenarios/mixed-failures.yaml (seed 8, 1,200 s) the
model put the 70B's fallback on two hoppers and four older GPUs at 629 ms TTFT p95, its factor
(2.1x) at 1.35 s. (Still within its 2 s SLO there, so that choice did not change; preempted at
2,400 s, at the tide's higher load, the 70B observed 1.5-3.6 s on it.)

NOTE: the standby counts the neighbour's own GPUs as lost (what it could do if forced now);
while its plan runs, the extra GPUs add it little at its demand, which is why a blanket
per-GPU credit was used before (bench/HISTORY.md, 2026-12-02): in
sim/scenarios/mixed-failures.yaml seed 8 the 7B, forced off node-b1, took all four spare hoppers
and the 70B preempted off its island later found none.

A forced switch may also take GPUs a settled neighbour holds (a **handover**): the neighbour
moves first, to its best plan on what is left (its own remaining GPUs and the spare pool), and
the switch waits for it. :func:`yield_cost` prices that: the SLO goodput the neighbour loses
over ``gain_horizon_s``, its own switch cost, and how long it takes to move off (the wait the
switch's outage counts). NOTE: without it a preempted deployment could only fall back on what
was spare, however little a neighbour needed the GPUs it sat on: in
sim/scenarios/mixed-failures.yaml the 70B, preempted off its island, landed on a 6-GPU PD plan
over two hoppers and four A100s (a 70 GB shard per prefill GPU: up in 16 s, TTFT p95 4.8x its
level before) while the 7B, which would have lost nothing on the A100s, held the other two
hoppers of the island the oracle gives the 70B.

Cost: a neighbour's ranking on the whole pool is a full enumeration (10-30 ms on 1,000 GPUs).
Where the cluster has room, every neighbour can restore all it is offered on a few of the
roomiest blocks the plan leaves (:func:`_restores_all`, well under a millisecond), and then it
loses nothing whatever the whole pool holds: the whole ranking runs only where room is short.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from gearbox.blocks import AtomicBlock
from gearbox.config import GearboxConfig, without_gpu_credit
from gearbox.correction import (
    Corrections,
    apply_correction,
    factor_for,
    plan_shape,
    tbt_factor_for,
)
from gearbox.model import ModelSpec
from gearbox.plans import DeploymentPlan
from gearbox.ranking import estimate_plan, rank_candidates
from gearbox.scoring import DeploymentEstimate, demand_rps, request_profile
from gearbox.switch import switch_cost
from gearbox.types import LoadSnapshot, TopologySnapshot

__all__ = [
    "Neighbour",
    "StandbyLoss",
    "Yield",
    "handover_blocks",
    "has_spare_twin",
    "standby_meter",
    "yield_cost",
]


@dataclass(frozen=True, slots=True)
class Neighbour:
    """Another resident deployment sharing the cluster, as a switch weighs it."""

    deployment: str  # its name
    model: ModelSpec  # the model it serves
    load: LoadSnapshot  # its serving load over the window (its demand)
    gpu_uuids: frozenset[str]  # GPUs its plans hold or are moving to: never in its standby
    # its learned factors (its GearState's): its standby is estimated as it would estimate it
    corrections: Corrections = field(default_factory=Corrections)
    # the plan it serves when settled (no switch in flight): only then may a handover move it
    plan: DeploymentPlan | None = None


@dataclass(frozen=True, slots=True)
class StandbyLoss:
    """What a set of GPUs taken costs the neighbours' standby."""

    tokens: float  # the sum over neighbours of (best − left) × gain_horizon_s, >= 0
    # the neighbour losing most: (name, best SLO goodput tok/s on the whole spare pool, on what
    # the plan leaves); None when no neighbour loses anything
    worst: tuple[str, float, float] | None = None


NO_LOSS = StandbyLoss(0.0)
PROBE_BLOCKS = 4  # the roomiest blocks a neighbour is first tried on (:func:`_restores_all`)
# NOTE: utilities are sums over replicas of shares of the demand; two plans that both serve all
# of it can differ in the last bits, which is no token lost
_ROUNDING = 1e-9


@dataclass(frozen=True, slots=True)
class Yield:
    """What a handover costs the neighbour it takes GPUs from."""

    deployment: str  # the neighbour
    taken: frozenset[str]  # its GPUs the switch takes
    to_plan: DeploymentPlan  # its best plan on what is left: it moves there first
    utility_now_tok_s: float  # its SLO goodput now (learned factors, no GPU credit)
    utility_after_tok_s: float  # ... on ``to_plan``
    loss_tokens: float  # (now − after) × gain_horizon_s + its switch cost, >= 0
    vacate_s: float  # its whole transition: until the taken GPUs are free


def _best_plan(
    neighbour: Neighbour,
    snapshot: TopologySnapshot,
    blocks: Sequence[AtomicBlock],
    pool: Mapping[str, int],
    config: GearboxConfig,
    current: DeploymentPlan | None = None,
) -> tuple[float, DeploymentPlan | None]:
    """The best SLO goodput (tok/s, no GPU credit, its learned TTFT factors applied)
    ``neighbour`` could restore on ``pool`` less the GPUs it holds, and the plan that does it
    (None when none); from ``current``, as its own step would rank a move from it (its running
    replicas kept or given up, new ones only on GPUs none of them holds)."""
    spare = {u: b for u, b in pool.items() if u not in neighbour.gpu_uuids}
    ranked = rank_candidates(
        snapshot,
        blocks,
        neighbour.model,
        neighbour.load,
        config,
        deployment=neighbour.deployment,
        current=current,
        available=spare,
    )
    best: tuple[float, DeploymentPlan] | None = None
    for candidate in ranked:
        utility = _learned(neighbour, candidate.plan, candidate.estimate, snapshot, config)
        # NOTE: the factors reorder the plain ranking; ties keep its order (then plan id)
        if best is None or utility > best[0]:
            best = (utility, candidate.plan)
    if best is None:
        return 0.0, None
    return max(0.0, best[0]), best[1]


def _learned(
    neighbour: Neighbour,
    plan: DeploymentPlan,
    estimate: DeploymentEstimate,
    snapshot: TopologySnapshot,
    config: GearboxConfig,
) -> float:
    """``estimate``'s SLO goodput (tok/s) with ``neighbour``'s learned TTFT and TBT factors for
    ``plan``'s shape."""
    learned = neighbour.corrections
    if learned.entries or learned.tbt:
        shape, now_s = plan_shape(plan), snapshot.now_s
        factor = factor_for(learned, shape, now_s, config)
        tbt = tbt_factor_for(learned, shape, now_s, config)
        estimate = apply_correction(estimate, factor, config, tbt)
    return estimate.utility_tok_s


def _standby(
    neighbour: Neighbour,
    snapshot: TopologySnapshot,
    blocks: Sequence[AtomicBlock],
    pool: Mapping[str, int],
    config: GearboxConfig,
) -> tuple[float, frozenset[str]]:
    """:func:`_best_plan`'s goodput and the GPUs of its plan (empty when none)."""
    utility, plan = _best_plan(neighbour, snapshot, blocks, pool, config)
    return utility, plan.gpu_uuids if plan is not None else frozenset()


def _roomiest(
    blocks: Sequence[AtomicBlock], pool: Mapping[str, int], skip: frozenset[str], k: int
) -> list[AtomicBlock]:
    """The ``k`` blocks with the most GPUs of ``pool`` not in ``skip`` (then bytes, then id)."""
    room: list[tuple[int, int, str, AtomicBlock]] = []
    for block in blocks:
        usable = [pool[u] for u in block.gpu_uuids if u in pool and u not in skip]
        if usable:
            room.append((-len(usable), -sum(usable), block.block_id, block))
    return [r[3] for r in sorted(room, key=lambda r: r[:3])[:k]]


def handover_blocks(
    blocks: Sequence[AtomicBlock], neighbour: Neighbour, pool: Mapping[str, int]
) -> tuple[AtomicBlock, ...]:
    """The blocks a handover from ``neighbour`` is enumerated on, in ``blocks``' order: those
    holding its GPUs and the :data:`PROBE_BLOCKS` others with the most GPUs of ``pool``
    (where a prefill/decode or pipeline plan's other part would go)."""
    own = [b for b in blocks if neighbour.gpu_uuids.intersection(b.gpu_uuids)]
    rest = [b for b in blocks if b not in own]
    chosen = {b.block_id for b in own} | {
        b.block_id for b in _roomiest(rest, pool, frozenset(), PROBE_BLOCKS)
    }
    return tuple(b for b in blocks if b.block_id in chosen)


def has_spare_twin(
    blocks: Sequence[AtomicBlock],
    neighbour: Neighbour,
    snapshot: TopologySnapshot,
    pool: Mapping[str, int],
) -> bool:
    """Whether every block holding ``neighbour``'s GPUs has its own twin wholly in ``pool``: a
    block of the same link with at least as many wholly free GPUs of each class as a handover
    could use there (the neighbour's and ``pool``'s). Then any plan a handover from it could
    make has a counterpart on spare GPUs with no neighbour to wait for, and the handover
    cannot win (a pipeline or prefill/decode plan's link to another block aside).

    NOTE: bench.pipeline's four deployments each hold one of 125 8-GPU nodes: without this,
    every forced decision ranked handovers from three neighbours none of which could win.
    """
    by_uuid = {g.uuid: g for g in snapshot.gpus}

    def free_whole(u: str) -> bool:
        g = by_uuid.get(u)
        return g is not None and pool.get(u, 0) >= g.total_memory_bytes

    taken: set[str] = set()
    for block in blocks:
        if not neighbour.gpu_uuids.intersection(block.gpu_uuids):
            continue
        need = Counter(
            by_uuid[u].gpu_class.name
            for u in block.gpu_uuids
            if u in by_uuid and (u in neighbour.gpu_uuids or pool.get(u, 0) > 0)
        )
        twin = next(
            (
                b
                for b in blocks
                if b.block_id not in taken
                and b.link == block.link
                and not neighbour.gpu_uuids.intersection(b.gpu_uuids)
                and not need
                - Counter(by_uuid[u].gpu_class.name for u in b.gpu_uuids if free_whole(u))
            ),
            None,
        )
        if twin is None:
            return False
        taken.add(twin.block_id)
    return True


def _restores_all(
    neighbour: Neighbour,
    snapshot: TopologySnapshot,
    blocks: Sequence[AtomicBlock],
    pool: Mapping[str, int],
    config: GearboxConfig,
) -> bool:
    """Whether ``neighbour`` restores every token it is offered, within its SLOs, on the
    :data:`PROBE_BLOCKS` blocks of ``pool`` with the most usable GPUs (then bytes, then id).

    NOTE: exact as a test of "loses nothing": a credit-free utility never exceeds the tokens
    offered (served <= demand, the SLO discount <= 1), so no plan on the whole pool beats one
    that reaches them, and the plan found here is still there on the whole of ``pool``.
    """
    offered = _offered(neighbour, config)
    roomiest = _roomiest(blocks, pool, neighbour.gpu_uuids, PROBE_BLOCKS)
    if not roomiest:
        return offered <= 0
    probe = {u: pool[u] for b in roomiest for u in b.gpu_uuids if u in pool}
    best, _ = _standby(neighbour, snapshot, roomiest, probe, config)
    return best >= offered * (1 - _ROUNDING)


def _offered(neighbour: Neighbour, config: GearboxConfig) -> float:
    """The tokens/s ``neighbour`` is offered (its demand × tokens per request)."""
    return demand_rps(neighbour.load, config) * sum(request_profile(neighbour.load, config))


def standby_meter(
    neighbours: Sequence[Neighbour],
    snapshot: TopologySnapshot,
    blocks: Sequence[AtomicBlock],
    available: Mapping[str, int],
    config: GearboxConfig,
) -> Callable[[frozenset[str]], StandbyLoss]:
    """A function: a GPU set (a candidate's GPUs) → what holding it costs ``neighbours``.

    ``available`` is the switching deployment's :func:`gearbox.ranking.available_memory`: its own
    GPUs count as free (it is moving off them), so the reference pool is everything spare.
    Pure and lazy (a decision asks only for the sets that could change its choice): per
    set asked for, a neighbour that restores all it is offered on a few blocks the set leaves
    loses nothing (:func:`_restores_all`); any other is ranked once on the whole pool, and again
    on what the set leaves only when the set takes GPUs of that best plan.
    """
    plain = without_gpu_credit(config)
    whole: dict[int, tuple[float, frozenset[str]]] = {}
    memo: dict[frozenset[str], StandbyLoss] = {}

    def loss(gpus: frozenset[str]) -> StandbyLoss:
        if not neighbours:
            return NO_LOSS
        if gpus in memo:
            return memo[gpus]
        pool = {u: b for u, b in available.items() if u not in gpus}
        tokens, worst = 0.0, None
        for i, n in enumerate(neighbours):
            if _restores_all(n, snapshot, blocks, pool, plain):
                continue
            if i not in whole:
                whole[i] = _standby(n, snapshot, blocks, available, plain)
            best, used = whole[i]
            # NOTE: a plan the set leaves untouched is still there on the smaller pool, and no
            # plan there beats the whole pool's best: nothing lost, no ranking (each neighbour's
            # ranking is a full enumeration: 10-30 ms on 1,000 GPUs, per set asked for)
            if best <= 0 or not used & gpus:
                left = best
            else:
                left = _standby(n, snapshot, blocks, pool, plain)[0]
            lost = max(0.0, best - left)
            if lost > 0 and (worst is None or lost > worst[1] - worst[2]):
                worst = (n.deployment, best, left)
            tokens += lost * config.gain_horizon_s
        memo[gpus] = StandbyLoss(tokens, worst)
        return memo[gpus]

    return loss


def yield_cost(
    neighbour: Neighbour,
    gpus: frozenset[str],
    snapshot: TopologySnapshot,
    blocks: Sequence[AtomicBlock],
    pool: Mapping[str, int],
    config: GearboxConfig,
) -> Yield | None:
    """What a switch to a plan on ``gpus`` costs ``neighbour`` when some of them are its own:
    it moves to its best plan on ``pool`` (the switching deployment's available memory with the
    neighbour's GPUs at their total) less ``gpus``, from its current plan as its own step ranks
    a move (make-before-break: new replicas only on GPUs none of its running ones holds). None
    when the neighbour has no settled plan, ``gpus`` takes none of it, or nothing is left it
    could serve on.
    """
    current = neighbour.plan
    taken = gpus & neighbour.gpu_uuids
    if current is None or not taken:
        return None
    plain = without_gpu_credit(config)
    left = {u: b for u, b in pool.items() if u not in gpus}
    mover = Neighbour(
        neighbour.deployment, neighbour.model, neighbour.load, frozenset(), neighbour.corrections
    )
    # NOTE: as the standby: a plan on a few roomy blocks that serves all it is offered is as
    # good as any on the whole pool (only its transition may differ); rank the pool otherwise.
    # Ranked from its current plan: the runtime loads new replicas before it releases old ones,
    # so the move cannot rebuild on GPUs its running replicas hold — counted on, its own step
    # found no such plan and the handover waited out handover_wait_s and rolled back
    # (bench/HISTORY.md, 2026-12-04 stop 36: a 70B whose one prefill/decode replica spans all
    # ten of its GPUs)
    probe = _roomiest(blocks, left, frozenset(), PROBE_BLOCKS)
    after, target = _best_plan(mover, snapshot, probe, left, plain, current)
    if after < _offered(neighbour, plain) * (1 - _ROUNDING):
        after, target = _best_plan(mover, snapshot, blocks, left, plain, current)
    if target is None:
        return None
    now = _learned(
        neighbour,
        current,
        estimate_plan(current, pool, neighbour.model, neighbour.load, plain),
        snapshot,
        plain,
    )
    cost = switch_cost(current, target, snapshot, neighbour.model, neighbour.load, plain, pool)
    lost = max(0.0, now - after) * config.gain_horizon_s + cost.total_tokens
    return Yield(neighbour.deployment, taken, target, max(0.0, now), after, lost, cost.transition_s)
