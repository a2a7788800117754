"""Single-process greedy generation: the reference every layout and shift must reproduce.

One rank holding the whole model, one sequence at a time, no batching, no shift — the same
forward code (:mod:`runtime.engine.torch.model`) with an identity all-reduce.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from gearbox.plans import ExecutionPlan, Stage, StageRole
from runtime.engine.torch.config import LlamaConfig
from runtime.engine.torch.layout import plan_ranks
from runtime.engine.torch.model import SeqChunk, embed, forward_layers, greedy, new_pool
from runtime.engine.torch.plans import CPU_HOST, SHM_LINK
from runtime.engine.torch.weights import load_shard


def _whole(cfg: LlamaConfig) -> ExecutionPlan:
    stage = Stage(
        "ref", "ref", ("ref-gpu0",), 0, cfg.num_layers, StageRole.UNIFIED, CPU_HOST, SHM_LINK
    )
    return ExecutionPlan(cfg.name, (stage,))


def generate(
    cfg: LlamaConfig,
    source: str,
    prompts: Mapping[str, Sequence[int]],
    max_new_tokens: Mapping[str, int],
    block_size: int = 16,
) -> dict[str, list[int]]:
    """Greedy outputs of each prompt, computed alone."""
    spec = plan_ranks(_whole(cfg), cfg)[0]
    weights = load_shard(source, cfg, spec)
    out: dict[str, list[int]] = {}
    for sid, prompt in prompts.items():
        budget = max_new_tokens[sid]
        blocks = tuple(range(-(-(len(prompt) + budget) // block_size)))
        pool = new_pool(cfg, cfg.num_layers, cfg.num_kv_heads, len(blocks), block_size)
        tokens: list[int] = []
        fed, start = list(prompt), 0
        with torch.no_grad():
            while len(tokens) < budget:
                hidden = forward_layers(
                    cfg,
                    weights,
                    (0, cfg.num_layers),
                    embed(weights, fed),
                    [SeqChunk(start, len(fed), blocks)],
                    pool,
                    lambda t: None,
                )
                token = greedy(cfg, weights, hidden, [len(fed) - 1])[0]
                tokens.append(token)
                start += len(fed)
                fed = [token]
        out[sid] = tokens
    return out
