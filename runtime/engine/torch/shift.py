"""A gear shift between two live torch engines: migrate or replay each active sequence.

The runtime's :class:`runtime.executor.TransitionExecutor` does this across a deployment with
a simulated clock; this is the same switch step on two real engines, for the tests and the
bench (and the hook the main job needs — see ``NOTES.md`` in this package):

1. prepare — the caller has loaded the shadow engine (same weights, re-sharded for its layout)
   and built its groups; nothing routes to it yet.
2. switch — gearbox's hand-over plan (:func:`runtime.handover.plan_handover`) picks migrate or
   replay per running sequence, longest first. Migrated sequences are exported (paused, KV kept)
   and their KV copied into the new layout; replayed ones are paused and re-prefilled on the new
   engine from the ledger's tokens. The old engine keeps serving everything else meanwhile.
3. commit — once every moved sequence is staged, the new engine activates them and the old one
   drops them (the route flip); ``abort`` instead resumes them on the old engine and drops them
   on the new one (rollback: the old plan keeps serving, no token lost or repeated).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from gearbox.config import DEFAULT_CONFIG, GearboxConfig
from gearbox.switch import KvAction, KvHandover
from gearbox.types import LinkClass
from runtime.engine.base import SeqSpec, SeqState, StepOutput
from runtime.engine.torch.engine import TorchEngine
from runtime.handover import plan_handover

MAX_REPLAY_STEPS = 10_000


@dataclass(frozen=True, slots=True)
class ShiftReport:
    """What one shift did."""

    migrated: tuple[str, ...]
    replayed: tuple[str, ...]
    committed: bool  # False: rolled back, the old engine serves them again
    migrate_bytes: int
    migrate_s: float  # wall time of the KV copies
    shift_s: float  # wall time from freezing the first sequence to the route flip
    # the same span's CPU time in this (driver) thread: the copies' work without a neighbour's
    # share of the core (replays' prefills run in the rank processes and are not in it)
    shift_cpu_s: float
    replay_mismatches: int  # replays whose re-prefill disagreed with the emitted token


def handover_plan(
    old: TorchEngine,
    new: TorchEngine,
    link: LinkClass,
    config: GearboxConfig = DEFAULT_CONFIG,
) -> tuple[KvHandover, ...]:
    """Gearbox's migrate-or-replay choice for each running sequence of ``old``."""
    running = [(p.seq_id, p.context_tokens) for p in old.progress() if p.state is SeqState.RUNNING]
    return plan_handover(running, old.plan, new.plan, old.cfg.model_spec(), config, link)


def shift(
    old: TorchEngine,
    new: TorchEngine,
    handover: Sequence[KvHandover],
    now_s: float = 0.0,
    *,
    abort: bool = False,
) -> tuple[ShiftReport, list[StepOutput]]:
    """Run the switch and commit (or, with ``abort``, roll back). Returns the report and the
    old engine's step outputs produced while replays were prefilling (tokens it served)."""
    t0, cpu0 = time.perf_counter(), time.thread_time()
    migrate = [h.seq_id for h in handover if h.action is KvAction.MIGRATE]
    replay = [h.seq_id for h in handover if h.action is KvAction.REPLAY]
    copy_t0 = time.perf_counter()
    exports = old.export_kv(migrate, now_s)
    result = new.import_kv(exports, now_s, 0.0)
    migrate_s = time.perf_counter() - copy_t0
    moved_bytes = new.last_handoff_bytes
    paused = old.export_kv(replay, now_s)
    for export in paused:
        new.admit(export.spec, now_s, staged=True)
    served: list[StepOutput] = []
    ids = [e.spec.seq_id for e in exports] + [e.spec.seq_id for e in paused]
    steps = 0
    while result.ok and not new.staged_ready(ids, now_s) and steps < MAX_REPLAY_STEPS:
        new.step(now_s)  # replays prefill; nothing else runs on the shadow engine yet
        served.append(old.step(now_s))  # the old plan keeps serving its other sequences
        steps += 1
    committed = result.ok and not abort and new.staged_ready(ids, now_s)
    if committed:
        new.activate(ids)
        old.drop(ids)
    else:
        old.resume(ids)
        new.drop(ids)
    report = ShiftReport(
        migrated=tuple(e.spec.seq_id for e in exports),
        replayed=tuple(e.spec.seq_id for e in paused),
        committed=committed,
        migrate_bytes=moved_bytes,
        migrate_s=migrate_s,
        shift_s=time.perf_counter() - t0,
        shift_cpu_s=time.thread_time() - cpu0,
        replay_mismatches=new.replay_mismatches,
    )
    return report, served


def run_to_completion(engines: Sequence[TorchEngine], max_steps: int = 10_000) -> int:
    """Step every engine until all are drained; returns the steps taken."""
    for n in range(max_steps):
        if all(e.is_drained() for e in engines):
            return n
        for engine in engines:
            out = engine.step(0.0)
            if out.failed:
                raise RuntimeError(f"{engine.replica_id}: sequences failed {out.failed}")
    raise RuntimeError(f"engines not drained after {max_steps} steps")


def admit_all(engine: TorchEngine, specs: Sequence[SeqSpec]) -> None:
    """Admit every spec or raise naming the fault."""
    for spec in specs:
        fault = engine.admit(spec, 0.0)
        if fault is not None:
            raise RuntimeError(f"{spec.seq_id}: admission refused ({fault})")
