"""The decoder's forward pass on one rank: a slice of layers × a slice of heads and MLP columns.

Plain torch, float32: RMSNorm, rotary embeddings (Hugging Face's rotate-half convention, so HF
Llama weights load unchanged), grouped-query attention over a paged KV cache, SwiGLU. Tokens of
several sequences are packed into one ``[T, hidden]`` batch (prefill chunks and decode tokens
mixed — continuous batching); attention runs per sequence over its blocks. A TP rank computes
its heads and MLP columns and ``allreduce`` sums the partial outputs; with ``tp_size`` 1 it is
the identity, so the single-process reference and every layout run the same code.

KV pool layout per rank: ``[layers, 2 (K,V), kv_heads, blocks, block_size, head_dim]`` — head
major, so one head's run of consecutive blocks is one contiguous range: a migration that re-splits
heads (TP2 → TP1) copies whole runs instead of a head slice of every token; a sequence's block
table indexes dimension 3.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from runtime.engine.torch.config import LlamaConfig

AllReduce = Callable[[torch.Tensor], None]


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """One sequence's tokens in a packed batch: ``n`` new tokens from position ``start``."""

    start: int  # tokens whose KV is already in the cache
    n: int  # new tokens in this batch (prompt chunk, replay, or one decode token)
    blocks: tuple[int, ...]  # block table, covering start + n tokens


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Root-mean-square layer norm (Zhang & Sennrich 2019), as Llama uses it."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding of ``x [T, heads, head_dim]`` (rotate-half convention)."""
    dim = x.shape[-1]
    steps = torch.arange(0, dim, 2, dtype=torch.float32, device=x.device)
    inv_freq = 1.0 / (theta ** (steps / dim))
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    half = dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * emb.cos() + rotated * emb.sin()


def new_pool(
    cfg: LlamaConfig,
    num_layers: int,
    num_kv_heads: int,
    num_blocks: int,
    block_size: int,
    device: str = "cpu",
) -> torch.Tensor:
    """A zeroed KV pool for one rank."""
    shape = (num_layers, 2, num_kv_heads, num_blocks, block_size, cfg.head_dim)
    return torch.zeros(shape, dtype=torch.float32, device=device)


def _slots(
    chunks: Sequence[SeqChunk], block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positions, block ids and in-block offsets of every packed token."""
    pos: list[int] = []
    blk: list[int] = []
    for c in chunks:
        for p in range(c.start, c.start + c.n):
            pos.append(p)
            blk.append(c.blocks[p // block_size])
    positions = torch.tensor(pos, dtype=torch.long, device=device)
    return positions, torch.tensor(blk, dtype=torch.long, device=device), positions % block_size


def _attend(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chunk: SeqChunk, scale: float
) -> torch.Tensor:
    """Causal GQA attention of one sequence's ``n`` queries over its cached keys/values."""
    total = chunk.start + chunk.n
    bs = k_cache.shape[2]
    blocks = torch.tensor(chunk.blocks[: -(-total // bs)], dtype=torch.long, device=q.device)
    k = k_cache[:, blocks].flatten(1, 2)[:, :total]  # [kv_heads, total, d]
    v = v_cache[:, blocks].flatten(1, 2)[:, :total]
    n, heads, d = q.shape
    kv_heads = k.shape[0]
    qg = q.view(n, kv_heads, heads // kv_heads, d)
    scores = torch.einsum("nkgd,ktd->kgnt", qg, k) * scale
    query_pos = torch.arange(chunk.start, total, device=q.device)[:, None]
    key_pos = torch.arange(total, device=q.device)[None, :]
    scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("kgnt,ktd->nkgd", probs, v).reshape(n, heads * d)


def forward_layers(
    cfg: LlamaConfig,
    weights: dict[str, torch.Tensor],
    layer_range: tuple[int, int],
    hidden: torch.Tensor,
    chunks: Sequence[SeqChunk],
    pool: torch.Tensor,
    allreduce: AllReduce,
) -> torch.Tensor:
    """Run layers ``layer_range`` of this rank over packed ``hidden [T, hidden_size]``.

    Writes the new tokens' K/V into ``pool`` at the chunks' block slots, then attends.
    """
    d = cfg.head_dim
    positions, blk, off = _slots(chunks, pool.shape[4], hidden.device)
    scale = d**-0.5
    for local, layer in enumerate(range(*layer_range)):
        w = {k[len(f"l{layer}.") :]: v for k, v in weights.items() if k.startswith(f"l{layer}.")}
        x = rms_norm(hidden, w["attn_norm"], cfg.rms_norm_eps)
        q = (x @ w["wq"].T).view(len(x), -1, d)
        k = (x @ w["wk"].T).view(len(x), -1, d)
        v = (x @ w["wv"].T).view(len(x), -1, d)
        q, k = rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta)
        k_cache, v_cache = pool[local, 0], pool[local, 1]
        k_cache[:, blk, off] = k.transpose(0, 1)  # [kv_heads, T, d]
        v_cache[:, blk, off] = v.transpose(0, 1)
        outs, at = [], 0
        for chunk in chunks:
            outs.append(_attend(q[at : at + chunk.n], k_cache, v_cache, chunk, scale))
            at += chunk.n
        attn = torch.cat(outs) @ w["wo"].T
        allreduce(attn)
        hidden = hidden + attn
        x = rms_norm(hidden, w["mlp_norm"], cfg.rms_norm_eps)
        mlp = (torch.nn.functional.silu(x @ w["w_gate"].T) * (x @ w["w_up"].T)) @ w["w_down"].T
        allreduce(mlp)
        hidden = hidden + mlp
    return hidden


def embed(weights: dict[str, torch.Tensor], tokens: Sequence[int]) -> torch.Tensor:
    """Token embeddings ``[T, hidden]`` (first stage)."""
    table = weights["embed"]
    return table[torch.tensor(list(tokens), dtype=torch.long, device=table.device)]


def greedy(
    cfg: LlamaConfig, weights: dict[str, torch.Tensor], hidden: torch.Tensor, rows: Sequence[int]
) -> list[int]:
    """Argmax next token of the given packed rows (last stage)."""
    if not rows:
        return []
    x = rms_norm(hidden[list(rows)], weights["norm"], cfg.rms_norm_eps)
    logits = x @ weights["lm_head"].T
    return [int(t) for t in logits.argmax(dim=-1).tolist()]
