"""Weights from a local Hugging Face directory load as the same shards as seeded init."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.engine.torch.layout import plan_ranks
from runtime.engine.torch.plans import make_plan
from runtime.engine.torch.reference import generate
from runtime.engine.torch.weights import init_weights, load_shard, read_config, save_hf
from tests.runtime.torch_engine.builders import CFG, SOURCE, make_prompts

pytestmark = pytest.mark.unit


def test_hf_directory_shards_equal_seeded_shards(tmp_path: Path) -> None:
    save_hf(tmp_path, CFG, init_weights(CFG, 7))
    assert read_config(str(tmp_path), CFG) == CFG
    for kind in ("tp2", "tp2pp2"):
        for spec in plan_ranks(make_plan(kind, CFG.num_layers, kind), CFG):
            from_file = load_shard(str(tmp_path), CFG, spec)
            seeded = load_shard(SOURCE, CFG, spec)
            assert from_file.keys() == seeded.keys()
            assert all(torch.equal(from_file[k], seeded[k]) for k in seeded)
    prompts = make_prompts("hf", 2)
    budget = dict.fromkeys(prompts, 6)
    assert generate(CFG, str(tmp_path), prompts, budget) == generate(CFG, SOURCE, prompts, budget)


def test_tp_shard_is_half_of_the_layer() -> None:
    spec = plan_ranks(make_plan("tp2", CFG.num_layers, "x"), CFG)[1]
    shard = load_shard(SOURCE, CFG, spec)
    assert shard["l0.wq"].shape == (CFG.hidden_size // 2, CFG.hidden_size)
    assert shard["l0.w_down"].shape == (CFG.hidden_size, CFG.intermediate_size // 2)
