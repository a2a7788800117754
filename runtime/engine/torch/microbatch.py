"""Pipeline micro-batches: how a packed batch is cut, and the device time of the overlap. Pure.

A pipeline of several stages passes its batch as micro-batches: stage k runs micro-batch m
while stage k+1 runs micro-batch m-1 (each stage its own GPU — here its own rank processes).
Sequences are never split (a micro-batch is a run of whole sequences, their KV in their own
blocks), so every sequence's tokens are those of the unsplit batch.
"""

from __future__ import annotations

from collections.abc import Sequence


def micro_batches(sizes: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """Cut ``sizes`` (tokens per sequence, in batch order) into at most ``parts`` contiguous,
    non-empty runs of near-equal tokens; (start, end) index ranges."""
    parts = max(1, min(parts, len(sizes)))
    total = sum(sizes)
    cuts: list[tuple[int, int]] = []
    at = acc = 0
    for i, size in enumerate(sizes):
        acc += size
        left = len(sizes) - i - 1  # sequences after this one
        need = parts - len(cuts) - 1  # runs still to open after the current one
        # NOTE: close the run once it reaches its share of the tokens, or when each run still
        # to open needs one of the sequences left
        if need and (acc >= total * (len(cuts) + 1) / parts or left == need):
            cuts.append((at, i + 1))
            at = i + 1
    cuts.append((at, len(sizes)))
    return [c for c in cuts if c[0] < c[1]]


def pipelined_s(busy: Sequence[Sequence[float]]) -> float:
    """Device time of micro-batches through stages: ``busy[m][s]`` is stage s's time on
    micro-batch m; a stage starts a micro-batch once it finished the previous one and the
    previous stage handed it on (the flow-shop recurrence). One micro-batch: the stages' sum."""
    done: list[float] = []
    for times in busy:
        prev = 0.0
        for s, t in enumerate(times):
            if s == len(done):
                done.append(0.0)
            done[s] = max(done[s], prev) + t
            prev = done[s]
    return done[-1] if done else 0.0
