"""The multi-model scenario: cluster, model catalogue and a seeded bursty workload.

Cluster (the second article's setting, scaled down): 4 large-memory GPUs (H100 80 GB, two per
node, NVLink) and 8 small ones (A10 24 GB, four per node, PCIe) on 4 nodes.

Catalogue: small (1.5B/3B), medium (7B, 13B) and large (34B, only placeable on the 80 GB
cards) open-model shapes. Each model has its own traffic: a two-state Markov-modulated Poisson
process (quiet ↔ burst, exponential sojourns) that may start late ("late" models, which need room
once the cluster is full) or stop early ("tidal" models, which go cold and become eviction
candidates). Cluster-wide long-prompt spikes (exponential gaps, minutes long) give a share of the
requests arriving inside them long prompts, raising KV demand.

Everything is drawn from ``random.Random`` seeded per model and per spike stream with string
seeds (hashed with SHA-512 by ``random``, independent of ``PYTHONHASHSEED``), so the same seed
gives the same requests on every machine; every system replays the same tuple of requests.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

from gearbox.model import ModelSpec
from gearbox.presets import GIB, GPU_CLASSES, LINK_CLASSES, MODEL_7B_MHA
from gearbox.types import Domain, Gpu, GpuClass, TopologySnapshot

__all__ = [
    "A10_24G",
    "ModelProfile",
    "Scenario",
    "SimRequest",
    "TrafficProfile",
    "build_scenario",
    "cluster_of",
    "in_spike",
    "lognormal_int",
    "make_cluster",
    "mmpp_arrivals",
    "spike_windows",
]

# NVIDIA A10 datasheet (2021): 125 TFLOPS bf16 dense, 24 GB GDDR6, 600 GB/s.
A10_24G = GpuClass("a10-24g", 125.0, 24 * GIB, 600.0)

# Shapes from the published Hugging Face config.json files (parameter counts as stated there).
QWEN2_1_5B = ModelSpec("qwen2-1.5b", 1_543_714_304, 28, 1536, 12, 2, 128)
QWEN2_5_3B = ModelSpec("qwen2.5-3b", 3_085_938_688, 36, 2048, 16, 2, 128)
LLAMA2_13B = ModelSpec("llama-2-13b", 13_015_864_320, 40, 5120, 40, 40, 128)
CODELLAMA_34B = ModelSpec("codellama-34b", 33_743_970_304, 48, 8192, 64, 8, 128)

LONG_PROMPT_TOKENS = (4096, 12288)  # a long prompt's length is uniform in this range
MAX_OUTPUT_TOKENS = 1024  # the max_tokens every client states (outputs are clipped to it)
NEVER_S = 1e12  # "no end" for traffic windows (finite so it stays JSON-safe)


@dataclass(frozen=True, slots=True)
class TrafficProfile:
    """One model's request process and request shapes."""

    quiet_rps: float  # arrival rate in the quiet state
    burst_rps: float  # arrival rate in the burst state
    mean_quiet_s: float  # mean sojourn in the quiet state
    mean_burst_s: float  # mean sojourn in the burst state
    mean_prompt_tokens: int  # lognormal mean outside long-prompt spikes
    mean_output_tokens: int  # lognormal mean
    long_prompt_share: float  # share of requests inside a spike that get a long prompt
    active_from_s: float = 0.0  # no requests before (a "late" model)
    active_until_s: float = NEVER_S  # no requests after (a "tidal" model)


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """A catalogue entry: the model, how many replicas it wants, the batch it is placed for."""

    name: str  # deployment name, unique in the catalogue
    spec: ModelSpec
    replicas: int  # replicas the (shared) control plane asks for while the model has demand
    batch_size: int  # placement footprint: concurrent sequences …
    seq_len_tokens: int  # … of this context length (gearbox's k × batch × seq × kv estimate)
    traffic: TrafficProfile


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request of the workload."""

    request_id: str
    model_name: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    long_prompt: bool  # drawn inside a spike with a long prompt
    max_tokens: int = MAX_OUTPUT_TOKENS  # what the client states; output_tokens is the truth


@dataclass(frozen=True, slots=True)
class Scenario:
    """Everything every system is given."""

    seed: int
    duration_s: float
    cluster: TopologySnapshot  # GPUs as built, all empty (free memory = total)
    models: tuple[ModelProfile, ...]
    spikes: tuple[tuple[float, float], ...]  # long-prompt spike windows [start, end)
    requests: tuple[SimRequest, ...]  # sorted by arrival time, then id
    popularity: tuple[tuple[str, ...], ...] = ()  # per phase, models with traffic by rank (farm)


# node, GPU class, link inside the node, GPUs
NodeLayout = tuple[str, str, str, int]


def cluster_of(layout: tuple[NodeLayout, ...]) -> TopologySnapshot:
    """A cluster of the given nodes, every GPU healthy and empty (free memory = total)."""
    gpus: list[Gpu] = []
    domains: list[Domain] = []
    for node, class_name, link, count in layout:
        gpu_class = A10_24G if class_name == "a10-24g" else GPU_CLASSES[class_name]
        domains.append(Domain(node, LINK_CLASSES[link]))
        for i in range(count):
            gpus.append(
                Gpu(
                    uuid=f"{node}-g{i}",
                    node=node,
                    gpu_class=gpu_class,
                    domain=node,
                    total_memory_bytes=gpu_class.memory_bytes,
                    free_memory_bytes=gpu_class.memory_bytes,
                    healthy=True,
                    schedulable=True,
                    utilisation=0.0,
                    last_seen_s=0.0,
                )
            )
    return TopologySnapshot(0.0, tuple(gpus), tuple(domains), LINK_CLASSES["ethernet"])


def make_cluster() -> TopologySnapshot:
    """4 × H100 80 GB on 2 NVLink nodes + 8 × A10 24 GB on 2 PCIe nodes, all free."""
    return cluster_of(
        (
            ("big-0", "h100-sxm", "nvlink", 2),
            ("big-1", "h100-sxm", "nvlink", 2),
            ("small-0", "a10-24g", "pcie-local", 4),
            ("small-1", "a10-24g", "pcie-local", 4),
        )
    )


def _traffic(
    quiet: float, burst: float, prompt: int, output: int, window: tuple[float, float]
) -> TrafficProfile:
    """Bursts of ~2 min every ~10 min; half the requests in a long-prompt spike are long."""
    return TrafficProfile(quiet, burst, 600.0, 120.0, prompt, output, 0.5, *window)


# name, spec, replicas, placement batch, quiet rps, burst rps, mean prompt, mean output, pattern
_FARM: tuple[tuple[str, ModelSpec, int, int, float, float, int, int, str], ...] = (
    ("code-34b", CODELLAMA_34B, 1, 2, 0.25, 1.0, 1500, 200, "always"),
    ("chat-34b", CODELLAMA_34B, 1, 2, 0.2, 0.8, 800, 300, "always"),
    ("chat-13b", LLAMA2_13B, 1, 4, 0.3, 1.2, 600, 200, "always"),
    ("tidal-13b", LLAMA2_13B, 1, 4, 0.2, 0.8, 600, 200, "tidal"),
    ("chat-7b", MODEL_7B_MHA, 2, 4, 0.6, 2.4, 600, 250, "always"),
    ("summ-7b", MODEL_7B_MHA, 1, 4, 0.15, 0.6, 2000, 300, "always"),
    ("rag-7b", MODEL_7B_MHA, 1, 4, 0.2, 0.8, 1500, 200, "always"),
    ("agent-7b", MODEL_7B_MHA, 1, 4, 0.2, 0.8, 1000, 200, "always"),
    ("tidal-7b-a", MODEL_7B_MHA, 1, 4, 0.3, 1.2, 600, 200, "tidal"),
    ("tidal-7b-b", MODEL_7B_MHA, 1, 4, 0.2, 0.8, 600, 200, "tidal"),
    ("late-7b-a", MODEL_7B_MHA, 1, 4, 0.3, 1.2, 600, 200, "late"),
    ("late-7b-b", MODEL_7B_MHA, 1, 4, 0.2, 0.8, 600, 200, "late"),
    *((f"assist-{c}", QWEN2_1_5B, 1, 8, 0.4, 1.6, 400, 120, "always") for c in "abcd"),
    *((f"tools-{c}", QWEN2_5_3B, 1, 8, 0.3, 1.2, 800, 150, "always") for c in "ab"),
    *((f"tidal-1.5b-{c}", QWEN2_1_5B, 1, 8, 0.4, 1.6, 400, 120, "tidal") for c in "ab"),
    ("tidal-3b", QWEN2_5_3B, 1, 8, 0.3, 1.2, 800, 150, "tidal"),
    *((f"late-1.5b-{c}", QWEN2_1_5B, 1, 8, 0.4, 1.6, 400, 120, "late") for c in "ab"),
    ("late-3b", QWEN2_5_3B, 1, 8, 0.3, 1.2, 800, 150, "late"),
)


def catalogue(duration_s: float) -> tuple[ModelProfile, ...]:
    """The model farm: 2 × 34B, 2 × 13B, 8 × 7B, 12 small (1.5B/3B); some tidal, some late.

    Tidal models fall silent after the first sixth of the run and go cold; late models start at
    two thirds, when the farm is full, so placing them needs the cold ones evicted.
    """
    windows = {
        "always": (0.0, NEVER_S),
        "tidal": (0.0, duration_s / 6),
        "late": (duration_s * 2 / 3, NEVER_S),
    }
    return tuple(
        ModelProfile(
            name,
            spec,
            replicas,
            batch,
            4096 if batch <= 2 else 2048,
            _traffic(quiet, burst, prompt, output, windows[pattern]),
        )
        for name, spec, replicas, batch, quiet, burst, prompt, output, pattern in _FARM
    )


def _scaled(profile: ModelProfile, load_scale: float) -> ModelProfile:
    traffic = profile.traffic
    scaled = dataclasses.replace(
        traffic, quiet_rps=traffic.quiet_rps * load_scale, burst_rps=traffic.burst_rps * load_scale
    )
    return dataclasses.replace(profile, traffic=scaled)


def spike_windows(seed: int, duration_s: float) -> tuple[tuple[float, float], ...]:
    """Long-prompt spike windows: gaps ~ Exp(mean 10 min), lengths uniform 1–3 min."""
    rng = random.Random(f"{seed}:spikes")
    out: list[tuple[float, float]] = []
    t = rng.expovariate(1 / 600.0)
    while t < duration_s:
        length = rng.uniform(60.0, 180.0)
        out.append((round(t, 6), round(min(duration_s, t + length), 6)))
        t += length + rng.expovariate(1 / 600.0)
    return tuple(out)


def in_spike(t: float, spikes: tuple[tuple[float, float], ...]) -> bool:
    return any(start <= t < end for start, end in spikes)


def lognormal_int(rng: random.Random, mean: float, sigma: float, lo: int, hi: int) -> int:
    """A lognormal draw with the given mean, clipped to [lo, hi]."""
    mu = math.log(mean) - sigma * sigma / 2
    return max(lo, min(hi, round(rng.lognormvariate(mu, sigma))))


def mmpp_arrivals(rng: random.Random, traffic: TrafficProfile, duration_s: float) -> list[float]:
    """MMPP arrival times: Poisson at the state's rate, the state flipping after Exp sojourns."""
    end = min(duration_s, traffic.active_until_s)
    t, burst = traffic.active_from_s, False
    switch = t + rng.expovariate(1 / traffic.mean_quiet_s)
    out: list[float] = []
    while t < end:
        rate = traffic.burst_rps if burst else traffic.quiet_rps
        step = rng.expovariate(rate) if rate > 0 else math.inf
        if t + step >= switch:
            # NOTE: memorylessness lets the draw restart at the switch without bias.
            t, burst = switch, not burst
            mean = traffic.mean_burst_s if burst else traffic.mean_quiet_s
            switch = t + rng.expovariate(1 / mean)
            continue
        t += step
        if t < end:
            out.append(t)
    return out


def _requests_for(
    seed: int, profile: ModelProfile, duration_s: float, spikes: tuple[tuple[float, float], ...]
) -> list[SimRequest]:
    rng = random.Random(f"{seed}:{profile.name}")
    traffic = profile.traffic
    out: list[SimRequest] = []
    for n, t in enumerate(mmpp_arrivals(rng, traffic, duration_s)):
        long_prompt = in_spike(t, spikes) and rng.random() < traffic.long_prompt_share
        if long_prompt:
            prompt = rng.randint(*LONG_PROMPT_TOKENS)
        else:
            prompt = lognormal_int(rng, traffic.mean_prompt_tokens, 0.6, 16, LONG_PROMPT_TOKENS[0])
        output = lognormal_int(rng, traffic.mean_output_tokens, 0.6, 1, MAX_OUTPUT_TOKENS)
        out.append(
            SimRequest(
                f"{profile.name}/{n}", profile.name, round(t, 6), prompt, output, long_prompt
            )
        )
    return out


def build_scenario(seed: int, duration_s: float, load_scale: float = 1.0) -> Scenario:
    """The full scenario for ``seed`` over ``duration_s`` simulated seconds.

    ``load_scale`` multiplies every model's arrival rates (a load sweep keeps all else equal).
    """
    spikes = spike_windows(seed, duration_s)
    models = tuple(_scaled(m, load_scale) for m in catalogue(duration_s))
    requests = [r for m in models for r in _requests_for(seed, m, duration_s, spikes)]
    requests.sort(key=lambda r: (r.arrival_s, r.request_id))
    return Scenario(seed, duration_s, make_cluster(), models, spikes, tuple(requests))
