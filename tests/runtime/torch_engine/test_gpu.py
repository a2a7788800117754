"""The torch engine on CUDA: a shift with KV migration between two engines on one GPU, and
NCCL TP2 when two GPUs are present. Skipped (with the reason) without a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gearbox.presets import LINK_CLASSES
from runtime.engine.torch.engine import TorchEngine
from runtime.engine.torch.plans import make_plan
from runtime.engine.torch.reference import generate
from runtime.engine.torch.shift import admit_all, handover_plan, run_to_completion, shift
from runtime.engine.torch.tokens import TokenLedger
from tests.runtime.torch_engine.builders import CFG, SETTINGS, SOURCE, make_prompts, specs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine"),
]


def _engine(kind: str, ledger: TokenLedger, backend: str, prefix: str, device: str) -> TorchEngine:
    settings = dataclasses.replace(SETTINGS, device=device, backend=backend)
    engine = TorchEngine(
        make_plan(kind, CFG.num_layers, prefix), CFG, SOURCE, ledger, settings=settings
    )
    for index in range(len(engine.plan.stages)):
        assert engine.load_shard(index, 0.0).ok
    assert engine.build_comm_groups(0.0).ok
    return engine


def test_cuda_shift_with_kv_migration_is_token_exact() -> None:
    ledger = TokenLedger(CFG.vocab_size)
    prompts = make_prompts("gpu", 6)
    for sid, prompt in prompts.items():
        ledger.register(sid, prompt)
    reference = generate(CFG, SOURCE, prompts, dict.fromkeys(prompts, 12))
    old = _engine("tp1", ledger, "gloo", "gpu-old", "cuda:0")
    new = _engine("tp1", ledger, "gloo", "gpu-new", "cuda:0")
    try:
        admit_all(old, specs(prompts, 12))
        for _ in range(4):
            old.step(0.0)
        report, _ = shift(old, new, handover_plan(old, new, LINK_CLASSES["nvlink"]))
        assert report.committed and report.migrated and report.migrate_bytes > 0
        run_to_completion([old, new])
        assert {s: ledger.outputs(s) for s in prompts} == reference
    finally:
        old.close()
        new.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL TP2 needs two GPUs")
def test_nccl_tp2_matches_reference() -> None:
    ledger = TokenLedger(CFG.vocab_size)
    prompts = make_prompts("nccl", 4)
    for sid, prompt in prompts.items():
        ledger.register(sid, prompt)
    engine = _engine("tp2", ledger, "nccl", "nccl", "cuda")
    try:
        admit_all(engine, specs(prompts, 12))
        run_to_completion([engine])
        reference = generate(CFG, SOURCE, prompts, dict.fromkeys(prompts, 12))
        assert {s: ledger.outputs(s) for s in prompts} == reference
    finally:
        engine.close()
