"""Load model of the simulated ("sim") backend: what a GPU reports given the work it carries.

Pure functions over one GPU's state, its share of a serving replica's load and a seeded RNG:
:func:`replica_load` (roofline-style busy fraction, KV footprint, decode steps),
:func:`build_sample` (an NVML-shaped :class:`GpuSample`) and :func:`build_launches` (eBPF-shaped
per-process kernel launch counts). Relative accuracy only — decisions use differences — in the
spirit of the article's estimates; the constants below say what they stand for.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from flexpipe.schemas import (
    GpuProcess,
    GpuSample,
    KernelLaunches,
    ProcessLaunches,
    SampleReason,
    gpu_sample,
)
from sim.spec import GIB, DeploymentSpec, GpuClassSpec, GpuSpec, LinkSpec

MIB = 1024**2
MFU = 0.45  # fraction of dense bf16 peak that serving reaches
DECODE_TOKENS_PER_S_PER_SEQ = 30.0  # per-sequence decode speed; Little's law gives batch size
PREFILL_CHUNK_TOKENS = 2048  # chunked prefill: one forward pass per chunk
KERNELS_PER_LAYER = 14  # eager kernels per transformer layer in a prefill pass
KERNELS_PER_DECODE_STEP = 6  # sampling/logits kernels outside the decode CUDA graph
CONTEXT_BYTES = 512 * MIB  # CUDA context and NCCL buffers per worker
WORKSPACE_BYTES = 2 * GIB  # activations and sampler workspace per worker
DRIVER_RESERVED_BYTES = 512 * MIB  # what NVML reports as "reserved"
VMM_PAGE_BYTES = 2 * MIB  # KV pages are committed through CUDA VMM in 2 MiB granules
TENANT_LAUNCHES_PER_S = 3500.0  # a foreign training job's kernel rate
TENANT_BUSY = 0.96
AMBIENT_C = 28.0
THERMAL_TAU_S = 60.0  # first-order lag of die temperature behind power
NVLINK_LINKS = 18


@dataclass(frozen=True, slots=True)
class GpuLoad:
    """One GPU's share of a serving replica's work at one instant."""

    busy: float  # fraction of time kernels run (above 1 when overloaded)
    mem_busy: float  # fraction of time HBM is busy
    kv_bytes: float  # KV cache resident on this GPU
    decode_steps_per_s: float
    prefill_chunks_per_s: float
    tokens_per_s: float  # prefill + decode tokens through the replica
    kv_bytes_per_token: float  # this GPU's share of one token's KV
    layers: int  # layers this GPU runs (all of them under TP)
    replica_gpus: int


@dataclass(frozen=True, slots=True)
class Worker:
    """A deployment's serving process on one GPU."""

    pid: int
    deployment: str
    replica: int
    weight_bytes: float  # resident even when the replica stalls
    replica_gpus: int
    held_bytes: float = 0.0  # preallocated by the engine (weights + KV pool); 0 = none

    @property
    def comm(self) -> str:
        """Process name as the kernel reports it (TASK_COMM_LEN: 15 characters)."""
        return f"sim-{self.deployment}"[:15]


@dataclass(slots=True)
class Reservation:
    """Another tenant's reservation: one job process per GPU it holds."""

    id: str
    pid: int  # of the job's first process; one process per GPU, offset by the GPU's index
    gpus: list[str]

    def job_pid(self, gpu_index: int) -> int:
        """The tenant job's process on the GPU with this index."""
        return self.pid + gpu_index


@dataclass(frozen=True, slots=True)
class SampleFields:
    """What every sample of one GPU reports the same: fixed by its spec and class."""

    uuid: str
    node: str
    name: str  # NVML's device name
    gpu_class: str
    domain: str
    index: int
    memory_total_bytes: int
    usable_bytes: int  # total less what the driver reserves


class GpuState:
    """Mutable per-GPU state (slots: it is touched once per sample)."""

    __slots__ = (
        "cls",
        "ecc_uncorrected",
        "fatal",
        "fixed",
        "isolated",
        "last_sample_s",
        "pending_xids",
        "reservation",
        "retired_pages",
        "spec",
        "temp_c",
    )

    def __init__(self, spec: GpuSpec, cls: GpuClassSpec) -> None:
        self.spec = spec
        self.cls = cls
        self.fixed = SampleFields(
            spec.uuid,
            spec.node,
            f"sim {cls.name}",
            cls.name,
            spec.domain,
            spec.index,
            cls.memory_total_bytes,
            cls.memory_total_bytes - DRIVER_RESERVED_BYTES,
        )
        self.isolated = spec.isolated
        self.fatal: tuple[int, ...] = ()  # fatal XIDs since the last restore
        self.pending_xids: list[int] = []  # recoverable XIDs since the last sample
        self.reservation: Reservation | None = None
        self.ecc_uncorrected = 0
        self.retired_pages = 0
        self.temp_c: float | None = None  # None until sampled (and after a reboot)
        self.last_sample_s = 0.0

    @property
    def healthy(self) -> bool:
        """Not isolated and no fatal XID since the last restore."""
        return not (self.isolated or self.fatal)


def replica_load(
    dep: DeploymentSpec, classes: Sequence[GpuClassSpec], share: float, t_s: float
) -> GpuLoad:
    """Per-GPU load of a replica on GPUs of ``classes`` carrying ``share`` of ``dep``'s traffic."""
    wl, model, n = dep.workload, dep.model, len(classes)
    chat_x, summ_x = wl.multipliers(t_s)
    mixes = (
        (wl.chat, wl.chat.arrival_rps * chat_x * share),
        (wl.summarisation, wl.summarisation.arrival_rps * summ_x * share),
    )
    prefill_tps = sum(rps * m.prompt_tokens_mean for m, rps in mixes)
    decode_tps = sum(rps * m.output_tokens_mean for m, rps in mixes)
    # Little's law: tokens held in KV by the sequences decoding at any moment.
    ctx_tokens = (
        sum(
            rps * m.output_tokens_mean * (m.prompt_tokens_mean + m.output_tokens_mean / 2)
            for m, rps in mixes
        )
        / DECODE_TOKENS_PER_S_PER_SEQ
    )
    seqs = decode_tps / DECODE_TOKENS_PER_S_PER_SEQ
    steps_per_s = DECODE_TOKENS_PER_S_PER_SEQ if seqs >= 1.0 else decode_tps
    capacity_flops = n * min(c.peak_bf16_tflops for c in classes) * 1e12 * MFU
    compute = 2.0 * model.params_b * 1e9 * (prefill_tps + decode_tps) / capacity_flops
    kv_per_token = model.kv_bytes_per_token / n
    step_bytes = model.weight_bytes / n + ctx_tokens * kv_per_token  # one decode step reads all
    membw = min(c.memory_bandwidth_gbps for c in classes) * 1e9
    mem_busy = steps_per_s * step_bytes / membw
    busy = compute + mem_busy
    return GpuLoad(
        busy=busy,
        mem_busy=min(1.0, mem_busy + 0.3 * compute),
        kv_bytes=ctx_tokens * kv_per_token * max(1.0, busy),  # overloaded: sequences linger
        decode_steps_per_s=steps_per_s / max(1.0, busy),
        prefill_chunks_per_s=prefill_tps / PREFILL_CHUNK_TOKENS,
        tokens_per_s=prefill_tps + decode_tps,
        kv_bytes_per_token=kv_per_token,
        layers=model.num_layers,
        replica_gpus=n,
    )


def build_sample(
    g: GpuState,
    served: Sequence[tuple[Worker, GpuLoad | None]],
    link: LinkSpec,
    now_s: float,
    rng: random.Random,
) -> GpuSample:
    """The NVML-shaped sample of one GPU at ``now_s``; reason is DELTA until the filter says.

    NOTE: every GPU is sampled every simulated second (the fleet's hottest path), so the fields
    fixed by the GPU's spec and class come from :meth:`GpuState.fixed` and the sample is built
    through :func:`~flexpipe.schemas.gpu_sample`; the arithmetic and the RNG draws (their number
    and order: memory noise, power, SM then memory utilisation) are those of the plain model.
    """
    fixed = g.fixed
    usable = fixed.usable_bytes
    procs: tuple[GpuProcess, ...] = ()
    busy = mem_busy = 0.0
    tp_share = 0.0  # fraction of link bandwidth tensor-parallel traffic uses
    used_bytes = 0
    healthy = not (g.isolated or g.fatal)
    if healthy and g.reservation is not None:
        busy, mem_busy, tp_share = TENANT_BUSY, 0.6, 0.08  # a training job runs flat out
        used_bytes = int(usable * 0.94)
        procs = (GpuProcess(g.reservation.job_pid(fixed.index), used_bytes),)
    elif healthy and served:
        # NOTE: several processes (on-demand models sharing the GPU) each hold their context,
        # weights and KV; the GPU's memory and activity are their sums.
        cap = usable - 256 * MIB
        total = 0.0
        held: list[GpuProcess] = []
        for worker, load in served:
            used = CONTEXT_BYTES + WORKSPACE_BYTES + worker.weight_bytes
            if load is not None:
                busy, mem_busy = min(1.0, busy + load.busy), min(1.0, mem_busy + load.mem_busy)
                used += load.kv_bytes * (0.995 + 0.01 * rng.random())  # sequences come and go
                tp_share = max(tp_share, 0.04 if worker.replica_gpus > 1 else 0.0)
            used = max(used, worker.held_bytes)  # a preallocated KV pool is held, used or not
            total += used
            held.append(GpuProcess(worker.pid, int(min(used, cap))))
        used_bytes = int(min(total, cap))
        procs = tuple(held)
    if g.pending_xids:
        xids = g.fatal + tuple(g.pending_xids)
        g.pending_xids = []
    else:
        xids = g.fatal
    if 79 in g.fatal:  # a GPU off the bus answers no NVML query
        power_w = temp_c = sm_pct = mem_pct = None
    else:
        power_w, temp_c = _thermal(g, busy, mem_busy, now_s, rng)
        sm_pct = _pct(100.0 * busy, rng)
        mem_pct = _pct(100.0 * mem_busy, rng)
    nvlink = link.name == "nvlink"
    link_bytes = busy * tp_share * link.bandwidth_gbps * 1e9
    nvlink_bytes = float(int(link_bytes)) if nvlink else None
    pcie_link = 0.0 if nvlink else link_bytes
    return gpu_sample(
        gpu_uuid=fixed.uuid,
        node=fixed.node,
        name=fixed.name,
        reason=SampleReason.DELTA,
        memory_total_bytes=fixed.memory_total_bytes,
        memory_used_bytes=used_bytes,
        memory_free_bytes=usable - used_bytes,
        healthy=healthy,
        gpu_class=fixed.gpu_class,
        domain=fixed.domain,
        index=fixed.index,
        memory_reserved_bytes=DRIVER_RESERVED_BYTES,
        sm_util_pct=sm_pct,
        mem_util_pct=mem_pct,
        power_w=power_w,
        temperature_c=temp_c,
        ecc_uncorrected=g.ecc_uncorrected,
        retired_pages=g.retired_pages,
        xid_errors=xids,
        nvlink_active_links=NVLINK_LINKS if nvlink else None,
        nvlink_tx_bytes_per_s=nvlink_bytes,
        nvlink_rx_bytes_per_s=nvlink_bytes,
        pcie_tx_bytes_per_s=float(int(2e7 + 8e8 * busy + pcie_link)),
        pcie_rx_bytes_per_s=float(int(3e7 + 1.5e9 * busy + pcie_link)),
        mig_mode=False,
        processes=procs,
    )


def _pct(value: float, rng: random.Random) -> float:
    if value <= 0.0:
        return 0.0
    return float(round(min(100.0, max(0.0, value + 2.0 * rng.random() - 1.0))))


def _thermal(
    g: GpuState, busy: float, mem_busy: float, now_s: float, rng: random.Random
) -> tuple[float, float]:
    """Power from activity; die temperature lags power with a first-order filter."""
    tdp = g.cls.tdp_w
    idle = 0.12 * tdp
    power = idle + (tdp - idle) * min(1.0, 0.7 * busy + 0.3 * mem_busy) + 4.0 * rng.random() - 2.0
    target = AMBIENT_C + 50.0 * power / tdp
    if g.temp_c is None:
        g.temp_c = target
    else:
        alpha = 1.0 - math.exp(-max(0.0, now_s - g.last_sample_s) / THERMAL_TAU_S)
        g.temp_c += (target - g.temp_c) * alpha
    g.last_sample_s = now_s
    return round(power, 1), float(round(g.temp_c))


def _worker_launches(
    worker: Worker, load: GpuLoad, interval_s: float, rng: random.Random
) -> ProcessLaunches:
    jitter = 0.97 + 0.06 * rng.random()
    steps = load.decode_steps_per_s * interval_s * jitter
    prefill_kernels = load.prefill_chunks_per_s * load.layers * KERNELS_PER_LAYER
    kernels = int(prefill_kernels * interval_s * jitter + steps * KERNELS_PER_DECODE_STEP)
    kv_bytes = load.tokens_per_s * interval_s * load.kv_bytes_per_token
    freed = kv_bytes * (0.96 + 0.08 * rng.random())  # finished sequences give pages back
    return ProcessLaunches(
        pid=worker.pid,
        comm=worker.comm,
        launches=kernels,
        launches_per_s=round(kernels / interval_s, 1),
        graph_launches=int(steps),  # one decode-graph replay per step
        mem_alloc_bytes=_pages(kv_bytes * jitter),
        mem_free_bytes=_pages(freed),
    )


def build_launches(
    g: GpuState,
    served: Sequence[tuple[Worker, GpuLoad | None]],
    interval_s: float,
    rng: random.Random,
) -> KernelLaunches | None:
    """Kernel launches on one GPU over ``interval_s`` (every serving process's, or the
    tenant's); None when nothing launched."""
    if interval_s <= 0.0 or not g.healthy:
        return None
    resv = g.reservation
    if resv is not None:
        kernels = int(TENANT_LAUNCHES_PER_S * interval_s * (0.95 + 0.1 * rng.random()))
        procs: tuple[ProcessLaunches, ...] = (
            ProcessLaunches(
                resv.job_pid(g.spec.index),
                "sim-tenant-job",
                kernels,
                round(kernels / interval_s, 1),
            ),
        )
    else:
        procs = tuple(
            _worker_launches(w, load, interval_s, rng) for w, load in served if load is not None
        )
        kernels = sum(p.launches for p in procs)
    if not kernels:
        return None
    rate = round(kernels / interval_s, 1)
    return KernelLaunches(g.spec.uuid, g.spec.node, interval_s, kernels, rate, procs)


def _pages(num_bytes: float) -> int:
    return int(num_bytes // VMM_PAGE_BYTES) * VMM_PAGE_BYTES
