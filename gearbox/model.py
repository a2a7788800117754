"""Model specification: the only immutable fact a plan is built around.

``ModelSpec.from_hf_config`` takes an already-parsed Hugging Face ``config.json`` mapping; the
caller reads the file (gearbox does no I/O).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from gearbox.serde import Serialisable

__all__ = ["ModelSpec"]

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "int8": 1}
_GATED_ACTIVATIONS = {"silu", "swiglu", "swish", "gelu_pytorch_tanh", "geglu"}


@dataclass(frozen=True, slots=True)
class ModelSpec(Serialisable):
    """A dense decoder-only transformer's shape."""

    name: str
    num_params: int  # total parameters (embeddings included)
    num_layers: int
    hidden_size: int
    num_heads: int  # query heads
    num_kv_heads: int  # == num_heads for multi-head attention, fewer for GQA/MQA
    head_dim: int
    dtype_bytes: int = 2  # bf16/fp16 weights and KV

    def __post_init__(self) -> None:
        for name in ("num_params", "num_layers", "hidden_size", "num_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads: must divide num_heads={self.num_heads}, got {self.num_kv_heads}"
            )
        if self.dtype_bytes not in (1, 2, 4):
            raise ValueError(f"dtype_bytes: must be 1, 2 or 4, got {self.dtype_bytes}")

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer: 2 × layers × kv_heads × head_dim × dtype bytes.

        For multi-head attention kv_heads × head_dim == hidden, giving the article's
        2 × layers × hidden × dtype bytes.
        """
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights in the serving dtype."""
        return self.num_params * self.dtype_bytes

    @property
    def attention_dim(self) -> int:
        """Width of the attention projections (num_heads × head_dim)."""
        return self.num_heads * self.head_dim

    def valid_tp_sizes(self, max_tp: int) -> tuple[int, ...]:
        """TP sizes up to ``max_tp`` that divide both the query heads and the KV heads."""
        common = math.gcd(self.num_heads, self.num_kv_heads)
        return tuple(tp for tp in range(1, max_tp + 1) if common % tp == 0)

    @classmethod
    def from_hf_config(
        cls,
        config: Mapping[str, object],
        *,
        name: str | None = None,
        dtype_bytes: int | None = None,
    ) -> ModelSpec:
        """Build a spec from a parsed Hugging Face ``config.json`` (Llama/Mistral/Qwen/GPT-2 keys).

        The parameter count is estimated from the shapes when the config does not state it:
        embeddings (twice unless tied) + per layer q/o (2·h·a), k/v (2·h·kv·d), the MLP
        (3·h·i for gated activations, else 2·h·i) and two norms (2·h), + the final norm (h).
        Raises ``ValueError`` naming a missing key.
        """
        layers = _int_key(config, "num_hidden_layers", "n_layer")
        hidden = _int_key(config, "hidden_size", "n_embd")
        heads = _int_key(config, "num_attention_heads", "n_head")
        kv_heads = _int_key(config, "num_key_value_heads", default=heads)
        head_dim = _int_key(config, "head_dim", default=hidden // heads)
        dtype = config.get("torch_dtype", "bfloat16")
        resolved_dtype = dtype_bytes or _DTYPE_BYTES.get(str(dtype), 2)
        params = config.get("num_parameters")
        if not isinstance(params, int):
            params = _estimate_params(config, layers, hidden, heads, kv_heads, head_dim)
        label = name or str(config.get("_name_or_path") or config.get("model_type") or "model")
        return cls(
            name=label,
            num_params=params,
            num_layers=layers,
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            dtype_bytes=resolved_dtype,
        )


def _int_key(config: Mapping[str, object], *keys: str, default: int | None = None) -> int:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    if default is None:
        raise ValueError(f"config.json: missing integer key {' / '.join(keys)}")
    return default


def _estimate_params(
    config: Mapping[str, object], layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int
) -> int:
    vocab = _int_key(config, "vocab_size", default=32000)
    intermediate = _int_key(config, "intermediate_size", "n_inner", default=4 * hidden)
    activation = str(config.get("hidden_act", config.get("activation_function", "gelu")))
    mlp_mats = 3 if activation in _GATED_ACTIVATIONS else 2
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    norms = 2 * hidden
    per_layer = attention + mlp_mats * hidden * intermediate + norms
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") is True else 2)
    return layers * per_layer + embeddings + hidden
