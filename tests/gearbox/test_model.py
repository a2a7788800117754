"""Model specs: KV bytes per token, presets, Hugging Face config parsing, TP sizes."""

from __future__ import annotations

import json

import pytest

from gearbox import MODEL_7B_MHA, MODEL_70B_GQA, ModelSpec

LLAMA2_70B_CONFIG = {
    "_name_or_path": "meta-llama/Llama-2-70b-hf",
    "hidden_act": "silu",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "model_type": "llama",
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "vocab_size": 32000,
}


@pytest.mark.unit
def test_kv_bytes_per_token_formula() -> None:
    # 2 × layers × kv_heads × head_dim × dtype bytes
    assert MODEL_7B_MHA.kv_bytes_per_token == 2 * 32 * 32 * 128 * 2 == 512 * 1024
    assert MODEL_70B_GQA.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 320 * 1024


@pytest.mark.unit
def test_gqa_needs_less_kv_than_mha_of_the_same_width() -> None:
    mha = ModelSpec("70b-mha", 70_000_000_000, 80, 8192, 64, 64, 128)
    assert mha.kv_bytes_per_token == 8 * MODEL_70B_GQA.kv_bytes_per_token


@pytest.mark.unit
def test_from_hf_config_matches_preset() -> None:
    spec = ModelSpec.from_hf_config(json.loads(json.dumps(LLAMA2_70B_CONFIG)))
    assert spec.name == "meta-llama/Llama-2-70b-hf"
    assert (spec.num_layers, spec.hidden_size, spec.num_heads) == (80, 8192, 64)
    assert (spec.num_kv_heads, spec.head_dim, spec.dtype_bytes) == (8, 128, 2)
    assert spec.num_params == MODEL_70B_GQA.num_params
    assert spec.kv_bytes_per_token == MODEL_70B_GQA.kv_bytes_per_token


@pytest.mark.unit
def test_from_hf_config_gpt2_keys_and_defaults() -> None:
    spec = ModelSpec.from_hf_config(
        {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "model_type": "gpt2"},
        dtype_bytes=4,
    )
    assert spec.num_kv_heads == 12 and spec.head_dim == 64 and spec.dtype_bytes == 4
    assert 80_000_000 < spec.num_params < 200_000_000  # GPT-2 small is ~124M
    assert spec.name == "gpt2"


@pytest.mark.unit
def test_from_hf_config_names_the_missing_key() -> None:
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ModelSpec.from_hf_config({"hidden_size": 8, "num_attention_heads": 2})


@pytest.mark.unit
def test_invalid_specs_are_rejected() -> None:
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelSpec("bad", 1, 1, 8, 8, 3, 1)
    with pytest.raises(ValueError, match="dtype_bytes"):
        ModelSpec("bad", 1, 1, 8, 8, 8, 1, dtype_bytes=3)


@pytest.mark.unit
def test_valid_tp_sizes_divide_query_and_kv_heads() -> None:
    assert MODEL_70B_GQA.valid_tp_sizes(16) == (1, 2, 4, 8)
    assert MODEL_7B_MHA.valid_tp_sizes(12) == (1, 2, 4, 8)
    assert ModelSpec("odd", 1, 1, 40 * 128, 40, 40, 128).valid_tp_sizes(8) == (1, 2, 4, 5, 8)


@pytest.mark.unit
def test_model_spec_round_trips() -> None:
    assert ModelSpec.from_dict(json.loads(json.dumps(MODEL_7B_MHA.to_dict()))) == MODEL_7B_MHA
