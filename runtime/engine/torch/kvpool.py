"""Block allocation for one pipeline's paged KV cache, committed page by page through the VMM.

All ranks of a pipeline share one block table per sequence (block ``b`` is slot ``b`` of every
rank's pool), so one allocator serves the pipeline. Blocks are grouped into pages of about the
VMM granularity; a page's bytes are committed on every GPU of the pipeline (all or nothing,
through :class:`runtime.vmm.manager.ReservationManager`) when its first block is taken and
released when its last block is freed. A refused commit makes ``allocate`` return ``None`` —
the engine turns it into ``OUT_OF_MEMORY`` and the runtime into a 429, never a crash.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping

from runtime.vmm.base import DEFAULT_GRANULARITY_BYTES
from runtime.vmm.manager import ReservationManager


class BlockAllocator:
    """Lowest-free-first block allocator with per-page VMM commits."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        bytes_per_block: Mapping[str, int],
        vmm: ReservationManager | None,
        replica_id: str,
        tag: str,
        granularity_bytes: int = DEFAULT_GRANULARITY_BYTES,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._bytes_per_block = dict(bytes_per_block)
        self._vmm = vmm
        self._replica_id = replica_id
        self._tag = tag
        largest = max(self._bytes_per_block.values(), default=1) or 1
        self.blocks_per_page = max(1, granularity_bytes // largest)
        self._free = list(range(num_blocks))
        heapq.heapify(self._free)
        self._page_refs: dict[int, int] = {}

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    @property
    def free_blocks(self) -> int:
        """Blocks not allocated."""
        return len(self._free)

    def _request(self, page: int) -> str:
        return f"kv/{self._tag}/page{page}"

    def _commit(self, page: int) -> bool:
        if self._vmm is None:
            return True
        per_page = {u: b * self.blocks_per_page for u, b in self._bytes_per_block.items()}
        return self._vmm.commit(self._replica_id, self._request(page), per_page)

    def allocate(self, count: int) -> list[int] | None:
        """``count`` blocks, or ``None`` when the pool or the VMM is out of memory."""
        if count > len(self._free):
            return None
        taken = [heapq.heappop(self._free) for _ in range(count)]
        committed: list[int] = []
        for block in taken:
            page = block // self.blocks_per_page
            if self._page_refs.get(page, 0) == 0 and page not in committed:
                if not self._commit(page):
                    for p in committed:
                        self._release_page(p)
                    for b in taken:
                        heapq.heappush(self._free, b)
                    return None
                committed.append(page)
        for block in taken:
            page = block // self.blocks_per_page
            self._page_refs[page] = self._page_refs.get(page, 0) + 1
        return taken

    def _release_page(self, page: int) -> None:
        if self._vmm is not None:
            self._vmm.release(self._replica_id, self._request(page))

    def free(self, blocks: Iterable[int]) -> None:
        """Return blocks; a page whose last block returns is released in the VMM."""
        for block in blocks:
            page = block // self.blocks_per_page
            heapq.heappush(self._free, block)
            self._page_refs[page] -= 1
            if self._page_refs[page] == 0:
                del self._page_refs[page]
                self._release_page(page)
