"""The article's arithmetic, reproduced with gearbox's own functions."""

from __future__ import annotations

import pytest

from gearbox import DEFAULT_CONFIG, MODEL_70B_GQA, ModelSpec, build_blocks, enumerate_options
from gearbox.presets import GIB
from tests.gearbox.builders import article_cluster

# "70B-class" as the article computes it: hidden 8192, 64 layers, FP16, K and V for every head.
ARTICLE_70B = ModelSpec(
    name="article-70b",
    num_params=70_000_000_000,
    num_layers=64,
    hidden_size=8192,
    num_heads=64,
    num_kv_heads=64,
    head_dim=128,
    dtype_bytes=2,
)


@pytest.mark.unit
def test_kv_per_token_is_about_2_mb() -> None:
    # 2 (K and V) × 64 layers × 8192 hidden × 2 bytes = 2,097,152 bytes = 2 MiB ≈ 2 MB
    assert ARTICLE_70B.kv_bytes_per_token == 2 * 64 * 8192 * 2 == 2 * 1024**2


@pytest.mark.unit
def test_a_2k_token_request_holds_about_4_gb() -> None:
    assert ARTICLE_70B.kv_bytes_per_token * 2048 == 4 * GIB


@pytest.mark.unit
def test_70b_weights_fit_tp8_on_block_a() -> None:
    # 70B parameters in bf16 ≈ 140 GB; block A's 80 GB GPUs carry it at TP8 (and TP4), not TP1.
    assert 137e9 < MODEL_70B_GQA.weight_bytes < 141e9
    snapshot = article_cluster()
    blocks = build_blocks(snapshot, DEFAULT_CONFIG)
    free = {g.uuid: g.free_memory_bytes for g in snapshot.gpus}
    options = enumerate_options(blocks, snapshot, MODEL_70B_GQA, 1000, 200, free, DEFAULT_CONFIG)
    on_a = {o.label.split("@")[0] for o in options if o.block_ids[0].startswith("A:")}
    assert {"tp8", "tp4"} <= on_a
    assert "tp1" not in on_a
