"""Child process for the SIGKILL tests: serve on TP2, shift to TP1, stop inside one phase.

``python -m tests.runtime.torch_engine.crash_driver JOURNAL PHASE`` appends to JOURNAL one line
per event (``tok <seq> <id>`` per emitted token, ``commit`` at the route flip, ``pids ...`` for
its rank processes) and writes ``paused`` once inside PHASE (prepare: shadow loaded; switch: KV
exported and imported, not committed; cleanup: committed, new plan serving, old not closed),
then blocks until it is killed. Each line is one ``write`` of a line-buffered file, so a
SIGKILL never leaves a partial token behind (the kernel holds what ``write`` returned).
"""

from __future__ import annotations

import sys
import threading
from typing import TextIO

from gearbox.types import LinkClass
from runtime.engine.base import StepOutput
from runtime.engine.torch.engine import TorchEngine
from runtime.engine.torch.shift import admit_all, handover_plan
from runtime.engine.torch.tokens import TokenLedger
from tests.runtime.torch_engine.builders import CFG, make_prompts, specs, start_engine

MAX_NEW = 12
STEPS_BEFORE_SHIFT = 4
PROMPTS = make_prompts("crash", 6)


def _journal(out: TextIO, ledger: TokenLedger, before: dict[str, int]) -> None:
    for sid in PROMPTS:
        for token in ledger.outputs(sid)[before.get(sid, 0) :]:
            out.write(f"tok {sid} {token}\n")
        before[sid] = len(ledger.outputs(sid))


def _step(engine: TorchEngine, out: TextIO, ledger: TokenLedger, seen: dict[str, int]) -> None:
    result: StepOutput = engine.step(0.0)
    assert not result.failed, result.failed
    _journal(out, ledger, seen)


def main(path: str, phase: str) -> None:
    out = open(path, "a", buffering=1)  # noqa: SIM115 - held until the process is killed
    ledger = TokenLedger(CFG.vocab_size)
    for sid, prompt in PROMPTS.items():
        ledger.register(sid, prompt)
    seen: dict[str, int] = {}
    old = start_engine("tp2", ledger, prefix="crash-old")
    out.write("pids " + " ".join(str(rp.proc.pid) for rp in old._procs.values()) + "\n")
    admit_all(old, specs(PROMPTS, MAX_NEW))
    for _ in range(STEPS_BEFORE_SHIFT):
        _step(old, out, ledger, seen)
    new = start_engine("tp1", ledger, prefix="crash-new")  # prepare: the shadow plan
    out.write("pids " + " ".join(str(rp.proc.pid) for rp in new._procs.values()) + "\n")
    if phase != "prepare":
        plan = handover_plan(old, new, LinkClass("shm", 10.0, 0.0))
        ids = [h.seq_id for h in plan]
        new.import_kv(old.export_kv(ids, 0.0), 0.0, 0.0)  # switch: every sequence migrates
        assert new.staged_ready(ids, 0.0)
        if phase == "cleanup":
            new.activate(ids)
            old.drop(ids)
            out.write("commit\n")
            _step(new, out, ledger, seen)  # the new plan serves before the old one is closed
    out.write("paused\n")
    threading.Event().wait()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
