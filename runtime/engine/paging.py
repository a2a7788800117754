"""Paged KV admission: the one rule the live engine and both benchmarks apply, with no foresight.

A sequence holds KV in pages of :data:`PAGE_TOKENS` tokens. What it takes when admitted (or
resumed after a preemption) is computed from what the client states — the prompt and
``max_tokens`` — and the tokens generated so far, never from the output length the request will
turn out to have:

* :attr:`KvAdmission.INCREMENTAL` (paged, as vLLM runs it): pages for the context plus one page
  of headroom; the engine grows them page by page as tokens are generated.
* :attr:`KvAdmission.MAX_TOKENS`: pages for prompt + the stated ``max_tokens``, taken at once.

When a page cannot be had, the engine preempts the youngest running sequence
(:func:`preemption_victim`): its pages are freed and it waits first in line; when resumed it
prefills prompt + the tokens it already generated again (recompute), and those stay as they were.
Pure functions, no I/O; :class:`KvPager` is the seam through which an engine holds its pages in
the runtime's VMM ledger (:class:`runtime.serving.ServingCore` implements it per replica).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    from _typeshed import SupportsRichComparison

__all__ = [
    "PAGE_TOKENS",
    "CoveringPager",
    "KvAdmission",
    "KvPager",
    "PagedEngine",
    "admission_tokens",
    "paged",
    "preemption_victim",
]

PAGE_TOKENS = 16  # vLLM's default block size

T = TypeVar("T")


class KvAdmission(StrEnum):
    """How much KV a sequence takes when admitted; neither reads its actual output length."""

    INCREMENTAL = "incremental"  # paged: the context's pages + one, grown before each step
    MAX_TOKENS = "max_tokens"  # prompt + the client's stated max_tokens, taken on admission


def paged(tokens: int) -> int:
    """``tokens`` rounded up to whole pages (in tokens)."""
    return -(-tokens // PAGE_TOKENS) * PAGE_TOKENS


def admission_tokens(
    mode: KvAdmission, prompt_tokens: int, generated_tokens: int, max_tokens: int
) -> int:
    """KV tokens (whole pages) a sequence takes when admitted or resumed after a preemption."""
    if mode is KvAdmission.MAX_TOKENS:
        return paged(prompt_tokens + max_tokens)
    return paged(prompt_tokens + generated_tokens + PAGE_TOKENS)


def preemption_victim(running: Iterable[T], age: Callable[[T], SupportsRichComparison]) -> T:
    """The sequence to preempt when a page cannot be had: the youngest (largest ``age``).

    NOTE: preempting the youngest keeps the oldest sequences progressing, so every sequence
    eventually finishes; preempting the largest would starve long contexts.
    """
    return max(running, key=age)


class KvPager(Protocol):
    """Where one replica's engine holds its sequences' KV pages (the runtime's VMM ledger)."""

    def hold(self, seq_id: str, tokens: int) -> bool:
        """Hold KV for at least ``tokens`` tokens of the sequence (it may already hold more);
        False when the pages are not there — the engine then preempts, never crashes."""
        ...

    def release(self, seq_id: str) -> None:
        """Give back every page the sequence holds (a preemption); idempotent."""
        ...


@runtime_checkable
class CoveringPager(KvPager, Protocol):
    """A :class:`KvPager` that says, without holding anything, which ``hold`` calls it would
    answer True at no cost: an engine skips those (they change nothing).

    ``covered(seq_id)``: the tokens the sequence's pages are known to cover (−1 when none), so
    that ``hold(seq_id, t)`` is True and changes nothing for every ``t`` up to it. It stays
    so until ``hold`` is called for that sequence, its id is appended to ``dropped`` (its
    figure was forgotten: its pages were given back; the engine reads and clears the list) or
    ``epoch`` changes (every figure was forgotten).
    """

    epoch: int
    dropped: list[str]

    def covered(self, seq_id: str) -> int:
        """Tokens the sequence's held pages cover (−1: none known)."""
        ...


@runtime_checkable
class PagedEngine(Protocol):
    """An engine that applies this rule itself, holding its pages through a :class:`KvPager`."""

    def attach_pager(self, pager: KvPager, mode: KvAdmission) -> None:
        """From now on hold KV through ``pager`` under ``mode``, preempting when refused."""
        ...
