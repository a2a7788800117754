"""Scenario files for the simulated fragmented cluster: typed specs and a validating loader.

A scenario (YAML) declares GPU classes, interconnect links, NVLink/RDMA/PCIe domains with their
nodes and GPUs, the deployments that run on them with their request mix, and a timeline of
topology events (preemptions, releases, node failures, XID errors, isolation). :func:`load_scenario`
turns a file into frozen dataclasses or raises :class:`flexpipe.errors.ValidationError` whose
``field`` is the path of the bad entry (``timeline[3].count``, ``domains.A.link``). The annotated
reference of every key is ``sim/scenarios/seed-fragmented.yaml``.

Bandwidths ending in ``_gbps`` are gigabytes per second (1e9 bytes/s) throughout: the datasheet
unit of HBM and NVLink, and the unit KV-migration arithmetic wants.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeVar

from gearbox.starting import PlanHint

T = TypeVar("T")
GIB = 1024**3


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """An interconnect class: NVLink island, RDMA fabric, PCIe host, plain Ethernet."""

    name: str
    bandwidth_gbps: float  # per GPU, GB/s
    latency_us: float


DEFAULT_LINKS: dict[str, LinkSpec] = {
    "nvlink": LinkSpec("nvlink", 900.0, 2.0),  # NVLink 4 through NVSwitch
    "rdma": LinkSpec("rdma", 25.0, 5.0),  # 200 Gb/s InfiniBand HDR per GPU
    "pcie": LinkSpec("pcie", 16.0, 15.0),  # PCIe 4 host bridges, TCP between hosts
    "ethernet": LinkSpec("ethernet", 12.5, 25.0),  # 100 GbE between blocks
}


@dataclass(frozen=True, slots=True)
class GpuClassSpec:
    """A GPU generation as the planner sees it."""

    name: str
    peak_bf16_tflops: float  # dense
    memory_gb: float  # GiB, as NVML reports total memory
    memory_bandwidth_gbps: float  # GB/s
    tdp_w: float = 400.0

    @property
    def memory_total_bytes(self) -> int:
        """Total memory in bytes."""
        return int(self.memory_gb * GIB)


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One GPU slot of a node."""

    uuid: str  # GPU-sim-<domain>-<node>-<index>
    node: str
    domain: str
    index: int
    gpu_class: str
    isolated: bool = False  # fault-isolated from t=0


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """A host: its GPUs all belong to one interconnect domain."""

    name: str
    domain: str
    gpus: tuple[GpuSpec, ...]


@dataclass(frozen=True, slots=True)
class DomainSpec:
    """An interconnect domain (the article's "block"): GPUs that share one link class."""

    id: str
    link: str  # key into Scenario.links
    nodes: tuple[NodeSpec, ...]

    @property
    def gpus(self) -> tuple[GpuSpec, ...]:
        """GPUs in node order, then index order."""
        return tuple(g for n in self.nodes for g in n.gpus)


@dataclass(frozen=True, slots=True)
class ModelSpecRef:
    """A model preset key plus the few numbers the simulator needs from it."""

    preset: str  # key into gearbox's model presets, e.g. "llama-70b-class"
    params_b: float  # parameters, billions (weights are bf16: 2 bytes each)
    num_layers: int
    kv_bytes_per_token: int  # all layers, K and V

    @property
    def weight_bytes(self) -> int:
        """bf16 weights in bytes."""
        return int(self.params_b * 1e9 * 2)


@dataclass(frozen=True, slots=True)
class MixSpec:
    """One request class (chat or summarisation) at multiplier 1."""

    arrival_rps: float
    prompt_tokens_mean: float
    output_tokens_mean: float


@dataclass(frozen=True, slots=True)
class Swing:
    """Daily tide: rates are multiplied by ``1 + amplitude·cos(2π(t − peak_s)/period_s)``."""

    amplitude: float = 0.0
    period_s: float = 86400.0
    peak_s: float = 0.0


@dataclass(frozen=True, slots=True)
class LoadPhase:
    """A window with scaled arrivals; outside every phase the multiplier is 1."""

    name: str
    start_s: float
    end_s: float
    chat_multiplier: float
    summarisation_multiplier: float


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """A deployment's request mix over time."""

    chat: MixSpec
    summarisation: MixSpec
    swing: Swing
    phases: tuple[LoadPhase, ...]

    def multipliers(self, t_s: float) -> tuple[float, float]:
        """(chat, summarisation) arrival multipliers at ``t_s``: swing times active phase."""
        sw = self.swing
        tide = 1.0 + sw.amplitude * math.cos(2.0 * math.pi * (t_s - sw.peak_s) / sw.period_s)
        for ph in self.phases:
            if ph.start_s <= t_s < ph.end_s:
                return tide * ph.chat_multiplier, tide * ph.summarisation_multiplier
        return tide, tide


@dataclass(frozen=True, slots=True)
class DeploymentSpec:
    """A model served on the cluster, its starting plan and its load."""

    name: str
    model: ModelSpecRef
    plan: PlanHint | None  # None: on demand, cold until requested
    workload: WorkloadSpec
    # Share of each of its GPUs' memory a replica's engine holds once loaded, as vLLM
    # preallocates weights plus KV cache up to ``gpu_memory_utilization``; 0 = the weights and
    # the live KV only. NOTE: with it, the telemetry shows a served GPU as full, so the planner
    # never puts another deployment there — which the runtime, owning GPUs whole, would refuse.
    memory_utilisation: float = 0.0
    # The deployment's SLOs (config's deployments[].ttft_slo_ms / tbt_slo_ms); None = gearbox's.
    ttft_slo_ms: float | None = None
    tbt_slo_ms: float | None = None
    # On demand (config residency on_demand): no plan until requested, loaded and evicted by
    # the stream; ``pin`` restricts it to a domain, the affinities name other deployments.
    on_demand: bool = False
    pin: str | None = None
    affinity: tuple[str, ...] = ()
    anti_affinity: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Preempt:
    """A tenant reservation takes ``gpus`` of a domain (chosen by seed when not named)."""

    t_s: float
    domain: str
    count: int
    gpus: tuple[str, ...] = ()  # uuids; empty = pick ``count`` schedulable GPUs by seed
    id: str = ""  # names the reservation for a later release


@dataclass(frozen=True, slots=True)
class Release:
    """A reservation gives GPUs back: a named one whole, or ``count`` GPUs oldest first."""

    t_s: float
    domain: str
    count: int | None = None
    preemption: str | None = None


@dataclass(frozen=True, slots=True)
class NodeFailure:
    """A host dies: its agent stops, its GPUs vanish, the scheduler marks it down."""

    t_s: float
    node: str


@dataclass(frozen=True, slots=True)
class NodeRecovery:
    """A failed host comes back with empty GPUs; its agent restarts."""

    t_s: float
    node: str


@dataclass(frozen=True, slots=True)
class Xid:
    """The driver logs an XID error on a GPU; fatal codes make it unhealthy."""

    t_s: float
    gpu: str  # uuid
    code: int


@dataclass(frozen=True, slots=True)
class Isolate:
    """The scheduler fault-isolates a GPU (removes it from the pool)."""

    t_s: float
    gpu: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Restore:
    """An isolated or failed GPU is back in the pool (reset or replaced)."""

    t_s: float
    gpu: str


@dataclass(frozen=True, slots=True)
class LinkChange:
    """The measured bandwidth of a domain's interconnect changes (congestion, a bad port)."""

    t_s: float
    domain: str
    bandwidth_gbps: float


TimelineEvent = (
    Preempt | Release | NodeFailure | NodeRecovery | Xid | Isolate | Restore | LinkChange
)


@dataclass(frozen=True, slots=True)
class Scenario:
    """A whole simulated cluster: hardware, deployments, load and what happens when."""

    name: str
    duration_s: float
    epoch_ms: int  # event time of t=0
    gpu_classes: tuple[GpuClassSpec, ...]
    links: tuple[LinkSpec, ...]
    inter_domain_link: str
    domains: tuple[DomainSpec, ...]
    deployments: tuple[DeploymentSpec, ...]
    timeline: tuple[TimelineEvent, ...]
    source: str = "<mapping>"
    placement: tuple[tuple[str, float], ...] = ()  # config ``placement`` knobs it sets

    @property
    def nodes(self) -> tuple[NodeSpec, ...]:
        """Every node, domain by domain."""
        return tuple(n for d in self.domains for n in d.nodes)

    @property
    def gpus(self) -> tuple[GpuSpec, ...]:
        """Every GPU, domain by domain."""
        return tuple(g for d in self.domains for g in d.gpus)

    def gpu_class(self, name: str) -> GpuClassSpec:
        """The class called ``name`` (KeyError when there is none)."""
        return _find(self.gpu_classes, "name", name)

    def link(self, name: str) -> LinkSpec:
        """The link class called ``name`` (KeyError when there is none)."""
        return _find(self.links, "name", name)

    def domain(self, domain_id: str) -> DomainSpec:
        """The domain with id ``domain_id`` (KeyError when there is none)."""
        return _find(self.domains, "id", domain_id)


def _find(items: tuple[T, ...], attr: str, value: str) -> T:
    for item in items:
        if getattr(item, attr) == value:
            return item
    raise KeyError(value)


def gpu_uuid(domain: str, node: str, index: int) -> str:
    """The deterministic uuid of a simulated GPU."""
    return f"GPU-sim-{domain}-{node}-{index}"
