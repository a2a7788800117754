"""Seeded load generator: short online chat plus long-prompt batch summarisation.

Arrivals of a request class follow a (non-homogeneous) Poisson process — a scenario
deployment's workload (daily swing times the active phase,
:meth:`sim.spec.WorkloadSpec.multipliers`) or explicit :class:`MixRates` — drawn by thinning
(Lewis & Shedler 1979) from a homogeneous process at the rate's upper bound: exact for a
workload (``(1 + |swing|) × the largest phase``), the peak on a 1 s grid for any other rate
function. Token counts are heavy-tailed, as real prompts are: log-normal around the class's
mean (σ 0.5 prompts, 0.4 outputs; the mean is preserved), clipped to [16, 4 × mean], so no
request is longer than any plan's KV could hold. Lengths are drawn for every candidate arrival,
accepted or not, so a change of rate never shifts other requests' lengths.

No foresight: a request states what a client states — its prompt and a ``max_tokens`` cap — and
not the length its answer will have. The cap is the class's (:func:`client_max_tokens`: the
longest answer a client of the class accepts, ``4 × the class's mean output``, the same for every
request of the class) or a fixed ``client_max_tokens``; the drawn length travels apart, as
:attr:`runtime.types.Request.sim_output_tokens`, to the SIMULATED engine alone, which stops the
answer there as a real model stops at its end-of-sequence token (over HTTP:
``simulated_output_tokens``). Admission, routing and estimates see the cap only.

Every (deployment, class) has its own ``random.Random`` seeded from a string (Python hashes
string seeds with SHA-512: the same requests in every process), so two deployments' arrivals
are independent. :func:`generate` serves ``flexpipe up`` and the CLI; :func:`scenario_trace`
gives the benchmark every deployment's arrivals at once. :func:`run_http` replays requests
against a worker's ``/v1/completions`` paced in wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
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
from sim.spec import Scenario, WorkloadSpec

SIGMA_PROMPT = 0.5  # log-normal shape of prompt lengths
SIGMA_OUTPUT = 0.4  # and of output lengths
MIN_TOKENS = 16
MAX_OVER_MEAN = 4.0


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


@dataclass(frozen=True, slots=True)
class WorkloadRates:
    """A scenario workload's rates over time, with their exact upper bound (for thinning)."""

    workload: WorkloadSpec
    base: MixRates

    def __call__(self, t_s: float) -> MixRates:
        chat, summ = self.workload.multipliers(t_s)
        return self.base.scaled(chat, summ)

    def class_at(self, t_s: float, kind: RequestKind) -> ClassRate:
        """``_class(self(t_s), kind)`` without building the other class's rate (the trace asks
        once per candidate arrival): the same product of the base rate and the multiplier."""
        chat, summ = self.workload.multipliers(t_s)
        if kind is RequestKind.CHAT:
            c, x = self.base.chat, chat
        else:
            c, x = self.base.summarisation, summ
        return ClassRate(c.arrival_rps * x, c.prompt_tokens_mean, c.output_tokens_mean)

    def peak(self, kind: RequestKind) -> float:
        """An upper bound of the class's arrival rate over all time."""
        wl = self.workload
        chat = kind is RequestKind.CHAT
        phases = [1.0] + [
            ph.chat_multiplier if chat else ph.summarisation_multiplier for ph in wl.phases
        ]
        return _class(self.base, kind).arrival_rps * ((1.0 + abs(wl.swing.amplitude)) * max(phases))


def rates_from_workload(workload: WorkloadSpec) -> WorkloadRates:
    """Rates over time from a scenario :class:`sim.spec.WorkloadSpec`."""
    c, s = workload.chat, workload.summarisation
    base = MixRates(
        ClassRate(c.arrival_rps, c.prompt_tokens_mean, c.output_tokens_mean),
        ClassRate(s.arrival_rps, s.prompt_tokens_mean, s.output_tokens_mean),
    )
    return WorkloadRates(workload, base)


def _rng(seed: int, stream: str, kind: RequestKind) -> random.Random:
    # NOTE: a string seed, never hash(); the label predates this module (the benchmark's
    # traces keep their bytes).
    return random.Random(f"flexpipe-bench:{seed}:{stream}:{kind.value}")


def _tokens(rng: random.Random, mean: float, sigma: float, cap: int) -> int:
    mu = math.log(mean) - sigma * sigma / 2  # E[lognormal(mu, sigma)] = mean
    draw = rng.lognormvariate(mu, sigma)
    return int(min(max(round(draw), MIN_TOKENS), round(mean * MAX_OVER_MEAN), cap))


def client_max_tokens(output_tokens_mean: float, cap: int = 32_768) -> int:
    """The ``max_tokens`` a client of a class with this mean output states on every request: the
    longest answer it accepts (the draw's upper clip, so no answer is cut)."""
    return int(min(round(output_tokens_mean * MAX_OVER_MEAN), cap))


def _peak(rates: MixRates | RatesAt, kind: RequestKind, start_s: float, duration_s: float) -> float:
    if isinstance(rates, WorkloadRates):
        return rates.peak(kind)
    if isinstance(rates, MixRates):
        return _class(rates, kind).arrival_rps
    grid = (rates(start_s + i) for i in range(max(1, math.ceil(duration_s)) + 1))
    return max(_class(r, kind).arrival_rps for r in grid)


def class_arrivals(
    rates: MixRates | RatesAt,
    kind: RequestKind,
    *,
    seed: int,
    stream: str,
    start_s: float = 0.0,
    duration_s: float = 60.0,
    max_tokens: int = 32_768,
    client_cap: int | None = None,
) -> Iterator[Request]:
    """One class's arrivals in ``[start_s, start_s + duration_s)`` from stream ``stream``
    (a deployment's name), in order; request ids are left empty for the caller to name.

    Each states the client's cap as ``max_output_tokens`` (``client_cap``, or the class's
    :func:`client_max_tokens`) and carries the drawn length, at most the cap, as the SIMULATED
    ``sim_output_tokens``. ``max_tokens`` clips the drawn lengths (prompt and output)."""
    rates_at = rates if callable(rates) else _constant(rates)
    class_at: Callable[[float], ClassRate] = (
        functools.partial(rates.class_at, kind=kind)
        if isinstance(rates, WorkloadRates)
        else lambda t_s: _class(rates_at(t_s), kind)
    )
    peak_rps = _peak(rates, kind, start_s, duration_s)
    if peak_rps <= 0:
        return
    rng = _rng(seed, stream, kind)
    t = start_s
    while True:
        t += rng.expovariate(peak_rps)
        if t >= start_s + duration_s:
            return
        now = class_at(t)
        accept = rng.random() * peak_rps < now.arrival_rps
        prompt = _tokens(rng, now.prompt_tokens_mean, SIGMA_PROMPT, max_tokens)
        output = _tokens(rng, now.output_tokens_mean, SIGMA_OUTPUT, max_tokens)
        if accept:
            cap = client_cap or client_max_tokens(now.output_tokens_mean, max_tokens)
            yield Request("", prompt, cap, t, kind, sim_output_tokens=min(output, cap))


def generate(
    rates: MixRates | RatesAt,
    *,
    seed: int,
    start_s: float = 0.0,
    duration_s: float = 60.0,
    prefix: str = "lg",
    max_tokens: int = 32_768,
    client_cap: int | None = None,
) -> Iterator[Request]:
    """Both classes' requests in ``[start_s, start_s + duration_s)``, in arrival order, named
    ``<prefix>-<n>``; ``prefix`` (a deployment's name) also picks the random streams. Each states
    a client's cap, not its length (see :func:`class_arrivals`)."""
    streams = [
        class_arrivals(
            rates,
            kind,
            seed=seed,
            stream=prefix,
            start_s=start_s,
            duration_s=duration_s,
            max_tokens=max_tokens,
            client_cap=client_cap,
        )
        for kind in (RequestKind.CHAT, RequestKind.SUMMARISATION)
    ]
    pending = [(next(s, None), s) for s in streams]
    heads = [(r, s) for r, s in pending if r is not None]
    count = 0
    while heads:
        heads.sort(key=lambda h: (h[0].arrival_s, h[0].kind))
        request, stream = heads.pop(0)
        yield dataclasses.replace(request, request_id=f"{prefix}-{count}")
        count += 1
        following = next(stream, None)
        if following is not None:
            heads.append((following, stream))


def scenario_trace(scenario: Scenario, duration_s: float, seed: int) -> dict[str, list[Request]]:
    """Every deployment's arrivals over ``[0, duration_s)``, both classes merged in arrival
    order (ties by id); ids ``<deployment>/<c|s><n>``. The same for every system of a run.

    Each request states its class's client cap as ``max_output_tokens`` and carries its drawn
    length apart, as the SIMULATED ``sim_output_tokens`` (see :func:`class_arrivals`): the
    benchmark's runtime sees what the live one does, no answer's length before it is out."""
    out: dict[str, list[Request]] = {}
    for dep in scenario.deployments:
        rates = rates_from_workload(dep.workload)
        merged = []
        for kind in (RequestKind.CHAT, RequestKind.SUMMARISATION):
            arrivals = class_arrivals(
                rates, kind, seed=seed, stream=dep.name, duration_s=duration_s
            )
            merged += [
                Request(
                    f"{dep.name}/{kind.value[0]}{i}",
                    r.prompt_tokens,
                    r.max_output_tokens,
                    r.arrival_s,
                    kind,
                    sim_output_tokens=r.sim_output_tokens,
                )
                for i, r in enumerate(arrivals)
            ]
        merged.sort(key=lambda r: (r.arrival_s, r.request_id))
        out[dep.name] = merged
    return out


def output_tokens(request: Request) -> int:
    """The tokens a request's answer will have: its SIMULATED length (the world's truth, which
    only the simulated engine, the offered-token count and the oracle read), else its cap."""
    if request.sim_output_tokens is None:
        return request.max_output_tokens
    return min(request.max_output_tokens, request.sim_output_tokens)


def offered_tokens(request: Request) -> int:
    """Prompt plus answer tokens: what serving the request to its end delivers."""
    return request.prompt_tokens + output_tokens(request)


def _constant(rates: MixRates) -> RatesAt:
    def at(_t_s: float) -> MixRates:
        return rates

    return at


def _class(rates: MixRates, kind: RequestKind) -> ClassRate:
    return rates.chat if kind is RequestKind.CHAT else rates.summarisation


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
        "max_tokens": request.max_output_tokens,  # the client's cap
    }
    if request.sim_output_tokens is not None:  # SIMULATED: where the simulated model stops
        body["simulated_output_tokens"] = request.sim_output_tokens
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
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="the cap every request states (default: "
        "the class's, 4 × its mean output); answers longer than it are cut there",
    )
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
    requests = generate(
        rates, seed=args.seed, start_s=args.start, duration_s=args.duration,
        client_cap=args.max_tokens,
    )  # fmt: skip
    report = asyncio.run(run_http(args.url, requests, deployment=args.deployment, speed=args.speed))
    print(json.dumps(report.summary(), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
