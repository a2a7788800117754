"""Weights: seeded random init or a local Hugging Face directory, read as one rank's shard.

A rank reads only its slice: query/key/value and gate/up rows of its heads and MLP columns,
the output and down projections' matching columns, and only its layers. From a safetensors file
that is a sliced read (``safe_open(...).get_slice``), so a TP2 rank reads half a layer; seeded
random init builds each full tensor from a per-tensor seed and slices it, so every layout of the
same seed holds bit-identical weights. Embeddings and the LM head are replicated (first and
last stage) — they are not split across TP ranks.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from runtime.engine.torch.config import LlamaConfig
from runtime.engine.torch.layout import RankSpec

Getter = Callable[[str, int | None, int, int], torch.Tensor]  # name, dim, start, end
RANDOM_PREFIX = "random:"
_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def hf_names(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the Hugging Face Llama layout and its shape."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    names: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        names[p + "self_attn.q_proj.weight"] = (cfg.num_heads * d, h)
        names[p + "self_attn.k_proj.weight"] = (cfg.num_kv_heads * d, h)
        names[p + "self_attn.v_proj.weight"] = (cfg.num_kv_heads * d, h)
        names[p + "self_attn.o_proj.weight"] = (h, cfg.num_heads * d)
        names[p + "mlp.gate_proj.weight"] = (i, h)
        names[p + "mlp.up_proj.weight"] = (i, h)
        names[p + "mlp.down_proj.weight"] = (h, i)
        names[p + "input_layernorm.weight"] = (h,)
        names[p + "post_attention_layernorm.weight"] = (h,)
    names["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = (cfg.vocab_size, h)
    return names


def random_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A tensor from a seed of its own (so any subset of tensors is reproducible)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if len(shape) == 1:  # norm weights: near one, not exactly (exercises the multiply)
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    std = 1.0 if "embed" in name else shape[1] ** -0.5
    return torch.randn(shape, generator=gen) * std


def init_weights(cfg: LlamaConfig, seed: int) -> dict[str, torch.Tensor]:
    """The whole model, seeded."""
    return {n: random_tensor(n, s, seed) for n, s in hf_names(cfg).items()}


def save_hf(directory: Path, cfg: LlamaConfig, weights: dict[str, torch.Tensor]) -> None:
    """Write ``config.json`` and ``model.safetensors`` the way Hugging Face lays them out."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg.to_hf(), indent=1))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / "model.safetensors"))


def read_config(source: str, default: LlamaConfig) -> LlamaConfig:
    """The model config of a weight source (a directory's ``config.json``, else ``default``)."""
    if source.startswith(RANDOM_PREFIX):
        return default
    return LlamaConfig.from_hf(json.loads((Path(source) / "config.json").read_text()))


def _getter(source: str, cfg: LlamaConfig) -> tuple[Getter, Callable[[], None]]:
    if source.startswith(RANDOM_PREFIX):
        seed = int(source[len(RANDOM_PREFIX) :])
        shapes = hf_names(cfg)

        def random_get(name: str, dim: int | None, start: int, end: int) -> torch.Tensor:
            full = random_tensor(name, shapes[name], seed)
            return full if dim is None else full.narrow(dim, start, end - start).clone()

        return random_get, lambda: None
    files = sorted(Path(source).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{source}: no *.safetensors file")
    handles = [safe_open(str(f), framework="pt") for f in files]
    where = {k: h for h in handles for k in h.keys()}  # noqa: SIM118 (safe_open is not a dict)

    def file_get(name: str, dim: int | None, start: int, end: int) -> torch.Tensor:
        if name not in where:
            raise KeyError(f"{source}: tensor {name} missing")
        part = where[name].get_slice(name)
        if dim is None:
            tensor = part[:]
        elif dim == 0:
            tensor = part[start:end]
        else:
            tensor = part[:, start:end]
        return tensor.to(torch.float32).contiguous()

    return file_get, lambda: None


def load_shard(source: str, cfg: LlamaConfig, spec: RankSpec) -> dict[str, torch.Tensor]:
    """The tensors rank ``spec`` needs, under short local names (see module docstring)."""
    get, done = _getter(source, cfg)
    d, tp, r = cfg.head_dim, spec.tp_size, spec.tp_rank
    q_rows = (r * cfg.num_heads // tp * d, (r + 1) * cfg.num_heads // tp * d)
    kv_rows = (spec.kv_head_start * d, spec.kv_head_end * d)
    mlp = (r * cfg.intermediate_size // tp, (r + 1) * cfg.intermediate_size // tp)
    out: dict[str, torch.Tensor] = {}
    if spec.is_first:
        out["embed"] = get("model.embed_tokens.weight", None, 0, 0)
    for layer in range(spec.layer_start, spec.layer_end):
        p, local = f"model.layers.{layer}.", f"l{layer}."
        out[local + "wq"] = get(p + "self_attn.q_proj.weight", 0, *q_rows)
        out[local + "wk"] = get(p + "self_attn.k_proj.weight", 0, *kv_rows)
        out[local + "wv"] = get(p + "self_attn.v_proj.weight", 0, *kv_rows)
        out[local + "wo"] = get(p + "self_attn.o_proj.weight", 1, *q_rows)
        out[local + "w_gate"] = get(p + "mlp.gate_proj.weight", 0, *mlp)
        out[local + "w_up"] = get(p + "mlp.up_proj.weight", 0, *mlp)
        out[local + "w_down"] = get(p + "mlp.down_proj.weight", 1, *mlp)
        out[local + "attn_norm"] = get(p + "input_layernorm.weight", None, 0, 0)
        out[local + "mlp_norm"] = get(p + "post_attention_layernorm.weight", None, 0, 0)
    if spec.is_last:
        out["norm"] = get("model.norm.weight", None, 0, 0)
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        out["lm_head"] = get(head, None, 0, 0)
    done()
    return out


def shard_bytes(cfg: LlamaConfig, spec: RankSpec) -> int:
    """Bytes of the shard :func:`load_shard` returns (float32), without loading it."""
    h, d, tp = cfg.hidden_size, cfg.head_dim, spec.tp_size
    attn = 2 * h * cfg.num_heads * d // tp + 2 * h * spec.num_kv_heads * d
    per_layer = attn + 3 * h * cfg.intermediate_size // tp + 2 * h
    total = spec.num_layers * per_layer
    if spec.is_first:
        total += cfg.vocab_size * h
    if spec.is_last:
        total += h + cfg.vocab_size * h
    return total * 4
