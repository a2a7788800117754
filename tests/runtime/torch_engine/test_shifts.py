"""Real gear shifts on the torch engine: greedy tokens with a shift mid-generation must equal
the tokens of the same requests generated alone in one process, without any shift.

Every shift moves some sequences by KV migration (re-partitioned for the new layout) and some
by replay (re-prefilled from their tokens) — the per-sequence choice is gearbox's hand-over
plan. Engines are shared across the module (forking rank processes costs a second each); each
test starts from drained engines.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from runtime.engine.base import EngineFault, SeqSpec, SeqState
from runtime.engine.torch.engine import TorchEngine
from runtime.engine.torch.reference import generate
from runtime.engine.torch.shift import admit_all, run_to_completion, shift
from runtime.engine.torch.tokens import TokenLedger
from tests.runtime.torch_engine.builders import (
    CFG,
    SETTINGS,
    SOURCE,
    make_prompts,
    mixed_handover,
    specs,
    start_engine,
)

pytestmark = pytest.mark.torch
MAX_NEW = 12
STEPS_BEFORE_SHIFT = 4


class Engines:
    """Lazily started engines of one ledger, by plan kind."""

    def __init__(self) -> None:
        self.ledger = TokenLedger(CFG.vocab_size)
        self._engines: dict[str, TorchEngine] = {}

    def __getitem__(self, kind: str) -> TorchEngine:
        if kind not in self._engines:
            self._engines[kind] = start_engine(kind, self.ledger)
        engine = self._engines[kind]
        assert engine.is_drained() and engine.health() is None
        return engine

    def close(self) -> None:
        for engine in self._engines.values():
            engine.close()


@pytest.fixture(scope="module")
def engines() -> Iterator[Engines]:
    pool = Engines()
    try:
        yield pool
    finally:
        pool.close()


def _run_shift(engines: Engines, src: str, dst: str, tag: str, *, abort: bool = False) -> None:
    prompts = make_prompts(tag, 6)
    for sid, prompt in prompts.items():
        engines.ledger.register(sid, prompt)
    reference = generate(CFG, SOURCE, prompts, dict.fromkeys(prompts, MAX_NEW))
    old, new = engines[src], engines[dst]
    admit_all(old, specs(prompts, MAX_NEW))
    for _ in range(STEPS_BEFORE_SHIFT):
        assert not old.step(0.0).failed
    handover = mixed_handover(old, new)
    report, _ = shift(old, new, handover, abort=abort)
    assert report.committed is not abort
    assert report.migrated and report.replayed  # both paths ran in this shift
    assert report.replay_mismatches == 0
    if not abort:
        assert report.migrate_bytes > 0
        assert {p.seq_id for p in new.progress()} == set(report.migrated + report.replayed)
    else:
        assert new.is_drained()
    run_to_completion([old, new])
    got = {sid: engines.ledger.outputs(sid) for sid in prompts}
    mismatched = [sid for sid in prompts if got[sid] != reference[sid]]
    assert not mismatched, {sid: (got[sid], reference[sid]) for sid in mismatched}


@pytest.mark.parametrize(
    ("src", "dst"),
    [("tp2", "tp1"), ("tp1", "tp2"), ("pp2", "tp2"), ("tp2", "pp2"), ("pd1-1", "tp1")],
    ids=["TP2-TP1", "TP1-TP2", "PP2-TP2", "TP2-PP2", "PD_on-off"],
)
def test_shift_mid_generation_is_token_exact(engines: Engines, src: str, dst: str) -> None:
    _run_shift(engines, src, dst, f"{src}-{dst}")


def test_rolled_back_shift_leaves_old_plan_serving_token_exact(engines: Engines) -> None:
    _run_shift(engines, "tp2", "tp1", "rollback", abort=True)


def test_plans_without_shift_match_the_single_process_reference(engines: Engines) -> None:
    prompts = make_prompts("noshift", 4)
    for sid, prompt in prompts.items():
        engines.ledger.register(sid, prompt)
    reference = generate(CFG, SOURCE, prompts, dict.fromkeys(prompts, MAX_NEW))
    for kind in ("tp2", "pp2", "pd1-1"):
        sub = {f"{sid}-{kind}": p for sid, p in prompts.items()}
        for sid, prompt in sub.items():
            engines.ledger.register(sid, prompt)
        engine = engines[kind]
        admit_all(engine, specs(sub, MAX_NEW))
        run_to_completion([engine])
        for sid in prompts:
            assert engines.ledger.outputs(f"{sid}-{kind}") == reference[sid], kind
        # the last step's device time: the ranks' CPU time, which a rank can only spend while
        # the step runs (each rank at most the step's wall time, plus the pipe's scheduling)
        assert engine.last_device_s > 0.0
        assert engine.last_device_s <= len(engine.ranks) * engine.last_iteration_s + 0.05, kind


def test_allreduce_probe_times_the_tp_group_and_leaves_serving_alone(engines: Engines) -> None:
    """The probe runs the TP group's all-reduces alone (bench.engine's measured collective):
    CPU time spent while it ran, none on a TP 1 plan's no-op, and the engine serves on."""
    tp2 = engines["tp2"]
    device_s, wall_s = tp2.probe_allreduce(4, 2 * CFG.num_layers)
    assert 0.0 < device_s <= 2 * wall_s + 0.05
    tp1_device_s, _ = engines["tp1"].probe_allreduce(4, 2 * CFG.num_layers)
    assert tp1_device_s < device_s
    prompts = make_prompts("probe", 2)
    for sid, prompt in prompts.items():
        engines.ledger.register(sid, prompt)
    admit_all(tp2, specs(prompts, MAX_NEW))
    run_to_completion([tp2])
    reference = generate(CFG, SOURCE, prompts, dict.fromkeys(prompts, MAX_NEW))
    assert {sid: engines.ledger.outputs(sid) for sid in prompts} == reference


def test_pp_micro_batches_are_token_exact_with_one_packed_batch(engines: Engines) -> None:
    prompts = make_prompts("micro", 6)
    unsplit = start_engine(
        "pp2", engines.ledger, "pp2-mb1", dataclasses.replace(SETTINGS, pp_microbatches=1)
    )
    # every pass split, decode steps of a few tokens included
    split = start_engine(
        "pp2", engines.ledger, "pp2-mb2", dataclasses.replace(SETTINGS, pp_microbatch_min_tokens=1)
    )
    try:
        for engine, tag in ((split, "split"), (unsplit, "unsplit")):
            sub = {f"{sid}-{tag}": p for sid, p in prompts.items()}
            for sid, prompt in sub.items():
                engines.ledger.register(sid, prompt)
            admit_all(engine, specs(sub, MAX_NEW))
            engine.step(0.0)  # every prompt prefilled in this one step
            engine.step(0.0)  # one decode step of six tokens
            assert engine.last_micro_batches == (2 if tag == "split" else 1)
            run_to_completion([engine])
    finally:
        unsplit.close()
        split.close()
    for sid in prompts:
        assert engines.ledger.outputs(f"{sid}-split") == engines.ledger.outputs(f"{sid}-unsplit")
        assert len(engines.ledger.outputs(f"{sid}-split")) == MAX_NEW


def test_dead_rank_fails_sequences_as_values() -> None:
    ledger = TokenLedger(CFG.vocab_size)
    engine = start_engine("tp2", ledger, prefix="doomed")
    try:
        prompts = make_prompts("doomed", 2)
        admit_all(engine, specs(prompts, MAX_NEW))
        assert not engine.step(0.0).failed
        victim = engine._procs[1].proc
        victim.kill()
        victim.join(10)
        out = engine.step(0.0)
        assert {f.seq_id for f in out.failed} == set(prompts)
        assert all(f.fault is EngineFault.GPU_LOST for f in out.failed)
        assert engine.health() is EngineFault.GPU_LOST and not engine.has_capacity()
        assert all(p.state is not SeqState.RUNNING for p in engine.progress())
    finally:
        engine.close()


def test_a_prompt_past_its_due_time_is_dropped_before_its_prefill(engines: Engines) -> None:
    engine = engines["tp1"]
    prompts = make_prompts("due", 2)
    for sid, prompt in prompts.items():
        engines.ledger.register(sid, prompt)
    (late, prompt_late), (in_time, prompt_in_time) = prompts.items()
    engine.admit(SeqSpec(late, len(prompt_late), 2, first_token_due_s=5.0), 0.0)
    engine.admit(SeqSpec(in_time, len(prompt_in_time), 2, first_token_due_s=60.0), 0.0)
    out = engine.step(10.0)  # the torch engine has no timing model: only a due time passed
    assert out.expired == (late,)
    assert [f.seq_id for f in out.first_tokens] == [in_time]
    assert out.prefill_tokens == len(prompt_in_time)
    run_to_completion([engine])
    assert engine.is_drained()
