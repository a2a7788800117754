"""SIGKILL of the process driving a torch shift, in each phase; recovery replays from the journal.

The driver (:mod:`tests.runtime.torch_engine.crash_driver`) serves six requests on TP2, starts
a TP1 shadow and stops inside one phase; the test SIGKILLs it. Checked: its rank processes die
with it (no orphan keeps the KV pools); a fresh TP1 engine (the plan the journal's ``commit``
says serves, or the old layout's replacement before it) replays every unfinished request from
its journaled tokens; final tokens equal the single-process reference and the tokens completed
before the kill are unchanged (a prefix of the final ones, none re-emitted).

NOTE: recovery here is the test's own reading of its journal, not ``runtime/worker.py``'s
journal/transitions replay: the runtime cannot build a TorchEngine yet (see NOTES.md).
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from subprocess import Popen

import pytest

from runtime.engine.base import SeqSpec
from runtime.engine.torch.reference import generate
from runtime.engine.torch.shift import admit_all, run_to_completion
from runtime.engine.torch.tokens import TokenLedger
from tests.runtime.torch_engine.builders import CFG, SOURCE, start_engine
from tests.runtime.torch_engine.crash_driver import MAX_NEW, PROMPTS

pytestmark = pytest.mark.torch
ROOT = Path(__file__).resolve().parents[3]
DEADLINE_S = 60.0
# NOTE: three drivers import torch and start five engines' ranks together; one alone paused
# after 15 s at a load average of 12, the three together missed 60 s at 15-18
PAUSE_DEADLINE_S = 240.0


def _wait_for(predicate: object, what: str, deadline_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + deadline_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def _read(journal: Path) -> tuple[dict[str, list[int]], bool, list[int]]:
    tokens: dict[str, list[int]] = {sid: [] for sid in PROMPTS}
    committed, pids = False, []
    for line in journal.read_text().splitlines():
        kind, *rest = line.split()
        if kind == "tok":
            tokens[rest[0]].append(int(rest[1]))
        elif kind == "commit":
            committed = True
        elif kind == "pids":
            pids += [int(p) for p in rest]
    return tokens, committed, pids


PHASES = ("prepare", "switch", "cleanup")


@pytest.fixture(scope="module")
def drivers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Popen, Path]]]:
    """One driver per phase, started together (their torch imports overlap)."""
    out = {}
    for phase in PHASES:
        journal = tmp_path_factory.mktemp(phase) / "journal"
        journal.touch()
        cmd = [sys.executable, "-m", "tests.runtime.torch_engine.crash_driver", str(journal), phase]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        out[phase] = (subprocess.Popen(cmd, cwd=ROOT, env=env), journal)
    try:
        yield out
    finally:
        for proc, _ in out.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(DEADLINE_S)


@functools.cache
def _reference() -> dict[str, list[int]]:
    return generate(CFG, SOURCE, PROMPTS, dict.fromkeys(PROMPTS, MAX_NEW))


@pytest.mark.parametrize("phase", PHASES)
def test_sigkill_in_phase_recovers_token_exact(
    drivers: dict[str, tuple[Popen, Path]], phase: str
) -> None:
    proc, journal = drivers[phase]
    try:
        _wait_for(
            lambda: "paused" in journal.read_text() or proc.poll() is not None,
            "pause",
            PAUSE_DEADLINE_S,
        )
        assert proc.poll() is None, f"driver exited {proc.returncode} before pausing"
        proc.send_signal(signal.SIGKILL)
        proc.wait(DEADLINE_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    done, committed, pids = _read(journal)
    assert committed == (phase == "cleanup")
    assert len(pids) == 3  # two TP2 ranks, one TP1 rank
    _wait_for(lambda: not any(_alive(p) for p in pids), "rank processes to die with the driver")
    assert all(done[sid] for sid in PROMPTS)  # every request had emitted tokens before the kill

    ledger = TokenLedger(CFG.vocab_size)
    for sid, prompt in PROMPTS.items():
        ledger.register(sid, prompt)
        for token in done[sid]:
            ledger.append(sid, token)
    engine = start_engine("tp1", ledger, prefix=f"recovered-{phase}")
    try:
        unfinished = [
            SeqSpec(sid, len(p), MAX_NEW, len(done[sid]))
            for sid, p in PROMPTS.items()
            if len(done[sid]) < MAX_NEW
        ]
        admit_all(engine, unfinished)
        run_to_completion([engine])
        assert engine.replay_mismatches == 0
    finally:
        engine.close()
    ref = _reference()
    for sid in PROMPTS:
        assert ledger.outputs(sid)[: len(done[sid])] == done[sid]  # completed tokens unchanged
        assert ledger.outputs(sid) == ref[sid]
