"""Micro-batch cuts and the pipelined device time (pure)."""

from __future__ import annotations

import pytest

from runtime.engine.torch.microbatch import micro_batches, pipelined_s

pytestmark = pytest.mark.unit


def test_cuts_are_contiguous_non_empty_and_balanced_by_tokens() -> None:
    assert micro_batches([5, 5, 5, 5], 2) == [(0, 2), (2, 4)]
    assert micro_batches([40, 1, 1, 1], 2) == [(0, 1), (1, 4)]  # a long prompt alone
    assert micro_batches([1, 1, 1, 40], 2) == [(0, 3), (3, 4)]
    assert micro_batches([10, 10], 4) == [(0, 1), (1, 2)]  # never more runs than sequences
    assert micro_batches([7], 3) == [(0, 1)]
    assert micro_batches([1, 2, 3], 1) == [(0, 3)]


def test_pipelined_time_overlaps_stages_and_is_their_sum_for_one_micro_batch() -> None:
    assert pipelined_s([[1.0, 2.0]]) == 3.0
    assert pipelined_s([[1.0, 1.0], [1.0, 1.0]]) == 3.0  # not 4: stage 0 runs m1 while 1 runs m0
    assert pipelined_s([[2.0, 1.0], [2.0, 1.0]]) == 5.0  # the slow first stage sets the pace
    assert pipelined_s([]) == 0.0
