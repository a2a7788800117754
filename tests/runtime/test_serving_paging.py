"""Unit: the runtime's admission under the paging rule — a request commits its prompt's pages
(never its future output), engines grow KV past that and preempt the youngest when the GPU runs
short, every request still finishes, the watermark's 429s still apply, and preemptions are counted
(ServingCore, the deployment's status, the Prometheus metric)."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from runtime.deployment import RuntimeSettings
from runtime.engine.paging import KvAdmission, admission_tokens
from runtime.engine.sim import SimEngine
from runtime.metrics import RuntimeMetrics
from runtime.types import Reason, ServingSettings
from runtime.vmm.base import DEFAULT_GRANULARITY_BYTES, round_up
from tests.runtime.builders import (
    FAST_EXECUTOR,
    FAST_POLICY,
    Harness,
    make_plan,
    make_replica,
    make_request,
    make_runtime,
)

pytestmark = pytest.mark.unit

C0 = make_replica(["C0"], gpu_class="l40s")  # 48 GB: 7B weights leave ~30 GB of KV


def _placed(kv_admission: KvAdmission = KvAdmission.INCREMENTAL) -> Harness:
    serving = ServingSettings(kv_admission=kv_admission)
    settings = RuntimeSettings(policy=FAST_POLICY, executor=FAST_EXECUTOR, serving=serving)
    h = Harness(make_runtime(settings=settings))
    plan = make_plan(C0)
    h.decide(1, plan)
    h.until(lambda: h.rt.state.active is None, 30)
    assert h.rt.state.serving_plan_id == plan.plan_id
    return h


@pytest.mark.parametrize("mode", list(KvAdmission))
def test_admission_commits_what_the_client_states_never_the_output(mode: KvAdmission) -> None:
    h = _placed(mode)
    engine = h.rt.core.engine(C0.plan_id)
    assert isinstance(engine, SimEngine)
    per_token = engine.timing.kv_bytes_per_token_per_gpu["C0"]
    before = h.rt.core.vmm.memory()["C0"].committed_bytes
    assert h.submit(make_request(0, 1000, 3000, h.now_s)).admitted
    committed = h.rt.core.vmm.memory()["C0"].committed_bytes - before
    tokens = admission_tokens(mode, 1000, 0, 3000)
    assert committed == round_up(tokens * per_token, DEFAULT_GRANULARITY_BYTES)
    if mode is KvAdmission.INCREMENTAL:
        assert tokens < 1000 + 3000  # the prompt's pages + one, grown as tokens come


def test_outputs_outgrowing_the_gpu_preempt_and_every_request_still_finishes() -> None:
    h = _placed()
    # Prompts pass the watermark on their own; prompts + outputs overrun the GPU's KV room.
    admitted = set()
    for i in range(30):
        adm = h.submit(make_request(i, 2000, 3000, h.now_s))
        if adm.admitted:
            admitted.add(adm.request_id)
    assert len(admitted) > 12
    h.until(lambda: not h.rt.core.router.ownership(), 900)
    done = {c.request_id: c.output_tokens for c in h.outputs.completions}
    assert done == dict.fromkeys(admitted, 3000)
    core = h.rt.core
    assert core.engine_preemptions > 0
    assert h.rt.pool.oom_events == 0 and core.engine_oom_events == 0
    status = h.rt.status(h.now_s)
    assert status["engine_preemptions"] == core.engine_preemptions
    metrics = RuntimeMetrics()
    metrics.count_preemptions("dep", core.engine_preemptions)
    metrics.count_preemptions("dep", core.engine_preemptions)  # a running total: counted once
    text = generate_latest(metrics.registry).decode()
    counted = f'flexpipe_runtime_preemptions_total{{deployment="dep"}} {core.engine_preemptions}.0'
    assert counted in text


def test_the_watermark_still_refuses_with_a_429_reason() -> None:
    h = _placed()
    outcomes = [h.submit(make_request(i, 12_000, 4_000, h.now_s)) for i in range(60)]
    refused = {o.reason for o in outcomes if not o.admitted}
    assert refused == {Reason.THROTTLED_WATERMARK}
    assert h.rt.core.vmm.memory()["C0"].fill <= h.rt.settings.serving.watermark
