"""The candidate cache: replica options memoised by (block signature, model, request profile).

A trigger touches a few blocks (a GPU lost, one GPU's free memory moved); every other block's
replica options are what they were on the previous decision. :func:`candidates.enumerate_options`
looks each block's TP options, the pipeline options over the blocks that cannot host the model
alone, and each prefill/decode pairing up here under a key that holds everything the options are
computed from — the block's GPUs with their class, node and the exact bytes a plan may use there,
its link, the model, the configuration and the request profile — so a hit returns exactly what
enumerating again would (the cache is a memo: pure, deterministic, only faster), and only what a
trigger touched is enumerated again.

Bounded (least recently used entries go first); :func:`clear` empties it (benchmarks, tests).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from gearbox.blocks import AtomicBlock
from gearbox.types import Gpu

__all__ = ["OPTIONS", "CacheStats", "Key", "OptionCache", "block_signature", "clear"]

V = TypeVar("V")
MAX_ENTRIES = 16_384  # ~ a few decisions' worth of options for a 2,048-GPU cluster, many models


class Key:
    """A cache key part hashed once: signatures are looked up several times per decision (a
    block's TP options, then each prefill/decode pairing it is in), and hashing a block's GPUs or
    the model and configuration afresh each time would cost more than the lookups save."""

    __slots__ = ("_hash", "parts")

    def __init__(self, *parts: Hashable) -> None:
        self.parts = parts
        self._hash = hash(parts)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Key):
            return NotImplemented
        return self._hash == other._hash and self.parts == other.parts

    def __repr__(self) -> str:
        return f"Key{self.parts!r}"


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Lookups answered from the cache and computed."""

    hits: int
    misses: int
    entries: int


class OptionCache:
    """A bounded least-recently-used memo; values must be immutable (they are shared)."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError("max_entries: must be positive")
        self._entries: OrderedDict[Hashable, object] = OrderedDict()
        self._keys: dict[Key, Key] = {}  # each distinct key part's one instance (:meth:`intern`)
        self._max = max_entries
        self._hits = 0
        self._misses = 0

    def get_or(self, key: Hashable, compute: Callable[[], V]) -> V:
        """The value cached under ``key``, else ``compute()`` (stored)."""
        entries = self._entries
        if key in entries:
            entries.move_to_end(key)
            self._hits += 1
            value: V = entries[key]  # type: ignore[assignment]  # NOTE: keys pin their value type
            return value
        self._misses += 1
        value = compute()
        entries[key] = value
        if len(entries) > self._max:
            entries.popitem(last=False)
        return value

    def intern(self, key: Key) -> Key:
        """The one instance of the key parts equal to ``key`` (``key`` itself the first time).

        NOTE: a hit compares the stored key with the one looked up part by part; with every part
        interned that is an identity check per part, where equal copies compared the model, the
        configuration and every GPU of a block again on each of a decision's ~300 lookups.
        """
        known = self._keys.setdefault(key, key)
        if len(self._keys) > self._max:  # NOTE: only an optimisation: start again
            self._keys = {key: key}
            return key
        return known

    def clear(self) -> None:
        """Drop every entry and reset the counters."""
        self._entries.clear()
        self._keys.clear()
        self._hits = self._misses = 0

    @property
    def stats(self) -> CacheStats:
        """Hits, misses and entries since the last :meth:`clear`."""
        return CacheStats(self._hits, self._misses, len(self._entries))


OPTIONS = OptionCache()  # the process's replica-option memo (candidates.enumerate_options)


def block_signature(block: AtomicBlock, gpus: Sequence[Gpu], available: Mapping[str, int]) -> Key:
    """What a block's options depend on: its id, domain and link, and per usable GPU (in the
    order options use them) the uuid, class, node and bytes a plan may use there."""
    return Key(
        block.block_id,
        block.domain_id,
        block.link,
        tuple((g.uuid, g.gpu_class, g.node, available.get(g.uuid, 0)) for g in gpus),
    )


def clear() -> None:
    """Empty the process's option cache."""
    OPTIONS.clear()
