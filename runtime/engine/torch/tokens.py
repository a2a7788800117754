"""The token ledger: prompt and output token ids of every sequence a deployment serves.

The :class:`runtime.engine.base.Engine` protocol speaks in token counts; a real engine needs
the ids. The ledger is shared by a deployment's engines (the runtime owns it; on a real server
the ids arrive with the request and leave in the response stream), so a replay on another plan
re-prefills exactly the tokens already emitted. Prompts not registered are derived from the
sequence id (deterministic), so count-only callers such as the load generator still work.

The ledger is the record of what was emitted: an engine resumes a sequence from every token the
ledger holds for it, never fewer (a count the runtime passes is a lower bound: a restarted
worker's journal knows the request, not its progress).

Durable ledger (``path`` given): one append-only file per deployment, read back when the ledger
is built — before the runtime's ``recover`` replays the journal's unfinished requests, which
then resume after their last emitted token instead of generating again. Records are lines:
``P <seq> <id>...`` (prompt), ``T <seq> <index> <id>`` (the index-th output),
``F <seq>`` (finished). fsync policy: :meth:`flush` — called by the engine at the end of each
step, before the step's tokens are reported to the runtime — hands the step's records to the
kernel in one ``write``, so a killed process (SIGKILL, OOM killer) loses no token it reported;
with ``fsync=True`` it also fsyncs, so a host crash loses none either (off by default: one
fsync per step is the cost). A torn last line is skipped on reading. Loading compacts the file
to the sequences not finished: a finished sequence is forgotten at the next start.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import quote, unquote


def _key(seq_id: str) -> str:
    # NOTE: request ids come from clients: quoted so a space or newline cannot split a record
    return quote(seq_id, safe="")


class TokenLedger:
    """Prompt and generated token ids per sequence id, optionally durable (module docstring)."""

    def __init__(self, vocab_size: int, path: Path | None = None, *, fsync: bool = False) -> None:
        self.vocab_size = vocab_size
        self.path = path
        self.fsync = fsync
        self._prompts: dict[str, list[int]] = {}
        self._outputs: dict[str, list[int]] = {}
        self._pending: list[str] = []  # records not yet handed to the kernel
        self._fd: int | None = None
        if path is not None:
            self._load(path)
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    # ---- durability ----------------------------------------------------------------------------

    def _load(self, path: Path) -> None:
        finished: set[str] = set()
        text = path.read_text() if path.exists() else ""
        lines = text.split("\n")[:-1]  # NOTE: the last piece has no newline: torn or empty
        for line in lines:
            parts = line.split()
            try:
                parts[1] = unquote(parts[1])
                if parts[0] == "P":
                    self._prompts[parts[1]] = [int(t) for t in parts[2:]]
                    self._outputs.setdefault(parts[1], [])
                elif parts[0] == "T":
                    out = self._outputs.setdefault(parts[1], [])
                    if int(parts[2]) == len(out):  # a repeat or a gap is not a next token
                        out.append(int(parts[3]))
                elif parts[0] == "F":
                    finished.add(parts[1])
            except (IndexError, ValueError):
                continue
        for sid in finished:
            self._prompts.pop(sid, None)
            self._outputs.pop(sid, None)
        # NOTE: written aside and renamed over the old file: a kill mid-compaction leaves
        # either file whole
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            for sid, prompt in self._prompts.items():
                f.write(self._prompt_record(sid, prompt))
            for sid, out in self._outputs.items():
                f.writelines(f"T {_key(sid)} {i} {t}\n" for i, t in enumerate(out))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @staticmethod
    def _prompt_record(seq_id: str, prompt: Sequence[int]) -> str:
        return " ".join(["P", _key(seq_id), *map(str, prompt)]) + "\n"

    def flush(self) -> None:
        """Hand the records since the last flush to the kernel (and fsync when asked)."""
        if self._fd is None or not self._pending:
            return
        data = "".join(self._pending).encode()
        self._pending.clear()
        while data:
            data = data[os.write(self._fd, data) :]
        if self.fsync:
            os.fsync(self._fd)

    def close(self) -> None:
        """Flush and close the file; idempotent."""
        self.flush()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _record(self, line: str) -> None:
        if self._fd is not None:
            self._pending.append(line)

    # ---- sequences -----------------------------------------------------------------------------

    def register(self, seq_id: str, prompt: Sequence[int]) -> None:
        """Set a sequence's prompt ids (before admission)."""
        self._prompts[seq_id] = list(prompt)
        self._outputs.setdefault(seq_id, [])
        self._record(self._prompt_record(seq_id, prompt))

    def prompt(self, seq_id: str, num_tokens: int) -> list[int]:
        """The prompt's ids (derived from the id when not registered)."""
        if seq_id not in self._prompts:
            rng = random.Random(seq_id)
            self.register(seq_id, [rng.randrange(self.vocab_size) for _ in range(num_tokens)])
        return self._prompts[seq_id][:num_tokens]

    def outputs(self, seq_id: str) -> list[int]:
        """Generated ids so far (a copy)."""
        return list(self._outputs.get(seq_id, []))

    def resume(self, seq_id: str, at_least: int) -> list[int]:
        """Every output emitted so far, from which a replay continues; the caller's count
        ``at_least`` is a lower bound (an error when the ledger holds fewer)."""
        out = self._outputs.setdefault(seq_id, [])
        if len(out) < at_least:
            raise ValueError(f"{seq_id}: ledger holds {len(out)} outputs, spec says {at_least}")
        return list(out)

    def append(self, seq_id: str, token: int) -> None:
        """Record one generated token."""
        out = self._outputs.setdefault(seq_id, [])
        self._record(f"T {_key(seq_id)} {len(out)} {token}\n")
        out.append(token)

    def finish(self, seq_id: str) -> None:
        """The sequence emitted its last token (kept in memory; forgotten at the next load)."""
        self._record(f"F {_key(seq_id)}\n")
