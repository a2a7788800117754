"""The load generator: seeded, rate-faithful, scenario-driven; replays over HTTP."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestServer

from runtime.http import build_app
from runtime.types import Reason, RequestKind
from sim.loadgen import ClassRate, MixRates, generate, rates_from_workload, run_http
from sim.scenario import SEED_FRAGMENTED, load_scenario
from tests.runtime.test_http import FakeWorker

SCENARIO = SEED_FRAGMENTED
RATES = MixRates(ClassRate(5.0, 500, 200), ClassRate(1.0, 6000, 400))


@pytest.mark.unit
def test_same_seed_same_requests_other_seed_other_requests() -> None:
    a = list(generate(RATES, seed=3, duration_s=60))
    assert a == list(generate(RATES, seed=3, duration_s=60))
    assert a != list(generate(RATES, seed=4, duration_s=60))
    assert [r.arrival_s for r in a] == sorted(r.arrival_s for r in a)
    assert len({r.request_id for r in a}) == len(a)


@pytest.mark.unit
def test_rates_and_token_means_follow_the_mix() -> None:
    requests = list(generate(RATES, seed=1, duration_s=2000))
    chat = [r for r in requests if r.kind is RequestKind.CHAT]
    summ = [r for r in requests if r.kind is RequestKind.SUMMARISATION]
    assert len(chat) / 2000 == pytest.approx(5.0, rel=0.05)
    assert len(summ) / 2000 == pytest.approx(1.0, rel=0.1)
    assert sum(r.prompt_tokens for r in summ) / len(summ) == pytest.approx(6000, rel=0.1)
    assert sum(r.max_output_tokens for r in chat) / len(chat) == pytest.approx(200, rel=0.1)
    assert min(r.prompt_tokens for r in requests) >= 1


@pytest.mark.unit
def test_scenario_phases_shape_the_load() -> None:
    workload = load_scenario(SCENARIO).deployments[0].workload
    rates = rates_from_workload(workload)
    ramp = list(generate(rates, seed=2, start_s=0, duration_s=600))  # summarisation × 0.4
    batch = list(generate(rates, seed=2, start_s=3600, duration_s=600))  # summarisation × 2.5
    count = [sum(r.kind is RequestKind.SUMMARISATION for r in rs) for rs in (ramp, batch)]
    assert count[1] > 4 * count[0]
    assert all(3600 <= r.arrival_s < 4200 for r in batch)


@pytest.mark.integration
async def test_replays_requests_over_http() -> None:
    worker = FakeWorker()
    server = TestServer(build_app(worker, None))
    await server.start_server()
    try:
        url = str(server.make_url("")).rstrip("/")
        requests = list(generate(RATES, seed=5, duration_s=4))
        report = await run_http(url, requests, speed=40.0)
        assert report.sent == len(requests) == report.ok
        worker.reason = Reason.THROTTLED_WATERMARK
        refused = await run_http(url, requests[:5], speed=40.0)
        assert refused.statuses[429] == 5 and refused.reasons["throttled_watermark"] == 5
    finally:
        await server.close()
    assert {r.request_id for r in worker.requests} == {r.request_id for r in requests}
