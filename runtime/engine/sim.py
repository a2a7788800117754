"""SimEngine: a SIMULATED inference engine for one replica, timed by gearbox's cost model or by
a simulated world's ground truth (``step_timing``, e.g. :mod:`sim.truth`).

It serves requests without a GPU. An iteration prefills the waiting prompts that fit a token
budget and advances every running sequence by one token, taking the time
:class:`runtime.timing.ReplicaTiming` computes for that batch on the replica's hardware. The
prompts and the decode tokens go through one forward pass, as vLLM's and Sarathi-Serve's mixed
batches do: such an iteration takes :func:`gearbox.cost.fused_iteration_s` of the prompts'
prefill plus the decode tokens' compute (timed as a prefill of that many tokens) and the decode
step. With chunked prefill (``prefill_chunk_tbt_share``) a unified replica's budget is its
chunk and the last prompt may be split, its rest prefilled in the next iterations, each chunk
timed as its share of the whole prompt's prefill (its KV allocated as it is prefilled). A
prefill/decode-split replica runs its two stages on different GPUs, concurrently: its prefill
stage takes a batch of waiting prompts whenever it is idle (at a decode-step boundary), and each
prompt joins the decode batch at the first step boundary after its prefill (KV hand-off
included) completes — the first token comes out at that completion; decode iterations never
wait for prefills.

It is stepped by events, not tokens: between two events (a prompt to prefill, a sequence
finishing, the context crossing a 64-token timing bucket, the caller's ``now_s``) every
iteration decodes the same batch in the same time, so a run of them is advanced at once
(:mod:`runtime.engine.batch`). Work per simulated second is proportional to requests, not
tokens. ``step`` is lazy: with nothing mutated since the last call and no event possible before
``now_s`` (a lower bound from the current step time, which only grows with context) it returns
at once and catches up later. ``tests/runtime/test_sim_engine_oracle.py`` checks first-token
and finish times against a token-by-token oracle.

KV is allocated against each simulated GPU's memory (:class:`SimGpuPool`), so a runtime that
over-admits sees out-of-memory events where a real engine would (a run's KV is allocated at
once; when it does not fit, the largest sequence fails first). With a pager attached
(:meth:`SimEngine.attach_pager`, the runtime's VMM ledger) the engine applies the paged-KV rule
of :mod:`runtime.engine.paging`: a sequence takes its admission pages before its prefill (the
head of the line waits until they are there) and its pages grow before each run of decode
iterations — for the whole run when they are there, else for the longest run (halved down to one
iteration) they are there for; when not even one iteration's page is there, the youngest running
sequence is preempted (its pages given back, its generated tokens kept, first in line to be
prefilled again) until it is. A new sequence whose first token cannot come by its TTFT deadline
(``SeqSpec.first_token_due_s``) is not prefilled: it is dropped when its turn comes and reported
``expired`` (:func:`runtime.admission.too_late_to_prefill`, on the engine's own timing
estimate). An iteration with prefills keeps its length once under way (begun before the
last ``step``'s ``now_s``), and a split replica's prefill stage stays busy until its pass ends:
a sequence dropped before then (refused, moved away) does not give its GPU time back, as it
could not on a GPU. Faults injected into the pool
(lost GPUs, failing loads or transfers) surface as :class:`EngineFault` values. Time is an
input: ``step(now_s)`` runs the iterations that complete by ``now_s`` and nothing else.
``stats`` (busy time, FLOPs, tokens, KV imported) and an optional decode observer serve
utilisation and latency measurements.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from gearbox.cost import fused_iteration_s
from runtime.admission import too_late_to_prefill
from runtime.engine.base import (
    EngineFault,
    Failed,
    Finished,
    FirstToken,
    KvExport,
    OpResult,
    SeqProgress,
    SeqSpec,
    SeqState,
    StepOutput,
)
from runtime.engine.batch import (
    EMPTY_STEP,
    DecodeObserver,
    EngineStats,
    PageRooms,
    RunningBatch,
    Segment,
    SeqRecord,
    StepAcc,
    StepTable,
    StepTiming,
    context_bucket,
    decode_segments,
    order_of,
)
from runtime.engine.paging import (
    CoveringPager,
    KvAdmission,
    KvPager,
    admission_tokens,
    paged,
)
from runtime.engine.simgpu import SimGpuPool
from runtime.timing import ReplicaTiming

_GB = 1e9
_INF = float("inf")


class SimEngine:
    """Simulated engine of one replica (see the module docstring)."""

    def __init__(
        self,
        timing: ReplicaTiming,
        pool: SimGpuPool,
        *,
        max_batch: int | None = None,
        max_prefill_tokens: int = 8192,
        observer: DecodeObserver | None = None,
        step_timing: StepTiming | None = None,
    ) -> None:
        self.replica_id = timing.replica_id
        self.timing = timing
        self._pool = pool
        self._max_batch = max_batch or timing.config.max_batch_sequences
        for uuid, total in timing.memory_bytes_per_gpu.items():
            pool.ensure(uuid, total)
        self._shard_ready_at: dict[int, float] = {}
        self._comm_ready_at: float | None = None
        self._dead: EngineFault | None = None
        self._admitting = True
        self._clock_s: float | None = None
        # NOTE: (GPU, bytes) of each token's KV, in the timing's order, GPUs without a share left
        # out here once rather than on every allocation (one per run of iterations).
        self._kv_shares = tuple((u, b) for u, b in timing.kv_bytes_per_token_per_gpu.items() if b)
        self._kv_total_per_token = timing.model.kv_bytes_per_token
        self._split = timing.plan.is_disaggregated  # prefill and decode stages run concurrently
        # NOTE: a split replica's decode never waits on a prefill: its prompts go whole.
        self._chunk_tokens = 0 if self._split else timing.prefill_chunk_tokens
        self._prefill_budget = min(max_prefill_tokens, self._chunk_tokens or max_prefill_tokens)
        self._inflight_done_s = 0.0
        self.stats = EngineStats()
        self._observer = observer
        model = timing.model
        self._flops_per_token = 2.0 * model.num_params
        self._attention_flops = 2.0 * model.num_layers * model.attention_dim  # × n² or 2·ctx
        self._records: dict[str, SeqRecord] = {}
        self._waiting: dict[str, SeqRecord] = {}
        self._batch = RunningBatch()
        # NOTE: iterations are timed by ``step_timing`` when given (a simulated world's ground
        # truth); ``timing`` still gives memory figures, and the router keeps estimating with it.
        self._clock_timing: StepTiming = step_timing or timing
        self._steps = StepTable(self._clock_timing)
        self._order = 0
        self._last_now_s = 0.0
        self._next_event_s = 0.0  # no observable output can happen before this
        self._dirty = True
        self._pending = StepAcc()  # output found while catching up outside ``step``
        self._pool_version = -1  # pool fault state last checked
        self._prefilling: list[SeqRecord] = []  # the split prefill stage's current batch
        # when the iteration with prefills under way at the engine clock ends (-inf: none is;
        # clocks start below 0 in a warm-up): it keeps its length even if a sequence in it is
        # dropped before then
        self._under_way_end_s = -_INF
        self._pager: KvPager | None = None  # KV pages held through the runtime's VMM ledger
        self._rooms: PageRooms | None = None  # with a pager that says what it covers
        self._kv_admission = KvAdmission.INCREMENTAL

    def attach_pager(self, pager: KvPager, mode: KvAdmission) -> None:
        """Hold KV pages through ``pager`` under ``mode`` (see the module docstring)."""
        self._pager = pager
        self._rooms = PageRooms(pager, self._batch) if isinstance(pager, CoveringPager) else None
        self._kv_admission = mode

    # ---- weights and groups --------------------------------------------------------------------

    def _shard_bytes(self, uuid: str) -> int:
        return self.timing.weight_bytes_per_gpu[uuid] + self.timing.config.runtime_overhead_bytes

    def load_shard(self, stage_index: int, now_s: float) -> OpResult:
        """Allocate the stage's weights (plus runtime overhead) and time the load from disk."""
        if self._dead is not None:
            return OpResult(False, fault=EngineFault.GPU_LOST, detail="engine is down")
        if stage_index in self._shard_ready_at:
            return OpResult(True, self._shard_ready_at[stage_index])
        stage = self.timing.plan.stages[stage_index]
        done: list[str] = []
        for uuid in stage.gpu_uuids:
            if self._pool.load_fails(uuid) or not self._pool.allocate(
                uuid, self._shard_bytes(uuid)
            ):
                for held in done:
                    self._pool.free(held, self._shard_bytes(held))
                return OpResult(False, fault=EngineFault.LOAD_FAILED, detail=f"gpu {uuid}")
            done.append(uuid)
        largest = max(self.timing.weight_bytes_per_gpu[u] for u in stage.gpu_uuids)
        ready = now_s + largest / (self.timing.config.weight_load_gbps * _GB)
        self._shard_ready_at[stage_index] = ready
        return OpResult(True, ready)

    def unload_shard(self, stage_index: int) -> None:
        """Free the stage's weights; idempotent."""
        if self._shard_ready_at.pop(stage_index, None) is None:
            return
        for uuid in self.timing.plan.stages[stage_index].gpu_uuids:
            self._pool.free(uuid, self._shard_bytes(uuid))
        self._comm_ready_at = None

    def build_comm_groups(self, now_s: float) -> OpResult:
        """Groups are ready ``comm_setup_s`` after the last shard finishes loading."""
        if len(self._shard_ready_at) != len(self.timing.plan.stages):
            return OpResult(False, fault=EngineFault.NOT_READY, detail="shards not loaded")
        lost = [u for u in self.timing.gpu_uuids if self._pool.is_lost(u)]
        if lost or self._dead is not None:
            return OpResult(False, fault=EngineFault.COMM_FAILED, detail=f"lost {lost}")
        start = max(now_s, *self._shard_ready_at.values())
        self._comm_ready_at = start + self.timing.config.comm_setup_s
        return OpResult(True, self._comm_ready_at)

    def is_ready(self, now_s: float) -> bool:
        """Loaded, connected and alive at ``now_s``."""
        self._check_gpus()
        return (
            self._dead is None and self._comm_ready_at is not None and now_s >= self._comm_ready_at
        )

    def health(self) -> EngineFault | None:
        """The fault that stopped the engine, if any."""
        self._check_gpus()
        return self._dead

    def _check_gpus(self) -> list[Failed]:
        """Die if a GPU was lost: every sequence fails and the engine's memory is freed."""
        if self._dead is not None:
            return []
        # NOTE: engines ask on every call; the pool's fault counter spares scanning GPUs.
        if self._pool.version == self._pool_version:
            return []
        self._pool_version = self._pool.version
        is_lost = self._pool.is_lost
        if not any(is_lost(u) for u in self.timing.gpu_uuids):
            return []
        self._sync()
        self._dead = EngineFault.GPU_LOST
        generated = self._batch.generated
        records = self._records
        failed = [Failed(sid, EngineFault.GPU_LOST, generated(q)) for sid, q in records.items()]
        self._drop(list(records))
        for index in list(self._shard_ready_at):
            self.unload_shard(index)
        return failed

    # ---- sequence bookkeeping ------------------------------------------------------------------

    def _sync(self) -> None:
        """Catch up to the last ``step`` before a read or a mutation.

        By the laziness rule nothing observable is due; anything found anyway (float slack) is
        kept for the next ``step`` rather than lost.
        """
        if not self._dirty and self._clock_s is not None and self._dead is None:
            self._advance(self._last_now_s, self._pending, partial=True)

    def _mutated(self) -> None:
        self._dirty = True

    # ---- sequences -----------------------------------------------------------------------------

    def has_capacity(self) -> bool:
        """Room in the batch and admission open."""
        return self._dead is None and self._admitting and len(self._records) < self._max_batch

    def admit(self, seq: SeqSpec, now_s: float, *, staged: bool = False) -> EngineFault | None:
        """Queue ``seq`` for prefill; ``staged`` replays wait for ``activate`` afterwards."""
        if self._dead is not None:
            return self._dead
        if not self._admitting and not staged:
            return EngineFault.DRAINING
        if len(self._records) >= self._max_batch:
            return EngineFault.BATCH_FULL
        self._sync()
        self._order += 1
        q = SeqRecord(seq, SeqState.WAITING, self._order, seq.generated_tokens, 0)
        q.stage_after_prefill, q.ready_at_s = staged, now_s
        self._records[seq.seq_id] = q
        self._waiting[seq.seq_id] = q
        self._mutated()
        return None

    def progress(self) -> tuple[SeqProgress, ...]:
        """Every held sequence."""
        self._sync()
        generated = self._batch.generated
        return tuple(
            SeqProgress(
                sid,
                q.state,
                q.spec.prompt_tokens + generated(q),
                generated(q),
                q.spec.max_output_tokens,
            )
            for sid, q in self._records.items()
        )

    def _alloc_kv(self, tokens: int) -> bool:
        pool = self._pool
        for i, (uuid, per_token) in enumerate(self._kv_shares):
            if not pool.allocate(uuid, per_token * tokens):
                for held, held_per_token in self._kv_shares[:i]:
                    pool.free(held, held_per_token * tokens)
                return False
        return True

    def _free_kv(self, tokens: int) -> None:
        pool = self._pool
        for uuid, per_token in self._kv_shares:
            pool.free(uuid, per_token * tokens)

    def drop(self, seq_ids: Sequence[str]) -> None:
        """Forget sequences and free their KV; unknown ids are ignored."""
        self._sync()
        self._drop(seq_ids)

    def _drop(self, seq_ids: Sequence[str]) -> None:
        for sid in seq_ids:
            q = self._records.pop(sid, None)
            if q is None:
                continue
            if q.state is SeqState.RUNNING:
                self._batch.stop(q, SeqState.RUNNING)
            self._waiting.pop(sid, None)
            self._prefilling = [r for r in self._prefilling if r is not q]
            self._free_kv(q.kv0)
        self._mutated()

    def export_kv(self, seq_ids: Sequence[str], now_s: float) -> tuple[KvExport, ...]:
        """Pause running sequences and describe their KV; others are skipped."""
        self._sync()
        out = []
        for sid in seq_ids:
            q = self._records.get(sid)
            if q is None or q.state is not SeqState.RUNNING:
                continue
            self._batch.stop(q, SeqState.PAUSED)
            spec = replace(q.spec, generated_tokens=q.gen0)
            out.append(KvExport(spec, q.kv0 * self._kv_total_per_token))
        self._mutated()
        return tuple(out)

    def import_kv(self, exports: Sequence[KvExport], now_s: float, transfer_s: float) -> OpResult:
        """Allocate the KV here and mark it complete ``transfer_s`` from now."""
        gpus = self.timing.gpu_uuids
        if self._dead is not None or any(self._pool.transfer_fails(u) for u in gpus):
            return OpResult(False, fault=EngineFault.TRANSFER_FAILED, detail="destination down")
        self._sync()
        taken: list[str] = []
        for export in exports:
            tokens = export.spec.context_tokens
            if not self._alloc_kv(tokens):
                self._drop(taken)
                return OpResult(False, fault=EngineFault.OUT_OF_MEMORY, detail=export.spec.seq_id)
            self._order += 1
            generated = export.spec.generated_tokens
            q = SeqRecord(export.spec, SeqState.IMPORTING, self._order, generated, tokens)
            q.ready_at_s = now_s + transfer_s
            self._records[export.spec.seq_id] = q
            taken.append(export.spec.seq_id)
        self.stats.kv_imported_bytes += sum(e.num_bytes for e in exports)
        self._mutated()
        return OpResult(True, now_s + transfer_s)

    def staged_ready(self, seq_ids: Sequence[str], now_s: float) -> bool:
        """Every sequence staged, or imported with its transfer complete."""
        for sid in seq_ids:
            q = self._records.get(sid)
            if q is None or not (
                q.state is SeqState.STAGED
                or (q.state is SeqState.IMPORTING and now_s >= q.ready_at_s)
            ):
                return False
        return self._dead is None

    def activate(self, seq_ids: Sequence[str]) -> None:
        """Staged or imported sequences start decoding."""
        self._sync()
        for sid in seq_ids:
            q = self._records.get(sid)
            if q is not None and q.state in (SeqState.STAGED, SeqState.IMPORTING):
                self._start(q)
        self._mutated()

    def resume(self, seq_ids: Sequence[str]) -> None:
        """Exported (paused) sequences continue decoding here."""
        self._sync()
        for sid in seq_ids:
            q = self._records.get(sid)
            if q is not None and q.state is SeqState.PAUSED:
                self._start(q)
        self._mutated()

    def close_admission(self) -> None:
        """Stop admitting (drain)."""
        self._admitting = False

    def is_drained(self) -> bool:
        """No sequence left."""
        return not self._records

    def kv_bytes(self) -> int:
        """KV bytes held across the replica."""
        self._sync()
        tokens = sum(self._batch.kv_tokens(q) for q in self._records.values())
        return tokens * self._kv_total_per_token

    # ---- iterations ----------------------------------------------------------------------------

    def step(self, now_s: float) -> StepOutput:
        """Run every iteration that completes by ``now_s``."""
        failed = self._check_gpus()
        if self._dead is not None or self._comm_ready_at is None:
            acc, self._pending = self._pending, StepAcc()
            acc.failed.extend(failed)
            return acc.output()
        if not self._dirty and now_s < self._next_event_s and self._clock_s is not None:
            self._last_now_s = now_s
            return EMPTY_STEP
        if self._clock_s is None:
            self._clock_s = now_s
        self._clock_s = max(self._clock_s, self._comm_ready_at)
        acc, self._pending = self._pending, StepAcc()
        self._advance(now_s, acc, partial=False)
        self._last_now_s = now_s
        self._dirty = False
        self._next_event_s = self._earliest_event_s()
        return acc.output()

    def _advance(self, now_s: float, acc: StepAcc, *, partial: bool) -> None:
        """Run iterations from the engine clock up to ``now_s`` (see the module docstring).

        Without ``partial``, decode iterations after the last event due by ``now_s`` are left
        for later (nothing observable happens in them); with it, the clock is brought as close
        to ``now_s`` as whole iterations allow, as a token-by-token engine's would be.
        """
        assert self._clock_s is not None
        clock = self._clock_s
        while True:
            if self._split:
                self._prefill_stage(clock, acc)
            else:
                picked = self._due_prefills(clock, acc)
                if picked or self._under_way_end_s > clock:
                    end = self._mixed_iteration(picked, clock, now_s, acc)
                    if end is None:
                        break
                    clock = end
                    continue
            if not self._batch:
                arrival = self._wake(clock)
                if arrival is not None and arrival <= now_s:
                    clock = arrival  # idle until this sequence was admitted
                    continue
                clock = max(clock, now_s)  # idle: the engine waits at the present
                break
            if not partial and self._finish_bound(clock) > now_s:
                arrival = self._wake(clock)
                if arrival is None or arrival > now_s:
                    break  # nothing observable before now_s: leave these iterations for later
            end = self._decode_run(clock, now_s, acc, partial)
            if end is None:
                break
            clock = end
        self._clock_s = clock

    def _earliest_event_s(self) -> float:
        """A lower bound on the time of the next first token, finish or prefill."""
        assert self._clock_s is not None
        if self._waiting:
            return self._clock_s  # a prefill may start as soon as one is due: do not skip
        if not self._batch:
            return _INF
        return self._finish_bound(self._clock_s)

    def _finish_bound(self, clock_s: float) -> float:
        """A lower bound on when the next running sequence finishes, decoding from ``clock_s``:
        the step time at the current context bucket (it only grows with the context)."""
        batch = self._batch
        step_s = self._step_s(len(batch), batch.mean_context())
        return clock_s + batch.steps_to_finish() * step_s - 1e-9

    def _step_s(self, batch: int, context: float) -> float:
        return self._steps.step_s(batch, context_bucket(context))

    def _prefill_stage(self, clock_s: float, acc: StepAcc) -> None:
        """A split replica's prefill stage at a step boundary: finish its batch if done by
        ``clock_s``, then start the next."""
        if self._prefilling and self._inflight_done_s <= clock_s:
            batch, self._prefilling = self._prefilling, []
            for q in batch:
                self._complete_prefill(q, self._inflight_done_s, acc)
        # NOTE: the stage is free once its pass ends, even if every prompt in it was dropped
        if not self._prefilling and self._inflight_done_s <= clock_s:
            picked = self._due_prefills(clock_s, acc)
            if picked:
                t = self._clock_timing
                self._prefilling = picked
                self._inflight_done_s = clock_s + sum(
                    t.prefill_s(q.spec.prompt_tokens + q.gen0) for q in picked
                )

    def _wake(self, clock_s: float) -> float | None:
        """The next admission, or the split prefill stage's batch end: decode runs stop there."""
        if self._prefilling or self._inflight_done_s > clock_s:
            return self._inflight_done_s
        return self._next_arrival(clock_s)

    def _next_arrival(self, clock_s: float) -> float | None:
        if not self._waiting:  # (the usual case: asked before every run of decode iterations)
            return None
        inflight = {id(r) for r in self._prefilling}
        later = [
            q.ready_at_s
            for q in self._waiting.values()
            if q.ready_at_s > clock_s and id(q) not in inflight
        ]
        return min(later) if later else None

    def _due_prefills(self, clock_s: float, acc: StepAcc) -> list[SeqRecord]:
        """The waiting sequences the iteration at ``clock_s`` prefills, FCFS within the token
        budget; those whose first token it could not give by their deadline are dropped
        (``acc.expired``)."""
        if not self._waiting:  # (the usual case: asked at every step boundary)
            return []
        picked: list[SeqRecord] = []
        expired: list[str] = []
        chunking, budget = self._chunk_tokens > 0, self._prefill_budget
        inflight = {id(r) for r in self._prefilling}
        start_s = clock_s  # the iteration's prefills picked so far come before the next one's
        for q in self._waiting.values():
            # NOTE: a sequence joins the first iteration that starts after its admission.
            if q.ready_at_s <= clock_s and id(q) not in inflight:
                due_s = q.spec.first_token_due_s
                if not (q.prefilled or q.gen0) and too_late_to_prefill(
                    start_s, due_s, self.timing, q.spec.prompt_tokens
                ):
                    expired.append(q.spec.seq_id)
                    continue
                tokens = q.spec.prompt_tokens + q.gen0 - q.prefilled
                if chunking:
                    if budget <= 0:
                        break
                    tokens = min(tokens, budget)  # the rest in the next iterations
                elif picked and tokens > budget:
                    break
                if not self._hold_admission(q):
                    break  # the head of the line waits for its pages, as vLLM's FCFS does
                q.chunk = tokens
                picked.append(q)
                budget -= tokens
                start_s += self.timing.prefill_s(tokens)
        if expired:
            self._drop(expired)
            acc.expired.extend(expired)
        return picked

    def _hold_admission(self, q: SeqRecord) -> bool:
        """Pages a sequence takes when admitted or resumed (no pager: nothing to hold)."""
        if self._pager is None:
            return True
        spec = q.spec
        tokens = admission_tokens(
            self._kv_admission, spec.prompt_tokens, q.gen0, spec.max_output_tokens
        )
        return self._pager.hold(spec.seq_id, tokens)

    def _grow_batch(self, runs: int, acc: StepAcc) -> tuple[int, bool]:
        """Pages for ``runs`` more tokens of every running sequence, oldest first.

        Returns the iterations every sequence holds pages for (``runs``, or fewer: halved until
        they are there; 0 once every sequence was preempted) and whether any was preempted.
        """
        pager, batch = self._pager, self._batch
        if pager is None:
            return runs, False
        rooms = self._rooms
        preempted = False
        while batch:
            fits = runs
            if rooms is None:
                for q in sorted(batch.seqs.values(), key=order_of):
                    while fits and not pager.hold(q.spec.seq_id, paged(batch.kv_tokens(q) + fits)):
                        fits //= 2
                    if not fits:
                        break
            else:
                # NOTE: the same holds, in the same order, as asking for every sequence: a hold
                # the pager's cache would answer True (within its page_room) changes nothing and
                # is skipped; only sequences whose pages end within the run are asked.
                rooms.refresh()
                v = batch.v
                short = rooms.short(v + runs)
                for q in short:
                    asked = False
                    while fits and v + fits > q.page_room:
                        held = pager.hold(q.spec.seq_id, paged(batch.kv_tokens(q) + fits))
                        rooms.read(q)  # (back in the heap at what it now holds)
                        asked = True
                        if held:
                            break
                        fits //= 2
                    if not asked:
                        rooms.keep(q)  # covered for the shorter run, or not asked once none fit
            if fits:
                return fits, preempted
            self._preempt(batch.youngest(), acc)
            preempted = True
        return 0, preempted

    def _preempt(self, q: SeqRecord, acc: StepAcc) -> None:
        """Recompute preemption: free the sequence's KV, keep its tokens, queue it first."""
        assert self._pager is not None
        sid = q.spec.seq_id
        self._batch.stop(q, SeqState.WAITING)
        self._free_kv(q.kv0)
        q.kv0 = q.prefilled = 0
        self._pager.release(sid)
        self._waiting = {sid: q, **self._waiting}
        acc.preempted.append(sid)
        self.stats.preemptions += 1

    def _mixed_iteration(
        self, picked: list[SeqRecord], clock: float, now_s: float, acc: StepAcc
    ) -> float | None:
        """One iteration with prefills (exact); None if it ends after ``now_s``.

        An iteration already under way lasts until its end (``_under_way_end_s``): a GPU
        does not get back the time of a prompt dropped after its forward pass began.
        """
        duration = sum(self._chunk_s(q) for q in picked)
        if self._batch:
            self._grow_batch(1, acc)
        n = len(self._batch)
        if n:
            # NOTE: one forward pass carries the prompts and the batch's decode tokens (fused).
            step_s = self._step_s(n, self._batch.mean_context())
            if picked:
                prompts_s = duration + self._clock_timing.prefill_s(n)
                duration = fused_iteration_s(prompts_s, step_s, self.timing.config)
            else:  # every prompt of the pass under way was dropped: its decode step is left
                duration = step_s
        # NOTE: the clock moves only when an iteration ends, so an end past it is this one's
        duration = max(duration, self._under_way_end_s - clock)
        if clock + duration > now_s:
            if clock < now_s:
                self._under_way_end_s = clock + duration
            return None
        self._under_way_end_s = -_INF
        end = clock + duration
        if n:
            self._commit_decode([Segment(1, duration, self._batch.mean_context())], clock, acc)
        else:
            self._count_busy(duration, 1, acc)
        for q in picked:
            if q.prefilled + q.chunk < q.spec.prompt_tokens + q.gen0:
                self._prefill_chunk(q, acc)  # (no OOM wait: it fails, as a whole prompt would)
            else:
                self._complete_prefill(q, end, acc)
        return end

    def _chunk_s(self, q: SeqRecord) -> float:
        """The true time of ``q``'s chunk: its share of the whole prompt's prefill."""
        total = q.spec.prompt_tokens + q.gen0
        whole = self._clock_timing.prefill_s(total)
        return whole if q.chunk >= total else whole * q.chunk / total

    def _decode_run(self, clock: float, now_s: float, acc: StepAcc, partial: bool) -> float | None:
        """Advance decode-only iterations up to the next finish, admission or ``now_s``.

        Returns the clock after them, or None when nothing was run: not one iteration fits
        before ``now_s``, or (without ``partial``) the run would end at ``now_s`` with no event.
        """
        arrival = self._wake(clock)
        segments, end, timed_out = decode_segments(self._batch, self._steps, clock, now_s, arrival)
        if not segments or (timed_out and not partial):
            return None
        runs = sum(seg.runs for seg in segments)
        fits, preempted = self._grow_batch(runs, acc)
        if preempted:
            return clock  # the batch changed: plan again (a resumed prefill may come first)
        if fits < runs:
            segments, end = _first_runs(segments, fits, clock)
        self._commit_decode(segments, clock, acc)
        return end

    def _count_busy(self, duration_s: float, iterations: int, acc: StepAcc) -> None:
        self.stats.busy_s += duration_s
        self.stats.iterations += iterations
        acc.iterations += iterations

    def _commit_decode(self, segments: list[Segment], start_s: float, acc: StepAcc) -> None:
        """Account the planned decode iterations: time, FLOPs, TBT, KV and finishes."""
        n = len(self._batch)
        clock, done = start_s, 0
        for seg in segments:
            clock += seg.runs * seg.step_s
            done += seg.runs
            per_token = self._flops_per_token + 2.0 * self._attention_flops * (
                seg.context + (seg.runs - 1) / 2
            )
            self.stats.model_flops += seg.runs * n * per_token
            acc.decode_step_s.append(seg.step_s)
            acc.decode_step_runs.append(seg.runs)
            if self._observer is not None:
                self._observer.on_decode(clock, seg.step_s, seg.runs * n)
        self._count_busy(clock - start_s, done, acc)
        self._decode(done, clock, acc)

    def _decode(self, runs: int, end_s: float, acc: StepAcc) -> None:
        """KV for ``runs`` iterations of the whole batch, and the sequences that finish."""
        batch = self._batch
        tokens = runs * len(batch)
        while not self._alloc_kv(tokens):  # NOTE: the VMM commit makes this rare
            # The run's KV is allocated at once; when it does not fit, the largest sequence
            # fails first until it does (a token-by-token engine fails whichever's next token
            # does not fit).
            victim = batch.largest()
            generated = batch.generated(victim)
            acc.failed.append(Failed(victim.spec.seq_id, EngineFault.OUT_OF_MEMORY, generated))
            self._drop([victim.spec.seq_id])
            tokens = runs * len(batch)
            if not batch:
                return
        acc.decode_tokens += tokens
        self.stats.decode_tokens += tokens
        for q in batch.advance(runs):
            acc.finished.append(Finished(q.spec.seq_id, end_s, batch.generated(q)))
            self._drop([q.spec.seq_id])

    def _prefill_chunk(self, q: SeqRecord, acc: StepAcc) -> bool:
        """Account ``q``'s chunk: its KV, tokens and FLOPs; False (it failed) when its KV does
        not fit."""
        done, n = q.prefilled, q.chunk
        if not self._alloc_kv(n):
            acc.failed.append(Failed(q.spec.seq_id, EngineFault.OUT_OF_MEMORY, q.gen0))
            self._drop([q.spec.seq_id])
            return False
        q.kv0 += n
        q.prefilled = done + n
        acc.prefill_tokens += n
        self.stats.prefill_tokens += n
        attention = self._attention_flops * ((done + n) ** 2 - done**2)
        self.stats.model_flops += n * self._flops_per_token + attention
        return True

    def _complete_prefill(self, q: SeqRecord, end_s: float, acc: StepAcc) -> None:
        sid = q.spec.seq_id
        if not self._prefill_chunk(q, acc):
            return
        del self._waiting[sid]
        q.prefilled = 0
        if q.stage_after_prefill:
            q.state = SeqState.STAGED
            return
        if q.gen0 == 0:  # the prefill's logits give the first output token
            q.gen0 = 1
            acc.first_tokens.append(FirstToken(sid, end_s))
            if q.gen0 >= q.spec.stop_tokens:  # the simulated model's EOS
                acc.finished.append(Finished(sid, end_s, q.gen0))
                self._drop([sid])
                return
        self._start(q)

    def _start(self, q: SeqRecord) -> None:
        """``q`` joins the decode batch."""
        self._batch.start(q)
        if self._rooms is not None:
            self._rooms.read(q)


def _first_runs(segments: list[Segment], runs: int, start_s: float) -> tuple[list[Segment], float]:
    """The first ``runs`` iterations of a planned run, and the clock after them."""
    out: list[Segment] = []
    end = start_s
    for seg in segments:
        take = min(seg.runs, runs)
        if take <= 0:
            break
        out.append(Segment(take, seg.step_s, seg.context))
        end += take * seg.step_s
        runs -= take
    return out, end
