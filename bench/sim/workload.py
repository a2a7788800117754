"""Arrival traces: the scenario's workload as seeded Poisson processes, generated once per seed.

Each deployment has two request classes (chat, summarisation). Arrivals of a class follow a
non-homogeneous Poisson process with rate ``arrival_rps × multiplier(t)`` — the daily swing
times the active load phase (:meth:`sim.spec.WorkloadSpec.multipliers`) — drawn by
thinning (Lewis & Shedler 1979) from a homogeneous process at the rate's upper bound. The
scenario gives token means only; lengths are drawn log-normal around them (σ below; the mean is
preserved) and clipped to [16, 4 × mean], so no request is longer than any plan's KV could hold.

Every stream has its own ``random.Random`` seeded from a string (Python hashes string seeds with
SHA-512, so the trace is the same in every process), and every system of a run gets the same
trace.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping

from runtime.types import Request, RequestKind
from sim.spec import DeploymentSpec, MixSpec, Scenario

SIGMA_PROMPT = 0.5  # log-normal shape of prompt lengths (heavy-ish tail, like real prompts)
SIGMA_OUTPUT = 0.4  # and of output lengths
MIN_TOKENS = 16
MAX_OVER_MEAN = 4.0


def _length(rng: random.Random, mean: float, sigma: float) -> int:
    mu = math.log(mean) - sigma * sigma / 2  # E[lognormal(mu, sigma)] = mean
    draw = rng.lognormvariate(mu, sigma)
    return int(min(max(round(draw), MIN_TOKENS), round(mean * MAX_OVER_MEAN)))


def _peak_multiplier(dep: DeploymentSpec, kind: RequestKind) -> float:
    """An upper bound of the class's rate multiplier over all time (for thinning)."""
    wl = dep.workload
    phases = [1.0] + [
        ph.chat_multiplier if kind is RequestKind.CHAT else ph.summarisation_multiplier
        for ph in wl.phases
    ]
    return (1.0 + abs(wl.swing.amplitude)) * max(phases)


def class_arrivals(
    dep: DeploymentSpec, kind: RequestKind, duration_s: float, seed: int
) -> list[Request]:
    """Arrivals of one request class of ``dep`` over ``[0, duration_s)``."""
    wl = dep.workload
    mix: MixSpec = wl.chat if kind is RequestKind.CHAT else wl.summarisation
    rng = random.Random(f"flexpipe-bench:{seed}:{dep.name}:{kind.value}")
    peak_rps = mix.arrival_rps * _peak_multiplier(dep, kind)
    out: list[Request] = []
    if peak_rps <= 0:
        return out
    t_s = 0.0
    index = 0
    while True:
        t_s += rng.expovariate(peak_rps)
        if t_s >= duration_s:
            return out
        chat_x, summ_x = wl.multipliers(t_s)
        multiplier = chat_x if kind is RequestKind.CHAT else summ_x
        accept = rng.random() * peak_rps < mix.arrival_rps * multiplier
        prompt = _length(rng, mix.prompt_tokens_mean, SIGMA_PROMPT)
        output = _length(rng, mix.output_tokens_mean, SIGMA_OUTPUT)
        if accept:
            rid = f"{dep.name}/{kind.value[0]}{index}"
            out.append(Request(rid, prompt, output, t_s, kind))
            index += 1


def deployment_arrivals(dep: DeploymentSpec, duration_s: float, seed: int) -> list[Request]:
    """Both classes of ``dep`` merged in arrival order (ties by request id)."""
    merged = [
        *class_arrivals(dep, RequestKind.CHAT, duration_s, seed),
        *class_arrivals(dep, RequestKind.SUMMARISATION, duration_s, seed),
    ]
    merged.sort(key=lambda r: (r.arrival_s, r.request_id))
    return merged


def scenario_trace(scenario: Scenario, duration_s: float, seed: int) -> Mapping[str, list[Request]]:
    """Deployment name → its arrivals; the same for every system of a run."""
    return {d.name: deployment_arrivals(d, duration_s, seed) for d in scenario.deployments}
