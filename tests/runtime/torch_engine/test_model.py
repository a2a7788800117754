"""The reference model's pieces on a device other than the CPU, without a GPU."""

from __future__ import annotations

import pytest
import torch

from runtime.engine.torch.model import rope

pytestmark = pytest.mark.unit


def test_rope_builds_its_frequencies_on_the_inputs_device() -> None:
    # on an H200 the CUDA shift test failed here: the frequencies were made on the CPU while
    # the positions and activations lived on cuda:0. The meta device reproduces the mismatch
    x = torch.empty(3, 2, 8, device="meta")
    out = rope(x, torch.arange(3, device="meta"), 10_000.0)
    assert out.device == x.device and out.shape == x.shape
    # and on the CPU it is still the rotation: position 0 leaves x as it is
    cpu = torch.randn(1, 2, 8)
    assert torch.allclose(rope(cpu, torch.zeros(1, dtype=torch.long), 10_000.0), cpu)
