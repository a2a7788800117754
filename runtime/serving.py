"""The data plane of one deployment: replicas, admission, engine stepping and KV hand-over.

:class:`ServingCore` joins the router (ownership, queues), the VMM ledger (reservations and
per-request commits), the watermark throttle and one engine per replica. It is synchronous and
clock-free — every call takes ``now_s`` — so the worker drives it under the wall clock and a
discrete-event benchmark under a simulated one. The transition executor calls its replica
lifecycle and hand-over methods; it never touches engines or the router directly.

Admission: candidates in predicted-completion order; a replica is skipped when its GPUs would
pass the watermark or its queue is full; the first whose VMM commit succeeds owns the request.
What a request commits is the paged-KV rule's (:mod:`runtime.engine.paging`,
``ServingSettings.kv_admission``): on an engine that pages (:class:`PagedEngine`, the
SimEngine) its prompt's pages + one, grown through the VMM by the engine as it generates
(:class:`runtime.kvpager.VmmPager`; youngest-first preemption when a page is refused), or
prompt + the client's stated ``max_tokens``; never the output length it will turn out to have.
An engine that does not page this way (the torch engine pages its own pool) commits prompt +
``max_tokens``.
No candidate → a rejection naming the rule (``THROTTLED_WATERMARK``, ``REJECTED_OOM_RISK``...),
which the HTTP layer turns into 429. Sequences moved by a hand-over or a failure are never
rejected: they wait in their new owner's queue until its VMM can commit them.

On demand (``hold_s`` set): a request arriving while no replica is routable (the model is cold,
loading or being evicted) is held, first come first served, and admitted once a replica serves;
after ``hold_s`` it is refused with ``MODEL_LOADING`` (``refused``, for the caller to answer).

Memory waits (``memory_wait_s`` > 0): a request the watermark refuses only because other
sequences' KV fills its replicas' GPUs for the moment is held too (``HELD_FOR_MEMORY``) and
tried again every step, while it can still get its first token within ``memory_wait_s`` of its
first refusal (:func:`runtime.admission.memory_wait_until_s`); then it is refused with
``THROTTLED_WATERMARK``. The watermark and the VMM commit still gate its admission. Held
requests are retried oldest first; a later request is not held behind them (measured: holding
it back cost more goodput than it saved, bench/HISTORY.md 2026-12-02).

TTFT deadline (``ttft_deadline_s`` > 0): a new request with no first token that long after its
arrival, still queued or prefilling, is refused with ``TTFT_DEADLINE`` (``refused``) and leaves
no trace (queue, engine, KV commit); one held for a load is exempt, its client waiting for the
load by design. Its engine knows the deadline (``SeqSpec.first_token_due_s``) and does not start
a prefill whose first token could not come by then: it reports the request ``expired`` and it is
refused the same way at once, without the prefill it could not use.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gearbox.plans import ExecutionPlan
from gearbox.switch import KvAction
from runtime.admission import (
    first_token_s,
    memory_wait_until_s,
    screen,
    transient,
    worst_refusal,
)
from runtime.engine.base import (
    Engine,
    EngineFault,
    OpResult,
    SeqProgress,
    SeqSpec,
    SeqState,
    StepOutput,
)
from runtime.engine.paging import PagedEngine, admission_tokens
from runtime.kvpager import VmmPager
from runtime.router import ROUTABLE, ReplicaRole, Router
from runtime.stats import ServingWindow
from runtime.timing import ReplicaTiming
from runtime.types import (
    Admission,
    Completion,
    OwnershipEvent,
    OwnershipKind,
    Reason,
    Request,
    ServingSettings,
)
from runtime.vmm.manager import WEIGHTS_REQUEST, ReservationManager, replica_floor

EngineFactory = Callable[[ReplicaTiming], Engine]
_RUNS = frozenset(
    {ReplicaRole.CANARY, ReplicaRole.ACTIVE, ReplicaRole.FROZEN, ReplicaRole.DRAINING}
)


@dataclass
class _Live:
    request: Request
    generated: int = 0  # output tokens known to exist (a replay continues after them)
    first_token_s: float | None = None
    admissions: int = 0  # times an engine took it (more than one = replayed)
    due_s: float | None = None  # its TTFT deadline (arrival + ttft_deadline_s; None: exempt)


@dataclass
class _Slot:
    plan: ExecutionPlan
    timing: ReplicaTiming
    engine: Engine
    ledger: str  # its id in the host's VMM ledger (ServingCore.ledger_id)
    pager: VmmPager | None = None  # the engine pages its KV through the VMM (None: up front)


@dataclass(frozen=True, slots=True)
class _Hold:
    """A request held for a load or for memory."""

    request: Request
    until_s: float  # refused when still not admitted then
    why: Reason  # HELD_FOR_LOAD or HELD_FOR_MEMORY
    first_refused_s: float  # held for memory: its first watermark refusal


@dataclass(frozen=True, slots=True)
class _Staged:
    source: str
    target: str
    action: KvAction


class ServingCore:
    """One deployment's serving replicas (see the module docstring)."""

    def __init__(
        self,
        deployment: str,
        engine_factory: EngineFactory,
        vmm: ReservationManager,
        router: Router | None = None,
        settings: ServingSettings | None = None,
    ) -> None:
        self.deployment = deployment
        self.settings = settings or ServingSettings()
        self.router = router or Router()
        self.vmm = vmm
        self.serving_plan_id: str | None = None
        self.model_name = ""
        self.window = ServingWindow(start_s=0.0)
        self.ownership_events: list[OwnershipEvent] = []
        self.completions: list[Completion] = []
        self.rejections: Counter[Reason] = Counter()
        self.engine_oom_events = 0
        self.preemptions = 0  # running sequences preempted for KV pages (recomputed later)
        self._factory = engine_factory
        self._slots: dict[str, _Slot] = {}
        self._live: dict[str, _Live] = {}
        self._unplaced: dict[str, _Live] = {}  # recovered before any replica could take them
        self._staged: dict[str, _Staged] = {}
        self.hold_s: float | None = None  # on demand: how long a request waits for a load
        # on demand: KV tokens each replica is guaranteed on a shared GPU (its VMM floor)
        self.kv_floor_tokens: int | None = None
        # how long a transient watermark refusal may wait for memory (0: refused at once)
        self.memory_wait_s = 0.0
        # how long a new request may go without a first token before it is refused (0: no limit)
        self.ttft_deadline_s = 0.0
        self._fresh: list[tuple[float, str]] = []  # (arrival, id) of admitted new requests
        self._held: dict[str, _Hold] = {}  # request id → its hold, in arrival order
        # held requests refused, and requests past their TTFT deadline, since the drain
        self.refused: list[tuple[str, Reason]] = []

    # ---- replica lifecycle ---------------------------------------------------------------------

    def has(self, replica_id: str) -> bool:
        """True while the replica is installed."""
        return replica_id in self._slots

    def install(
        self, timing: ReplicaTiming, now_s: float, role: ReplicaRole = ReplicaRole.SHADOW
    ) -> OpResult:
        """Reserve VMM, commit the weights, start loading shards and building groups."""
        rid = timing.replica_id
        if rid in self._slots:
            return OpResult(True, 0.0)
        mem, ledger = timing.memory_bytes_per_gpu, self.ledger_id(rid)
        if not self.vmm.reserve_replica(ledger, {u: (m, m) for u, m in mem.items()}):
            return OpResult(False, fault=EngineFault.OUT_OF_MEMORY, detail=self._vmm_detail())
        overhead = timing.config.runtime_overhead_bytes
        weights = {u: b + overhead for u, b in timing.weight_bytes_per_gpu.items()}
        if not self.vmm.commit(ledger, WEIGHTS_REQUEST, weights):
            self.vmm.unreserve_replica(ledger)
            return OpResult(False, fault=EngineFault.OUT_OF_MEMORY, detail=self._vmm_detail())
        if self.kv_floor_tokens is not None:
            kv, cap = timing.kv_bytes_per_token_per_gpu, self.settings.watermark
            floor = {
                u: replica_floor(b, kv[u] * self.kv_floor_tokens, mem[u], cap)
                for u, b in weights.items()
            }
            self.vmm.set_floor(ledger, floor)
        engine = self._factory(timing)
        pager = None
        if isinstance(engine, PagedEngine):
            pager = VmmPager(self.vmm, ledger, timing)
            engine.attach_pager(pager, self.settings.kv_admission)
        ready = 0.0
        for index in range(len(timing.plan.stages)):
            result = engine.load_shard(index, now_s)
            if not result.ok:
                self._discard(ledger, engine, timing)
                return result
        result = engine.build_comm_groups(now_s)
        if not result.ok:
            self._discard(ledger, engine, timing)
            return result
        ready = result.ready_at_s
        self._slots[rid] = _Slot(timing.plan, timing, engine, ledger, pager)
        self.router.add_replica(timing, role)
        self.model_name = timing.model.name
        return OpResult(True, ready)

    def ledger_id(self, replica_id: str) -> str:
        """The replica's id in the host's VMM ledger.

        NOTE: a replica's id is its plan's, which names the model and GPUs, not the deployment:
        two deployments of one model sharing a GPU (on-demand models) would hold one entry.
        """
        return f"{self.deployment}/{replica_id}"

    def _vmm_detail(self) -> str:
        failure = self.vmm.last_failure
        if failure is None:
            return "VMM refused"
        return f"VMM refused on {failure.gpu_uuid}: {failure.error}"

    def _discard(self, ledger: str, engine: Engine, timing: ReplicaTiming) -> None:
        for index in range(len(timing.plan.stages)):
            engine.unload_shard(index)
        self.vmm.unreserve_replica(ledger)

    def retire(self, replica_id: str) -> bool:
        """Unload and release a replica that owns nothing; False while it still owns sequences."""
        slot = self._slots.get(replica_id)
        if slot is None:
            return True
        if self.router.owned(replica_id) or any(
            s.source == replica_id or s.target == replica_id for s in self._staged.values()
        ):
            return False
        slot.engine.drop([p.seq_id for p in slot.engine.progress()])
        self._discard(slot.ledger, slot.engine, slot.timing)
        self.router.remove_replica(replica_id)
        del self._slots[replica_id]
        return True

    def is_ready(self, replica_id: str, now_s: float) -> bool:
        """Installed, loaded and healthy."""
        slot = self._slots.get(replica_id)
        return slot is not None and slot.engine.is_ready(now_s)

    def health(self, replica_id: str) -> EngineFault | None:
        """The replica's engine fault (``NOT_READY`` when not installed)."""
        slot = self._slots.get(replica_id)
        return slot.engine.health() if slot is not None else EngineFault.NOT_READY

    def set_role(self, replica_id: str, role: ReplicaRole) -> None:
        """Move an installed replica in the route table (failed replicas stay failed)."""
        if replica_id in self._slots and self.router.role(replica_id) is not ReplicaRole.FAILED:
            self.router.set_role(replica_id, role)

    def close_admission(self, replica_id: str) -> None:
        """The replica's engine stops admitting (it drains)."""
        if replica_id in self._slots:
            self._slots[replica_id].engine.close_admission()

    def replica_ids(self) -> tuple[str, ...]:
        """Installed replicas."""
        return tuple(self._slots)

    def plan_of(self, replica_id: str) -> ExecutionPlan:
        """The replica's execution plan."""
        return self._slots[replica_id].plan

    # ---- admission -----------------------------------------------------------------------------

    def submit(self, request: Request, now_s: float) -> Admission:
        """Route and commit a new request, hold it (for a load or for memory), or reject it with
        the rule that refused."""
        rid = request.request_id
        reason, soonest_s = self._try_admit(request, now_s)
        if reason.reason is Reason.NO_SERVING_PLAN and self.hold_s is not None:
            self._held[rid] = _Hold(request, now_s + self.hold_s, Reason.HELD_FOR_LOAD, now_s)
            reason = Admission(rid, True, Reason.HELD_FOR_LOAD)
        elif (until_s := self._memory_wait(reason.reason, soonest_s, now_s, now_s)) is not None:
            self._held[rid] = _Hold(request, until_s, Reason.HELD_FOR_MEMORY, now_s)
            reason = Admission(rid, True, Reason.HELD_FOR_MEMORY)
        elif reason.reason is Reason.ADMITTED and self.ttft_deadline_s > 0.0:
            # NOTE: not one held for a load: its client waits for the load (``hold_s``) by
            # design (one held for memory joins when admitted: _release_held)
            self._watch_deadline(request)
        self.window.on_arrival(request, reason.reason)
        if not reason.admitted:
            self.rejections[reason.reason] += 1
        return reason

    def held(self, why: Reason | None = None) -> tuple[str, ...]:
        """Requests held (``why``: only those held for a load, or for memory), oldest first."""
        return tuple(rid for rid, h in self._held.items() if why is None or h.why is why)

    def _memory_wait(
        self, refusal: Reason, soonest_s: float | None, first_s: float, now_s: float
    ) -> float | None:
        if self.memory_wait_s <= 0.0:
            return None
        return memory_wait_until_s(refusal, soonest_s, first_s, now_s, self.memory_wait_s)

    def _release_held(self, now_s: float) -> None:
        """Admit held requests, oldest first, once a replica serves and has room; refuse those
        whose wait ran out (or that a serving replica refused: the reason stays that replica's)."""
        held, self._held = self._held, {}
        for rid, hold in held.items():
            admission, soonest_s = self._try_admit(hold.request, now_s)
            if admission.admitted:
                if hold.why is Reason.HELD_FOR_MEMORY and self.ttft_deadline_s > 0.0:
                    self._watch_deadline(hold.request)
                continue
            if admission.reason is Reason.NO_SERVING_PLAN and now_s < hold.until_s:
                self._held[rid] = hold  # NOTE: in arrival order, as before
                continue
            first_s = hold.first_refused_s if hold.why is Reason.HELD_FOR_MEMORY else now_s
            until_s = self._memory_wait(admission.reason, soonest_s, first_s, now_s)
            if until_s is not None:
                self._held[rid] = _Hold(hold.request, until_s, Reason.HELD_FOR_MEMORY, first_s)
                continue
            reason = admission.reason
            if reason is Reason.NO_SERVING_PLAN:
                reason = Reason.MODEL_LOADING
            self.refused.append((rid, reason))
            self.rejections[reason] += 1
            self.window.on_refused(reason)

    def _try_admit(self, request: Request, now_s: float) -> tuple[Admission, float | None]:
        """The admission, and on a refusal the soonest first token on a replica where a
        watermark refusal is transient (None: on none; :mod:`runtime.admission`)."""
        rid_ = request.request_id
        if rid_ in self._live or rid_ in self._unplaced or rid_ in self._held:
            return Admission(rid_, False, Reason.DUPLICATE_REQUEST), None
        choices = self.router.candidates(request, now_s)
        if not choices:
            return Admission(rid_, False, Reason.NO_SERVING_PLAN), None
        refused: set[Reason] = set()
        soonest_s: float | None = None
        watermark = self.settings.watermark
        for choice in choices:
            slot = self._slots[choice.replica_id]
            timing = slot.timing
            need = self._kv_need(slot, request, 0)
            memory = self.vmm.memory_for(slot.ledger, need)
            reason = screen(
                too_long=request.total_tokens > timing.kv_capacity_tokens,
                queue_full=self.router.queue_len(choice.replica_id)
                >= self.settings.max_queue_per_replica,
                memory=memory,
                need_bytes=need,
                watermark=watermark,
            )
            if reason is None and not self.vmm.commit(slot.ledger, rid_, need):
                reason = Reason.REJECTED_OOM_RISK
            if reason is None:
                self.router.enqueue(request, choice.replica_id)
                self._live[rid_] = _Live(request)
                self.ownership_events.append(
                    OwnershipEvent(OwnershipKind.ADMITTED, request, choice.replica_id)
                )
                admitted = Admission(
                    rid_, True, Reason.ADMITTED, choice.replica_id, choice.predicted_completion_s
                )
                return admitted, None
            refused.add(reason)
            if reason is Reason.THROTTLED_WATERMARK and transient(
                memory, self.vmm.held_bytes(slot.ledger, WEIGHTS_REQUEST), need, watermark
            ):
                t_s = first_token_s(timing, request.prompt_tokens)
                soonest_s = t_s if soonest_s is None else min(soonest_s, t_s)
        return Admission(rid_, False, worst_refusal(refused)), soonest_s

    def readmit(self, request: Request, now_s: float) -> None:
        """Take back a sequence recovered from the journal; it is replayed, never rejected."""
        if request.request_id in self._live or request.request_id in self._unplaced:
            return
        live = _Live(request)
        if not self._place(request.request_id, live, now_s):
            self._unplaced[request.request_id] = live

    def _place(self, seq_id: str, live: _Live, now_s: float, exclude: str | None = None) -> bool:
        """Queue a sequence (new or moving) at the best routable replica; False when none."""
        choices = [
            c for c in self.router.candidates(live.request, now_s) if c.replica_id != exclude
        ]
        if not choices:
            return False
        target = choices[0].replica_id
        self._live[seq_id] = live
        if self.router.owner(seq_id) is None:
            self.router.enqueue(live.request, target, front=True)
        else:
            self.router.transfer(seq_id, target, running=False, prompt_tokens=self._ctx(live))
        return True

    def _kv_need(self, slot: _Slot, request: Request, generated: int) -> dict[str, int]:
        """KV bytes per GPU a request commits when (re)admitted on the slot's replica."""
        tokens = request.total_tokens
        if slot.pager is not None:
            mode = self.settings.kv_admission
            tokens = admission_tokens(
                mode, request.prompt_tokens, generated, request.max_output_tokens
            )
        return slot.timing.kv_bytes_for(tokens)

    def _release(self, replica_id: str, seq_id: str) -> None:
        """Give back the sequence's KV commit on the replica (and what its pager knew)."""
        slot = self._slots.get(replica_id)
        if slot is not None and slot.pager is not None:
            slot.pager.forget(seq_id)
        self.vmm.release(self.ledger_id(replica_id) if slot is None else slot.ledger, seq_id)

    @staticmethod
    def _ctx(live: _Live) -> int:
        return live.request.prompt_tokens + live.generated

    # ---- stepping ------------------------------------------------------------------------------

    def step(self, now_s: float) -> None:
        """Admit queued sequences into ready engines and run them up to ``now_s``."""
        self.reap_failed(now_s)
        if self._held:
            self._release_held(now_s)
        for seq_id, live in list(self._unplaced.items()):
            if self._place(seq_id, live, now_s):
                del self._unplaced[seq_id]
        for rid, slot in self._slots.items():
            if self.router.role(rid) in _RUNS and slot.engine.is_ready(now_s):
                self._feed(rid, slot, now_s)
                self._absorb(rid, slot.engine.step(now_s))
        if self._fresh:
            self._refuse_late(now_s)

    def _watch_deadline(self, request: Request) -> None:
        """An admitted new request is refused past its TTFT deadline; its engine is told the
        deadline too, and does not start a prefill that could not meet it."""
        heapq.heappush(self._fresh, (request.arrival_s, request.request_id))
        self._live[request.request_id].due_s = request.arrival_s + self.ttft_deadline_s

    def _refuse_late(self, now_s: float) -> None:
        """Refuse (``TTFT_DEADLINE``) the new requests with no first token ``ttft_deadline_s``
        after their arrival, queued or still prefilling."""
        # NOTE: past its TTFT SLO a request can no longer count as goodput; left in the queue
        # it delays every later one (a saturated 70B queued 100 s: bench/HISTORY.md stop 40)
        # and its client waits for an answer it will not use in time
        cutoff = now_s - self.ttft_deadline_s
        while self._fresh and self._fresh[0][0] <= cutoff:
            _, seq_id = heapq.heappop(self._fresh)
            live = self._live.get(seq_id)
            owner = self.router.owner(seq_id)
            if (
                live is None
                or owner is None
                or live.first_token_s is not None
                or live.generated
                or seq_id in self._staged
            ):
                continue
            self._refuse_deadline(owner, seq_id, live)

    def _refuse_deadline(self, owner: str, seq_id: str, live: _Live) -> None:
        """Refuse a new request past (or bound to miss) its TTFT deadline: it leaves no trace."""
        self._take_out(owner, seq_id)
        self.ownership_events.append(OwnershipEvent(OwnershipKind.FINISHED, live.request, owner))
        self.refused.append((seq_id, Reason.TTFT_DEADLINE))
        self.rejections[Reason.TTFT_DEADLINE] += 1
        self.window.on_refused(Reason.TTFT_DEADLINE)

    def _feed(self, rid: str, slot: _Slot, now_s: float) -> None:
        # NOTE: a full engine takes nothing: asked before the queue is copied (a busy replica's
        # queue is long and it is fed on every tick).
        if not slot.engine.has_capacity():
            return
        for seq_id in self.router.queued(rid):
            if not slot.engine.has_capacity():
                return
            live = self._live[seq_id]
            req = live.request
            if not self.vmm.holds(slot.ledger, seq_id):
                need = self._kv_need(slot, req, live.generated)
                if not self.vmm.commit(slot.ledger, seq_id, need):
                    continue  # waits for memory; later queue entries may still fit
            fresh = live.first_token_s is None and not live.generated
            spec = SeqSpec(
                seq_id, req.prompt_tokens, req.max_output_tokens, live.generated,
                req.sim_output_tokens,  # SIMULATED: for the simulated engine's stop only
                live.due_s if fresh else None,
            )  # fmt: skip
            if slot.engine.admit(spec, now_s) is not None:
                return
            live.admissions += 1
            self.router.mark_running(seq_id)

    def _absorb(self, rid: str, out: StepOutput) -> None:
        self.window.on_step(
            out.prefill_tokens, out.decode_tokens, out.decode_step_s, out.decode_step_runs
        )
        if out.preempted:
            self.preemptions += len(out.preempted)
            self.window.on_preempted(len(out.preempted))
        for first in out.first_tokens:
            live = self._live.get(first.seq_id)
            if live is not None and live.first_token_s is None:
                live.first_token_s = first.t_s
        for done in out.finished:
            self._finish(rid, done.seq_id, done.t_s, done.output_tokens)
        for seq_id in out.expired:
            live = self._live.get(seq_id)
            if live is not None and self.router.owner(seq_id) == rid:
                self._refuse_deadline(rid, seq_id, live)
        for failed in out.failed:
            live = self._live.get(failed.seq_id)
            if live is None or self.router.owner(failed.seq_id) != rid:
                continue
            if failed.fault is EngineFault.OUT_OF_MEMORY:
                self.engine_oom_events += 1
            live.generated = max(live.generated, failed.generated_tokens)
            self._release(rid, failed.seq_id)
            self.router.mark_waiting(failed.seq_id, self._ctx(live))

    def _finish(self, rid: str, seq_id: str, t_s: float, output_tokens: int) -> None:
        live = self._live.pop(seq_id, None)
        if live is None:
            return
        self.router.finish(seq_id, output_tokens)
        self._release(rid, seq_id)
        req = live.request
        done = Completion(
            request_id=seq_id,
            replica_id=rid,
            plan_id=self.serving_plan_id,
            prompt_tokens=req.prompt_tokens,
            output_tokens=output_tokens,
            arrival_s=req.arrival_s,
            first_token_s=live.first_token_s if live.first_token_s is not None else t_s,
            finish_s=t_s,
            replays=max(0, live.admissions - 1),
        )
        self.completions.append(done)
        self.window.on_completion(done)
        self.ownership_events.append(OwnershipEvent(OwnershipKind.FINISHED, req, rid))

    def reap_failed(self, now_s: float) -> None:
        """Notice engines that died since the last step: free their memory and queue their
        sequences elsewhere."""
        for rid, slot in self._slots.items():
            if self.router.role(rid) is not ReplicaRole.FAILED and slot.engine.health() is not None:
                self._fail_replica(rid, now_s)

    def _fail_replica(self, rid: str, now_s: float) -> None:
        """An engine died: its memory is gone; its sequences wait for replay elsewhere."""
        self.router.set_role(rid, ReplicaRole.FAILED)
        slot = self._slots[rid]
        self.vmm.unreserve_replica(slot.ledger)
        pager = slot.pager
        if pager is not None:
            pager.forget_all()
        for seq_id, staged in list(self._staged.items()):
            # NOTE: a hand-over touching the dead replica is abandoned: the sequence is replayed
            # from the queue below (or resumes at a live source), never kept in two places.
            if rid in (staged.source, staged.target):
                self._unstage(seq_id, staged)
        for seq_id in self.router.owned(rid):
            live = self._live[seq_id]
            if seq_id in self.router.running(rid):
                self.router.mark_waiting(seq_id, self._ctx(live))
            self._place(seq_id, live, now_s, exclude=rid)

    # ---- hand-over (used by the transition executor) -------------------------------------------

    def running_progress(self, replica_id: str) -> tuple[SeqProgress, ...]:
        """Decoding sequences the replica owns and that are not already being handed over."""
        slot = self._slots.get(replica_id)
        if slot is None:
            return ()
        owned = self.router.running(replica_id)
        return tuple(
            p
            for p in slot.engine.progress()
            if p.state is SeqState.RUNNING and p.seq_id in owned and p.seq_id not in self._staged
        )

    def stage(
        self,
        seq_id: str,
        source: str,
        target: str,
        action: KvAction,
        transfer_s: float,
        now_s: float,
    ) -> int | None:
        """Copy (migrate) or re-prefill (replay) a sequence onto ``target`` without moving its
        ownership; returns the bytes migrated (0 for a replay), ``None`` when it cannot be staged.
        """
        live = self._live.get(seq_id)
        if live is None or seq_id not in self.router.running(source):
            # NOTE: a switch plans its hand-overs once and starts a batch per poll: this one
            # ended (its answer shorter than the cap the plan counted on) or left the engine since
            return None
        src, dst = self._slots[source].engine, self._slots[target]
        generated = live.generated
        if dst.pager is not None:
            # NOTE: the target takes the pages the sequence holds by now, not its admission's.
            now = [p.generated_tokens for p in src.progress() if p.seq_id == seq_id]
            generated = max(now, default=generated)
        need = self._kv_need(dst, live.request, generated)
        if not self.vmm.commit(dst.ledger, seq_id, need):
            return None
        exports = src.export_kv([seq_id], now_s)  # pauses it at the source until commit/abort
        if not exports:
            self._release(target, seq_id)
            return None
        if action is KvAction.MIGRATE:
            ok = dst.engine.import_kv(exports, now_s, transfer_s).ok
        else:  # replay: re-prefill prompt + generated tokens on the target, held until the swap
            ok = dst.engine.admit(exports[0].spec, now_s, staged=True) is None
        if not ok:
            src.resume([seq_id])
            self._release(target, seq_id)
            return None
        self._staged[seq_id] = _Staged(source, target, action)
        return exports[0].num_bytes if action is KvAction.MIGRATE else 0

    def staged_ready(self, now_s: float) -> bool:
        """Every staged copy is complete on its target."""
        return all(
            self._slots[s.target].engine.staged_ready([sid], now_s)
            for sid, s in self._staged.items()
        )

    @property
    def num_staged(self) -> int:
        """Sequences being handed over."""
        return len(self._staged)

    def commit_staged(self) -> int:
        """Flip ownership of every staged sequence to its target (the swap); returns the count."""
        for seq_id, s in self._staged.items():
            live = self._live[seq_id]
            self.router.transfer(seq_id, s.target, running=True)
            self._slots[s.target].engine.activate([seq_id])
            self._slots[s.source].engine.drop([seq_id])
            self._release(s.source, seq_id)
            live.admissions += 1
        count = len(self._staged)
        self._staged.clear()
        return count

    def abort_staged(self) -> None:
        """Abandon every staged copy; the sequences continue at their sources."""
        for seq_id, s in list(self._staged.items()):
            self._unstage(seq_id, s)

    def _unstage(self, seq_id: str, s: _Staged) -> None:
        self._slots[s.target].engine.drop([seq_id])
        self._release(s.target, seq_id)
        self._slots[s.source].engine.resume([seq_id])
        del self._staged[seq_id]

    def move_queued(self, source: str, now_s: float) -> int:
        """Re-route the replica's waiting sequences to routable replicas; returns the count."""
        if source not in self._slots:
            return 0
        moved = 0
        for seq_id in self.router.queued(source):
            self._release(source, seq_id)
            if self._place(seq_id, self._live[seq_id], now_s, exclude=source):
                moved += 1
        return moved

    def requeue_unstaged(self, source: str, min_remaining_tokens: int, now_s: float) -> int:
        """Re-route what would hold the replica's drain, of the sequences not being handed over:
        those inside its engine not yet decoding, as queued ones, then those decoding with more
        than ``min_remaining_tokens`` to go, as replays (each re-prefills its prompt and
        generated tokens where it is queued). Returns how many decoding ones were replayed."""
        slot = self._slots.get(source)
        if slot is None:
            return 0
        owned = self.router.running(source)
        progress = [
            p for p in slot.engine.progress() if p.seq_id in owned and p.seq_id not in self._staged
        ]
        waiting = sorted(p.seq_id for p in progress if p.state is SeqState.WAITING)
        self._to_waiting(slot, waiting)
        self.move_queued(source, now_s)
        long = sorted(
            p.seq_id
            for p in progress
            if p.state is SeqState.RUNNING and p.remaining_tokens > min_remaining_tokens
        )
        self._to_waiting(slot, long)
        self.move_queued(source, now_s)
        return len(long)

    def evacuate(self, source: str, now_s: float) -> int:
        """Move everything the replica owns elsewhere, running sequences as replays."""
        slot = self._slots.get(source)
        if slot is None:
            return 0
        for seq_id, s in list(self._staged.items()):
            if source in (s.source, s.target):
                self._unstage(seq_id, s)
        self._to_waiting(slot, self.router.running(source))
        return self.move_queued(source, now_s)

    def _to_waiting(self, slot: _Slot, seq_ids: Iterable[str]) -> None:
        """Drop these sequences from the slot's engine, in the given order; each waits to
        replay what it has."""
        progress = {p.seq_id: p for p in slot.engine.progress()}
        for seq_id in seq_ids:
            live = self._live[seq_id]
            if seq_id in progress:
                live.generated = max(live.generated, progress[seq_id].generated_tokens)
            slot.engine.drop([seq_id])
            self.router.mark_waiting(seq_id, self._ctx(live))

    def unplace_all(self, source: str) -> int:
        """Take every sequence the replica owns out of the route table into the holding area
        (no replica left to take them: e.g. a rolled-back first placement); returns the count.
        """
        moved = 0
        for seq_id in self.router.owned(source):
            self._unplaced[seq_id] = self._take_out(source, seq_id)
            moved += 1
        return moved

    def _take_out(self, owner: str, seq_id: str) -> _Live:
        """Remove a sequence from its owner: engine, KV commit, route table; returns its record."""
        live = self._live.pop(seq_id)
        slot = self._slots.get(owner)
        if slot is not None:
            slot.engine.drop([seq_id])  # (a queued one is not in the engine: ignored)
        self._release(owner, seq_id)
        self.router.finish(seq_id)
        return live

    # ---- views ---------------------------------------------------------------------------------

    def queue_len(self) -> int:
        """Sequences waiting for an engine, across replicas and unplaced."""
        queued = sum(self.router.queue_len(r) for r in self._slots)
        return queued + len(self._unplaced)

    def active_sequences(self) -> int:
        """Sequences inside engines."""
        return sum(len(self.router.running(r)) for r in self._slots)

    def kv_bytes(self) -> int:
        """KV bytes held by all engines."""
        return sum(s.engine.kv_bytes() for s in self._slots.values())

    def unplaced(self) -> tuple[str, ...]:
        """Recovered sequences still waiting for a replica to exist."""
        return tuple(self._unplaced)

    def engine(self, replica_id: str) -> Engine:
        """The replica's engine."""
        return self._slots[replica_id].engine

    def routable(self) -> tuple[str, ...]:
        """Replicas taking new requests."""
        return self.router.replicas(*ROUTABLE)
