"""The runtime drives torch engines: its transition (prepare, switch, cleanup) shifts a live
deployment from TP2 to TP1 while requests generate, and every request's tokens equal the
single-process reference. The engines come from the runtime's engine-factory seam
(:mod:`runtime.engine.torch.factory`), the one `flexpipe up --engine torch` uses."""

from __future__ import annotations

import pytest

from runtime.deployment import DeploymentRuntime, RuntimeSettings
from runtime.engine.base import EngineFault
from runtime.engine.torch.factory import (
    DEMO_MODEL,
    DEMO_SOURCE,
    SimulatedGpuTorchEngine,
    _scaled_bounds,
    scaled_plan,
    torch_engine_factory,
)
from runtime.engine.torch.reference import generate
from runtime.engine.torch.tokens import TokenLedger
from tests.runtime.builders import (
    DEPLOYMENT,
    FAST_EXECUTOR,
    FAST_POLICY,
    Harness,
    make_plan,
    make_replica,
    make_request,
)

pytestmark = pytest.mark.torch
LIMIT_S = 120.0  # simulated seconds; each tick runs one real iteration
MAX_NEW = 24


def test_a_runtime_transition_shifts_torch_engines_token_exact() -> None:
    ledger = TokenLedger(DEMO_MODEL.vocab_size)
    settings = RuntimeSettings(policy=FAST_POLICY, executor=FAST_EXECUTOR)
    rt = DeploymentRuntime(
        DEPLOYMENT, settings=settings, engine_factory=torch_engine_factory(ledger)
    )
    h = Harness(rt)
    tp2 = make_plan(make_replica(["A0", "A1"]))
    tp1 = make_plan(make_replica(["A2"]))
    try:
        h.decide(1, tp2)
        h.until(lambda: rt.state.serving_plan_id == tp2.plan_id, LIMIT_S)
        requests = [
            make_request(i, prompt=20 + 3 * i, output=24, arrival_s=h.now_s) for i in range(6)
        ]
        for r in requests:
            assert h.submit(r).admitted, r
        h.until(lambda: all(len(ledger.outputs(r.request_id)) >= 4 for r in requests), LIMIT_S)
        h.decide(2, tp1, from_plan_id=tp2.plan_id)
        h.until(
            lambda: rt.state.serving_plan_id == tp1.plan_id and rt.state.active is None, LIMIT_S
        )
        h.until(lambda: len(h.outputs.completions) == len(requests), LIMIT_S)
    finally:
        for rid in rt.core.replica_ids():
            rt.core.retire(rid)
    moved = [c for c in h.outputs.completions if c.plan_id == tp1.plan_id]
    assert moved, "no request finished on the new plan"
    prompts = {r.request_id: ledger.prompt(r.request_id, r.prompt_tokens) for r in requests}
    want = generate(DEMO_MODEL, DEMO_SOURCE, prompts, {r.request_id: MAX_NEW for r in requests})
    for r in requests:
        assert ledger.outputs(r.request_id) == want[r.request_id], r.request_id


def test_a_lost_gpu_kills_its_rank_and_the_next_plan_replays_token_exact() -> None:
    ledger = TokenLedger(DEMO_MODEL.vocab_size)
    settings = RuntimeSettings(policy=FAST_POLICY, executor=FAST_EXECUTOR)
    rt = DeploymentRuntime(
        DEPLOYMENT, settings=settings, engine_factory=torch_engine_factory(ledger)
    )
    h = Harness(rt)
    tp2 = make_plan(make_replica(["B0", "B1"]))
    tp1 = make_plan(make_replica(["B2"]))
    try:
        h.decide(1, tp2)
        h.until(lambda: rt.state.serving_plan_id == tp2.plan_id, LIMIT_S)
        requests = [make_request(i, 18 + 5 * i, MAX_NEW, h.now_s, prefix="g") for i in range(4)]
        for r in requests:
            assert h.submit(r).admitted, r
        h.until(lambda: all(len(ledger.outputs(r.request_id)) >= 3 for r in requests), LIMIT_S)
        (old,) = rt.core.replica_ids()
        engine = rt.core.engine(old)
        assert isinstance(engine, SimulatedGpuTorchEngine)
        rank_on_b1 = next(rp.proc for rp in engine._procs.values() if rp.boot.spec.gpu_uuid == "B1")
        rt.pool.preempt(["B1"])  # the simulated GPU goes: its rank process is killed
        h.advance(0.1)
        assert not rank_on_b1.is_alive()
        assert engine.health() is EngineFault.GPU_LOST
        h.decide(2, tp1, from_plan_id=tp2.plan_id)
        h.until(lambda: len(h.outputs.completions) == len(requests), LIMIT_S)
    finally:
        for rid in rt.core.replica_ids():
            rt.core.retire(rid)
    assert {c.plan_id for c in h.outputs.completions} == {tp1.plan_id}
    prompts = {r.request_id: ledger.prompt(r.request_id, r.prompt_tokens) for r in requests}
    want = generate(DEMO_MODEL, DEMO_SOURCE, prompts, {r.request_id: MAX_NEW for r in requests})
    for r in requests:
        assert ledger.outputs(r.request_id) == want[r.request_id], r.request_id


def test_scaled_plan_maps_layer_ranges_onto_the_small_model() -> None:
    wide = make_replica(["A0", "A1", "A2"])
    assert wide.stages[0].layer_end == 32  # the 7B-class model the plan was made for
    assert scaled_plan(wide, 4).stages[0].layer_end == 4
    # pipelines: proportional, contiguous, at least one layer per stage
    assert _scaled_bounds([27, 54, 80], 80, 4) == [1, 3, 4]
    assert _scaled_bounds([79, 80], 80, 4) == [3, 4]
    assert _scaled_bounds([1, 2, 80], 80, 4) == [1, 2, 4]
    with pytest.raises(ValueError, match="stages"):
        _scaled_bounds([10, 20, 30, 40, 80], 80, 4)
