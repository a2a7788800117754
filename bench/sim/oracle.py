"""The oracle: the SLO goodput each simulated world allows, the limit FlexPipe is judged against.

It knows the timeline and the arrival trace in advance, shifts instantly and for free, and picks
the best plans per interval by the ground truth (:mod:`sim.truth`), jointly over deployments:

* intervals — the run is cut at every timeline event, every load phase's edges and at least
  every ``MAX_INTERVAL_S`` (the daily swing moves the load between phases);
* candidates — per deployment, on the interval's live GPUs (all free: the oracle owes no
  switch): every replica option gearbox enumerates (a block and TP degree, a pipeline, a
  prefill/decode split) as one, half or all of its copies, and one replica on each copy (the
  world's per-step jitter is drawn per replica, so a shape runs at its own speed on each) — so
  a plan gearbox's estimator ranks low is still tried — and the splits with a stage on part of
  a block (:func:`cut_splits`); every plan gearbox assembles for the interval's true load scaled by
  each of ``DEMAND_SCALES`` (mixes of options; bigger plans queue less); the deployment's
  starting plan there and its share of the static layout over every GPU (the baselines'
  plans); or nothing;
* ranking — each candidate serves the interval's arrivals alone in the simulated world, timed by
  the ground truth gearbox cannot see, from a warm start (loaded before the interval begins);
  the joint choice is the combination on disjoint GPUs with the most goodput tokens (ties: fewer
  GPUs, then plan ids). Deployments on disjoint GPUs share nothing in the simulator but the
  runtimes' tick grid, so the joint goodput is the sum of the singles';
* the oracle's run — each deployment's run of its chosen plan, which the ranking simulated to
  its end, side by side (:func:`_together`: not simulated again), and the intervals' metrics
  put together on the run's clock (:func:`bench.sim.metrics.combined`).

Every interval starts empty and warm, and its requests may finish after it ends (up to the
last instant one could still meet its SLOs, never past the run's end) on the interval's plans
while the next interval's plans serve new arrivals: both favour the oracle, which is what an
upper bound may do. A system that beats it has found a plan outside its candidates, or a bug.

Cost: every candidate simulated is a run of its interval (the 8-hour scenario, seed 7's
intervals 3 and 9: 75 and 52 candidates for the 70B, 184 and 138 for the 7B; ~10 CPU s a
whole run at that load). :meth:`Oracle.choose` finds the same combination as simulating them
all, lazily: an unsimulated candidate counts at its deployment's ceiling (every token offered
in the interval), and only candidates of the best combination by those bounds are simulated,
until it is known throughout. Where small plans already serve every arrival within SLO most
candidates are never run; an interval that no plan serves in full (the last one, whose late
arrivals cannot finish before the run ends) still simulates all of its candidates. The 8-hour
scenario, seeds 7-11: 2,127 CPU s at bc0dc54 (2,759 before the search found its combinations
once and the run stopped simulating the choice again, with fewer candidates;
bench/HISTORY.md, 2026-12-05 stop 47).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench.sim.baselines import static_layout
from bench.sim.des import RunResult, Simulation
from bench.sim.metrics import DeploymentMetrics, Utilisation, combined
from bench.sim.systems import SystemSpec
from flexpipe.config import FlexPipeConfig
from gearbox import DeploymentPlan, GearboxConfig
from gearbox.blocks import AtomicBlock
from gearbox.candidates import OptionKind, ReplicaOption, enumerate_options
from gearbox.model import ModelSpec
from gearbox.ranking import available_memory, rank_candidates
from gearbox.scoring import request_profile
from gearbox.types import LoadSnapshot, TopologySnapshot
from runtime.deployment import RuntimeSettings
from runtime.host import RuntimeHost
from runtime.types import Request
from sim.catalog import with_scenario
from sim.loadgen import offered_tokens, output_tokens
from sim.spec import Preempt, Scenario
from sim.truth import GroundTruth
from sim.world import World

MAX_INTERVAL_S = 1800.0
STEP_S = 5.0  # simulated seconds a candidate's run advances between looks at its bound
DEMAND_SCALES = (1.0, 2.0, 4.0)
ORACLE = SystemSpec("oracle", "oracle", adaptive=False, static_layout=False)

Trace = Mapping[str, Sequence[Request]]


@dataclass(frozen=True, slots=True)
class Interval:
    """A stretch of the run with one topology and one load phase: ``[start_s, end_s)``."""

    start_s: float
    end_s: float

    @property
    def length_s(self) -> float:
        """Seconds the interval lasts."""
        return self.end_s - self.start_s


@dataclass(frozen=True, slots=True)
class Scored:
    """One deployment's candidate for an interval and the goodput it earned there alone."""

    plan: DeploymentPlan | None  # None: the deployment serves nothing
    goodput_tokens: int
    # The plan's id ("" for None) and the GPUs it holds, read once: gearbox computes both on
    # every read (a content hash), and the search compares every combination again and again.
    plan_id: str = ""
    gpus: frozenset[str] = frozenset()

    @classmethod
    def of(cls, plan: DeploymentPlan | None, goodput_tokens: int) -> Scored:
        """``plan`` at ``goodput_tokens``, its id and GPUs read from it."""
        if plan is None:
            return cls(None, goodput_tokens)
        return cls(plan, goodput_tokens, plan.plan_id, plan.gpu_uuids)


@dataclass(frozen=True, slots=True)
class Choice:
    """The oracle's plans for one interval, chosen among ``candidates`` per deployment."""

    interval: Interval
    plans: dict[str, DeploymentPlan | None]
    goodput_tokens: dict[str, int]  # each chosen plan's, alone (the ranking's figure)
    candidates: dict[str, int]  # how many there were per deployment
    simulated: dict[str, int]  # how many the search simulated to the end (not in the results)
    # each deployment's run on its chosen plan, alone (for an idle one: its arrivals refused)
    runs: dict[str, RunResult] = dataclasses.field(default_factory=dict, compare=False)

    def as_dict(self) -> dict[str, Any]:
        """The results file's record of this interval."""
        return {
            "start_s": self.interval.start_s,
            "end_s": self.interval.end_s,
            "candidates": self.candidates,
            "plans": {name: _plan_row(plan) for name, plan in self.plans.items()},
            "goodput_tokens": self.goodput_tokens,
        }


def _plan_row(plan: DeploymentPlan | None) -> dict[str, Any] | None:
    if plan is None:
        return None
    return {"plan_id": plan.plan_id, "gpus": plan.num_gpus, "replicas": len(plan.replicas)}


def intervals(scenario: Scenario, duration_s: float) -> tuple[Interval, ...]:
    """The oracle's intervals over ``[0, duration_s)`` (see the module docstring)."""
    marks = {0.0, duration_s}
    marks |= {ev.t_s for ev in scenario.timeline}
    for dep in scenario.deployments:
        marks |= {t for ph in dep.workload.phases for t in (ph.start_s, ph.end_s)}
    edges = sorted(t for t in marks if 0.0 <= t <= duration_s)
    out = []
    for start, end in itertools.pairwise(edges):
        parts = math.ceil((end - start) / MAX_INTERVAL_S)
        cuts = [start + (end - start) * i / parts for i in range(parts)] + [end]
        out += [Interval(a, b) for a, b in itertools.pairwise(cuts)]
    return tuple(out)


def segment_scenario(
    scenario: Scenario, interval: Interval, names: Sequence[str], run_s: float
) -> Scenario:
    """The world of one interval, ``run_s`` long: every timeline event up to its start happens
    at t=0 (in order, so a preemption by count takes the same GPUs), none after; only the
    deployments ``names``."""
    timeline = tuple(
        dataclasses.replace(ev, t_s=0.0) for ev in scenario.timeline if ev.t_s <= interval.start_s
    )
    deployments = tuple(d for d in scenario.deployments if d.name in names)
    return dataclasses.replace(
        scenario, duration_s=run_s, deployments=deployments, timeline=timeline
    )


def interval_requests(requests: Sequence[Request], interval: Interval) -> list[Request]:
    """The arrivals of ``interval``, on its own clock (arrival − start)."""
    return [
        dataclasses.replace(r, arrival_s=r.arrival_s - interval.start_s)
        for r in requests
        if interval.start_s <= r.arrival_s < interval.end_s
    ]


def interval_load(requests: Sequence[Request], interval: Interval) -> LoadSnapshot:
    """The interval's true load (the oracle knows the trace): rate, mean prompt and output."""
    count = len(requests)
    if count == 0:
        return LoadSnapshot(0.0, 0.0, 1.0, 1.0)
    return LoadSnapshot(
        0.0,
        count / interval.length_s,
        max(1.0, sum(r.prompt_tokens for r in requests) / count),
        max(1.0, sum(output_tokens(r) for r in requests) / count),
    )


class Oracle:
    """The oracle for one scenario, trace, seed and ground truth (see the module docstring)."""

    def __init__(
        self,
        scenario: Scenario,
        trace: Trace,
        *,
        seed: int,
        duration_s: float,
        truth: GroundTruth,
        config: FlexPipeConfig | None = None,
    ) -> None:
        self.scenario = scenario
        self.trace = trace
        self.seed = seed
        self.duration_s = duration_s
        self.truth = truth
        self.config = config or FlexPipeConfig()
        cfg = with_scenario(self.config, scenario)
        self.gearbox: GearboxConfig = cfg.gearbox
        self.names = sorted(d.name for d in scenario.deployments)
        self._memo: dict[tuple[str, Interval], list[Request]] = {}
        self._run_s_memo: dict[Interval, float] = {}
        self.slo_s: dict[str, tuple[float, float]] = {}
        for dep in cfg.deployments:
            ttft_ms, tbt_ms = dep.slo_ms(cfg.gearbox)
            self.slo_s[dep.name] = (ttft_ms / 1000.0, tbt_ms / 1000.0)

    # ---- one interval --------------------------------------------------------------------------

    def _arrivals(self, name: str, interval: Interval) -> list[Request]:
        """:func:`interval_requests`, once per deployment and interval (every candidate's run
        reads them; the 8-hour trace holds ~10^5 requests a deployment)."""
        key = (name, interval)
        if key not in self._memo:
            self._memo[key] = interval_requests(self.trace[name], interval)
        return self._memo[key]

    def _run_s(self, interval: Interval) -> float:
        """How long an interval's runs last: until no request of any deployment could still meet
        its SLOs (first token within the TTFT SLO, every gap within the TBT SLO), never past the
        run. Whichever deployments a run serves, so that a choice's runs side by side cover one
        span (:func:`_together`); once per interval (every candidate's run asks)."""
        if interval not in self._run_s_memo:
            last = interval.end_s
            for name in self.names:
                ttft_s, tbt_s = self.slo_s[name]
                for r in self._arrivals(name, interval):
                    done = interval.start_s + r.arrival_s + ttft_s + tbt_s * (output_tokens(r) - 1)
                    last = max(last, done)
            self._run_s_memo[interval] = min(last, self.duration_s) - interval.start_s
        return self._run_s_memo[interval]

    def simulate(self, interval: Interval, plans: Mapping[str, DeploymentPlan | None]) -> RunResult:
        """The deployments of ``plans`` serving the interval's arrivals on those plans (loaded
        before it starts), in the ground-truth world; times on the whole run's clock."""
        return self.simulation(interval, plans).run()

    def simulation(
        self, interval: Interval, plans: Mapping[str, DeploymentPlan | None]
    ) -> Simulation:
        """:meth:`simulate`'s run, not started (to be run in steps)."""
        names = sorted(plans)
        run_s = self._run_s(interval)
        scenario = segment_scenario(self.scenario, interval, names, run_s)
        trace = {n: self._arrivals(n, interval) for n in names}
        chosen = {n: p for n, p in plans.items() if p is not None}
        return Simulation(
            ORACLE,
            scenario,
            trace,
            seed=self.seed,
            duration_s=run_s,
            config=self.config,
            truth=self.truth,
            plans=chosen,
            clock_offset_s=interval.start_s,
        )

    def candidates(self, interval: Interval) -> dict[str, list[DeploymentPlan]]:
        """Every deployment's candidate plans for ``interval`` (see the module docstring)."""
        scenario = segment_scenario(self.scenario, interval, self.names, interval.length_s)
        cfg = with_scenario(self.config, scenario)
        world = World(cfg, scenario, self.seed, RuntimeHost(self.names, RuntimeSettings()))
        for name in self.names:  # nothing placed: every live GPU is the oracle's to give
            world.fleet.cluster.place(name, [])
        world.observe(0.0)
        topology, blocks = world.topology()
        free = available_memory(topology, frozenset())
        starting = world.starting_plans()
        static = static_layout(
            scenario, world.deployments, starting, topology, blocks, self.gearbox
        )
        out: dict[str, list[DeploymentPlan]] = {}
        for dep in world.deployments:
            load = interval_load(self._arrivals(dep.name, interval), interval)
            plans: dict[str, DeploymentPlan] = {}
            prompt, output = request_profile(load, self.gearbox)
            options = enumerate_options(
                blocks, topology, dep.model, prompt, output, free, self.gearbox
            )
            cut = cut_splits(
                options, blocks, topology, dep.model, (prompt, output), free, self.gearbox
            )
            for option in (*options, *cut):
                copies = len(option.copies)
                # NOTE: one replica on each copy, not only the first: the world's per-step
                # jitter is drawn per replica (its GPUs), so a shape runs at another speed on
                # other GPUs of its block (steady-noisy, seed 7: the no-hysteresis ablation's
                # TP2 on a block's second pair of hoppers beat the oracle's first pair)
                singles = [(i,) for i in range(copies)]
                firsts = [tuple(range(n)) for n in sorted({(copies + 1) // 2, copies} - {1})]
                for picked in (*singles, *firsts):
                    replicas = tuple(option.plan(dep.model.name, i) for i in picked)
                    made = DeploymentPlan(dep.name, dep.model.name, replicas)
                    plans[made.plan_id] = made
            for scale in DEMAND_SCALES:
                scaled = dataclasses.replace(load, arrival_rate_rps=load.arrival_rate_rps * scale)
                ranked = rank_candidates(
                    topology, blocks, dep.model, scaled, self.gearbox, deployment=dep.name
                )
                plans.update((c.plan.plan_id, c.plan) for c in ranked)
            for baseline in (starting.get(dep.name), static.get(dep.name)):
                if baseline is not None and baseline.replicas:
                    plans[baseline.plan_id] = baseline
            out[dep.name] = [plans[k] for k in sorted(plans)]
        return out

    def choose(self, interval: Interval) -> Choice:
        """The interval's best plans by the ground truth, jointly over deployments.

        Exactly the combination that simulating every candidate and taking the best disjoint
        one would give, but lazily (branch and bound): a candidate not yet simulated to its end
        counts at an upper bound of its goodput — every token of the interval's arrivals, which
        no plan can exceed, less the tokens of its requests already settled outside the SLO
        goodput (refused, or completed late: a completed request's goodput is at most its
        prompt + stated output tokens) — so the best combination by these bounds is simulated
        further where it is not yet known, and the search stops once the best combination is
        known throughout. Any other combination's bound is then at most its key, so its
        goodput is too. A candidate's run is advanced in steps of ``STEP_S`` simulated seconds
        and paused (kept, to be resumed) as soon as its bound no longer keeps it in the best
        combination; runs stepped so end exactly as whole runs do. Candidates that cannot win
        (more GPUs than a plan that already serves every arrival within SLO, or losing more
        tokens early on than another plan loses in all) are never simulated to their end.
        """
        candidates = self.candidates(interval)
        names = list(candidates)
        ceiling = {n: sum(offered_tokens(r) for r in self._arrivals(n, interval)) for n in names}
        known: dict[tuple[str, str], int] = {}
        bound: dict[tuple[str, str], int] = {}  # of candidates whose run is paused
        paused: dict[tuple[str, str], Simulation] = {}
        finished: dict[tuple[str, str], RunResult] = {}  # the runs of the known ones

        # Each deployment's candidates, idle first; a combination is one index into each list.
        lists = [[Scored(None, 0)] + [Scored.of(p, 0) for p in candidates[n]] for n in names]
        joint = _Joint(lists)

        def worth() -> list[list[int]]:
            """Every candidate's goodput as known now: exact, bounded, or its ceiling."""
            return [
                [0]
                + [
                    known.get((n, s.plan_id), bound.get((n, s.plan_id), ceiling[n]))
                    for s in cands[1:]
                ]
                for n, cands in zip(names, lists, strict=True)
            ]

        while True:
            values = worth()
            totals = joint.totals(values)
            best = joint.best(totals)
            combo = joint.combos[best]
            unknown = [
                (k, i)
                for k, i in enumerate(combo)
                if i and (names[k], lists[k][i].plan_id) not in known
            ]
            if not unknown:
                break
            index, i = unknown[0]
            name, chosen = names[index], lists[index][i]
            plan = chosen.plan
            assert plan is not None
            key = (name, chosen.plan_id)
            # The best combination without this candidate: while the best with it (whose
            # other members stay as they are) still beats that, it stays the best.
            rival = joint.key(joint.best(totals, without=(index, i)), totals)
            others = totals[best] - values[index][i]
            run = paused.pop(key, None)
            if run is None:
                run = self.simulation(interval, {name: plan})
                run.start()
            while True:
                done = run.advance(run.clock_s + STEP_S)
                if done:
                    finished[key] = run.result()
                    got = finished[key].metrics[name].goodput_tokens
                    if got > ceiling[name] or got > ceiling[name] - run.lost_tokens[name]:
                        # the bound would not hold: the search is not exact
                        raise AssertionError(f"{name}: goodput {got} over its bound")
                    known[key] = got
                    bound.pop(key, None)
                    break
                now = ceiling[name] - run.lost_tokens[name]
                if now == bound.get(key, ceiling[name]):
                    continue
                bound[key] = now
                if (others + now, *joint.ties[best]) < rival:
                    paused[key] = run
                    break
        return Choice(
            interval,
            {n: lists[k][i].plan for k, (n, i) in enumerate(zip(names, combo, strict=True))},
            {n: values[k][i] for k, (n, i) in enumerate(zip(names, combo, strict=True))},
            {n: len(candidates[n]) for n in names},
            {n: sum(1 for k in known if k[0] == n) for n in names},
            {
                n: finished[(n, lists[k][i].plan_id)] if i else self.simulate(interval, {n: None})
                for k, (n, i) in enumerate(zip(names, combo, strict=True))
            },
        )

    # ---- the whole run -------------------------------------------------------------------------

    def run(self) -> tuple[RunResult, list[Choice]]:
        """Every interval's choice, served; the oracle's run and the choices."""
        choices, runs = [], []
        for interval in intervals(self.scenario, self.duration_s):
            choice = self.choose(interval)
            choices.append(choice)
            runs.append((interval, _together(list(choice.runs.values()))))
        return self._result(runs), choices

    def _result(self, runs: Sequence[tuple[Interval, RunResult]]) -> RunResult:
        metrics: dict[str, DeploymentMetrics] = {
            n: combined([r.metrics[n] for _, r in runs]) for n in self.names
        }
        utilisation = Utilisation()
        for interval, r in runs:
            minutes = range(int(interval.start_s // 60), math.ceil(interval.end_s / 60))
            utilisation.absorb(r.utilisation, minutes)
        events = [ev for ev in self.scenario.timeline if ev.t_s < self.duration_s]
        return RunResult(
            system=ORACLE,
            metrics=metrics,
            utilisation=utilisation,
            decisions=[],
            transitions=[],
            preemptions=[ev.t_s for ev in events if isinstance(ev, Preempt)],
            timeline=[(ev.t_s, type(ev).__name__.lower()) for ev in events],
            unfinished={n: sum(r.unfinished.get(n, 0) for _, r in runs) for n in self.names},
            observed_s=[],
            violations=[
                f"interval {i.start_s:g}-{i.end_s:g} s: {v}"
                for i, r in runs
                for v in [*r.violations, *_cold(r)]
            ],
            offered_tokens={
                n: sum(offered_tokens(r) for r in self.trace[n] if r.arrival_s < self.duration_s)
                for n in self.names
            },
        )


def cut_splits(
    options: Sequence[ReplicaOption],
    blocks: Sequence[AtomicBlock],
    topology: TopologySnapshot,
    model: ModelSpec,
    profile: tuple[int, int],
    free: Mapping[str, int],
    config: GearboxConfig,
) -> list[ReplicaOption]:
    """Prefill/decode splits with a stage smaller than its block's biggest option.

    gearbox pairs each block's biggest TP option only, over the GPUs it is given; in a live
    cluster those are what the other deployments leave, so a split there may decode on half a
    block (the 8-hour scenario, seed 7: prefill on A's two hoppers, decode on four of B's GPUs
    after the third preemption), while the oracle, given every GPU, only ever saw B whole.
    So each block is cut in turn to each copy of each of its TP options (the GPUs that copy
    takes: where it sits matters to the other deployments), and the splits gearbox
    enumerates on the pool so cut are candidates too. ``options``: gearbox's options on
    ``free`` (the TP ones give the cuts); ``profile``: the request's prompt and output tokens.
    """
    prompt, output = profile
    members = {b.block_id: frozenset(b.gpu_uuids) for b in blocks}
    out: list[ReplicaOption] = []
    cuts = {
        members[option.block_ids[0]] - frozenset(copy.gpu_groups[0])
        for option in options
        if option.kind is OptionKind.TP
        for copy in option.copies
    }
    for dropped in sorted((c for c in cuts if c), key=sorted):
        pool = {u: m for u, m in free.items() if u not in dropped}
        cut = enumerate_options(blocks, topology, model, prompt, output, pool, config)
        out.extend(o for o in cut if o.kind is OptionKind.PD)
    return out


class _Joint:
    """The disjoint combinations of an interval's candidates (one per deployment, idle
    included), found once: which candidates can serve together is fixed for the interval, only
    their goodputs change as the search learns them, and the search asks for the best
    combination hundreds of times over ≈ 10^4 combinations (the 8-hour scenario: 65 × 150
    candidates an interval), which checking every product for disjointness each time made a
    fifth of the search's CPU."""

    def __init__(self, lists: Sequence[Sequence[Scored]]) -> None:
        ranges = [range(len(cands)) for cands in lists]
        self.combos = [
            c
            for c in itertools.product(*ranges)
            if _disjoint([cands[i] for cands, i in zip(lists, c, strict=True)])
        ]
        self.columns = [[c[k] for c in self.combos] for k in range(len(lists))]
        self.ties = [
            _ties([cands[i] for cands, i in zip(lists, c, strict=True)]) for c in self.combos
        ]

    def totals(self, worth: Sequence[Sequence[int]]) -> list[int]:
        """Each combination's goodput, its members' ``worth`` (per deployment, per candidate)
        added up."""
        per = [[w[i] for i in column] for w, column in zip(worth, self.columns, strict=True)]
        return [sum(t) for t in zip(*per, strict=True)]

    def key(self, position: int, totals: Sequence[int]) -> tuple[int, int, tuple[str, ...]]:
        """The :func:`_joint_order` key of the combination at ``position``."""
        return (totals[position], *self.ties[position])

    def best(self, totals: Sequence[int], without: tuple[int, int] | None = None) -> int:
        """The position of the best combination by :func:`_joint_order`; ``without``: leave
        out those whose deployment ``without[0]`` takes its candidate ``without[1]``."""
        positions: Sequence[int] = range(len(totals))
        if without is not None:
            column, skip = self.columns[without[0]], without[1]
            positions = [j for j in positions if column[j] != skip]
        top = max(totals[j] for j in positions)
        return max((j for j in positions if totals[j] == top), key=self.ties.__getitem__)


def _together(parts: Sequence[RunResult]) -> RunResult:
    """One interval's run from its deployments' runs alone on their chosen plans, all as long:
    on disjoint GPUs they share nothing in the simulated world but the runtimes' tick grid
    (a step finer while any of them is busy), so serving them together differs from this only
    by when a tick finds work (seed 7 of the 8-hour scenario: the same goodput to the token in
    the intervals compared) — and this is what the search ranked, without running again."""
    first = parts[0]
    return RunResult(
        system=ORACLE,
        metrics={n: m for part in parts for n, m in part.metrics.items()},
        utilisation=Utilisation.side_by_side([part.utilisation for part in parts]),
        decisions=[],
        transitions=sorted(
            (log for part in parts for log in part.transitions),
            key=lambda x: (x.deployment, x.seq),
        ),
        preemptions=first.preemptions,
        timeline=first.timeline,
        unfinished={n: c for part in parts for n, c in part.unfinished.items()},
        observed_s=[],
        violations=[v for part in parts for v in part.violations],
        offered_tokens={n: t for part in parts for n, t in part.offered_tokens.items()},
    )


def _cold(run: RunResult) -> list[str]:
    """Plans still loading when their interval began: the shift was not free after all."""
    return [
        f"{log.deployment} loaded at {t_s:g} s, after the interval began"
        for log in run.transitions
        for t_s, phase, *_ in log.records
        if phase == "done" and t_s > 0.0
    ]


def _disjoint(combo: Sequence[Scored]) -> bool:
    gpus = [u for s in combo for u in s.gpus]
    return len(gpus) == len(set(gpus))


def _ties(combo: Sequence[Scored]) -> tuple[int, tuple[str, ...]]:
    """How equal goodputs are ordered: fewest GPUs, then plan ids (max() takes the largest)."""
    return (-sum(len(s.gpus) for s in combo), tuple(s.plan_id for s in combo))


def _joint_order(combo: Sequence[Scored]) -> tuple[int, int, tuple[str, ...]]:
    """Most goodput, then :func:`_ties` (max() takes the largest key)."""
    return (sum(s.goodput_tokens for s in combo), *_ties(combo))


__all__ = ["ORACLE", "Choice", "Interval", "Oracle", "intervals", "segment_scenario"]
