"""Pure decoding of the launch probe's BPF maps into FlexPipe events (no kernel, no bcc).

The BPF program keeps cumulative counters per (process, probed symbol); :class:`CounterDeltas`
turns successive reads into per-interval counts, :func:`aggregate_processes` folds symbols into
one :class:`~flexpipe.schemas.ProcessLaunches` per process, and :func:`to_kernel_launches`
attributes processes to GPUs.

NOTE on the two approximations (the README should carry the same note):

* Runtime vs driver launches. ``cudaLaunchKernel`` normally reaches the driver through
  ``cuLaunchKernel``'s exported entry point, so a runtime launch is seen twice. A process's
  launches are therefore ``max(driver launches, runtime launches)``: exact when the runtime
  forwards through the driver's entry points, a lower bound when it does not.
* GPU attribution. Launch counts know the process, not the GPU. A process is mapped to the GPUs on
  whose NVML process list it appears, and a process on several GPUs has its launches attributed to
  each of them: an upper bound per GPU. Processes on no GPU's list (not yet holding memory, or in
  another PID namespace) are not attributed.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from flexpipe.schemas import KernelLaunches, ProcessLaunches

TASK_COMM_LEN = 16


class Category(enum.StrEnum):
    """What a probed symbol counts."""

    DRIVER_LAUNCH = "driver_launch"
    RUNTIME_LAUNCH = "runtime_launch"
    GRAPH_LAUNCH = "graph_launch"
    MEM_ALLOC = "mem_alloc"
    MEM_FREE = "mem_free"


class Library(enum.StrEnum):
    """Which CUDA library exports a symbol."""

    DRIVER = "libcuda"
    RUNTIME = "libcudart"


class SymbolId(enum.IntEnum):
    """Ids the BPF program writes into its map keys (passed to it as ``-DSYM_<NAME>=<id>``)."""

    CU_LAUNCH_KERNEL = 1
    CU_LAUNCH_KERNEL_PTSZ = 2
    CU_LAUNCH_KERNEL_EX = 3
    CU_LAUNCH_KERNEL_EX_PTSZ = 4
    CUDA_LAUNCH_KERNEL = 5
    CUDA_LAUNCH_KERNEL_PTSZ = 6
    CU_GRAPH_LAUNCH = 7
    CU_GRAPH_LAUNCH_PTSZ = 8
    CU_MEM_ALLOC = 9
    CU_MEM_FREE = 10


@dataclass(frozen=True, slots=True)
class ProbeSpec:
    """One uprobe: the exported symbol, the BPF function it runs and what it counts."""

    symbol: str  # exported name in libcuda / libcudart
    sym_id: SymbolId
    fn_name: str  # BPF function run at entry
    category: Category
    library: Library
    ret_fn_name: str | None = None  # BPF function run at return (uretprobe), if any


PROBES: tuple[ProbeSpec, ...] = (
    ProbeSpec(
        "cuLaunchKernel",
        SymbolId.CU_LAUNCH_KERNEL,
        "on_cu_launch_kernel",
        Category.DRIVER_LAUNCH,
        Library.DRIVER,
    ),
    ProbeSpec(
        "cuLaunchKernel_ptsz",
        SymbolId.CU_LAUNCH_KERNEL_PTSZ,
        "on_cu_launch_kernel_ptsz",
        Category.DRIVER_LAUNCH,
        Library.DRIVER,
    ),
    ProbeSpec(
        "cuLaunchKernelEx",
        SymbolId.CU_LAUNCH_KERNEL_EX,
        "on_cu_launch_kernel_ex",
        Category.DRIVER_LAUNCH,
        Library.DRIVER,
    ),
    ProbeSpec(
        "cuLaunchKernelEx_ptsz",
        SymbolId.CU_LAUNCH_KERNEL_EX_PTSZ,
        "on_cu_launch_kernel_ex_ptsz",
        Category.DRIVER_LAUNCH,
        Library.DRIVER,
    ),
    ProbeSpec(
        "cudaLaunchKernel",
        SymbolId.CUDA_LAUNCH_KERNEL,
        "on_cuda_launch_kernel",
        Category.RUNTIME_LAUNCH,
        Library.RUNTIME,
    ),
    ProbeSpec(
        "cudaLaunchKernel_ptsz",
        SymbolId.CUDA_LAUNCH_KERNEL_PTSZ,
        "on_cuda_launch_kernel_ptsz",
        Category.RUNTIME_LAUNCH,
        Library.RUNTIME,
    ),
    ProbeSpec(
        "cuGraphLaunch",
        SymbolId.CU_GRAPH_LAUNCH,
        "on_cu_graph_launch",
        Category.GRAPH_LAUNCH,
        Library.DRIVER,
    ),
    ProbeSpec(
        "cuGraphLaunch_ptsz",
        SymbolId.CU_GRAPH_LAUNCH_PTSZ,
        "on_cu_graph_launch_ptsz",
        Category.GRAPH_LAUNCH,
        Library.DRIVER,
    ),
    ProbeSpec(
        "cuMemAlloc_v2",
        SymbolId.CU_MEM_ALLOC,
        "on_cu_mem_alloc",
        Category.MEM_ALLOC,
        Library.DRIVER,
        ret_fn_name="on_cu_mem_alloc_ret",
    ),
    ProbeSpec(
        "cuMemFree_v2",
        SymbolId.CU_MEM_FREE,
        "on_cu_mem_free",
        Category.MEM_FREE,
        Library.DRIVER,
    ),
)
PROBE_BY_ID: dict[int, ProbeSpec] = {int(p.sym_id): p for p in PROBES}
PROBE_BY_SYMBOL: dict[str, ProbeSpec] = {p.symbol: p for p in PROBES}
MEMORY_CATEGORIES = frozenset({Category.MEM_ALLOC, Category.MEM_FREE})

# struct count_key { u32 tgid; u32 sym; } and struct count_val { u64 calls; u64 bytes; char[16] }
_KEY = struct.Struct("=II")
_VAL = struct.Struct(f"=QQ{TASK_COMM_LEN}s")
# struct launch_sample { u64 seq; u32 tgid, sym, grid[3], block[3], shared, pad; u64 stream; }
_SAMPLE = struct.Struct("=QIIIIIIIIIIQ")
COUNT_KEY_SIZE = _KEY.size
COUNT_VAL_SIZE = _VAL.size
SAMPLE_SIZE = _SAMPLE.size


@dataclass(frozen=True, slots=True)
class CountEntry:
    """A (process, symbol) counter: cumulative as read, per interval after CounterDeltas."""

    pid: int
    sym_id: int  # a SymbolId value; kept as int so unknown ids from a newer program survive
    calls: int
    bytes: int
    comm: str


@dataclass(frozen=True, slots=True)
class LaunchSample:
    """Arguments of one recorded launch (debug sample ring)."""

    seq: int
    pid: int
    sym_id: int
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem_bytes: int
    stream: int

    @property
    def symbol(self) -> str:
        """The probed symbol's name, or ``sym#<id>`` for an id this code does not know."""
        spec = PROBE_BY_ID.get(self.sym_id)
        return spec.symbol if spec else f"sym#{self.sym_id}"


def decode_count(key: bytes, value: bytes) -> CountEntry:
    """Decode one raw ``counts`` map entry (native-endian C structs)."""
    pid, sym_id = _KEY.unpack(key[: _KEY.size])
    calls, nbytes, comm = _VAL.unpack(value[: _VAL.size])
    return CountEntry(pid, sym_id, calls, nbytes, _decode_comm(comm))


def decode_sample(raw: bytes) -> LaunchSample | None:
    """Decode one slot of the sample ring; ``None`` for a slot never written."""
    seq, pid, sym_id, gx, gy, gz, bx, by, bz, shared, _pad, stream = _SAMPLE.unpack(
        raw[: _SAMPLE.size]
    )
    if seq == 0:
        return None
    return LaunchSample(seq, pid, sym_id, (gx, gy, gz), (bx, by, bz), shared, stream)


def _decode_comm(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", errors="replace")


class CounterDeltas:
    """Turns cumulative per-(pid, symbol) counters into per-interval counts.

    The kernel never resets a counter, so no increment is lost between a read and a reset; an entry
    that went backwards (removed and re-created, e.g. a reused pid) counts from zero.
    """

    def __init__(self) -> None:
        self._last: dict[tuple[int, int], tuple[int, int]] = {}

    def update(self, entries: Iterable[CountEntry]) -> list[CountEntry]:
        """Deltas since the previous call; entries absent from ``entries`` are forgotten."""
        current: dict[tuple[int, int], tuple[int, int]] = {}
        deltas: list[CountEntry] = []
        for e in entries:
            key = (e.pid, e.sym_id)
            current[key] = (e.calls, e.bytes)
            prev_calls, prev_bytes = self._last.get(key, (0, 0))
            if e.calls < prev_calls or e.bytes < prev_bytes:
                prev_calls, prev_bytes = 0, 0
            d_calls, d_bytes = e.calls - prev_calls, e.bytes - prev_bytes
            if d_calls or d_bytes:
                deltas.append(CountEntry(e.pid, e.sym_id, d_calls, d_bytes, e.comm))
        self._last = current
        return deltas


def aggregate_processes(entries: Iterable[CountEntry], interval_s: float) -> list[ProcessLaunches]:
    """Fold per-symbol deltas into one ProcessLaunches per pid, sorted by pid.

    Launches are ``max(driver, runtime)`` launches (see the module docstring); graph launches and
    memory bytes are reported apart. Unknown symbol ids are ignored.
    """
    per_pid: dict[int, dict[Category, int]] = {}
    mem: dict[int, list[int]] = {}
    comms: dict[int, str] = {}
    for e in entries:
        spec = PROBE_BY_ID.get(e.sym_id)
        if spec is None:
            continue
        cat = spec.category
        counts = per_pid.setdefault(e.pid, {})
        counts[cat] = counts.get(cat, 0) + e.calls
        if cat in MEMORY_CATEGORIES:
            slot = 0 if cat is Category.MEM_ALLOC else 1
            mem.setdefault(e.pid, [0, 0])[slot] += e.bytes
        if e.comm:
            comms[e.pid] = e.comm
    out: list[ProcessLaunches] = []
    for pid in sorted(per_pid):
        counts = per_pid[pid]
        launches = max(
            counts.get(Category.DRIVER_LAUNCH, 0), counts.get(Category.RUNTIME_LAUNCH, 0)
        )
        alloc_bytes, free_bytes = mem.get(pid, [0, 0])
        out.append(
            ProcessLaunches(
                pid=pid,
                comm=comms.get(pid, ""),
                launches=launches,
                launches_per_s=_rate(launches, interval_s),
                graph_launches=counts.get(Category.GRAPH_LAUNCH, 0),
                mem_alloc_bytes=alloc_bytes,
                mem_free_bytes=free_bytes,
            )
        )
    return out


def to_kernel_launches(
    processes: Sequence[ProcessLaunches],
    gpus_of_pid: Mapping[int, Sequence[str]],
    node: str,
    interval_s: float,
    quiet_gpus: Iterable[str] = (),
) -> list[KernelLaunches]:
    """One KernelLaunches per GPU, sorted by GPU uuid.

    Every GPU that holds one of ``gpus_of_pid``'s processes gets an event, zero launches included
    (a GPU going quiet is news); so does every GPU in ``quiet_gpus`` (the caller passes the GPUs of
    the previous interval, so a GPU whose processes exited reports its drop to zero once).
    """
    per_gpu: dict[str, list[ProcessLaunches]] = {uuid: [] for uuid in quiet_gpus}
    for gpus in gpus_of_pid.values():
        for uuid in gpus:
            per_gpu.setdefault(uuid, [])
    for proc in processes:
        for uuid in gpus_of_pid.get(proc.pid, ()):
            per_gpu[uuid].append(proc)
    out: list[KernelLaunches] = []
    for uuid in sorted(per_gpu):
        procs = tuple(per_gpu[uuid])
        launches = sum(p.launches for p in procs)
        out.append(
            KernelLaunches(
                gpu_uuid=uuid,
                node=node,
                interval_s=interval_s,
                launches=launches,
                launches_per_s=_rate(launches, interval_s),
                processes=procs,
            )
        )
    return out


def _rate(count: int, interval_s: float) -> float:
    return count / interval_s if interval_s > 0 else 0.0
