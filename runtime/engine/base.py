"""The engine protocol: what the runtime needs from whatever runs a replica's forward passes.

One engine serves one replica (an :class:`gearbox.plans.ExecutionPlan`): it loads the replica's
weight shards, builds its communication groups, admits sequences, advances them one iteration at
a time, and hands KV cache in and out for a gear shift. Time is an input (``now_s``) so the same
runtime drives a simulated engine under a simulated clock and a real engine under the wall clock.

Contract for implementers (a real torch engine included):

* Mutations (admit, export, drop, activate) take effect at an iteration boundary — the "safe
  boundary" a drain waits for; ``step`` never leaves a sequence half-advanced.
* ``export_kv`` pauses the sequences and keeps their KV until ``drop`` (copy-then-commit): a
  failed hand-over resumes them where they were (``resume``).
* Imported and replayed sequences are *staged*: they hold KV but do not decode until
  ``activate`` — the route-table swap decides which copy lives on.
* Faults are values (:class:`EngineFault`), never exceptions out of the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol


class EngineFault(StrEnum):
    """Why an engine operation failed."""

    GPU_LOST = "gpu_lost"  # a GPU of the replica was preempted, failed or isolated
    LOAD_FAILED = "load_failed"  # a weight shard could not be loaded
    COMM_FAILED = "comm_failed"  # a communication group could not be built
    TRANSFER_FAILED = "transfer_failed"  # a KV import failed
    OUT_OF_MEMORY = "out_of_memory"  # a KV allocation hit the GPU's memory limit
    NOT_READY = "not_ready"  # weights or groups are not loaded yet
    BATCH_FULL = "batch_full"  # the running batch is at its cap
    DRAINING = "draining"  # admission is closed
    UNKNOWN_SEQUENCE = "unknown_sequence"


class SeqState(StrEnum):
    """Where a sequence stands inside an engine."""

    WAITING = "waiting"  # admitted, prefill not done
    RUNNING = "running"  # decoding
    PAUSED = "paused"  # exported; KV kept until dropped or resumed
    IMPORTING = "importing"  # KV arriving from another replica
    STAGED = "staged"  # KV present (imported or replayed), waits for activate


@dataclass(frozen=True, slots=True)
class SeqSpec:
    """A sequence to run: its prompt, output budget and what was already generated elsewhere."""

    seq_id: str
    prompt_tokens: int
    max_output_tokens: int  # the client's stated cap: what admission and progress report
    generated_tokens: int = 0  # a replay re-prefills prompt + these and continues after them
    sim_output_tokens: int | None = None  # SIMULATED: the simulated model's EOS (Request's)
    # a new request's TTFT deadline: an engine does not start a prefill whose first token
    # cannot come by then (runtime.admission.too_late_to_prefill) and reports it expired
    first_token_due_s: float | None = None

    @property
    def context_tokens(self) -> int:
        """Tokens whose KV the sequence holds."""
        return self.prompt_tokens + self.generated_tokens

    @property
    def stop_tokens(self) -> int:
        """SIMULATED: the output length at which a simulated engine finishes the sequence (the
        simulated model's EOS, or the cap). Only an engine's stopping may read it."""
        if self.sim_output_tokens is None:
            return self.max_output_tokens
        return max(1, min(self.max_output_tokens, self.sim_output_tokens))


@dataclass(frozen=True, slots=True)
class SeqProgress:
    """A sequence's state inside an engine."""

    seq_id: str
    state: SeqState
    context_tokens: int
    generated_tokens: int
    max_output_tokens: int

    @property
    def remaining_tokens(self) -> int:
        """Output tokens still to generate."""
        return max(0, self.max_output_tokens - self.generated_tokens)


@dataclass(frozen=True, slots=True)
class KvExport:
    """A sequence's KV handed out of an engine (the simulated engine carries sizes only)."""

    spec: SeqSpec  # generated_tokens as of the export
    num_bytes: int  # all layers, K and V


@dataclass(frozen=True, slots=True)
class OpResult:
    """Outcome of a load, comm-group build or KV import: ready at ``ready_at_s`` or a fault."""

    ok: bool
    ready_at_s: float = 0.0
    fault: EngineFault | None = None
    detail: str = ""


@dataclass(frozen=True, slots=True)
class FirstToken:
    """A sequence produced its first output token."""

    seq_id: str
    t_s: float


@dataclass(frozen=True, slots=True)
class Finished:
    """A sequence generated its whole output and released its KV."""

    seq_id: str
    t_s: float
    output_tokens: int


@dataclass(frozen=True, slots=True)
class Failed:
    """A sequence the engine lost (its KV is gone); the runtime must replay it elsewhere."""

    seq_id: str
    fault: EngineFault
    generated_tokens: int


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What happened between the last ``step`` and ``now_s``."""

    iterations: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    first_tokens: tuple[FirstToken, ...] = ()
    finished: tuple[Finished, ...] = ()
    failed: tuple[Failed, ...] = ()
    decode_step_s: tuple[float, ...] = ()  # duration of each iteration that decoded (TBT)
    # running sequences preempted for KV pages (runtime.engine.paging): still held, waiting
    # first in line to be prefilled again with their generated tokens
    preempted: tuple[str, ...] = ()
    # how many identical iterations each decode_step_s entry stands for (an engine that
    # advances runs of them at once, runtime.engine.sim); empty: one each
    decode_step_runs: tuple[int, ...] = ()
    # sequences dropped before their prefill started: their first token could not come by
    # SeqSpec.first_token_due_s (no KV left, never prefilled)
    expired: tuple[str, ...] = ()


class Engine(Protocol):
    """One replica's inference engine (see the module docstring for the contract)."""

    replica_id: str

    def load_shard(self, stage_index: int, now_s: float) -> OpResult:
        """Start loading stage ``stage_index``'s weights; ready at ``ready_at_s``."""
        ...

    def unload_shard(self, stage_index: int) -> None:
        """Free the stage's weights (idempotent)."""
        ...

    def build_comm_groups(self, now_s: float) -> OpResult:
        """Build TP/PP/KV-hand-off groups once shards are loaded."""
        ...

    def is_ready(self, now_s: float) -> bool:
        """Weights loaded and groups built by ``now_s``."""
        ...

    def health(self) -> EngineFault | None:
        """``None`` while the engine can serve; the fault that stopped it otherwise."""
        ...

    def has_capacity(self) -> bool:
        """True when another sequence fits in the running batch."""
        ...

    def admit(self, seq: SeqSpec, now_s: float, *, staged: bool = False) -> EngineFault | None:
        """Queue a sequence for prefill (``staged``: a replay that waits for ``activate``)."""
        ...

    def step(self, now_s: float) -> StepOutput:
        """Run every iteration that completes by ``now_s``."""
        ...

    def progress(self) -> tuple[SeqProgress, ...]:
        """Every sequence the engine holds."""
        ...

    def export_kv(self, seq_ids: Sequence[str], now_s: float) -> tuple[KvExport, ...]:
        """Pause the running sequences and describe their KV for a hand-over."""
        ...

    def import_kv(self, exports: Sequence[KvExport], now_s: float, transfer_s: float) -> OpResult:
        """Receive KV (staged); ``transfer_s`` is the modelled transfer time."""
        ...

    def staged_ready(self, seq_ids: Sequence[str], now_s: float) -> bool:
        """True when each sequence is staged with its KV complete."""
        ...

    def activate(self, seq_ids: Sequence[str]) -> None:
        """Staged sequences start decoding."""
        ...

    def resume(self, seq_ids: Sequence[str]) -> None:
        """Paused (exported) sequences continue here: the hand-over was abandoned."""
        ...

    def drop(self, seq_ids: Sequence[str]) -> None:
        """Forget the sequences and free their KV (idempotent)."""
        ...

    def close_admission(self) -> None:
        """Stop admitting new sequences (drain)."""
        ...

    def is_drained(self) -> bool:
        """No sequence left, at an iteration boundary."""
        ...

    def kv_bytes(self) -> int:
        """KV bytes held now."""
        ...
