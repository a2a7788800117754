"""TokenSimEngine: the token-by-token oracle of :class:`runtime.engine.sim.SimEngine`.

The product's engine advances runs of identical decode iterations at once; this one does the
same arithmetic one iteration at a time (it was the product's SimEngine before the two became
one), so tests can check the event-stepped ledger against it on traces.

It serves requests without a GPU: each iteration prefills waiting prompts (up to a token budget)
and advances every running sequence by one token, taking the time :class:`runtime.timing.
ReplicaTiming` computes for that batch on the replica's hardware. A prefill/decode-split
replica runs its two stages on different GPUs, concurrently: its prefill stage takes a batch of
waiting prompts whenever it is idle (at a decode-step boundary), and each prompt joins the decode
batch at the first step boundary after its prefill (KV hand-off included) completes — the first
token comes out at that completion; decode iterations never wait for prefills.

KV is allocated per token against each simulated GPU's memory (:class:`SimGpuPool`), so a
runtime that over-admits sees out-of-memory events exactly where a real engine would. Faults
injected into the pool (lost GPUs, failing loads or transfers) surface as :class:`EngineFault`
values. Time is an input: ``step(now_s)`` runs the iterations that complete by ``now_s`` and
nothing else.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gearbox.cost import fused_iteration_s
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
from runtime.engine.simgpu import SimGpuPool
from runtime.timing import ReplicaTiming

_GB = 1e9
MAX_ITERATIONS_PER_STEP = 100_000  # a bound on work per call if the clock jumps far ahead


@dataclass
class _Seq:
    spec: SeqSpec
    state: SeqState
    generated: int
    kv_tokens: int = 0  # tokens whose KV is allocated
    stage_after_prefill: bool = False  # a replay: hold after prefill until activated
    ready_at_s: float = 0.0  # KV import completion; for waiting sequences, their admission
    prefilled: int = 0  # prompt tokens prefilled by earlier chunks
    chunk: int = 0  # prompt tokens the iteration being planned prefills


class TokenSimEngine:
    """Simulated engine of one replica, one iteration at a time (see the module docstring)."""

    def __init__(
        self,
        timing: ReplicaTiming,
        pool: SimGpuPool,
        *,
        max_batch: int | None = None,
        max_prefill_tokens: int = 8192,
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
        self._seqs: dict[str, _Seq] = {}
        self._clock_s: float | None = None
        self._kv_per_token = timing.kv_bytes_per_token_per_gpu
        self._kv_total_per_token = timing.model.kv_bytes_per_token
        self._split = timing.plan.is_disaggregated  # prefill and decode stages run concurrently
        self._chunk_tokens = 0 if self._split else timing.prefill_chunk_tokens
        self._prefill_budget = min(max_prefill_tokens, self._chunk_tokens or max_prefill_tokens)
        self._inflight: list[str] = []  # the split prefill stage's current batch
        self._under_way_end_s = -math.inf  # of an iteration with prefills under way (or none)
        self._inflight_done_s = 0.0

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
        if self._dead is not None or not any(self._pool.is_lost(u) for u in self.timing.gpu_uuids):
            return []
        self._dead = EngineFault.GPU_LOST
        failed = [Failed(s, EngineFault.GPU_LOST, q.generated) for s, q in self._seqs.items()]
        self.drop(list(self._seqs))
        for index in list(self._shard_ready_at):
            self.unload_shard(index)
        return failed

    # ---- sequences -----------------------------------------------------------------------------

    def has_capacity(self) -> bool:
        """Room in the batch and admission open."""
        return self._dead is None and self._admitting and len(self._seqs) < self._max_batch

    def admit(self, seq: SeqSpec, now_s: float, *, staged: bool = False) -> EngineFault | None:
        """Queue ``seq`` for prefill; ``staged`` replays wait for ``activate`` afterwards."""
        if self._dead is not None:
            return self._dead
        if not self._admitting and not staged:
            return EngineFault.DRAINING
        if len(self._seqs) >= self._max_batch:
            return EngineFault.BATCH_FULL
        self._seqs[seq.seq_id] = _Seq(seq, SeqState.WAITING, seq.generated_tokens, 0, staged, now_s)
        return None

    def progress(self) -> tuple[SeqProgress, ...]:
        """Every held sequence."""
        return tuple(
            SeqProgress(
                sid,
                q.state,
                q.spec.prompt_tokens + q.generated,
                q.generated,
                q.spec.max_output_tokens,
            )
            for sid, q in self._seqs.items()
        )

    def _alloc_kv(self, tokens: int) -> bool:
        done: list[str] = []
        for uuid, per_token in self._kv_per_token.items():
            if per_token and not self._pool.allocate(uuid, per_token * tokens):
                for held in done:
                    self._pool.free(held, self._kv_per_token[held] * tokens)
                return False
            done.append(uuid)
        return True

    def _free_kv(self, tokens: int) -> None:
        for uuid, per_token in self._kv_per_token.items():
            if per_token:
                self._pool.free(uuid, per_token * tokens)

    def drop(self, seq_ids: Sequence[str]) -> None:
        """Forget sequences and free their KV; unknown ids are ignored."""
        for sid in seq_ids:
            q = self._seqs.pop(sid, None)
            if q is not None:
                self._free_kv(q.kv_tokens)
                if sid in self._inflight:
                    self._inflight.remove(sid)

    def export_kv(self, seq_ids: Sequence[str], now_s: float) -> tuple[KvExport, ...]:
        """Pause running sequences and describe their KV; others are skipped."""
        out = []
        for sid in seq_ids:
            q = self._seqs.get(sid)
            if q is None or q.state is not SeqState.RUNNING:
                continue
            q.state = SeqState.PAUSED
            spec = SeqSpec(sid, q.spec.prompt_tokens, q.spec.max_output_tokens, q.generated)
            out.append(KvExport(spec, q.kv_tokens * self._kv_total_per_token))
        return tuple(out)

    def import_kv(self, exports: Sequence[KvExport], now_s: float, transfer_s: float) -> OpResult:
        """Allocate the KV here and mark it complete ``transfer_s`` from now."""
        if self._dead is not None or any(
            self._pool.transfer_fails(u) for u in self.timing.gpu_uuids
        ):
            return OpResult(False, fault=EngineFault.TRANSFER_FAILED, detail="destination down")
        taken: list[str] = []
        for export in exports:
            tokens = export.spec.context_tokens
            if not self._alloc_kv(tokens):
                self.drop(taken)
                return OpResult(False, fault=EngineFault.OUT_OF_MEMORY, detail=export.spec.seq_id)
            q = _Seq(export.spec, SeqState.IMPORTING, export.spec.generated_tokens, tokens)
            q.ready_at_s = now_s + transfer_s
            self._seqs[export.spec.seq_id] = q
            taken.append(export.spec.seq_id)
        return OpResult(True, now_s + transfer_s)

    def staged_ready(self, seq_ids: Sequence[str], now_s: float) -> bool:
        """Every sequence staged, or imported with its transfer complete."""
        for sid in seq_ids:
            q = self._seqs.get(sid)
            if q is None or not (
                q.state is SeqState.STAGED
                or (q.state is SeqState.IMPORTING and now_s >= q.ready_at_s)
            ):
                return False
        return self._dead is None

    def activate(self, seq_ids: Sequence[str]) -> None:
        """Staged or imported sequences start decoding."""
        for sid in seq_ids:
            q = self._seqs.get(sid)
            if q is not None and q.state in (SeqState.STAGED, SeqState.IMPORTING):
                q.state = SeqState.RUNNING

    def resume(self, seq_ids: Sequence[str]) -> None:
        """Exported (paused) sequences continue decoding here."""
        for sid in seq_ids:
            q = self._seqs.get(sid)
            if q is not None and q.state is SeqState.PAUSED:
                q.state = SeqState.RUNNING

    def close_admission(self) -> None:
        """Stop admitting (drain)."""
        self._admitting = False

    def is_drained(self) -> bool:
        """No sequence left."""
        return not self._seqs

    def kv_bytes(self) -> int:
        """KV bytes held across the replica."""
        return sum(q.kv_tokens for q in self._seqs.values()) * self._kv_total_per_token

    # ---- iterations ----------------------------------------------------------------------------

    def step(self, now_s: float) -> StepOutput:
        """Run every iteration that completes by ``now_s``."""
        failed = self._check_gpus()
        if self._dead is not None or self._comm_ready_at is None:
            return StepOutput(failed=tuple(failed))
        clock = max(self._clock_s or now_s, self._comm_ready_at)
        acc = _Acc(failed=failed)
        for _ in range(MAX_ITERATIONS_PER_STEP):
            if self._split:
                self._prefill_stage(clock, acc)
                prefill = []
            else:
                prefill = self._pick_prefill(clock)
            decode = [sid for sid, q in self._seqs.items() if q.state is SeqState.RUNNING]
            # an iteration with prefills that was under way lasts as long, whatever was dropped
            under_way = self._under_way_end_s > clock
            if not prefill and not decode and not under_way:
                arrival = self._wake_s(clock)
                if arrival is not None and arrival <= now_s:
                    clock = arrival  # idle until this sequence was admitted
                    continue
                clock = max(clock, now_s)  # idle: the engine waits at the present
                break
            duration = self._iteration_s(prefill, decode)
            duration = max(duration, self._under_way_end_s - clock)
            if clock + duration > now_s:
                if clock < now_s and (prefill or under_way):
                    self._under_way_end_s = clock + duration
                break
            self._under_way_end_s = -math.inf
            clock += duration
            self._run_iteration(prefill, decode, clock, duration, acc)
        self._clock_s = clock
        return acc.output()

    def _prefill_stage(self, clock_s: float, acc: _Acc) -> None:
        """A split replica's prefill stage at a step boundary: finish its batch if done by
        ``clock_s`` (first tokens at the batch's end), then start the next if prompts are due."""
        if self._inflight and self._inflight_done_s <= clock_s:
            batch, self._inflight = self._inflight, []
            for sid in batch:
                self._finish_prefill(sid, self._inflight_done_s, acc)
        if not self._inflight and self._inflight_done_s <= clock_s:  # (busy even if dropped)
            picked = self._pick_prefill(clock_s)
            if picked:
                t = self.timing
                self._inflight = picked
                self._inflight_done_s = clock_s + sum(
                    t.prefill_s(self._seqs[s].spec.prompt_tokens + self._seqs[s].generated)
                    for s in picked
                )

    def _wake_s(self, clock_s: float) -> float | None:
        """When an idle engine has work next: an admission, or the prefill stage's batch."""
        if self._inflight or self._inflight_done_s > clock_s:
            return self._inflight_done_s
        return self._next_arrival(clock_s)

    def _next_arrival(self, clock_s: float) -> float | None:
        waiting = [
            q.ready_at_s
            for sid, q in self._seqs.items()
            if q.state is SeqState.WAITING and sid not in self._inflight
        ]
        later = [t for t in waiting if t > clock_s]
        return min(later) if later else None

    def _pick_prefill(self, clock_s: float) -> list[str]:
        picked: list[str] = []
        chunking, budget = self._chunk_tokens > 0, self._prefill_budget
        for sid, q in self._seqs.items():
            # NOTE: a sequence joins the first iteration that starts after its admission.
            due = q.state is SeqState.WAITING and q.ready_at_s <= clock_s
            if due and sid not in self._inflight:
                tokens = q.spec.prompt_tokens + q.generated - q.prefilled
                if chunking:
                    if budget <= 0:
                        break
                    tokens = min(tokens, budget)
                elif picked and tokens > budget:
                    break
                q.chunk = tokens
                picked.append(sid)
                budget -= tokens
        return picked

    def _chunk_s(self, q: _Seq) -> float:
        total = q.spec.prompt_tokens + q.generated
        whole = self.timing.prefill_s(total)
        return whole if q.chunk >= total else whole * q.chunk / total

    def _iteration_s(self, prefill: list[str], decode: list[str]) -> float:
        t = self.timing
        prefill_s = sum(self._chunk_s(self._seqs[s]) for s in prefill)
        if not decode:
            return prefill_s
        mean_context = sum(self._seqs[s].kv_tokens for s in decode) / len(decode)
        if not prefill:
            return t.decode_cycle_s(len(decode), mean_context)
        prefill_s += t.prefill_s(len(decode))  # the decode tokens' compute, in the same pass
        return fused_iteration_s(prefill_s, t.decode_cycle_s(len(decode), mean_context), t.config)

    def _run_iteration(
        self, prefill: list[str], decode: list[str], end_s: float, duration_s: float, acc: _Acc
    ) -> None:
        for sid in decode:
            q = self._seqs[sid]
            if not self._alloc_kv(1):
                acc.failed.append(Failed(sid, EngineFault.OUT_OF_MEMORY, q.generated))
                self.drop([sid])
                continue
            q.kv_tokens += 1
            q.generated += 1
            acc.decode_tokens += 1
            if q.generated >= q.spec.max_output_tokens:
                acc.finished.append(Finished(sid, end_s, q.generated))
                self.drop([sid])
        if decode:
            acc.decode_step_s.append(duration_s)
        for sid in prefill:
            self._finish_prefill(sid, end_s, acc)
        acc.iterations += 1

    def _finish_prefill(self, sid: str, end_s: float, acc: _Acc) -> None:
        q = self._seqs[sid]
        tokens = q.chunk or q.spec.prompt_tokens + q.generated
        if not self._alloc_kv(tokens):
            acc.failed.append(Failed(sid, EngineFault.OUT_OF_MEMORY, q.generated))
            self.drop([sid])
            return
        q.kv_tokens += tokens
        q.prefilled += tokens
        acc.prefill_tokens += tokens
        if q.prefilled < q.spec.prompt_tokens + q.generated:
            return  # more chunks to come
        q.prefilled = 0
        if q.stage_after_prefill:
            q.state = SeqState.STAGED
            return
        q.state = SeqState.RUNNING
        if q.generated == 0:  # the prefill's logits give the first output token
            q.generated = 1
            acc.first_tokens.append(FirstToken(sid, end_s))
            if q.generated >= q.spec.max_output_tokens:
                acc.finished.append(Finished(sid, end_s, q.generated))
                self.drop([sid])


@dataclass
class _Acc:
    failed: list[Failed]
    iterations: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0

    def __post_init__(self) -> None:
        self.first_tokens: list[FirstToken] = []
        self.finished: list[Finished] = []
        self.decode_step_s: list[float] = []

    def output(self) -> StepOutput:
        """The accumulated step output."""
        return StepOutput(
            self.iterations,
            self.prefill_tokens,
            self.decode_tokens,
            tuple(self.first_tokens),
            tuple(self.finished),
            tuple(self.failed),
            tuple(self.decode_step_s),
        )
