"""The token ledger: prompt and output token ids of every sequence a deployment serves.

The :class:`runtime.engine.base.Engine` protocol speaks in token counts; a real engine needs
the ids. The ledger is shared by a deployment's engines (the runtime owns it; on a real server
the ids arrive with the request and leave in the response stream), so a replay on another plan
re-prefills exactly the tokens already emitted. Prompts not registered are derived from the
sequence id (deterministic), so count-only callers such as the load generator still work.
"""

from __future__ import annotations

import random
from collections.abc import Sequence


class TokenLedger:
    """Prompt and generated token ids per sequence id."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._prompts: dict[str, list[int]] = {}
        self._outputs: dict[str, list[int]] = {}

    def register(self, seq_id: str, prompt: Sequence[int]) -> None:
        """Set a sequence's prompt ids (before admission)."""
        self._prompts[seq_id] = list(prompt)
        self._outputs.setdefault(seq_id, [])

    def prompt(self, seq_id: str, num_tokens: int) -> list[int]:
        """The prompt's ids (derived from the id when not registered)."""
        if seq_id not in self._prompts:
            rng = random.Random(seq_id)
            self.register(seq_id, [rng.randrange(self.vocab_size) for _ in range(num_tokens)])
        return self._prompts[seq_id][:num_tokens]

    def outputs(self, seq_id: str) -> list[int]:
        """Generated ids so far (a copy)."""
        return list(self._outputs.get(seq_id, []))

    def truncate(self, seq_id: str, num_tokens: int) -> list[int]:
        """Keep the first ``num_tokens`` outputs (what the replaying side knows) and return them."""
        kept = self._outputs.setdefault(seq_id, [])[:num_tokens]
        if len(kept) < num_tokens:
            raise ValueError(f"{seq_id}: ledger holds {len(kept)} outputs, spec says {num_tokens}")
        self._outputs[seq_id] = kept
        return list(kept)

    def append(self, seq_id: str, token: int) -> None:
        """Record one generated token."""
        self._outputs.setdefault(seq_id, []).append(token)
