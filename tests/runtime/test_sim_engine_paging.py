"""Unit: the live engine's paged KV (:mod:`runtime.engine.paging`) — pages grow with generated
tokens, memory pressure preempts the youngest running sequence (never an out-of-memory), and a
preempted sequence resumes by recompute with the tokens it had generated."""

from __future__ import annotations

import pytest

from gearbox.config import DEFAULT_CONFIG
from gearbox.presets import MODEL_7B_MHA
from runtime.engine.base import SeqSpec, SeqState, StepOutput
from runtime.engine.paging import PAGE_TOKENS, KvAdmission, admission_tokens, paged
from runtime.engine.sim import SimEngine
from runtime.engine.simgpu import SimGpuPool
from runtime.timing import ReplicaTiming
from tests.runtime.builders import make_replica

pytestmark = pytest.mark.unit

PROMPT, OUTPUT = 2000, 600
# Three prompts' admission pages fit, with four pages to spare: their growth cannot all fit.
TIGHT_ROOM = 3 * admission_tokens(KvAdmission.INCREMENTAL, PROMPT, 0, OUTPUT) + 4 * PAGE_TOKENS


def _timing() -> ReplicaTiming:
    return ReplicaTiming.build(make_replica(["G0"], gpu_class="l40s"), MODEL_7B_MHA, DEFAULT_CONFIG)


def _engine(room_tokens: int | None = None) -> tuple[SimEngine, SimGpuPool]:
    """An engine on one L40S; ``room_tokens``: KV room left once its weights are loaded (the
    rest taken by another tenant), all of it when None."""
    timing, pool = _timing(), SimGpuPool()
    engine = SimEngine(timing, pool)
    assert engine.load_shard(0, 0.0).ok
    if room_tokens is not None:
        per_token = timing.kv_bytes_per_token_per_gpu["G0"]
        assert pool.allocate("G0", pool.free_bytes("G0") - room_tokens * per_token)
    engine.step(engine.build_comm_groups(0.0).ready_at_s)
    return engine, pool


def _run(engine: SimEngine, until_s: float, dt_s: float = 0.05) -> list[StepOutput]:
    """Step every ``dt_s`` up to ``until_s``; each step's output."""
    outs, now = [], 10.0
    while now < until_s:
        now = round(now + dt_s, 6)
        outs.append(engine.step(now))
    return outs


def test_kv_grows_with_generated_tokens_in_whole_pages() -> None:
    engine, pool = _engine()
    per_token = MODEL_7B_MHA.kv_bytes_per_token
    base = pool.used_bytes("G0")
    engine.admit(SeqSpec("s", PROMPT, OUTPUT), 10.0)
    held: list[int] = []
    now = 10.0
    while not engine.is_drained():
        now = round(now + 0.02, 6)
        engine.step(now)
        progress = engine.progress()
        if not progress:
            break
        tokens, rest = divmod(engine.kv_bytes(), per_token)
        assert rest == 0 and tokens % PAGE_TOKENS == 0
        assert pool.used_bytes("G0") - base == tokens * per_token  # what the GPU gave
        kv = progress[0].context_tokens - 1  # the newest token's KV is written when it is fed
        assert kv <= tokens < kv + 2 * PAGE_TOKENS  # at most its partial page + one of headroom
        held.append(tokens)
    assert held[0] == paged(PROMPT + PAGE_TOKENS)  # not prompt + max_output: nothing foreseen
    assert held[-1] >= PROMPT + OUTPUT - PAGE_TOKENS
    assert held == sorted(held) and len(set(held)) > OUTPUT // PAGE_TOKENS - 2
    assert pool.used_bytes("G0") == base  # every page freed at the finish


def test_memory_pressure_preempts_the_youngest_sequence_never_out_of_memory() -> None:
    engine, pool = _engine(TIGHT_ROOM)
    for sid in ("a", "b", "c"):  # admitted oldest first
        assert engine.admit(SeqSpec(sid, PROMPT, OUTPUT), 10.0) is None
    outs = _run(engine, 120.0)
    preempted = [sid for out in outs for sid in out.preempted]
    assert preempted and preempted[0] == "c"
    assert "a" not in preempted  # the oldest always progresses
    assert engine.stats.preemptions == len(preempted)
    assert pool.oom_events == 0 and not any(out.failed for out in outs)
    finished = {f.seq_id: f.output_tokens for out in outs for f in out.finished}
    assert finished == {"a": OUTPUT, "b": OUTPUT, "c": OUTPUT}


def test_a_preempted_sequence_resumes_with_the_tokens_it_generated() -> None:
    with_room, _ = _engine()
    tight, _ = _engine(TIGHT_ROOM)
    for engine in (with_room, tight):
        for sid in ("a", "b", "c"):
            engine.admit(SeqSpec(sid, PROMPT, OUTPUT), 10.0)
    free_outs = _run(with_room, 120.0)
    assert not any(out.preempted for out in free_outs)
    at_preemption: int | None = None  # "c"'s tokens when first preempted
    resume_prefill: int | None = None  # tokens prefilled when it came back
    seen: list[int] = []  # "c"'s tokens after each step
    tight_outs, now = [], 10.0
    while not tight.is_drained():
        now = round(now + 0.05, 6)
        out = tight.step(now)
        tight_outs.append(out)
        c = {p.seq_id: p for p in tight.progress()}.get("c")
        if "c" in out.preempted and at_preemption is None:
            assert c is not None and c.state is SeqState.WAITING
            at_preemption = c.generated_tokens
        elif at_preemption is not None and resume_prefill is None and out.prefill_tokens:
            resume_prefill = out.prefill_tokens
        seen += [c.generated_tokens] if c is not None else []
    assert at_preemption is not None and 1 < at_preemption < OUTPUT
    assert seen == sorted(seen)  # a preemption never loses a generated token
    assert resume_prefill == PROMPT + at_preemption  # recompute: prompt + what it had generated
    finished = {f.seq_id: f.output_tokens for out in tight_outs for f in out.finished}
    free_finished = {f.seq_id: f.output_tokens for out in free_outs for f in out.finished}
    assert finished == free_finished == {"a": OUTPUT, "b": OUTPUT, "c": OUTPUT}
