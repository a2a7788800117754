"""Domain types: hardware classes, GPUs, interconnect domains, topology and load snapshots.

Units are carried in names. Bandwidths named ``*_gbps`` are GIGABYTES per second (GB/s, 1e9
bytes/s), per GPU and per direction — never gigabits. Memory is in bytes, latencies in
microseconds (``_us``), times in seconds (``_s``) or milliseconds (``_ms``).
"""

from __future__ import annotations

from dataclasses import dataclass

from gearbox.serde import Serialisable

__all__ = [
    "Domain",
    "Gpu",
    "GpuClass",
    "LinkClass",
    "LinkOverride",
    "LoadSnapshot",
    "TopologySnapshot",
]


@dataclass(frozen=True, slots=True)
class GpuClass(Serialisable):
    """A GPU model's datasheet figures."""

    name: str  # e.g. "h100-sxm"
    peak_bf16_tflops: float  # dense bf16 tensor-core peak, TFLOP/s
    memory_bytes: int  # HBM/GDDR capacity
    memory_bandwidth_gbps: float  # DRAM bandwidth, GB/s

    def __post_init__(self) -> None:
        if self.peak_bf16_tflops <= 0 or self.memory_bytes <= 0 or self.memory_bandwidth_gbps <= 0:
            raise ValueError(f"GpuClass {self.name}: figures must be positive")


@dataclass(frozen=True, slots=True)
class LinkClass(Serialisable):
    """An interconnect's per-GPU, per-direction bandwidth and one-hop latency."""

    name: str  # e.g. "nvlink", "rdma", "pcie", "ethernet"
    bandwidth_gbps: float  # GB/s per GPU per direction
    latency_us: float  # one message's fixed latency

    def __post_init__(self) -> None:
        if self.bandwidth_gbps <= 0 or self.latency_us < 0:
            raise ValueError(f"LinkClass {self.name}: bandwidth must be > 0, latency >= 0")


@dataclass(frozen=True, slots=True)
class Gpu(Serialisable):
    """One GPU as the fragment monitor last saw it."""

    uuid: str  # NVML UUID, the GPU's identity everywhere
    node: str  # host name
    gpu_class: GpuClass
    domain: str  # interconnect domain id (see Domain)
    total_memory_bytes: int
    free_memory_bytes: int  # memory not held by any process
    healthy: bool  # False after XID errors / failed health checks
    schedulable: bool  # False when cordoned, reserved by another tenant or isolated
    utilisation: float  # compute utilisation in [0, 1]
    last_seen_s: float  # event time of the last heartbeat


@dataclass(frozen=True, slots=True)
class Domain(Serialisable):
    """GPUs sharing one interconnect: an NVLink/NVSwitch domain, an RDMA fabric, a PCIe group."""

    domain_id: str
    link: LinkClass  # the link between any two GPUs of the domain


@dataclass(frozen=True, slots=True)
class LinkOverride(Serialisable):
    """A measured link between two specific domains, replacing the inter-domain default."""

    domain_a: str
    domain_b: str
    link: LinkClass


@dataclass(frozen=True, slots=True)
class TopologySnapshot(Serialisable):
    """The schedulable resource tree at one instant, as built by the stream processor."""

    now_s: float  # event time the snapshot describes; gearbox never reads a clock
    gpus: tuple[Gpu, ...]
    domains: tuple[Domain, ...]
    inter_domain_link: LinkClass  # default link between GPUs of different domains
    heartbeat_timeout_s: float = 45.0  # GPUs silent for longer are out
    link_overrides: tuple[LinkOverride, ...] = ()

    def domain_link(self, domain_id: str) -> LinkClass:
        """Link inside ``domain_id``; unknown domains get the inter-domain link (conservative)."""
        for domain in self.domains:
            if domain.domain_id == domain_id:
                return domain.link
        return self.inter_domain_link

    def link_between(self, domain_a: str, domain_b: str) -> LinkClass:
        """Link between two domains: the domain's own link when equal, else override or default."""
        if domain_a == domain_b:
            return self.domain_link(domain_a)
        for override in self.link_overrides:
            if {override.domain_a, override.domain_b} == {domain_a, domain_b}:
                return override.link
        return self.inter_domain_link

    def gpu_is_live(self, gpu: Gpu) -> bool:
        """Healthy, schedulable and heard from within the heartbeat timeout."""
        return (
            gpu.healthy
            and gpu.schedulable
            and self.now_s - gpu.last_seen_s <= self.heartbeat_timeout_s
        )


@dataclass(frozen=True, slots=True)
class LoadSnapshot(Serialisable):
    """One deployment's serving load over the recent sliding window."""

    now_s: float
    arrival_rate_rps: float  # requests per second
    mean_prompt_tokens: float
    mean_output_tokens: float
    queue_len: int = 0  # requests waiting for admission
    active_sequences: int = 0  # sequences holding KV now
    active_kv_tokens: int = 0  # sum of their context lengths
    ttft_p95_ms: float = 0.0  # observed: highest of the reports' own p95s (pressure, explanation)
    tbt_p95_ms: float = 0.0  # observed: highest of the reports' own p95s (pressure, explanation)
    # p95 over every TTFT sample of the window (0 = none), what gearbox.correction learns from:
    # the highest of many small reports' p95s sits near the window's maximum instead. Requests
    # refused for want of room count as TTFTs beyond every sample (they never got a first
    # token); when the p95 falls among them it is only a lower bound (the largest sample).
    window_ttft_p95_ms: float = 0.0
    num_ttft_samples: int = 0  # TTFT samples behind window_ttft_p95_ms
    num_ttft_refused: int = 0  # capacity refusals counted in it, beyond every sample
    window_ttft_p95_censored: bool = False  # window_ttft_p95_ms is a lower bound (see above)
    # The prompt tail the TTFT estimate uses (gearbox.cost, M/G/c wait): heavy-tailed prompts
    # set the TTFT p95, not the mean one. The streams give the window's; decide replaces them
    # with the ones of its smoothed lengths (gearbox.correction). p95 0 = unknown: every prompt
    # is then taken as the mean one, with exponential service times.
    p95_prompt_tokens: float = 0.0
    prompt_tokens_scv: float = 0.0  # squared coefficient of variation of prompt tokens
    # the window's prompt lengths as (tokens, count), ascending (empty = not reported)
    prompt_lengths: tuple[tuple[float, int], ...] = ()

    def __post_init__(self) -> None:
        if (
            self.arrival_rate_rps < 0
            or self.queue_len < 0
            or self.active_sequences < 0
            or self.num_ttft_samples < 0
            or self.num_ttft_refused < 0
            or self.p95_prompt_tokens < 0
            or self.prompt_tokens_scv < 0
        ):
            raise ValueError("LoadSnapshot: rates and counts must be >= 0")
        if self.mean_prompt_tokens < 1 or self.mean_output_tokens < 1:
            raise ValueError("LoadSnapshot: mean prompt/output tokens must be >= 1")
