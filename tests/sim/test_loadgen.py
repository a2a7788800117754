"""The load generator: seeded, rate-faithful, scenario-driven; replays over HTTP."""

from __future__ import annotations

import itertools

import pytest
from aiohttp.test_utils import TestServer

from runtime.http import build_app
from runtime.types import Reason, RequestKind
from sim.loadgen import (
    MAX_OVER_MEAN,
    MIN_TOKENS,
    ClassRate,
    MixRates,
    client_max_tokens,
    generate,
    offered_tokens,
    output_tokens,
    rates_from_workload,
    run_http,
    scenario_trace,
)
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
    lengths = [r.sim_output_tokens or 0 for r in chat]
    assert sum(lengths) / len(chat) == pytest.approx(200, rel=0.1)
    assert min(r.prompt_tokens for r in requests) >= 1


@pytest.mark.unit
def test_a_request_states_its_classs_cap_not_its_length() -> None:
    requests = list(generate(RATES, seed=1, duration_s=600))
    for kind, mean in ((RequestKind.CHAT, 200), (RequestKind.SUMMARISATION, 400)):
        some = [r for r in requests if r.kind is kind]
        assert {r.max_output_tokens for r in some} == {client_max_tokens(mean)}  # one cap a class
        lengths = [r.sim_output_tokens for r in some]
        assert all(x is not None and MIN_TOKENS <= x <= r.max_output_tokens
                   for x, r in zip(lengths, some, strict=True))  # fmt: skip
        assert len(set(lengths)) > 50  # the lengths vary; the cap does not
    fixed = list(generate(RATES, seed=1, duration_s=600, client_cap=300))
    assert {r.max_output_tokens for r in fixed} == {300}
    assert max(r.sim_output_tokens or 0 for r in fixed) == 300  # longer answers cut at the cap
    assert [r.arrival_s for r in fixed] == [r.arrival_s for r in requests]


@pytest.mark.unit
def test_the_benchmark_trace_states_caps_not_lengths() -> None:
    # bench.fragmented's runtime sees what the live one does: the client's cap per class; the
    # drawn length travels apart, and only the offered-token count (and the oracle) read it
    trace = scenario_trace(load_scenario(SEED_FRAGMENTED), 600.0, seed=4)["chat-70b"]
    assert len({r.max_output_tokens for r in trace}) <= 2  # chat's cap and summarisation's
    lengths = [output_tokens(r) for r in trace]
    assert len(set(lengths)) > 50
    assert all(MIN_TOKENS <= n <= r.max_output_tokens for n, r in zip(lengths, trace, strict=True))
    assert sum(lengths) < 0.5 * sum(r.max_output_tokens for r in trace)
    assert [offered_tokens(r) for r in trace] == [
        r.prompt_tokens + n for r, n in zip(trace, lengths, strict=True)
    ]


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
        # the body states the cap as max_tokens; the drawn length goes to the simulated engine
        # apart (simulated_output_tokens), the way a real model's EOS would end the answer
        sent = {r.request_id: r for r in requests}
        for got in worker.requests:
            assert got.max_output_tokens == sent[got.request_id].max_output_tokens
            assert got.sim_output_tokens == sent[got.request_id].sim_output_tokens
        worker.reason = Reason.THROTTLED_WATERMARK
        refused = await run_http(url, requests[:5], speed=40.0)
        assert refused.statuses[429] == 5 and refused.reasons["throttled_watermark"] == 5
    finally:
        await server.close()
    assert {r.request_id for r in worker.requests} == {r.request_id for r in requests}


@pytest.mark.unit
def test_lengths_are_heavy_tailed_and_clipped_around_the_mean() -> None:
    requests = list(generate(RATES, seed=6, duration_s=2000))
    summ = sorted(r.prompt_tokens for r in requests if r.kind is RequestKind.SUMMARISATION)
    assert summ[0] >= MIN_TOKENS and summ[-1] <= MAX_OVER_MEAN * 6000
    median = summ[len(summ) // 2]
    assert median < 6000 < summ[int(len(summ) * 0.95)]  # right-skewed: a long tail above


@pytest.mark.unit
def test_each_deployment_draws_from_its_own_streams() -> None:
    a = [r.arrival_s for r in generate(RATES, seed=3, duration_s=60, prefix="a")]
    b = [r.arrival_s for r in generate(RATES, seed=3, duration_s=60, prefix="b")]
    assert a != b


@pytest.mark.unit
def test_the_scenario_trace_follows_each_deployments_rates() -> None:
    scenario = load_scenario(SEED_FRAGMENTED)
    trace = scenario_trace(scenario, 3600.0, seed=4)
    assert trace == scenario_trace(scenario, 3600.0, seed=4)
    assert trace != scenario_trace(scenario, 3600.0, seed=5)
    # morning-ramp: chat × 0.6, summarisation × 0.4, tide ≈ 1.0–1.1 over the first hour
    big = trace["chat-70b"]
    expected = 3600.0 * (2.5 * 0.6 + 0.3 * 0.4) * 1.05
    assert abs(len(big) - expected) < 0.1 * expected
    assert all(x.arrival_s <= y.arrival_s for x, y in itertools.pairwise(big))
    assert big[0].request_id.startswith("chat-70b/")
