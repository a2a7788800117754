"""HTTP API of a runtime worker (aiohttp).

* ``POST /v1/completions`` — completions-style; body ``{"deployment", "prompt" | "prompt_tokens",
  "max_tokens", "request_id"?, "simulated_output_tokens"?}``. ``max_tokens`` is the client's cap,
  all that admission and routing see. ``simulated_output_tokens`` (SIMULATED engine only, e.g.
  the load generator's drawn length) is where the simulated model stops, as a real one stops at
  its end-of-sequence token: at most ``max_tokens``; without it the answer runs to the cap.
  200 when served (the SIMULATED engine returns token counts and timings, no text), 429 when
  throttled or the VMM refuses (body names the reason, e.g. ``throttled_watermark``), 503
  without a serving plan, 404 for a deployment not served here.
* ``GET /status`` — per deployment: serving plan, transition phase, migration queue, shadow plan
  state, replicas, ownership counts (``?ownership=1`` adds the map) and invariant violations.
* ``POST /control/downshift`` / ``POST /control/pin`` — need ``Authorization: Bearer <token>``
  (401 otherwise, and always when no token is configured); they publish a ControlCommand on the
  control topic — control never rides on a data channel.
* ``GET /metrics`` — Prometheus text format.
"""

from __future__ import annotations

import asyncio
import hmac
import uuid
from collections.abc import Callable
from typing import Any, Protocol

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from flexpipe.schemas import ControlAction, ControlCommand
from runtime.metrics import RuntimeMetrics
from runtime.types import Admission, Completion, Reason, Request, RequestKind, RequestRefused

_STATUS_FOR = {
    Reason.THROTTLED_WATERMARK: 429,
    Reason.REJECTED_OOM_RISK: 429,
    Reason.QUEUE_FULL: 429,
    Reason.MODEL_LOADING: 429,
    Reason.TTFT_DEADLINE: 429,
    Reason.NO_SERVING_PLAN: 503,
    Reason.TOO_LONG: 400,
    Reason.DUPLICATE_REQUEST: 409,
    Reason.UNKNOWN_DEPLOYMENT: 404,
}
_CHARS_PER_TOKEN = 4  # simulated tokenizer: the usual rule of thumb for English text
MAX_TOKENS_LIMIT = 1_000_000


class WorkerApi(Protocol):
    """What the HTTP layer needs from a worker (a fake implements it in tests)."""

    deployments: tuple[str, ...]
    metrics: RuntimeMetrics

    async def submit(
        self, deployment: str, request: Request
    ) -> tuple[Admission, asyncio.Future[Completion] | None]:
        """Admit now; the future resolves on completion."""
        ...

    def now_s(self) -> float:
        """The runtime clock."""
        ...

    def status(self, *, ownership: bool = False) -> dict[str, Any]:
        """The ``/status`` body."""
        ...

    async def publish_control(self, command: ControlCommand) -> None:
        """Publish on the control topic."""
        ...


class BadRequest(Exception):
    """A request body the API refuses (400), with the field at fault."""


def _int_field(body: dict[str, Any], name: str, default: int | None) -> int:
    value = body.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= MAX_TOKENS_LIMIT:
        raise BadRequest(f"{name}: must be an integer in [1, {MAX_TOKENS_LIMIT}]")
    return value


def parse_completion(body: Any, deployments: tuple[str, ...], now_s: float) -> tuple[str, Request]:
    """(deployment, request) from a completions body; raises :class:`BadRequest`."""
    if not isinstance(body, dict):
        raise BadRequest("body: must be a JSON object")
    deployment = body.get("deployment", body.get("model", deployments[0]))
    if not isinstance(deployment, str):
        raise BadRequest("deployment: must be a string")
    prompt = body.get("prompt")
    if "prompt_tokens" in body:
        prompt_tokens = _int_field(body, "prompt_tokens", None)
    elif isinstance(prompt, str) and prompt:
        prompt_tokens = max(1, len(prompt) // _CHARS_PER_TOKEN)
    else:
        raise BadRequest("prompt: a non-empty string or prompt_tokens is required")
    max_tokens = _int_field(body, "max_tokens", 16)
    stop: int | None = None  # SIMULATED: the simulated model's EOS, for the engine's stop only
    if "simulated_output_tokens" in body:
        stop = min(max_tokens, _int_field(body, "simulated_output_tokens", None))
    request_id = body.get("request_id") or f"cmpl-{uuid.uuid4().hex[:16]}"
    if not isinstance(request_id, str) or len(request_id) > 200:
        raise BadRequest("request_id: must be a string of at most 200 characters")
    kind = RequestKind.SUMMARISATION if prompt_tokens >= 2048 else RequestKind.CHAT
    return deployment, Request(request_id, prompt_tokens, max_tokens, now_s, kind, stop)


def _error(status: int, reason: str, message: str, **headers: str) -> web.Response:
    return web.json_response(
        {"error": {"reason": reason, "message": message}}, status=status, headers=headers or None
    )


class _Api:
    """Request handlers bound to one worker."""

    def __init__(self, worker: WorkerApi, token: str | None, request_timeout_s: float) -> None:
        self.worker = worker
        self.token = token
        self.request_timeout_s = request_timeout_s

    async def completions(self, request: web.Request) -> web.Response:
        """Admit, wait for the completion, answer 200 — or the refusal's status and reason."""
        worker = self.worker
        try:
            body = await request.json()
            deployment, req = parse_completion(body, worker.deployments, worker.now_s())
        except BadRequest as exc:
            return _error(400, "bad_request", str(exc))
        except ValueError:
            return _error(400, "bad_request", "body: not valid JSON")
        if deployment not in worker.deployments:
            return _error(404, Reason.UNKNOWN_DEPLOYMENT, f"{deployment} is not served here")
        admission, done = await worker.submit(deployment, req)
        if not admission.admitted or done is None:
            status = _STATUS_FOR.get(admission.reason, 429)
            headers = {"Retry-After": "1"} if status in (429, 503) else {}
            return _error(status, admission.reason, f"request {req.request_id} refused", **headers)
        try:
            result = await asyncio.wait_for(asyncio.shield(done), self.request_timeout_s)
        except TimeoutError:
            return _error(504, "timeout", f"{req.request_id} still running; it will complete")
        except RequestRefused as exc:  # held for a load or for memory, then refused
            status = _STATUS_FOR.get(exc.reason, 429)
            headers = {"Retry-After": "1"} if status in (429, 503) else {}
            return _error(status, exc.reason, f"request {req.request_id} refused", **headers)
        return web.json_response(_completion_body(deployment, result, req.max_output_tokens))

    async def status(self, request: web.Request) -> web.Response:
        """The worker's status (``?ownership=1`` adds the ownership map)."""
        detail = request.query.get("ownership") in ("1", "true", "yes")
        return web.json_response(self.worker.status(ownership=detail), dumps=_dumps)

    def authorised(self, request: web.Request) -> bool:
        """A ``Bearer`` header carrying the configured token (constant-time compare)."""
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if self.token is None or scheme.lower() != "bearer" or not token:
            return False
        return hmac.compare_digest(token.strip().encode(), self.token.encode())

    async def control(
        self, request: web.Request, action_for: Callable[[dict[str, Any]], ControlCommand]
    ) -> web.Response:
        """Authorise, build the command, publish it on the control topic."""
        if not self.authorised(request):
            return web.json_response(
                {"error": {"reason": "unauthorized", "message": "bearer token required"}},
                status=401,
                headers={"WWW-Authenticate": 'Bearer realm="flexpipe-control"'},
            )
        try:
            body = await request.json()
            command = action_for(body if isinstance(body, dict) else {})
        except (BadRequest, ValueError) as exc:
            return _error(400, "bad_request", str(exc) or "body: not valid JSON")
        await self.worker.publish_control(command)
        return web.json_response({"published": _command_body(command)}, status=202)

    async def downshift(self, request: web.Request) -> web.Response:
        """``POST /control/downshift``: emergency downshift, or ``{"clear": true}`` to end it."""

        def action(body: dict[str, Any]) -> ControlCommand:
            clear = bool(body.get("clear"))
            kind = ControlAction.CLEAR_DOWNSHIFT if clear else ControlAction.EMERGENCY_DOWNSHIFT
            return _command(body, kind, self.worker.deployments)

        return await self.control(request, action)

    async def pin(self, request: web.Request) -> web.Response:
        """``POST /control/pin``: pin ``plan_id``, or unpin with ``plan_id`` null."""

        def action(body: dict[str, Any]) -> ControlCommand:
            kind = ControlAction.PIN if body.get("plan_id") else ControlAction.UNPIN
            return _command(body, kind, self.worker.deployments)

        return await self.control(request, action)

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus text format."""
        registry: CollectorRegistry = self.worker.metrics.registry
        return web.Response(
            body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )


def build_app(
    worker: WorkerApi, control_token: str | None, *, request_timeout_s: float = 300.0
) -> web.Application:
    """The aiohttp application for ``worker``."""
    api = _Api(worker, control_token, request_timeout_s)
    app = web.Application(client_max_size=1024**2)
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_get("/status", api.status)
    app.router.add_post("/control/downshift", api.downshift)
    app.router.add_post("/control/pin", api.pin)
    app.router.add_get("/metrics", api.metrics)
    return app


def _command(
    body: dict[str, Any], action: ControlAction, deployments: tuple[str, ...]
) -> ControlCommand:
    deployment = body.get("deployment", deployments[0])
    plan_id = body.get("plan_id")
    reason = body.get("reason", "")
    if deployment not in deployments:
        raise BadRequest(f"deployment: {deployment!r} is not served by this worker")
    if plan_id is not None and not isinstance(plan_id, str):
        raise BadRequest("plan_id: must be a string")
    if not isinstance(reason, str):
        raise BadRequest("reason: must be a string")
    return ControlCommand(deployment, action, plan_id, issued_by="http", reason=reason[:500])


def _command_body(command: ControlCommand) -> dict[str, Any]:
    return {
        "deployment": command.deployment,
        "action": str(command.action),
        "plan_id": command.plan_id,
        "reason": command.reason,
    }


def _completion_body(deployment: str, c: Completion, max_tokens: int) -> dict[str, Any]:
    finish = "length" if c.output_tokens >= max_tokens else "stop"  # cap reached, or model's EOS
    return {
        "id": c.request_id,
        "object": "text_completion",
        "deployment": deployment,
        "plan_id": c.plan_id,
        "replica_id": c.replica_id,
        "simulated": True,
        "choices": [{"index": 0, "text": "", "finish_reason": finish}],
        "usage": {
            "prompt_tokens": c.prompt_tokens,
            "completion_tokens": c.output_tokens,
            "total_tokens": c.prompt_tokens + c.output_tokens,
        },
        "timing": {
            "ttft_ms": round(c.ttft_s * 1000.0, 3),
            "latency_ms": round(c.latency_s * 1000.0, 3),
            "replays": c.replays,
        },
    }


def _dumps(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()
