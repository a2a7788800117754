"""``EbpfLaunchCounter``: CUDA kernel launches per process from uprobes, per GPU every interval.

Uprobes on the discovered libcuda / libcudart files count calls in a BPF hash map; :meth:`drain`
reads the cumulative counters, turns them into per-interval deltas and attributes processes to GPUs
through an injected ``gpus_of_pid`` (NVML's process lists: see :mod:`probes.ebpf.decode` for the
approximation). eBPF is enrichment: NVML stays the primary source, and one vendor retired its GPU
uprobes after crashes on aarch64 GB300 machines, so the agent must run without this backend.

NOTE: the kernel's counters are never reset. Reading cumulative values and subtracting in user
space loses no increment between "read" and "clear" (there is no clear); entries of processes
that have exited are deleted after their last read, which keeps the map bounded.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from flexpipe.errors import FlexPipeError
from flexpipe.schemas import KernelLaunches
from probes.ebpf.available import ebpf_available, find_kernel_source
from probes.ebpf.decode import (
    MEMORY_CATEGORIES,
    PROBE_BY_SYMBOL,
    CountEntry,
    CounterDeltas,
    LaunchSample,
    aggregate_processes,
    decode_count,
    decode_sample,
    to_kernel_launches,
)
from probes.ebpf.program import ProgramOptions, program_cflags, program_text
from probes.libfind import CudaLibrary, LibraryFinder

log = logging.getLogger(__name__)

GpusOfPid = Callable[[], Mapping[int, Sequence[str]]]


class EbpfUnavailable(FlexPipeError):
    """The eBPF backend cannot run here; the message says why, in one line."""


class BpfProgram(Protocol):
    """The part of ``bcc.BPF`` the counter uses (a fake implements it in unit tests)."""

    def __getitem__(self, name: str) -> Any: ...

    def attach_uprobe(self, *, name: str, sym: str, fn_name: str) -> Any: ...

    def attach_uretprobe(self, *, name: str, sym: str, fn_name: str) -> Any: ...

    def cleanup(self) -> None: ...


BpfFactory = Callable[[str, list[str]], BpfProgram]


def bcc_factory(text: str, cflags: list[str]) -> BpfProgram:
    """Compile and load with BCC (imported here: the module is optional)."""
    import bcc

    return _Bcc(bcc.BPF(text=text.encode(), cflags=cflags))


class _Bcc:
    """``bcc.BPF`` behind the str-typed :class:`BpfProgram` (BCC wants bytes for names)."""

    def __init__(self, bpf: Any) -> None:
        self._bpf = bpf
        self.uprobe_fds: dict[Any, Any] = bpf.uprobe_fds  # shared, for _detach_all

    def __getitem__(self, name: str) -> Any:
        return self._bpf[name.encode()]

    def attach_uprobe(self, *, name: str, sym: str, fn_name: str) -> Any:
        return self._bpf.attach_uprobe(
            name=name.encode(), sym=sym.encode(), fn_name=fn_name.encode()
        )

    def attach_uretprobe(self, *, name: str, sym: str, fn_name: str) -> Any:
        return self._bpf.attach_uretprobe(
            name=name.encode(), sym=sym.encode(), fn_name=fn_name.encode()
        )

    def detach_uprobe_event(self, ev_name: Any) -> None:
        self._bpf.detach_uprobe_event(ev_name)

    def cleanup(self) -> None:
        self._bpf.cleanup()


class EbpfLaunchCounter:
    """Counts CUDA launches per process in the kernel, reports them per GPU (a LaunchCounter)."""

    name = "ebpf"

    def __init__(
        self,
        node: str,
        gpus_of_pid: GpusOfPid,
        *,
        libraries: Callable[[], Sequence[CudaLibrary]] | None = None,
        bpf_factory: BpfFactory = bcc_factory,
        kernel_source: Path | None = None,
        options: ProgramOptions | None = None,
        track_memory: bool = True,
        interval_s: float = 0.2,
        rediscover_s: float = 30.0,
        proc_root: Path = Path("/proc"),
    ) -> None:
        """Compile the program, load it and attach to every library ``libraries()`` finds.

        ``libraries`` defaults to :class:`~probes.libfind.LibraryFinder` over ``proc_root``;
        ``interval_s`` is the assumed length of the first interval (later ones are measured);
        libraries are looked for again every ``rediscover_s`` (new containers, new processes).
        Raises :class:`EbpfUnavailable` when BCC cannot compile or load the program, or when
        libraries were found but no probe could be attached to any of them.
        """
        self._node = node
        self._gpus_of_pid = gpus_of_pid
        self._libraries = libraries or LibraryFinder(proc_root=proc_root).find
        self._options = options or ProgramOptions()
        self._track_memory = track_memory
        self._interval_s = interval_s
        self._rediscover_s = rediscover_s
        self._proc_root = proc_root
        self._deltas = CounterDeltas()
        self._attached: dict[tuple[int, int], tuple[CudaLibrary, tuple[str, ...]]] = {}
        self._failed_symbols: set[tuple[int, int, str]] = set()
        self._attach_errors: list[str] = []
        self._last_drain_s: float | None = None
        self._last_discovery_s: float | None = None
        self._loud_gpus: set[str] = set()
        self._closed = False
        self.last_counts: tuple[CountEntry, ...] = ()
        """Per-(pid, symbol) deltas of the latest drain (debugging, tests)."""
        self.unattributed_launches = 0
        """Launches of processes on no GPU's NVML list, summed since start (for a metric)."""
        _export_kernel_source(kernel_source)
        try:
            self._bpf = bpf_factory(program_text(), program_cflags(self._options))
        except Exception as exc:  # BCC raises bare Exception for compile and load errors
            raise EbpfUnavailable(f"BCC could not compile/load the launch probe: {exc}") from exc
        self.refresh_libraries()
        if self._attach_errors and not self._attached:
            # NOTE: libraries exist but not one probe went in (bpf() refused, lockdown...): say
            # so now rather than run as an "up" backend that never counts anything.
            self.close()
            raise EbpfUnavailable(f"no uprobe could be attached: {self._attach_errors[0]}")

    @property
    def attached(self) -> list[tuple[CudaLibrary, tuple[str, ...]]]:
        """Libraries with probes, each with the symbols actually attached."""
        return list(self._attached.values())

    def refresh_libraries(self, now_s: float | None = None) -> int:
        """Look for libraries again and attach to new ones; returns how many were added."""
        self._last_discovery_s = now_s
        added = 0
        for lib in self._libraries():
            ident = (lib.dev, lib.inode)
            if ident in self._attached:
                continue
            symbols = self._attach(lib)
            if symbols:
                self._attached[ident] = (lib, symbols)
                added += 1
                log.info("ebpf: probing %s (%s) [%s]", lib.path, lib.source, ", ".join(symbols))
        return added

    def _attach(self, lib: CudaLibrary) -> tuple[str, ...]:
        done: list[str] = []
        for symbol in lib.symbols:
            spec = PROBE_BY_SYMBOL.get(symbol)
            if spec is None or (spec.category in MEMORY_CATEGORIES and not self._track_memory):
                continue
            try:
                self._bpf.attach_uprobe(name=lib.path, sym=symbol, fn_name=spec.fn_name)
                if spec.ret_fn_name:
                    self._bpf.attach_uretprobe(name=lib.path, sym=symbol, fn_name=spec.ret_fn_name)
            except Exception as exc:  # one symbol failing must not cost the others
                key = (lib.dev, lib.inode, symbol)
                if key not in self._failed_symbols:
                    self._failed_symbols.add(key)
                    self._attach_errors.append(f"{symbol} in {lib.path}: {exc}")
                    log.warning("ebpf: cannot probe %s in %s: %s", symbol, lib.path, exc)
                continue
            done.append(symbol)
        return tuple(done)

    def drain(self, now_s: float) -> list[KernelLaunches]:
        """Launch counts per GPU since the previous drain (see LaunchCounter)."""
        if self._closed:
            return []
        if self._last_discovery_s is None:  # discovered at construction, before time was known
            self._last_discovery_s = now_s
        elif now_s - self._last_discovery_s >= self._rediscover_s:
            self.refresh_libraries(now_s)
        interval_s = self._interval_s
        if self._last_drain_s is not None and now_s > self._last_drain_s:
            interval_s = now_s - self._last_drain_s
        self._last_drain_s = now_s
        raw = self._read_counts()
        deltas = self._deltas.update(entry for _, entry in raw)
        self.last_counts = tuple(deltas)
        processes = aggregate_processes(deltas, interval_s)
        pid_gpus = self._gpus_of_pid()
        self.unattributed_launches += sum(p.launches for p in processes if p.pid not in pid_gpus)
        events = to_kernel_launches(processes, pid_gpus, self._node, interval_s, self._loud_gpus)
        self._loud_gpus = {e.gpu_uuid for e in events if e.launches}
        self._forget_exited(raw)
        return events

    def recent_samples(self) -> list[LaunchSample]:
        """The debug ring's launch arguments, oldest first (empty unless ``sample_ring_size``)."""
        if self._closed or self._options.sample_ring_size == 0:
            return []
        samples = (decode_sample(bytes(v)) for v in self._bpf["samples"].values())
        return sorted((s for s in samples if s is not None), key=lambda s: s.seq)

    def _read_counts(self) -> list[tuple[Any, CountEntry]]:
        return [(k, decode_count(bytes(k), bytes(v))) for k, v in self._bpf["counts"].items()]

    def _forget_exited(self, raw: list[tuple[Any, CountEntry]]) -> None:
        table = self._bpf["counts"]
        for key, entry in raw:
            if not (self._proc_root / str(entry.pid)).exists():
                with contextlib.suppress(KeyError):  # already gone: nothing to forget
                    del table[key]

    def close(self) -> None:
        """Detach every uprobe and free the maps; idempotent."""
        if self._closed:
            return
        self._closed = True
        _detach_all(self._bpf)
        try:
            self._bpf.cleanup()
        except Exception as exc:
            log.warning("ebpf: cleanup failed: %s", exc)


def _export_kernel_source(kernel_source: Path | None) -> None:
    """Tell libbcc where the headers are; it reads ``BCC_KERNEL_SOURCE`` from the environment."""
    source = kernel_source or find_kernel_source()
    if source is not None and (kernel_source is not None or "BCC_KERNEL_SOURCE" not in os.environ):
        os.environ["BCC_KERNEL_SOURCE"] = str(source)


def _detach_all(bpf: BpfProgram) -> None:
    """Close every uprobe, tolerating a missing tracefs.

    NOTE: BCC attaches through the uprobe PMU but its detach also edits tracefs' uprobe_events;
    without tracefs mounted that edit fails *after* the probe's fd is closed, and BCC then keeps
    the entry and raises. The probe is gone either way, so drop the entry and go on.
    """
    fds: dict[Any, Any] = getattr(bpf, "uprobe_fds", {})
    detach = getattr(bpf, "detach_uprobe_event", None)
    for ev_name in list(fds):
        try:
            if detach is not None:
                detach(ev_name)
        except Exception:
            fds.pop(ev_name, None)


def open_launch_counter(
    node: str,
    gpus_of_pid: GpusOfPid,
    available: Callable[[], tuple[bool, str]] = ebpf_available,
    **kwargs: Any,
) -> tuple[EbpfLaunchCounter | None, str]:
    """The counter, or ``(None, why)`` when eBPF cannot run here; never raises for that.

    ``kwargs`` go to :class:`EbpfLaunchCounter`. The agent logs the reason once and exports
    ``backend_up{backend="ebpf"} 0``.
    """
    ok, why = available()
    if not ok:
        return None, why
    try:
        counter = EbpfLaunchCounter(node, gpus_of_pid, **kwargs)
    except EbpfUnavailable as exc:
        return None, str(exc)
    return counter, why
