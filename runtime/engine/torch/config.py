"""The decoder's shape: a Llama-style config read from a Hugging Face ``config.json`` mapping.

Pure: no torch. :meth:`LlamaConfig.model_spec` gives gearbox the same model the engine runs, so
the cost model and the engine agree on layers, heads and KV bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

from gearbox.model import ModelSpec

F32_BYTES = 4  # the reference engine computes and stores KV in float32


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """A dense Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU)."""

    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 4
    num_heads: int = 4  # query heads
    num_kv_heads: int = 2  # KV heads (GQA: num_heads is a multiple)
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    name: str = "tiny-llama"

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size: must be a multiple of num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: must divide num_heads={self.num_heads}")
        if self.head_dim % 2:
            raise ValueError("head_dim: RoPE needs an even head dimension")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_heads

    @property
    def num_params(self) -> int:
        """Parameters, embeddings included (the lm head counted once when tied)."""
        h, d = self.hidden_size, self.head_dim
        attention = 2 * h * self.num_heads * d + 2 * h * self.num_kv_heads * d
        per_layer = attention + 3 * h * self.intermediate_size + 2 * h
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + h

    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, float32."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * F32_BYTES

    def valid_tp(self, tp: int) -> bool:
        """True when ``tp`` splits query heads, KV heads and the MLP evenly."""
        return (
            self.num_heads % tp == 0
            and self.num_kv_heads % tp == 0
            and self.intermediate_size % tp == 0
        )

    def model_spec(self) -> ModelSpec:
        """The same model as gearbox sees it (float32 weights and KV)."""
        return ModelSpec(
            name=self.name,
            num_params=self.num_params,
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype_bytes=F32_BYTES,
        )

    def to_hf(self) -> dict[str, object]:
        """A Hugging Face ``config.json`` mapping for this model."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "_name_or_path": self.name,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }

    @classmethod
    def from_hf(cls, data: Mapping[str, object]) -> LlamaConfig:
        """Read a parsed ``config.json``; raises ``ValueError`` naming a missing or bad key."""

        def need_int(key: str, default: int | None = None) -> int:
            value = data.get(key, default)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"config.json: {key} must be an integer, got {value!r}")
            return value

        act = data.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"config.json: hidden_act {act!r} is not SwiGLU (silu)")
        heads = need_int("num_attention_heads")
        hidden = need_int("hidden_size")
        if data.get("head_dim") not in (None, hidden // heads):
            raise ValueError("config.json: head_dim must equal hidden_size / num_attention_heads")
        return cls(
            vocab_size=need_int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need_int("intermediate_size"),
            num_layers=need_int("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=need_int("num_key_value_heads", heads),
            rope_theta=float(data.get("rope_theta", 10_000.0)),  # type: ignore[arg-type]
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-5)),  # type: ignore[arg-type]
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            name=str(data.get("_name_or_path") or data.get("model_type") or "llama"),
        )

    def to_dict(self) -> dict[str, object]:
        """Plain fields (for passing to rank processes)."""
        return asdict(self)
