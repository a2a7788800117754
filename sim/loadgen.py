"""Seeded load generator: short online chat plus long-prompt batch summarisation.

:func:`generate` yields :class:`runtime.types.Request` objects with Poisson arrivals per class
and gamma-distributed token counts around each class's mean (shape 2: a right tail, never
zero). Rates come from a scenario deployment's workload (daily swing and phases included, via
:meth:`sim.spec.WorkloadSpec.multipliers`) or from explicit :class:`MixRates`. The same
seed gives the same requests in any process. :func:`run_http` replays them against a worker's
``/v1/completions`` paced in wall time; a discrete-event benchmark feeds them straight into a
``DeploymentRuntime`` instead.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from runtime.stats import p95
from runtime.types import Request, RequestKind


@dataclass(frozen=True, slots=True)
class ClassRate:
    """One request class at one instant."""

    arrival_rps: float
    prompt_tokens_mean: float
    output_tokens_mean: float


@dataclass(frozen=True, slots=True)
class MixRates:
    """Chat and summarisation rates at one instant."""

    chat: ClassRate
    summarisation: ClassRate

    @classmethod
    def default(cls) -> MixRates:
        """The seed scenario's chat-70b mix at multiplier 1."""
        return cls(ClassRate(2.5, 800, 250), ClassRate(0.3, 6000, 400))

    def scaled(self, chat: float, summarisation: float) -> MixRates:
        """Arrival rates multiplied per class."""
        c, s = self.chat, self.summarisation
        return MixRates(
            ClassRate(c.arrival_rps * chat, c.prompt_tokens_mean, c.output_tokens_mean),
            ClassRate(s.arrival_rps * summarisation, s.prompt_tokens_mean, s.output_tokens_mean),
        )


RatesAt = Callable[[float], MixRates]


def rates_from_workload(workload: Any) -> RatesAt:
    """Rates over time from a scenario :class:`sim.spec.WorkloadSpec`."""
    base = MixRates(
        ClassRate(
            workload.chat.arrival_rps,
            workload.chat.prompt_tokens_mean,
            workload.chat.output_tokens_mean,
        ),
        ClassRate(
            workload.summarisation.arrival_rps,
            workload.summarisation.prompt_tokens_mean,
            workload.summarisation.output_tokens_mean,
        ),
    )

    def at(t_s: float) -> MixRates:
        chat, summ = workload.multipliers(t_s)
        return base.scaled(chat, summ)

    return at


def _rng(seed: int, label: str) -> random.Random:
    # NOTE: seeded from a digest, never hash(): the same seed gives the same stream everywhere.
    digest = hashlib.sha256(f"{seed}/{label}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def _tokens(rng: random.Random, mean: float, cap: int) -> int:
    return max(1, min(cap, round(rng.gammavariate(2.0, mean / 2.0))))


def generate(
    rates: MixRates | RatesAt,
    *,
    seed: int,
    start_s: float = 0.0,
    duration_s: float = 60.0,
    prefix: str = "lg",
    max_tokens: int = 32_768,
) -> Iterator[Request]:
    """Requests arriving in ``[start_s, start_s + duration_s)``, in arrival order.

    Time-varying rates are followed by thinning against the peak rate found on a 1 s grid.
    """
    rates_at = rates if callable(rates) else _constant(rates)
    grid = [rates_at(start_s + i) for i in range(max(1, math.ceil(duration_s)) + 1)]
    streams = []
    for kind in (RequestKind.CHAT, RequestKind.SUMMARISATION):
        peak = max(_class(r, kind).arrival_rps for r in grid)
        if peak > 0:
            streams.append(
                _class_stream(rates_at, kind, peak, seed, start_s, duration_s, max_tokens)
            )
    pending = [(next(s, None), s) for s in streams]
    heads = [(r, s) for r, s in pending if r is not None]
    count = 0
    while heads:
        heads.sort(key=lambda h: (h[0].arrival_s, h[0].kind))
        request, stream = heads.pop(0)
        yield Request(
            f"{prefix}-{count}",
            request.prompt_tokens,
            request.max_output_tokens,
            request.arrival_s,
            request.kind,
        )
        count += 1
        following = next(stream, None)
        if following is not None:
            heads.append((following, stream))


def _constant(rates: MixRates) -> RatesAt:
    def at(_t_s: float) -> MixRates:
        return rates

    return at


def _class(rates: MixRates, kind: RequestKind) -> ClassRate:
    return rates.chat if kind is RequestKind.CHAT else rates.summarisation


def _class_stream(
    rates_at: RatesAt,
    kind: RequestKind,
    peak_rps: float,
    seed: int,
    start_s: float,
    duration_s: float,
    max_tokens: int,
) -> Iterator[Request]:
    rng = _rng(seed, kind)
    t = start_s
    while True:
        t += rng.expovariate(peak_rps)
        if t >= start_s + duration_s:
            return
        now = _class(rates_at(t), kind)
        if rng.random() * peak_rps > now.arrival_rps:
            continue  # thinned: the rate here is below the peak
        prompt = _tokens(rng, now.prompt_tokens_mean, max_tokens)
        output = _tokens(rng, now.output_tokens_mean, max_tokens)
        yield Request("", prompt, output, t, kind)


@dataclass
class LoadReport:
    """Outcome of replaying requests over HTTP."""

    sent: int = 0
    ok: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    reasons: Counter[str] = field(default_factory=Counter)
    ttft_ms: list[float] = field(default_factory=list)
    latency_ms: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """Counts and p95 latencies (simulated milliseconds from the worker's clock)."""
        return {
            "sent": self.sent,
            "ok": self.ok,
            "statuses": dict(self.statuses),
            "reasons": dict(self.reasons),
            "ttft_p95_ms": p95(self.ttft_ms),
            "latency_p95_ms": p95(self.latency_ms),
        }


async def run_http(
    url: str,
    requests: Sequence[Request] | Iterator[Request],
    *,
    deployment: str | None = None,
    speed: float = 1.0,
    max_in_flight: int = 256,
    timeout_s: float = 300.0,
) -> LoadReport:
    """POST each request to ``url``/v1/completions at ``arrival_s / speed`` wall seconds."""
    report = LoadReport()
    gate = asyncio.Semaphore(max_in_flight)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.monotonic()
        tasks = []
        first: float | None = None
        for request in requests:
            first = request.arrival_s if first is None else first
            delay = start + (request.arrival_s - first) / speed - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await gate.acquire()
            tasks.append(
                asyncio.create_task(_post(session, url, request, deployment, report, gate))
            )
        await asyncio.gather(*tasks)
    return report


async def _post(
    session: aiohttp.ClientSession,
    url: str,
    request: Request,
    deployment: str | None,
    report: LoadReport,
    gate: asyncio.Semaphore,
) -> None:
    body: dict[str, Any] = {
        "request_id": request.request_id,
        "prompt_tokens": request.prompt_tokens,
        "max_tokens": request.max_output_tokens,
    }
    if deployment is not None:
        body["deployment"] = deployment
    report.sent += 1
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            data = await resp.json(content_type=None)
            report.statuses[resp.status] += 1
            if resp.status == 200:
                report.ok += 1
                report.ttft_ms.append(data["timing"]["ttft_ms"])
                report.latency_ms.append(data["timing"]["latency_ms"])
            else:
                report.reasons[data.get("error", {}).get("reason", "unknown")] += 1
    except (aiohttp.ClientError, TimeoutError, ValueError):
        report.statuses[0] += 1  # connection lost or timed out
    finally:
        gate.release()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sim.loadgen --url http://127.0.0.1:8470 --duration 60``."""
    parser = argparse.ArgumentParser(prog="sim.loadgen", description=__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8470")
    parser.add_argument("--deployment", default=None)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--duration", type=float, default=60.0, help="simulated seconds")
    parser.add_argument("--start", type=float, default=0.0, help="scenario time to start at")
    parser.add_argument("--speed", type=float, default=1.0, help="simulated s per wall s")
    parser.add_argument("--scenario", default=None, help="take rates from this scenario file")
    parser.add_argument("--chat-rps", type=float, default=None)
    parser.add_argument("--summarisation-rps", type=float, default=None)
    args = parser.parse_args(argv)
    rates: MixRates | RatesAt = MixRates.default()
    if args.scenario:
        from sim.scenario import load_scenario

        scenario = load_scenario(args.scenario)
        spec = next(
            (d for d in scenario.deployments if d.name == args.deployment), scenario.deployments[0]
        )
        rates = rates_from_workload(spec.workload)
    elif args.chat_rps is not None or args.summarisation_rps is not None:
        base = MixRates.default()
        chat = (args.chat_rps or 0.0) / base.chat.arrival_rps
        summ = (args.summarisation_rps or 0.0) / base.summarisation.arrival_rps
        rates = base.scaled(chat, summ)
    requests = generate(rates, seed=args.seed, start_s=args.start, duration_s=args.duration)
    report = asyncio.run(run_http(args.url, requests, deployment=args.deployment, speed=args.speed))
    print(json.dumps(report.summary(), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
