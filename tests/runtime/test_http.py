"""Integration (HTTP): the worker API — bearer-token control, 429 mapping, status, metrics.

A fake worker stands behind the real aiohttp app, so these tests need no broker.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from flexpipe.schemas import ControlAction, ControlCommand
from runtime.http import build_app
from runtime.metrics import RuntimeMetrics
from runtime.types import Admission, Completion, Reason, Request

pytestmark = pytest.mark.integration

TOKEN = "s3cret-token"


class FakeWorker:
    """Scripted admissions; records published control commands."""

    deployments: tuple[str, ...] = ("chat-70b",)

    def __init__(self) -> None:
        self.metrics = RuntimeMetrics()
        self.published: list[ControlCommand] = []
        self.reason = Reason.ADMITTED
        self.requests: list[Request] = []

    async def submit(
        self, deployment: str, request: Request
    ) -> tuple[Admission, asyncio.Future[Completion] | None]:
        self.requests.append(request)
        if self.reason is not Reason.ADMITTED:
            return Admission(request.request_id, False, self.reason), None
        fut: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        fut.set_result(
            Completion(
                request.request_id,
                "xp-1",
                "dp-1",
                request.prompt_tokens,
                request.sim_output_tokens or request.max_output_tokens,  # the simulated stop
                0.0,
                0.25,
                1.0,
            )
        )
        return Admission(request.request_id, True, Reason.ADMITTED, "xp-1", 1.0), fut

    def now_s(self) -> float:
        return 0.0

    def status(self, *, ownership: bool = False) -> dict[str, Any]:
        return {"worker_id": "w", "simulated": True, "ownership": ownership}

    async def publish_control(self, command: ControlCommand) -> None:
        self.published.append(command)


@pytest.fixture
def worker() -> FakeWorker:
    return FakeWorker()


async def _client(worker: FakeWorker, token: str | None) -> TestClient[Any, Any]:
    client: TestClient[Any, Any] = TestClient(TestServer(build_app(worker, token)))
    await client.start_server()
    return client


@pytest.fixture
async def client(worker: FakeWorker) -> AsyncIterator[TestClient[Any, Any]]:
    c = await _client(worker, TOKEN)
    yield c
    await c.close()


@pytest.mark.parametrize("path", ["/control/downshift", "/control/pin"])
@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong-token"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": "Bearer"},
        {"Authorization": f"Bearer {TOKEN}x"},
    ],
)
async def test_control_refuses_a_missing_or_wrong_token(
    client: TestClient[Any, Any], worker: FakeWorker, path: str, headers: dict[str, str]
) -> None:
    resp = await client.post(path, json={"plan_id": "dp-x"}, headers=headers)
    assert resp.status == 401
    assert resp.headers["WWW-Authenticate"].startswith("Bearer")
    assert worker.published == []


async def test_control_publishes_with_the_right_token(
    client: TestClient[Any, Any], worker: FakeWorker
) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    resp = await client.post("/control/downshift", json={"reason": "p99 on fire"}, headers=auth)
    assert resp.status == 202
    resp = await client.post("/control/downshift", json={"clear": True}, headers=auth)
    resp = await client.post("/control/pin", json={"plan_id": "dp-abc"}, headers=auth)
    resp = await client.post("/control/pin", json={"plan_id": None}, headers=auth)
    assert [c.action for c in worker.published] == [
        ControlAction.EMERGENCY_DOWNSHIFT,
        ControlAction.CLEAR_DOWNSHIFT,
        ControlAction.PIN,
        ControlAction.UNPIN,
    ]
    assert worker.published[0].reason == "p99 on fire"
    assert worker.published[2].plan_id == "dp-abc"
    assert {c.deployment for c in worker.published} == {"chat-70b"}
    bad = await client.post("/control/pin", json={"deployment": "nope"}, headers=auth)
    assert bad.status == 400


async def test_control_is_closed_when_no_token_is_configured(worker: FakeWorker) -> None:
    client = await _client(worker, None)
    try:
        resp = await client.post(
            "/control/downshift", json={}, headers={"Authorization": "Bearer anything"}
        )
        assert resp.status == 401
    finally:
        await client.close()
    assert worker.published == []


@pytest.mark.parametrize(
    ("reason", "status"),
    [
        (Reason.THROTTLED_WATERMARK, 429),
        (Reason.REJECTED_OOM_RISK, 429),
        (Reason.QUEUE_FULL, 429),
        (Reason.NO_SERVING_PLAN, 503),
    ],
)
async def test_refusals_map_to_status_codes_with_the_reason(
    client: TestClient[Any, Any], worker: FakeWorker, reason: Reason, status: int
) -> None:
    worker.reason = reason
    resp = await client.post("/v1/completions", json={"prompt_tokens": 9000, "max_tokens": 10})
    assert resp.status == status
    assert (await resp.json())["error"]["reason"] == reason
    assert resp.headers["Retry-After"] == "1"


async def test_completion_body(client: TestClient[Any, Any], worker: FakeWorker) -> None:
    resp = await client.post(
        "/v1/completions", json={"prompt": "x" * 400, "max_tokens": 32, "request_id": "abc"}
    )
    body = await resp.json()
    assert resp.status == 200 and body["id"] == "abc" and body["simulated"] is True
    assert body["usage"] == {"prompt_tokens": 100, "completion_tokens": 32, "total_tokens": 132}
    assert body["timing"]["ttft_ms"] == 250.0
    assert body["choices"][0]["finish_reason"] == "length"
    assert worker.requests[0].prompt_tokens == 100


async def test_the_simulated_length_reaches_the_engine_apart_from_the_cap(
    client: TestClient[Any, Any], worker: FakeWorker
) -> None:
    body = {"prompt_tokens": 40, "max_tokens": 512, "simulated_output_tokens": 7}
    resp = await client.post("/v1/completions", json=body)
    out = await resp.json()
    assert resp.status == 200 and out["usage"]["completion_tokens"] == 7
    assert out["choices"][0]["finish_reason"] == "stop"  # the simulated model's EOS
    req = worker.requests[0]
    assert (req.max_output_tokens, req.sim_output_tokens) == (512, 7)
    body = {"prompt_tokens": 40, "max_tokens": 5, "simulated_output_tokens": 70}
    await client.post("/v1/completions", json=body)
    assert worker.requests[1].sim_output_tokens == 5  # never past the client's cap


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ("not json", 400),
        ({"max_tokens": 5}, 400),
        ({"prompt_tokens": 0}, 400),
        ({"prompt_tokens": 10, "max_tokens": "many"}, 400),
        ({"prompt_tokens": 10, "simulated_output_tokens": 0}, 400),
        ({"prompt_tokens": 10, "deployment": "elsewhere"}, 404),
    ],
)
async def test_bad_completion_requests(
    client: TestClient[Any, Any], body: Any, status: int
) -> None:
    kwargs: dict[str, Any] = {"data": body} if isinstance(body, str) else {"json": body}
    resp = await client.post("/v1/completions", **kwargs)
    assert resp.status == status


async def test_status_and_metrics(client: TestClient[Any, Any], worker: FakeWorker) -> None:
    resp = await client.get("/status?ownership=1")
    assert (await resp.json())["ownership"] is True
    worker.metrics.requests.labels("chat-70b", "admitted").inc()
    text = await (await client.get("/metrics")).text()
    assert 'flexpipe_runtime_requests_total{deployment="chat-70b",reason="admitted"} 1.0' in text
