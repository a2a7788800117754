"""The ledger of :class:`runtime.engine.sim.SimEngine`: its decode batch under a virtual decode
counter, the runs of decode iterations it plans, and what a step accumulates.

Every decode iteration advances every running sequence by one token, so the batch keeps one
counter ``v`` (iterations run) instead of per-sequence counters: a sequence that started running
at ``v0`` with ``gen0`` tokens generated and ``kv0`` tokens of KV has ``gen0 + v − v0`` and
``kv0 + v − v0`` now, and finishes at ``v0 + max_output − gen0``. A heap of those finish points
gives the next finish in O(log n); the batch's total context is ``a_sum + n·v`` with
``a_sum = Σ (kv0 − v0)``, so the mean context (what the step time depends on) is O(1).

:func:`decode_segments` plans a run of decode-only iterations: it stops at the next finish, the
first iteration that would start after a waiting sequence's admission, or ``now_s``, and splits
the run where the mean context crosses a 64-token timing bucket (the step time changes there).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from runtime.engine.base import Failed, Finished, FirstToken, SeqSpec, SeqState, StepOutput
from runtime.engine.paging import PAGE_TOKENS, CoveringPager, preemption_victim
from runtime.timing import TOKEN_BUCKET

EPS_S = 1e-12  # float slack when fitting whole iterations before ``now_s``


@dataclass(slots=True)
class SeqRecord:
    """One sequence inside the engine."""

    spec: SeqSpec
    state: SeqState
    order: int  # admission order: output order among events at the same instant
    gen0: int  # generated tokens at v0 (exact while not running)
    kv0: int  # KV tokens at v0
    v0: int = 0  # decode counter when it (re)started running
    stage_after_prefill: bool = False
    ready_at_s: float = 0.0  # admission (waiting) or KV arrival (importing)
    prefilled: int = 0  # prompt tokens prefilled by earlier chunks (waiting only)
    chunk: int = 0  # prompt tokens the iteration being planned prefills
    finish_v: int = 0  # decode counter at which it finishes (running only)
    heap_serial: int = 0  # its live entry in the finish heap (older entries are stale)
    # While running: the decode counter up to which its held KV pages are known to cover its
    # iterations (a pager's hold for them would change nothing), and its live entry in
    # :class:`PageRooms`' heap.
    page_room: int = 0
    room_tick: int = 0


def order_of(q: SeqRecord) -> int:
    """Admission order (a sort key)."""
    return q.order


def context_bucket(context: float) -> int:
    """The 64-token bucket :class:`ReplicaTiming` rounds a context up to."""
    return max(TOKEN_BUCKET, math.ceil(context / TOKEN_BUCKET) * TOKEN_BUCKET)


class StepTiming(Protocol):
    """What times an engine's iterations: gearbox's estimate (:class:`ReplicaTiming`) by
    default, or a simulated world's ground truth that the planner cannot see."""

    def prefill_s(self, num_tokens: int) -> float:
        """Latency of one prompt through the prefill pipeline."""
        ...

    def decode_cycle_s(self, batch: int, context_tokens: float) -> float:
        """One decode step for ``batch`` sequences at a (bucketed) mean context."""
        ...


class StepTable:
    """Decode step times of one replica by (batch, context bucket), computed once each."""

    def __init__(self, timing: StepTiming) -> None:
        self._timing = timing
        self._memo: dict[tuple[int, int], float] = {}

    def step_s(self, batch: int, bucket: int) -> float:
        """One decode iteration of ``batch`` sequences at a bucketed mean context."""
        value = self._memo.get((batch, bucket))
        if value is None:
            value = self._memo[(batch, bucket)] = self._timing.decode_cycle_s(batch, bucket)
        return value


class RunningBatch:
    """The running sequences of one engine (see the module docstring)."""

    def __init__(self) -> None:
        self.v = 0
        self.seqs: dict[str, SeqRecord] = {}
        self._a_sum = 0
        # (finish_v, serial, seq id); live while the sequence runs with that serial — a
        # paused-and-resumed sequence leaves a stale entry behind.
        self._heap: list[tuple[int, int, str]] = []
        self._serial = 0

    def __len__(self) -> int:
        return len(self.seqs)

    def generated(self, q: SeqRecord) -> int:
        """Output tokens ``q`` has now."""
        return q.gen0 + self.v - q.v0 if q.state is SeqState.RUNNING else q.gen0

    def kv_tokens(self, q: SeqRecord) -> int:
        """KV tokens ``q`` holds now."""
        return q.kv0 + self.v - q.v0 if q.state is SeqState.RUNNING else q.kv0

    def start(self, q: SeqRecord) -> None:
        """``q`` joins the batch at the current counter."""
        q.state = SeqState.RUNNING
        q.v0 = self.v
        # NOTE: as in a token-by-token engine, a running sequence decodes at least once more
        # before it finishes.
        q.finish_v = self.v + max(1, q.spec.stop_tokens - q.gen0)
        self.seqs[q.spec.seq_id] = q
        self._a_sum += q.kv0 - q.v0
        self._serial += 1
        q.heap_serial = self._serial
        heapq.heappush(self._heap, (q.finish_v, self._serial, q.spec.seq_id))

    def stop(self, q: SeqRecord, state: SeqState) -> None:
        """``q`` leaves the batch; its counts are frozen at the current counter."""
        self._a_sum -= q.kv0 - q.v0
        q.gen0 = self.generated(q)
        q.kv0 = self.kv_tokens(q)
        q.state = state
        del self.seqs[q.spec.seq_id]

    def mean_context(self) -> float:
        """Mean KV tokens per running sequence (the batch must not be empty)."""
        n = len(self.seqs)
        return (self._a_sum + n * self.v) / n

    def steps_to_finish(self) -> int:
        """Iterations until the next running sequence finishes (the batch must not be empty)."""
        heap = self._heap
        while heap:
            _, serial, sid = heap[0]
            q = self.seqs.get(sid)
            if q is not None and q.heap_serial == serial:
                return heap[0][0] - self.v
            heapq.heappop(heap)
        raise ValueError("steps_to_finish: the batch is empty")

    def advance(self, runs: int) -> list[SeqRecord]:
        """Run ``runs`` iterations; the sequences that finish with the last one, in order."""
        self.v += runs
        heap, done = self._heap, []
        while heap and heap[0][0] <= self.v:
            _, serial, sid = heapq.heappop(heap)
            q = self.seqs.get(sid)
            if q is not None and q.heap_serial == serial:
                done.append(q)
        return sorted(done, key=lambda s: s.order)

    def youngest(self) -> SeqRecord:
        """The running sequence admitted last (the one preempted first for KV pages)."""
        return preemption_victim(self.seqs.values(), order_of)

    def largest(self) -> SeqRecord:
        """The running sequence holding the most KV (ties: the latest admitted)."""
        return max(self.seqs.values(), key=lambda q: (self.kv_tokens(q), q.order))


class PageRooms:
    """Where each running sequence's KV pages end, on the batch's decode counter, for an engine
    whose pager says what its pages cover (:class:`CoveringPager`).

    ``hold(seq, paged(kv + runs))`` is a no-op while ``v + runs`` is at most the sequence's
    ``page_room`` (it holds ``kv0 + v − v0`` tokens, and ``paged(x) <= c`` iff
    ``x <= c // PAGE_TOKENS * PAGE_TOKENS``). A heap of those points gives the sequences a run
    of decode iterations must ask the pager about in O(k log n) rather than a scan of the batch
    (a busy replica runs ~200 sequences and ~4 of them need a page per run).
    """

    def __init__(self, pager: CoveringPager, batch: RunningBatch) -> None:
        self._pager = pager
        self._batch = batch
        self._epoch = pager.epoch - 1  # read everything at the first refresh
        # (page_room, order, tick, q): live while q runs and q.room_tick == tick
        self._heap: list[tuple[int, int, int, SeqRecord]] = []
        self._tick = 0

    def read(self, q: SeqRecord) -> None:
        """Read the running sequence's page_room from the pager (after a hold, or on start)."""
        covered = self._pager.covered(q.spec.seq_id) // PAGE_TOKENS * PAGE_TOKENS
        q.page_room = covered - q.kv0 + q.v0
        self.keep(q)

    def keep(self, q: SeqRecord) -> None:
        """Put the running sequence back in the heap at its page_room."""
        self._tick += 1
        q.room_tick = self._tick
        heapq.heappush(self._heap, (q.page_room, q.order, self._tick, q))

    def refresh(self) -> None:
        """Read again the sequences whose figure the pager dropped (all after a new epoch)."""
        pager, seqs = self._pager, self._batch.seqs
        if pager.epoch != self._epoch:
            self._epoch = pager.epoch
            pager.dropped.clear()
            self._heap = []
            for q in seqs.values():
                self.read(q)
        elif pager.dropped:
            for sid in pager.dropped:
                dropped = seqs.get(sid)
                if dropped is not None:
                    self.read(dropped)
            pager.dropped.clear()
        if len(self._heap) > 2 * len(seqs) + 256:  # mostly entries of sequences gone
            self._heap = [(q.page_room, q.order, q.room_tick, q) for q in seqs.values()]
            heapq.heapify(self._heap)

    def short(self, until_v: int) -> list[SeqRecord]:
        """The running sequences whose pages end before ``until_v``, oldest first. They leave
        the heap: the caller puts each back (``read`` or ``keep``) while it still runs."""
        heap, seqs = self._heap, self._batch.seqs
        out: list[SeqRecord] = []
        while heap and heap[0][0] < until_v:
            _, _, tick, q = heapq.heappop(heap)
            if q.room_tick == tick and seqs.get(q.spec.seq_id) is q:
                out.append(q)
        out.sort(key=order_of)
        return out


class Segment(NamedTuple):
    """Iterations of one run that share a step time."""

    # NOTE: a named tuple, not a frozen dataclass: as immutable, and several times faster to
    # make (an engine plans one or more per run of decode iterations).

    runs: int
    step_s: float
    context: float  # mean context at the first of them


def decode_segments(
    batch: RunningBatch,
    table: StepTable,
    clock_s: float,
    now_s: float,
    arrival_s: float | None,
) -> tuple[list[Segment], float, bool]:
    """Plan decode-only iterations from ``clock_s`` (see the module docstring).

    Returns the segments, the clock after them, and whether ``now_s`` cut the run (rather than
    a finish or an admission).
    """
    n = len(batch)
    left = batch.steps_to_finish()
    context = batch.mean_context()
    segments: list[Segment] = []
    end, timed_out = clock_s, False
    while left > 0:
        bucket = context_bucket(context)
        step_s = table.step_s(n, bucket)
        runs = min(left, math.floor(bucket - context) + 1)  # same timing bucket
        fit = math.floor((now_s - end) / step_s + EPS_S)
        while fit > 0 and end + fit * step_s > now_s:
            fit -= 1
        timed_out = fit < runs
        runs, cut = min(runs, fit), timed_out
        if arrival_s is not None:  # only iterations starting before the next admission
            due = max(0, math.ceil((arrival_s - end) / step_s))
            if due <= runs:
                runs, cut, timed_out = due, True, False
        if runs > 0:
            segments.append(Segment(runs, step_s, context))
            end += runs * step_s
            left -= runs
            context += runs
        if cut or runs <= 0:
            break
    return segments, end, timed_out


class DecodeObserver(Protocol):
    """Receives every run of decode iterations (for token-weighted TBT histograms)."""

    def on_decode(self, end_s: float, step_s: float, tokens: int) -> None:
        """``tokens`` inter-token gaps of ``step_s`` each, in iterations ending by ``end_s``."""
        ...


@dataclass
class EngineStats:
    """What measurements read off an engine: busy time and work done (cumulative)."""

    busy_s: float = 0.0  # time spent inside iterations
    model_flops: float = 0.0  # forward-pass FLOPs done (gearbox's formulas: 2·N + attention)
    iterations: int = 0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    kv_imported_bytes: int = 0  # migrated KV received
    preemptions: int = 0  # running sequences preempted for KV pages (recomputed when resumed)


EMPTY_STEP = StepOutput()


@dataclass
class StepAcc:
    """One ``step``'s output, accumulated."""

    iterations: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    first_tokens: list[FirstToken] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)
    failed: list[Failed] = field(default_factory=list)
    decode_step_s: list[float] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    decode_step_runs: list[int] = field(default_factory=list)
    expired: list[str] = field(default_factory=list)

    def output(self) -> StepOutput:
        """The accumulated output (the shared empty one when nothing happened)."""
        if not (
            self.iterations or self.failed or self.prefill_tokens or self.preempted or self.expired
        ):
            return EMPTY_STEP  # (a split replica's prefill stage completes outside iterations)
        return StepOutput(
            self.iterations,
            self.prefill_tokens,
            self.decode_tokens,
            tuple(self.first_tokens),
            tuple(self.finished),
            tuple(self.failed),
            tuple(self.decode_step_s),
            tuple(self.preempted),
            tuple(self.decode_step_runs),
            tuple(self.expired),
        )
