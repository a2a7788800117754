"""TorchEngine: the :class:`runtime.engine.base.Engine` protocol over real rank processes.

The driver (this object, in the runtime's process) owns scheduling and block tables; each GPU
of the plan is one rank process (:mod:`runtime.engine.torch.rank`) holding its weight shard and
KV pool. One ``step`` is one real iteration (continuous batching): waiting prompts are prefilled
and running sequences decode one token, packed into one forward per pipeline (cut into
micro-batches that overlap across the stages of a pipeline); with a PD split the
prefill and decode pipelines run concurrently and finished prompts' KV is handed to the decode
pipeline, re-partitioned for its layout. ``export_kv``/``import_kv`` move KV between two engines
the same way (gear-shift migration); ``admit(staged=True)`` replays from the ledger's tokens.

Time: ``now_s`` only stamps events; ``step`` runs exactly one iteration and blocks for it, and
``load_shard``/``build_comm_groups`` block until ranks report (ready at ``now_s``). Greedy decoding.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gearbox.plans import ExecutionPlan
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
from runtime.engine.torch import procs
from runtime.engine.torch.config import F32_BYTES, LlamaConfig
from runtime.engine.torch.kvmove import copy_kv, map_pages, place_blocks
from runtime.engine.torch.kvpool import BlockAllocator
from runtime.engine.torch.layout import Pipeline, RankSpec, kv_holders, plan_ranks, repartition
from runtime.engine.torch.microbatch import micro_batches, pipelined_s
from runtime.engine.torch.model import SeqChunk
from runtime.engine.torch.rank import RankBoot
from runtime.engine.torch.tokens import TokenLedger
from runtime.engine.torch.weights import shard_bytes
from runtime.vmm.manager import WEIGHTS_REQUEST, ReservationManager

_GIB = 1024**3


@dataclass(frozen=True, slots=True)
class TorchEngineConfig:
    """Knobs of one torch engine."""

    num_blocks: int = 256  # KV blocks per rank pool
    block_size: int = 16  # tokens per block (equal across engines that exchange KV)
    max_batch: int = 32  # sequences held at once
    max_prefill_tokens: int = 2048  # prompt tokens per iteration
    # micro-batches per pass of a pipeline of several stages (0: one per stage, as gearbox's
    # cost model assumes; 1: one packed batch passes the stages in turn)
    pp_microbatches: int = 0
    # fewest tokens a micro-batch carries: each costs the stages a message and a hop, which a
    # small decode pass does not win back (bench.engine: PP2 decoding 8 sequences took 20 ms
    # packed, 24 ms in two micro-batches; a prefill of 8×64 tokens 180 → 139 ms device time)
    pp_microbatch_min_tokens: int = 64
    device: str = "cpu"  # "cpu", "cuda:<n>" (all ranks share GPU n) or "cuda" (rank r on GPU r)
    backend: str = "gloo"  # torch.distributed backend ("nccl" on GPUs)
    capacity_bytes_per_gpu: int = 64 * _GIB  # VMM ledger capacity when the engine reserves


@dataclass(frozen=True, slots=True)
class TorchKvExport(KvExport):
    """A paused sequence's KV, readable from the source engine's pools until it drops it."""

    source: TorchEngine | None = None
    blocks: tuple[int, ...] = ()
    kv_tokens: int = 0


@dataclass
class _Seq:
    spec: SeqSpec
    state: SeqState
    prompt: list[int]
    out: list[int]
    hold: bool = False  # a replay: stage after prefill
    blocks: list[int] = field(default_factory=list)  # in the KV pipeline's allocator
    kv_tokens: int = 0
    prefill_blocks: list[int] = field(default_factory=list)  # PD split: until the hand-off

    def prefill_tokens(self) -> list[int]:
        return self.prompt + self.out[:-1] if self.out else list(self.prompt)


@dataclass
class _Acc:
    prefill_tokens: int = 0
    decode_tokens: int = 0
    first: list[FirstToken] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)
    failed: list[Failed] = field(default_factory=list)


class TorchEngine:
    """A real replica of a Llama-style model (see the module docstring)."""

    def __init__(
        self,
        plan: ExecutionPlan,
        cfg: LlamaConfig,
        source: str,
        ledger: TokenLedger,
        vmm: ReservationManager | None = None,
        settings: TorchEngineConfig | None = None,
        replica_id: str | None = None,
    ) -> None:
        self.replica_id = replica_id or plan.plan_id
        self.plan = plan
        self.cfg = cfg
        self.source = source
        self.ledger = ledger
        self.settings = settings or TorchEngineConfig()
        self.vmm = vmm or ReservationManager()
        self.ranks = plan_ranks(plan, cfg)
        self._kv_pipe = Pipeline.DECODE if plan.is_disaggregated else Pipeline.UNIFIED
        self._workdir = Path(tempfile.mkdtemp(prefix="flexpipe-torch-"))
        self._procs: dict[int, procs.RankProc] = {}
        self._loaded: set[int] = set()
        self._connected = False
        self._dead: EngineFault | None = None
        self._admitting = True
        self._seqs: dict[str, _Seq] = {}
        self._alloc = self._allocator(self._kv_pipe)
        self._prefill_alloc = self._allocator(Pipeline.PREFILL) if plan.is_disaggregated else None
        self.last_iteration_s = 0.0  # wall time of the last step's forward(s)
        # the same step's device time: per pipeline, the stages' busiest rank's CPU time per
        # micro-batch, overlapped as the stages pipeline them (``microbatch.pipelined_s``);
        # concurrent pipelines, the longest
        self.last_device_s = 0.0
        self.last_micro_batches = 0  # micro-batches of the last step's longest pipeline pass
        self.last_handoff_bytes = 0
        self.replay_mismatches = 0  # replays whose re-prefill predicted another last token

    # ---- set-up --------------------------------------------------------------------------------

    def _allocator(self, pipeline: Pipeline) -> BlockAllocator:
        per_block = {
            r.gpu_uuid: r.num_layers
            * 2
            * self.settings.block_size
            * r.num_kv_heads
            * self.cfg.head_dim
            * F32_BYTES
            for r in kv_holders(self.ranks, pipeline)
        }
        s = self.settings
        return BlockAllocator(
            s.num_blocks, s.block_size, per_block, self.vmm, self.replica_id, pipeline.value
        )

    def _pool_bytes(self, spec: RankSpec) -> int:
        s = self.settings
        return (
            spec.num_layers
            * 2
            * s.num_blocks
            * s.block_size
            * spec.num_kv_heads
            * self.cfg.head_dim
            * F32_BYTES
        )

    def _reserve(self) -> bool:
        cap = self.settings.capacity_bytes_per_gpu
        sizes = {
            r.gpu_uuid: (shard_bytes(self.cfg, r) + self._pool_bytes(r), cap) for r in self.ranks
        }
        if not self.vmm.reserve_replica(self.replica_id, sizes):
            return False
        weights = {r.gpu_uuid: shard_bytes(self.cfg, r) for r in self.ranks}
        return self.vmm.commit(self.replica_id, WEIGHTS_REQUEST, weights)

    def load_shard(self, stage_index: int, now_s: float) -> OpResult:
        """Start the stage's rank processes; each loads its shard and allocates its pool."""
        if self._dead is not None:
            return OpResult(False, fault=self._dead, detail="engine is down")
        if stage_index in self._loaded:
            return OpResult(True, now_s)
        if not self._loaded and not self._reserve():
            return OpResult(False, fault=EngineFault.OUT_OF_MEMORY, detail="VMM reserve refused")
        stage = self.plan.stages[stage_index]
        specs = [r for r in self.ranks if r.gpu_uuid in stage.gpu_uuids]
        groups = tuple(dict.fromkeys(r.tp_group for r in self.ranks))
        s = self.settings
        boots = [
            RankBoot(
                spec,
                len(self.ranks),
                groups,
                self.cfg,
                self.source,
                s.num_blocks,
                s.block_size,
                str(self._workdir / "store"),
                # NOTE: "cuda" alone puts rank r on GPU r (NCCL needs one GPU per rank)
                f"cuda:{spec.rank}" if s.device == "cuda" else s.device,
                s.backend,
            )
            for spec in specs
        ]
        started = procs.spawn(boots)
        for rp in started:
            self._procs[rp.boot.spec.rank] = rp
        try:
            for rp in started:
                rp.pool = procs.receive(rp, procs.LOAD_TIMEOUT_S)[1]
                if rp.pool is not None:
                    map_pages(rp.pool)
        except procs.RankFailure as exc:
            procs.stop(started)
            for rp in started:
                self._procs.pop(rp.boot.spec.rank, None)
            return OpResult(False, fault=EngineFault.LOAD_FAILED, detail=str(exc))
        self._loaded.add(stage_index)
        return OpResult(True, now_s)

    def unload_shard(self, stage_index: int) -> None:
        """Stop the stage's ranks (the engine can no longer serve); idempotent."""
        if stage_index not in self._loaded:
            return
        self._loaded.discard(stage_index)
        uuids = self.plan.stages[stage_index].gpu_uuids
        procs.stop([self._procs.pop(r.rank) for r in self.ranks if r.gpu_uuid in uuids])
        self._connected = False
        if not self._loaded:
            self.vmm.unreserve_replica(self.replica_id)

    def build_comm_groups(self, now_s: float) -> OpResult:
        """Every rank joins the engine's process group and builds its TP group."""
        if len(self._loaded) != len(self.plan.stages):
            return OpResult(False, fault=EngineFault.NOT_READY, detail="shards not loaded")
        if not self._connected:
            ordered = [self._procs[r.rank] for r in self.ranks]
            try:
                procs.request_all(ordered, [("connect",)] * len(ordered), procs.LOAD_TIMEOUT_S)
            except procs.RankFailure as exc:
                return OpResult(False, fault=EngineFault.COMM_FAILED, detail=str(exc))
            self._connected = True
        return OpResult(True, now_s)

    def probe_allreduce(self, rows: int, num_calls: int) -> tuple[float, float]:
        """(device, wall) seconds of ``num_calls`` all-reduces of ``rows`` × hidden float32 run
        back to back on every TP group of the serving pipeline, no sequence touched: the
        collective's own cost, measured on the ranks and groups the steps use (device time as
        in ``last_device_s``: the busiest rank's CPU time). A TP 1 rank's all-reduce is a no-op.
        """
        targets = [self._procs[r.rank] for r in kv_holders(self.ranks, self._kv_pipe)]
        msgs = [("allreduce_probe", rows, num_calls)] * len(targets)
        replies = procs.request_all(targets, msgs, procs.STEP_TIMEOUT_S)
        return max(m[2] for m in replies), max(m[1] for m in replies)

    def is_ready(self, now_s: float) -> bool:
        """Loaded, connected and every rank alive."""
        return self._connected and self.health() is None

    def health(self) -> EngineFault | None:
        """``GPU_LOST`` once any rank process has died."""
        if self._dead is None and any(not rp.proc.is_alive() for rp in self._procs.values()):
            self._dead = EngineFault.GPU_LOST
        return self._dead

    def close(self) -> None:
        """Stop every rank and release the VMM reservation; idempotent."""
        procs.stop(self._procs.values())
        self._procs.clear()
        self._loaded.clear()
        self._connected = False
        self.vmm.unreserve_replica(self.replica_id)
        shutil.rmtree(self._workdir, ignore_errors=True)

    def pools(self, pipeline: Pipeline | None = None) -> dict[int, torch.Tensor]:
        """The KV pools of a pipeline's ranks (default: the KV-holding one), by global rank."""
        holders = kv_holders(self.ranks, pipeline or self._kv_pipe)
        out = {}
        for r in holders:
            pool = self._procs[r.rank].pool
            assert pool is not None
            out[r.rank] = pool
        return out

    def kv_specs(self, pipeline: Pipeline | None = None) -> dict[int, RankSpec]:
        """The ranks holding a pipeline's KV, by global rank."""
        return {r.rank: r for r in kv_holders(self.ranks, pipeline or self._kv_pipe)}

    # ---- sequences -----------------------------------------------------------------------------

    def has_capacity(self) -> bool:
        """Room in the batch, admission open, engine alive."""
        return self._dead is None and self._admitting and len(self._seqs) < self.settings.max_batch

    def admit(self, seq: SeqSpec, now_s: float, *, staged: bool = False) -> EngineFault | None:
        """Queue a prompt, or a replay: prompt + every output the ledger holds (at least
        ``generated_tokens``; a restarted runtime passes 0 and the durable ledger knows more)."""
        if self.health() is not None:
            return self._dead
        if not self._admitting and not staged:
            return EngineFault.DRAINING
        if len(self._seqs) >= self.settings.max_batch:
            return EngineFault.BATCH_FULL
        prompt = self.ledger.prompt(seq.seq_id, seq.prompt_tokens)
        out = self.ledger.resume(seq.seq_id, seq.generated_tokens)
        self._seqs[seq.seq_id] = _Seq(seq, SeqState.WAITING, prompt, out, hold=staged)
        return None

    def progress(self) -> tuple[SeqProgress, ...]:
        """Every held sequence."""
        return tuple(
            SeqProgress(
                sid, q.state, len(q.prompt) + len(q.out), len(q.out), q.spec.max_output_tokens
            )
            for sid, q in self._seqs.items()
        )

    def tokens(self, seq_id: str) -> list[int]:
        """Output ids a held sequence has generated."""
        return list(self._seqs[seq_id].out)

    def drop(self, seq_ids: Sequence[str]) -> None:
        """Forget sequences and free their blocks; unknown ids are ignored."""
        for sid in seq_ids:
            q = self._seqs.pop(sid, None)
            if q is not None:
                self._alloc.free(q.blocks)
                if self._prefill_alloc is not None:
                    self._prefill_alloc.free(q.prefill_blocks)

    def export_kv(self, seq_ids: Sequence[str], now_s: float) -> tuple[KvExport, ...]:
        """Pause running sequences; their blocks stay readable until ``drop``."""
        out: list[KvExport] = []
        for sid in seq_ids:
            q = self._seqs.get(sid)
            if q is None or q.state is not SeqState.RUNNING:
                continue
            q.state = SeqState.PAUSED
            spec = SeqSpec(sid, q.spec.prompt_tokens, q.spec.max_output_tokens, len(q.out))
            nbytes = q.kv_tokens * self.cfg.kv_bytes_per_token()
            out.append(TorchKvExport(spec, nbytes, self, tuple(q.blocks), q.kv_tokens))
        return tuple(out)

    def import_kv(self, exports: Sequence[KvExport], now_s: float, transfer_s: float) -> OpResult:
        """Copy each sequence's KV from its source engine, re-partitioned for this layout.

        All sequences from one source take their blocks in one allocation, placed in the
        source's block order (:func:`place_blocks`), so the copy runs over the longest
        contiguous ranges both pools allow rather than a few per sequence."""
        if self.health() is not None:
            return OpResult(False, fault=EngineFault.TRANSFER_FAILED, detail="destination down")
        self.last_handoff_bytes = 0
        groups: dict[int, list[TorchKvExport]] = {}
        for export in exports:
            if not isinstance(export, TorchKvExport) or export.source is None:
                return OpResult(False, fault=EngineFault.TRANSFER_FAILED, detail="no source KV")
            groups.setdefault(id(export.source), []).append(export)
        taken: list[str] = []
        for group in groups.values():
            fault = self._import_group(group, taken)
            if fault is not None:
                self.drop(taken)
                return fault
        return OpResult(True, now_s)

    def _import_group(self, group: list[TorchKvExport], taken: list[str]) -> OpResult | None:
        src = group[0].source
        assert src is not None
        if src.health() is not None:
            return OpResult(False, fault=EngineFault.TRANSFER_FAILED, detail="source down")
        free = self._alloc.allocate(sum(len(e.blocks) for e in group))
        if free is None:
            return OpResult(False, fault=EngineFault.OUT_OF_MEMORY, detail=group[0].spec.seq_id)
        tables = place_blocks([e.blocks for e in group], free)
        for export, blocks in zip(group, tables, strict=True):
            sid = export.spec.seq_id
            self._seqs[sid] = _Seq(
                export.spec,
                SeqState.STAGED,
                self.ledger.prompt(sid, export.spec.prompt_tokens),
                self.ledger.resume(sid, export.spec.generated_tokens),
                blocks=blocks,
                kv_tokens=export.kv_tokens,
            )
            taken.append(sid)
        src_specs, dst_specs = src.kv_specs(), self.kv_specs()
        ops = repartition(tuple(src_specs.values()), tuple(dst_specs.values()))
        pairs = sorted(
            (s, d)
            for export, table in zip(group, tables, strict=True)
            for s, d in zip(export.blocks, table, strict=True)
        )
        self.last_handoff_bytes += copy_kv(
            ops,
            src.pools(),
            src_specs,
            [s for s, _ in pairs],
            self.pools(),
            dst_specs,
            [d for _, d in pairs],
        )
        return None

    def staged_ready(self, seq_ids: Sequence[str], now_s: float) -> bool:
        """Each sequence staged (imports complete synchronously; replays after their prefill)."""
        return self._dead is None and all(
            sid in self._seqs and self._seqs[sid].state is SeqState.STAGED for sid in seq_ids
        )

    def activate(self, seq_ids: Sequence[str]) -> None:
        """Staged sequences start decoding."""
        for sid in seq_ids:
            q = self._seqs.get(sid)
            if q is not None and q.state in (SeqState.STAGED, SeqState.IMPORTING):
                q.state = SeqState.RUNNING

    def resume(self, seq_ids: Sequence[str]) -> None:
        """Paused (exported) sequences continue here."""
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
        """KV bytes held (all layers and heads, float32)."""
        return sum(q.kv_tokens for q in self._seqs.values()) * self.cfg.kv_bytes_per_token()

    # ---- iterations ----------------------------------------------------------------------------

    def step(self, now_s: float) -> StepOutput:
        """Run one iteration: prefill waiting prompts and decode every running sequence."""
        if self.health() is not None:
            return StepOutput(failed=self._fail_all())
        if not self._connected:
            return StepOutput()
        acc = _Acc()
        expired = self._expire(now_s)
        prefill = [sid for sid in self._pick_prefill() if self._grow(sid, True, acc)]
        running = [s for s, q in self._seqs.items() if q.state is SeqState.RUNNING]
        decode = [sid for sid in running if self._grow(sid, False, acc)]
        if not prefill and not decode:
            return StepOutput(failed=tuple(acc.failed), expired=expired)
        t0 = time.perf_counter()
        self.last_micro_batches = 0
        try:
            if self._prefill_alloc is not None:
                launched = [
                    self._launch(Pipeline.PREFILL, prefill),
                    self._launch(self._kv_pipe, decode),
                ]
            else:
                launched = [self._launch(self._kv_pipe, prefill + decode)]
            collected = [self._collect(batch) for batch in launched]
        except procs.RankFailure:
            self._dead = EngineFault.GPU_LOST
            return StepOutput(failed=tuple(acc.failed) + self._fail_all(), expired=expired)
        self.last_iteration_s = time.perf_counter() - t0
        self.last_device_s = max(device_s for _, device_s in collected)
        sampled = [tok for tokens, _ in collected for tok in tokens]
        order = prefill + decode  # replies come back pipeline by pipeline, in this order
        for sid, token in zip(order, sampled, strict=True):
            if sid in prefill:
                self._after_prefill(sid, token, now_s, acc)
            else:
                self._after_decode(sid, token, now_s, acc)
        self.ledger.flush()  # the step's tokens are durable before the runtime hears of them
        return StepOutput(
            iterations=1,
            prefill_tokens=acc.prefill_tokens,
            decode_tokens=acc.decode_tokens,
            first_tokens=tuple(acc.first),
            finished=tuple(acc.finished),
            failed=tuple(acc.failed),
            decode_step_s=(self.last_iteration_s,) if decode else (),
            expired=expired,
        )

    def _fail_all(self) -> tuple[Failed, ...]:
        failed = tuple(Failed(s, EngineFault.GPU_LOST, len(q.out)) for s, q in self._seqs.items())
        self._seqs.clear()
        return failed

    def _expire(self, now_s: float) -> tuple[str, ...]:
        """Drop the new prompts already past their TTFT deadline (``first_token_due_s``) before
        their prefill: this engine has no timing model, so zero compute is its lower bound."""
        late = tuple(
            sid
            for sid, q in self._seqs.items()
            if q.state is SeqState.WAITING
            and not q.out
            and q.spec.first_token_due_s is not None
            and now_s > q.spec.first_token_due_s
        )
        self.drop(late)
        return late

    def _pick_prefill(self) -> list[str]:
        picked: list[str] = []
        budget = self.settings.max_prefill_tokens
        for sid, q in self._seqs.items():
            if q.state is SeqState.WAITING:
                tokens = len(q.prefill_tokens())
                if picked and tokens > budget:
                    break
                picked.append(sid)
                budget -= tokens
        return picked

    def _grow(self, sid: str, prefill: bool, acc: _Acc) -> bool:
        """Blocks for this iteration's tokens; an out-of-memory sequence fails (and is dropped)."""
        q = self._seqs[sid]
        if prefill:
            alloc = self._prefill_alloc or self._alloc
            need = alloc.blocks_for(len(q.prefill_tokens()))
            got = alloc.allocate(need)
            if got is not None:
                if self._prefill_alloc is not None:
                    q.prefill_blocks = got
                else:
                    q.blocks = got
        else:
            need = self._alloc.blocks_for(q.kv_tokens + 1) - len(q.blocks)
            got = self._alloc.allocate(need) if need > 0 else []
            if got is not None:
                q.blocks.extend(got)
        if got is None:
            acc.failed.append(Failed(sid, EngineFault.OUT_OF_MEMORY, len(q.out)))
            self.drop([sid])
            return False
        return True

    def _launch(self, pipeline: Pipeline, sids: list[str]) -> tuple[list[procs.RankProc], int]:
        """Send one forward per micro-batch to a pipeline's ranks (nothing when ``sids`` is
        empty); the ranks and the number of micro-batches."""
        if not sids:
            return [], 0
        feeds: list[tuple[list[int], SeqChunk]] = []
        for sid in sids:
            q = self._seqs[sid]
            if q.state is SeqState.WAITING:
                fed = q.prefill_tokens()
                blocks = q.prefill_blocks if pipeline is Pipeline.PREFILL else q.blocks
                feeds.append((fed, SeqChunk(0, len(fed), tuple(blocks))))
            else:
                feeds.append(([q.out[-1]], SeqChunk(q.kv_tokens, 1, tuple(q.blocks))))
        ranks = kv_holders(self.ranks, pipeline)
        targets = [self._procs[r.rank] for r in ranks]
        stages = ranks[0].num_stages
        sizes = [c.n for _, c in feeds]
        parts = 1 if stages == 1 else self.settings.pp_microbatches or stages
        parts = min(parts, max(1, sum(sizes) // max(1, self.settings.pp_microbatch_min_tokens)))
        cuts = micro_batches(sizes, parts)
        # NOTE: micro-batch-major: every rank holds micro-batch m before any is sent m + 1, so
        # a rank blocked handing activations on never waits for a message not yet sent
        for a, b in cuts:
            tokens = [t for fed, _ in feeds[a:b] for t in fed]
            chunks = [c for _, c in feeds[a:b]]
            rows = [end - 1 for end in itertools.accumulate(c.n for c in chunks)]
            for r, rp in zip(ranks, targets, strict=True):
                msg = ("forward", tokens if r.is_first else [], chunks, rows if r.is_last else [])
                procs.send(rp, msg)
        self.last_micro_batches = max(self.last_micro_batches, len(cuts))
        return targets, len(cuts)

    def _collect(self, launched: tuple[list[procs.RankProc], int]) -> tuple[list[int], float]:
        """The sampled tokens and the pipeline's device time (see ``last_device_s``)."""
        targets, num_micro = launched
        sampled: dict[int, list[int]] = {}
        busy: list[dict[int, float]] = [{} for _ in range(num_micro)]
        for rp in targets:
            pos = rp.boot.spec.stage_pos
            for m in range(num_micro):  # a rank replies to its micro-batches in order
                msg = procs.receive(rp, procs.STEP_TIMEOUT_S)
                if msg[1] is not None:
                    sampled[m] = list(msg[1])
                busy[m][pos] = max(busy[m].get(pos, 0.0), msg[3])
        tokens = [t for m in range(num_micro) for t in sampled.get(m, [])]
        return tokens, pipelined_s([[b[s] for s in sorted(b)] for b in busy])

    def _after_prefill(self, sid: str, token: int, now_s: float, acc: _Acc) -> None:
        q = self._seqs[sid]
        q.kv_tokens = len(q.prefill_tokens())
        acc.prefill_tokens += q.kv_tokens
        if self._prefill_alloc is not None and not self._hand_off(sid, acc):
            return
        q.state = SeqState.STAGED if q.hold else SeqState.RUNNING
        if q.out:  # a replay: the re-prefill predicts the last emitted token again
            self.replay_mismatches += int(token != q.out[-1])
            if len(q.out) >= q.spec.max_output_tokens and not q.hold:
                # emitted in full before a restart whose journal still held it: done, no token
                self._finish(sid, now_s, acc)
            return
        self._emit(sid, token, now_s, acc)
        acc.first.append(FirstToken(sid, now_s))

    def _hand_off(self, sid: str, acc: _Acc) -> bool:
        """PD split: move a prefilled prompt's KV to the decode pipeline's layout."""
        q = self._seqs[sid]
        assert self._prefill_alloc is not None
        blocks = self._alloc.allocate(len(q.prefill_blocks))
        if blocks is None:
            acc.failed.append(Failed(sid, EngineFault.OUT_OF_MEMORY, len(q.out)))
            self.drop([sid])
            return False
        src_specs = self.kv_specs(Pipeline.PREFILL)
        ops = repartition(tuple(src_specs.values()), tuple(self.kv_specs().values()))
        self.last_handoff_bytes = copy_kv(
            ops,
            self.pools(Pipeline.PREFILL),
            src_specs,
            q.prefill_blocks,
            self.pools(),
            self.kv_specs(),
            blocks,
        )
        self._prefill_alloc.free(q.prefill_blocks)
        q.prefill_blocks, q.blocks = [], blocks
        return True

    def _after_decode(self, sid: str, token: int, now_s: float, acc: _Acc) -> None:
        q = self._seqs[sid]
        q.kv_tokens += 1
        acc.decode_tokens += 1
        self._emit(sid, token, now_s, acc)

    def _emit(self, sid: str, token: int, now_s: float, acc: _Acc) -> None:
        q = self._seqs[sid]
        q.out.append(token)
        self.ledger.append(sid, token)
        if len(q.out) >= q.spec.max_output_tokens:
            self._finish(sid, now_s, acc)

    def _finish(self, sid: str, now_s: float, acc: _Acc) -> None:
        acc.finished.append(Finished(sid, now_s, len(self._seqs[sid].out)))
        self.ledger.finish(sid)
        self.drop([sid])
