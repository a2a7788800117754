"""The token ledger's durable file: read back, torn tails, compaction, ids that need quoting."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.engine.torch.tokens import TokenLedger

pytestmark = pytest.mark.unit


def test_flushed_tokens_survive_a_restart_and_unflushed_ones_do_not(tmp_path: Path) -> None:
    path = tmp_path / "ledger"
    first = TokenLedger(64, path)
    first.register("a b\nc", [1, 2, 3])  # a client's id: space and newline quoted
    prompt = first.prompt("derived", 4)
    for token in (7, 8):
        first.append("a b\nc", token)
    first.append("derived", 9)
    first.flush()
    first.append("a b\nc", 10)  # a step that never returned: not reported, not durable
    again = TokenLedger(64, path)
    assert again.prompt("a b\nc", 3) == [1, 2, 3]
    assert again.prompt("derived", 4) == prompt
    assert again.outputs("a b\nc") == [7, 8]
    assert again.outputs("derived") == [9]


def test_a_torn_tail_and_repeated_indices_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "ledger"
    path.write_text("P s 1 2\nT s 0 5\nT s 0 6\nT s 2 7\nT s 1 8\nT s 2 9")  # last line torn
    ledger = TokenLedger(64, path)
    assert ledger.outputs("s") == [5, 8]
    ledger.append("s", 4)
    ledger.close()
    assert TokenLedger(64, path).outputs("s") == [5, 8, 4]


def test_finished_sequences_are_compacted_away_on_load(tmp_path: Path) -> None:
    path = tmp_path / "ledger"
    ledger = TokenLedger(64, path)
    for sid in ("done", "live"):
        ledger.register(sid, [1])
        ledger.append(sid, 2)
    ledger.finish("done")
    ledger.close()
    assert ledger.outputs("done") == [2]  # kept in memory for the caller's report
    again = TokenLedger(64, path)
    assert again.outputs("done") == [] and again.outputs("live") == [2]
    assert "done" not in path.read_text()


def test_resume_returns_every_emitted_token_and_refuses_a_longer_count() -> None:
    ledger = TokenLedger(64)
    ledger.register("s", [1])
    for token in (3, 4, 5):
        ledger.append("s", token)
    assert ledger.resume("s", 0) == [3, 4, 5]  # a restarted runtime's count is a lower bound
    with pytest.raises(ValueError, match="holds 3"):
        ledger.resume("s", 4)
