"""The transition executor: carries out the machine's phases on a :class:`ServingCore`.

Replicas present in both plans (same content hash) are untouched; only added replicas are
loaded and only removed ones drained. Each phase is a small job advanced by :meth:`poll(now_s)`:

* prepare — re-check the target GPUs, reserve VMM and commit weights, load shards into the shadow
  replicas, build their groups. Nothing is routable yet. An eviction waits here for a moment
  with no request for the model when gearbox displaced it in use, else fails if it has one. A
  GPU handover's target GPUs (:meth:`TransitionExecutor.note_decision`) may still be held by
  the deployment it takes them from, which moves off them first: the prepare waits for them up
  to ``handover_wait_s``.
  NOTE: only claims on this worker's inventory are seen; served by another worker, the other
  deployment's memory is the engine's and VMM's to refuse (the attempt fails and is retried).
* switch — canary (new replicas take ``canary_share`` of new requests for ``canary_s``; none for
  an urgent decision: see :meth:`TransitionExecutor.note_decision`), then
  freeze the old replicas' entry, hand over their long sequences (gearbox picks migrate or replay
  per sequence, longest first; short ones finish where they are; those still prefilling at the
  freeze are handed over once they decode, before the swap; prompts not prefilled by then are
  re-routed with the queued ones), and swap the route table at once: ownership of every staged
  sequence flips in one step.
* cleanup — drain the old replicas to an iteration boundary (forcing replays after
  ``drain_timeout_s``), release their memory and return their GPUs.

``abort`` undoes a failed attempt; ``rollback`` undoes the transition. Both are idempotent, so a
restarted worker can issue them with nothing in memory. A pause point per phase (``pause_in``)
holds a phase just before it would finish (from transition ``pause_from_seq`` on) — a test
hook for crash tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from flexpipe.schemas import TransitionPhase
from gearbox.plans import DeploymentPlan, ExecutionPlan
from gearbox.presets import LINK_CLASSES
from gearbox.switch import KvAction, KvHandover
from gearbox.types import LinkClass
from runtime.handover import plan_handover
from runtime.inventory import GpuInventory
from runtime.router import ReplicaRole
from runtime.serving import ServingCore
from runtime.timing import ReplicaTiming
from runtime.transition import AbortPhase, PhaseDone, PhaseFailed, RollBack, RunPhase
from runtime.types import HandoverTally

TimingFor = Callable[[ExecutionPlan], ReplicaTiming | None]
Result = PhaseDone | PhaseFailed | None
P, S, C = TransitionPhase.PREPARE, TransitionPhase.SWITCH, TransitionPhase.CLEANUP


class SwitchStep(StrEnum):
    """Where a switch stands."""

    CANARY = "canary"
    MIGRATE = "migrate"


class KvPolicy(StrEnum):
    """How running sequences move to the new plan at a switch."""

    AUTO = "auto"  # gearbox's per-sequence choice: migrate the KV cache or re-prefill
    REPLAY_ONLY = "replay_only"  # always re-prefill on the new plan; no KV crosses a link


@dataclass(frozen=True, slots=True)
class ExecutorSettings:
    """Knobs of the hand-over, in the caller's clock."""

    canary_s: float = 2.0  # how long the canary share runs before the old entry freezes
    short_sequence_tokens: int = 32  # sequences this close to done finish on the old replica
    max_handovers_per_poll: int = 64  # cap per batch (KV-queue backlog pitfall)
    # graceful drain, then remaining sequences are replayed; also how long a displaced model's
    # eviction waits for an idle moment (note_decision's ``when_idle``)
    drain_timeout_s: float = 60.0
    handover_wait_s: float = 60.0  # a handover's prepare waits this long for its GPUs
    inter_domain_link: LinkClass = LINK_CLASSES["ethernet"]
    kv_policy: KvPolicy = KvPolicy.AUTO  # REPLAY_ONLY: never migrate KV (an ablation)


@dataclass
class _Job:
    effect: RunPhase
    added: tuple[ExecutionPlan, ...]
    removed: tuple[ExecutionPlan, ...]
    started_s: float
    step: SwitchStep = SwitchStep.CANARY
    until_s: float = 0.0  # canary end or drain deadline
    queue: list[tuple[KvHandover, str, str]] = field(default_factory=list)
    link_free_s: dict[tuple[str, str], float] = field(default_factory=dict)
    tally: HandoverTally = field(default_factory=HandoverTally)
    paused: bool = False
    handed: set[str] = field(default_factory=set)  # sequences queued for hand-over so far
    waiting: bool = False  # a handover's prepare, waiting for its GPUs to be handed over


@dataclass(frozen=True, slots=True)
class _Decided:
    urgent: bool  # no canary
    takes_from: str | None  # a GPU handover's neighbour
    since_s: float  # when the decision came
    when_idle: bool = False  # an eviction that waits for the model to go idle


def replica_diff(
    old: DeploymentPlan | None, new: DeploymentPlan
) -> tuple[tuple[ExecutionPlan, ...], tuple[ExecutionPlan, ...]]:
    """(added, removed) replicas between two deployment plans, by content hash."""
    old_ids = {r.plan_id for r in old.replicas} if old else set()
    new_ids = {r.plan_id for r in new.replicas}
    added = tuple(r for r in new.replicas if r.plan_id not in old_ids)
    removed = tuple(r for r in old.replicas if r.plan_id not in new_ids) if old else ()
    return added, removed


class TransitionExecutor:
    """Applies RunPhase/AbortPhase/RollBack to a serving core (see the module docstring)."""

    def __init__(
        self,
        core: ServingCore,
        timing_for: TimingFor,
        inventory: GpuInventory,
        settings: ExecutorSettings | None = None,
        pause_in: TransitionPhase | None = None,
        pause_from_seq: int = 0,
    ) -> None:
        self.core = core
        self.settings = settings or ExecutorSettings()
        self.pause_in = pause_in
        self.pause_from_seq = pause_from_seq  # transitions before this sequence are not held
        self._timing_for = timing_for
        self._inventory = inventory
        self._job: _Job | None = None
        self._decided: dict[int, _Decided] = {}  # by transition seq: what its decision said

    def note_decision(
        self,
        seq: int,
        *,
        urgent: bool,
        takes_from: str | None,
        now_s: float,
        when_idle: bool = False,
    ) -> None:
        """What transition ``seq``'s decision (arrived at ``now_s``) says beyond its plan.

        ``urgent`` (a forced switch off an infeasible plan, an emergency downshift): its switch
        runs no canary. NOTE: such a switch has no healthy plan to protect (the one it leaves
        lost GPUs), or someone waits for it (a neighbour yielding GPUs to a handover, the
        operator); the canary held either for ``canary_s`` (the whole switch phase of
        bench.fragmented's forced 70B shifts, 2.0 s of 12.9). A pinned plan keeps its canary.

        ``takes_from``: a GPU handover (:attr:`gearbox.decisions.Decision.takes_from`): its
        prepare waits for the GPUs that deployment holds until ``handover_wait_s`` after
        ``now_s`` instead of failing at once (retries included).

        ``when_idle``: an eviction of a model in use (gearbox's displace rule): its prepare waits
        until no request is active, queued or held for the deployment, up to
        ``drain_timeout_s`` after ``now_s``, instead of failing at once; the entry stays open
        meanwhile, so the model serves. At the switch the entry closes: requests admitted since
        the idle moment finish on the frozen replica (within the same timeout), new ones are
        held for the model's reload elsewhere. No request is cut; past the timeout the eviction
        fails and is rolled back.
        """
        self._decided = {s: d for s, d in self._decided.items() if s >= seq}
        self._decided[seq] = _Decided(urgent, takes_from, now_s, when_idle)

    @property
    def paused(self) -> bool:
        """True while a phase is held at its pause point."""
        return self._job is not None and self._job.paused

    def run(self, effect: RunPhase, now_s: float) -> Result:
        """Start a phase; a failure found at once is returned immediately."""
        added, removed = replica_diff(effect.from_plan, effect.to_plan)
        self._job = _Job(effect, added, removed, now_s)
        start = {P: self._start_prepare, S: self._start_switch, C: self._start_cleanup}
        return start[effect.phase](self._job, now_s)

    def poll(self, now_s: float) -> Result:
        """Advance the running phase; its result once it finishes or fails."""
        job = self._job
        if job is None:
            return None
        advance = {P: self._poll_prepare, S: self._poll_switch, C: self._poll_cleanup}
        result = advance[job.effect.phase](job, now_s)
        if result is not None:
            self._job = None
        return result

    def _done(self, job: _Job, detail: str) -> PhaseDone:
        e = job.effect
        return PhaseDone(e.seq, e.phase, e.attempt, 0.0, detail)

    def _failed(self, job: _Job, detail: str) -> PhaseFailed:
        e = job.effect
        return PhaseFailed(e.seq, e.phase, e.attempt, 0.0, detail)

    def _hold(self, job: _Job) -> bool:
        job.paused = self.pause_in is job.effect.phase and job.effect.seq >= self.pause_from_seq
        return job.paused

    # ---- prepare -------------------------------------------------------------------------------

    def _evicting(self, job: _Job) -> bool:
        """The transition unloads the deployment (an on-demand model's eviction)."""
        return not job.effect.to_plan.replicas and bool(job.removed)

    def _busy(self, job: _Job, *, held_ok: bool = False) -> str:
        """Why the deployment may not be evicted now ('' when it may); ``held_ok``: requests
        held for it (waiting for a load) do not count."""
        owned, held = len(self.core.router.ownership()), len(self.core.held())
        if not owned and not (held and not held_ok):
            return ""
        late = self._idle_deadline(job) is not None
        note = f" (not idle within {self.settings.drain_timeout_s:g} s)" if late else ""
        return f"not evicted: {owned} requests active or queued, {held} held for it{note}"

    def _start_prepare(self, job: _Job, now_s: float) -> Result:
        deployment = self.core.deployment
        # NOTE: the stream decided the eviction on a view a few seconds old; a request may have
        # come since. A model with active or queued requests is never evicted.
        if self._evicting(job) and (busy := self._busy(job)):
            job.waiting = self._waits_for_idle(job, now_s)
            return None if job.waiting else self._failed(job, busy)
        gpus = [u for r in job.added for u in r.gpu_uuids]
        problems = self._inventory.problems(gpus, deployment)
        decided = self._decided.get(job.effect.seq)
        taking = decided.takes_from if decided is not None else None
        held = taking is not None and self._inventory.held_only_by(gpus, deployment, (taking,))
        job.waiting = (
            decided is not None and held and now_s - decided.since_s < self.settings.handover_wait_s
        )
        if job.waiting:
            return None
        if problems:
            detail = "target GPUs not free: " + "; ".join(problems)
            if held:
                detail += f" (not handed over within {self.settings.handover_wait_s:g} s)"
            return self._failed(job, detail)
        self._inventory.claim(gpus, deployment)
        # NOTE: a forced switch after a GPU loss reuses the dead replica's surviving GPUs; its
        # memory there is freed once the engine's death is noticed, so notice it first (else
        # the reservation fails and the retry costs a backoff: 1 s of a 70B's 15.45-s shift)
        self.core.reap_failed(now_s)
        for replica in job.added:
            timing = self._timing_for(replica)
            if timing is None:
                return self._failed(job, f"unknown model {replica.model_name!r}")
            result = self.core.install(timing, now_s, ReplicaRole.SHADOW)
            if not result.ok:
                return self._failed(
                    job, f"shadow {replica.plan_id}: {result.fault} {result.detail}"
                )
        return None

    def _idle_deadline(self, job: _Job) -> float | None:
        """Until when a displaced model's eviction waits for an idle moment (None: it does
        not wait)."""
        decided = self._decided.get(job.effect.seq)
        if decided is None or not decided.when_idle:
            return None
        return decided.since_s + self.settings.drain_timeout_s

    def _waits_for_idle(self, job: _Job, now_s: float) -> bool:
        deadline = self._idle_deadline(job)
        return deadline is not None and now_s < deadline

    def _poll_prepare(self, job: _Job, now_s: float) -> Result:
        if job.waiting:
            return self._start_prepare(job, now_s)
        for replica in job.added:
            fault = self.core.health(replica.plan_id)
            if fault is not None:
                return self._failed(job, f"shadow {replica.plan_id}: {fault}")
        if not all(self.core.is_ready(r.plan_id, now_s) for r in job.added) or self._hold(job):
            return None
        return self._done(job, f"{len(job.added)} shadow replicas loaded")

    def _undo_prepare(self, added: tuple[ExecutionPlan, ...], now_s: float) -> None:
        for replica in added:
            self.core.evacuate(replica.plan_id, now_s)
            self.core.unplace_all(replica.plan_id)
            self.core.retire(replica.plan_id)
        self._inventory.release([u for r in added for u in r.gpu_uuids], self.core.deployment)

    # ---- switch --------------------------------------------------------------------------------

    def _check_added(self, job: _Job, now_s: float) -> Result:
        for replica in job.added:
            fault = self.core.health(replica.plan_id)
            if fault is not None or not self.core.is_ready(replica.plan_id, now_s):
                return self._failed(job, f"new replica {replica.plan_id}: {fault or 'not ready'}")
        return None

    def _start_switch(self, job: _Job, now_s: float) -> Result:
        failed = self._check_added(job, now_s)
        if failed is not None:
            return failed
        for replica in job.added:
            self.core.set_role(replica.plan_id, ReplicaRole.CANARY)
        decided = self._decided.get(job.effect.seq)
        job.until_s = now_s + self.settings.canary_s
        # NOTE: no canary for an eviction either: the entry closes now, new requests are held
        if (decided is not None and decided.urgent) or self._evicting(job):
            self._freeze(job)
        return None

    def _poll_switch(self, job: _Job, now_s: float) -> Result:
        failed = self._check_added(job, now_s)
        if failed is not None:
            return failed
        if job.step is SwitchStep.CANARY:
            if now_s < job.until_s:
                return None
            self._freeze(job)
        self._start_handovers(job, now_s)
        if not job.queue:
            # NOTE: a sequence still prefilling at the freeze starts decoding later; left on
            # its old replica it would hold the cleanup for its whole output (5 s of a 7B's
            # 7.3-s shift in bench.fragmented), so late starters are handed over before the swap.
            job.queue = self._handover_queue(job)
            self._start_handovers(job, now_s)
        if job.queue or not self.core.staged_ready(now_s) or self._hold(job):
            return None
        # NOTE: a displaced model's requests that came since its idle moment finish on the
        # frozen replica (a drain); those held since the freeze wait for its reload elsewhere
        held_ok = self._idle_deadline(job) is not None
        if self._evicting(job) and (busy := self._busy(job, held_ok=held_ok)):
            return None if self._waits_for_idle(job, now_s) else self._failed(job, busy)
        return self._swap(job, now_s)

    def _freeze(self, job: _Job) -> None:
        for replica in job.removed:
            self.core.set_role(replica.plan_id, ReplicaRole.FROZEN)
        for replica in job.added:
            self.core.set_role(replica.plan_id, ReplicaRole.ACTIVE)
        job.step = SwitchStep.MIGRATE
        job.queue = self._handover_queue(job)

    def _handover_queue(self, job: _Job) -> list[tuple[KvHandover, str, str]]:
        targets = [r.plan_id for r in job.added] or [
            r.plan_id for r in job.effect.to_plan.replicas if self.core.has(r.plan_id)
        ]
        if not targets:
            return []
        load = dict.fromkeys(targets, 0)
        queue: list[tuple[KvHandover, str, str]] = []
        for replica in job.removed:
            moving = [
                (p.seq_id, p.context_tokens)
                for p in self.core.running_progress(replica.plan_id)
                if p.remaining_tokens > self.settings.short_sequence_tokens
                and p.seq_id not in job.handed
            ]
            job.handed.update(seq_id for seq_id, _ in moving)
            by_target: dict[str, list[tuple[str, int]]] = {}
            for seq in sorted(moving, key=lambda s: (-s[1], s[0])):  # longest first
                target = min(targets, key=lambda t: (load[t], t))
                load[target] += seq[1]
                by_target.setdefault(target, []).append(seq)
            for target, seqs in by_target.items():
                timing = self._timing_for(self.core.plan_of(target))
                assert timing is not None  # installed replicas always have a timing
                plan = plan_handover(
                    seqs,
                    replica,
                    self.core.plan_of(target),
                    timing.model,
                    timing.config,
                    self.settings.inter_domain_link,
                )
                if self.settings.kv_policy is KvPolicy.REPLAY_ONLY:
                    plan = tuple(
                        dataclasses.replace(h, action=KvAction.REPLAY, transfer_bytes=0)
                        for h in plan
                    )
                queue.extend((h, replica.plan_id, target) for h in plan)
        return sorted(queue, key=lambda q: (-q[0].num_tokens, q[0].seq_id))

    def _start_handovers(self, job: _Job, now_s: float) -> None:
        batch, job.queue = (
            job.queue[: self.settings.max_handovers_per_poll],
            job.queue[self.settings.max_handovers_per_poll :],
        )
        for handover, source, target in batch:
            transfer_s = 0.0
            if handover.action is KvAction.MIGRATE:  # one link, transfers queue behind each other
                free = max(now_s, job.link_free_s.get((source, target), now_s))
                job.link_free_s[(source, target)] = free + handover.est_s
                transfer_s = free + handover.est_s - now_s
            moved = self.core.stage(
                handover.seq_id, source, target, handover.action, transfer_s, now_s
            )
            if moved is None:
                job.tally.skipped += 1
            elif handover.action is KvAction.MIGRATE:
                job.tally.migrated += 1
                job.tally.migrated_bytes += moved
            else:
                job.tally.replayed += 1

    def _swap(self, job: _Job, now_s: float) -> PhaseDone:
        self.core.commit_staged()
        for replica in job.removed:
            self.core.set_role(replica.plan_id, ReplicaRole.DRAINING)
            self.core.close_admission(replica.plan_id)
            # NOTE: prompts the old engine has not prefilled yet go to the new plan like queued
            # ones, and long sequences the new plan had no room for when they were staged as
            # replays; kept, each would hold the cleanup for its whole output on the old replica
            # (14.5 s of a 70B's 30.7-s shift in bench.fragmented)
            short = self.settings.short_sequence_tokens
            replayed = self.core.requeue_unstaged(replica.plan_id, short, now_s)
            job.tally.replayed += replayed
            job.tally.skipped -= replayed
        self.core.serving_plan_id = job.effect.to_plan.plan_id
        t = job.tally
        return self._done(
            job,
            f"migrated {t.migrated} ({t.migrated_bytes} B), replayed {t.replayed}, "
            f"left to finish on old {t.skipped}",
        )

    def _undo_switch(self, effect: RunPhase | RollBack, now_s: float) -> None:
        added, removed = replica_diff(effect.from_plan, effect.to_plan)
        self.core.abort_staged()
        for replica in removed:
            self.core.set_role(replica.plan_id, ReplicaRole.ACTIVE)
        for replica in added:
            self.core.set_role(replica.plan_id, ReplicaRole.SHADOW)
            self.core.evacuate(replica.plan_id, now_s)
        self.core.serving_plan_id = effect.from_plan.plan_id if effect.from_plan else None

    # ---- cleanup -------------------------------------------------------------------------------

    def _start_cleanup(self, job: _Job, now_s: float) -> Result:
        for replica in job.removed:
            self.core.set_role(replica.plan_id, ReplicaRole.DRAINING)
            self.core.close_admission(replica.plan_id)
            self.core.move_queued(replica.plan_id, now_s)
        self.core.serving_plan_id = job.effect.to_plan.plan_id
        job.until_s = now_s if job.effect.force else now_s + self.settings.drain_timeout_s
        return None

    def _poll_cleanup(self, job: _Job, now_s: float) -> Result:
        busy = [r.plan_id for r in job.removed if self.core.router.owned(r.plan_id)]
        if busy and now_s < job.until_s:
            return None
        if self._hold(job):
            return None
        for rid in busy:  # drain deadline passed: replay what is left on the new plan
            self.core.evacuate(rid, now_s)
            self.core.unplace_all(rid)  # only when no replica of the new plan can take them
        for replica in job.removed:
            self.core.retire(replica.plan_id)
        kept = set(job.effect.to_plan.gpu_uuids)
        freed = [u for r in job.removed for u in r.gpu_uuids if u not in kept]
        self._inventory.release(freed, self.core.deployment)
        detail = f"released {len(job.removed)} replicas, {len(freed)} GPUs"
        return self._done(job, detail + (f"; {len(busy)} drained by force" if busy else ""))

    # ---- compensation --------------------------------------------------------------------------

    def abort(self, effect: AbortPhase, now_s: float) -> None:
        """Undo a failed attempt so the phase can start again (cleanup needs no undo)."""
        job, self._job = self._job, None
        if job is None or job.effect.seq != effect.seq:
            return
        if effect.phase is P:
            self._undo_prepare(job.added, now_s)
        elif effect.phase is S:
            self._undo_switch(job.effect, now_s)

    def rollback(self, effect: RollBack, now_s: float) -> None:
        """Undo the whole transition; the old plan's replicas serve again."""
        self._job = None
        added, _ = replica_diff(effect.from_plan, effect.to_plan)
        self._undo_switch(effect, now_s)
        self._undo_prepare(added, now_s)

    def status(self) -> dict[str, Any]:
        """Phase step, migration queue and shadow plan state (for /status)."""
        job = self._job
        if job is None:
            return {"phase": None, "migration_queue": 0, "staged": self.core.num_staged}
        return {
            "phase": str(job.effect.phase),
            "attempt": job.effect.attempt,
            "step": str(job.step) if job.effect.phase is S else None,
            "paused": job.paused,
            "migration_queue": len(job.queue),
            "staged": self.core.num_staged,
            "shadow_replicas": [r.plan_id for r in job.added],
            "migrated": job.tally.migrated,
            "replayed": job.tally.replayed,
        }
