"""Builders for the torch engine tests: the tiny model, prompts, engines and a mixed hand-over."""

from __future__ import annotations

import random
from collections.abc import Iterator

from gearbox.switch import KvAction, KvHandover
from gearbox.types import LinkClass
from runtime.engine.base import SeqSpec
from runtime.engine.torch.config import LlamaConfig
from runtime.engine.torch.engine import TorchEngine, TorchEngineConfig
from runtime.engine.torch.plans import make_plan
from runtime.engine.torch.shift import handover_plan
from runtime.engine.torch.tokens import TokenLedger

CFG = LlamaConfig(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
)
SOURCE = "random:7"
SETTINGS = TorchEngineConfig(num_blocks=128, block_size=8, max_batch=16)


def make_prompts(tag: str, count: int, seed: int = 0) -> dict[str, list[int]]:
    """``count`` prompts of 5–40 tokens, ids prefixed with ``tag``."""
    rng = random.Random(f"{tag}/{seed}")
    return {
        f"{tag}-{i}": [rng.randrange(CFG.vocab_size) for _ in range(rng.randint(5, 40))]
        for i in range(count)
    }


def specs(prompts: dict[str, list[int]], max_new: int) -> list[SeqSpec]:
    """One spec per prompt with the same output budget."""
    return [SeqSpec(sid, len(p), max_new) for sid, p in prompts.items()]


def start_engine(
    kind: str,
    ledger: TokenLedger,
    prefix: str | None = None,
    settings: TorchEngineConfig = SETTINGS,
) -> TorchEngine:
    """A loaded, connected engine for plan ``kind`` (see ``make_plan``)."""
    plan = make_plan(kind, CFG.num_layers, prefix or kind, model_name=CFG.name)
    engine = TorchEngine(plan, CFG, SOURCE, ledger, settings=settings)
    for index in range(len(plan.stages)):
        result = engine.load_shard(index, 0.0)
        assert result.ok, result
    assert engine.build_comm_groups(0.0).ok
    return engine


def _bandwidths() -> Iterator[float]:
    for exp in range(-60, 30):
        yield 10 ** (exp / 10)


def mixed_handover(old: TorchEngine, new: TorchEngine) -> tuple[KvHandover, ...]:
    """Gearbox's hand-over plan over the first link speed at which it both migrates and
    replays (so one shift exercises both paths); the choice itself is gearbox's."""
    for gbps in _bandwidths():
        plan = handover_plan(old, new, LinkClass("probe", gbps, 0.0))
        actions = {h.action for h in plan}
        if actions == {KvAction.MIGRATE, KvAction.REPLAY}:
            return plan
    raise AssertionError("no link speed gives a mixed hand-over")
