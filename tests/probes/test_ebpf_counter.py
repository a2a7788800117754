"""EbpfLaunchCounter against a fake BCC program: attach, drain, prune, rediscover, close."""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from probes.ebpf.counter import EbpfLaunchCounter, EbpfUnavailable, open_launch_counter
from probes.ebpf.decode import SymbolId
from probes.ebpf.program import ProgramOptions
from probes.libfind import DRIVER_SYMBOLS, CudaLibrary

pytestmark = pytest.mark.unit

DRIVER = CudaLibrary("/usr/lib/libcuda.so.1", 1, 100, tuple(sorted(DRIVER_SYMBOLS)), "ldconfig")
RUNTIME = CudaLibrary("/opt/libcudart-1.so.12", 1, 200, ("cudaLaunchKernel",), "maps:7")


class FakeBpf:
    """The slice of bcc.BPF the counter uses; tables hold raw bytes like BCC's ctypes values."""

    def __init__(self, text: str, cflags: list[str], fail_symbols: Sequence[str] = ()) -> None:
        self.text, self.cflags = text, cflags
        self.fail_symbols = set(fail_symbols)
        self.tables: dict[str, dict[bytes, bytes]] = {"counts": {}, "samples": {}}
        self.uprobes: list[tuple[str, str, str]] = []
        self.uretprobes: list[tuple[str, str, str]] = []
        self.uprobe_fds: dict[str, int] = {}
        self.cleaned = 0

    def __getitem__(self, name: str) -> dict[bytes, bytes]:
        return self.tables[name]

    def attach_uprobe(self, *, name: str, sym: str, fn_name: str) -> None:
        if sym in self.fail_symbols:
            raise Exception(f"could not determine address of symbol {sym}")
        self.uprobes.append((name, sym, fn_name))
        self.uprobe_fds[f"p_{name}_{sym}"] = len(self.uprobe_fds)

    def attach_uretprobe(self, *, name: str, sym: str, fn_name: str) -> None:
        self.uretprobes.append((name, sym, fn_name))

    def detach_uprobe_event(self, ev_name: str) -> None:
        # what BCC does without tracefs: the fd is closed, then the tracefs edit fails
        raise Exception("Failed to detach BPF from uprobe")

    def cleanup(self) -> None:
        self.cleaned += 1

    def set_count(self, pid: int, sym: SymbolId, calls: int, nbytes: int = 0) -> None:
        key = struct.pack("=II", pid, int(sym))
        self.tables["counts"][key] = struct.pack("=QQ16s", calls, nbytes, b"worker")


@pytest.fixture(autouse=True)
def restore_bcc_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The counter exports BCC_KERNEL_SOURCE; let monkeypatch put the real value back after."""
    monkeypatch.setenv("BCC_KERNEL_SOURCE", os.environ.get("BCC_KERNEL_SOURCE", "unset"))


def make_counter(
    tmp_path: Path,
    libraries: Sequence[CudaLibrary] = (DRIVER, RUNTIME),
    gpus: dict[int, tuple[str, ...]] | None = None,
    **kwargs: Any,
) -> tuple[EbpfLaunchCounter, FakeBpf]:
    made: list[FakeBpf] = []
    fail = kwargs.pop("fail_symbols", ())

    def factory(text: str, cflags: list[str]) -> FakeBpf:
        made.append(FakeBpf(text, cflags, fail))
        return made[0]

    (tmp_path / "7").mkdir(exist_ok=True)  # pid 7 is alive in this fake /proc
    counter = EbpfLaunchCounter(
        "n1",
        lambda: gpus if gpus is not None else {7: ("GPU-a",)},
        libraries=lambda: list(libraries),
        bpf_factory=factory,
        kernel_source=tmp_path,
        proc_root=tmp_path,
        **kwargs,
    )
    return counter, made[0]


def test_attaches_every_known_symbol_of_every_library(tmp_path: Path) -> None:
    counter, bpf = make_counter(tmp_path)
    attached = {(name, sym) for name, sym, _ in bpf.uprobes}
    assert attached == {(DRIVER.path, s) for s in DRIVER_SYMBOLS} | {
        (RUNTIME.path, "cudaLaunchKernel")
    }
    assert bpf.uretprobes == [(DRIVER.path, "cuMemAlloc_v2", "on_cu_mem_alloc_ret")]
    assert [lib.path for lib, _ in counter.attached] == [DRIVER.path, RUNTIME.path]
    assert "-DSAMPLE_RING=0" in bpf.cflags and "int on_cu_launch_kernel(" in bpf.text


def test_memory_probes_are_optional(tmp_path: Path) -> None:
    _, bpf = make_counter(tmp_path, track_memory=False)
    syms = {sym for _, sym, _ in bpf.uprobes}
    assert "cuMemAlloc_v2" not in syms and "cuMemFree_v2" not in syms and bpf.uretprobes == []


def test_one_failing_symbol_costs_only_itself_and_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        counter, bpf = make_counter(tmp_path, fail_symbols=["cuLaunchKernelEx"], rediscover_s=0.0)
        counter.drain(1.0)
        counter.drain(2.0)
    assert "cuLaunchKernelEx" not in {sym for _, sym, _ in bpf.uprobes}
    assert "cuLaunchKernel" in {sym for _, sym, _ in bpf.uprobes}
    assert len([r for r in caplog.records if "cuLaunchKernelEx" in r.getMessage()]) == 1


def test_compile_failure_is_ebpf_unavailable(tmp_path: Path) -> None:
    def broken(text: str, cflags: list[str]) -> FakeBpf:
        raise Exception("Unable to find kernel headers")

    with pytest.raises(EbpfUnavailable, match="Unable to find kernel headers"):
        EbpfLaunchCounter("n1", dict, libraries=list, bpf_factory=broken, kernel_source=tmp_path)


def test_libraries_found_but_nothing_attachable_is_ebpf_unavailable(tmp_path: Path) -> None:
    with pytest.raises(EbpfUnavailable, match="no uprobe could be attached: cuGraphLaunch"):
        make_counter(tmp_path, libraries=[DRIVER], fail_symbols=DRIVER_SYMBOLS)


def test_no_libraries_yet_is_fine(tmp_path: Path) -> None:
    counter, _ = make_counter(tmp_path, libraries=[])
    assert counter.attached == [] and counter.drain(1.0)[0].launches == 0


def test_kernel_source_is_exported_for_libbcc(tmp_path: Path) -> None:
    make_counter(tmp_path)
    assert os.environ["BCC_KERNEL_SOURCE"] == str(tmp_path)


def test_drain_reports_per_interval_counts_and_measured_rates(tmp_path: Path) -> None:
    counter, bpf = make_counter(tmp_path, gpus={7: ("GPU-a", "GPU-b")})
    bpf.set_count(7, SymbolId.CU_LAUNCH_KERNEL, 10)
    [a, b] = counter.drain(1.0)
    assert (a.gpu_uuid, a.launches, a.interval_s, a.launches_per_s) == ("GPU-a", 10, 0.2, 50.0)
    assert b.gpu_uuid == "GPU-b" and b.launches == 10
    bpf.set_count(7, SymbolId.CU_LAUNCH_KERNEL, 30)
    bpf.set_count(7, SymbolId.CU_GRAPH_LAUNCH, 2)
    [a, _] = counter.drain(1.5)
    assert (a.launches, a.interval_s, a.launches_per_s) == (20, 0.5, 40.0)
    assert a.processes[0].graph_launches == 2 and a.processes[0].comm == "worker"
    assert {(e.sym_id, e.calls) for e in counter.last_counts} == {(1, 20), (7, 2)}
    [a, _] = counter.drain(1.7)
    assert a.launches == 0  # nothing new: a zero event, not silence


def test_unattributed_launches_are_counted_not_published(tmp_path: Path) -> None:
    (tmp_path / "8").mkdir()
    counter, bpf = make_counter(tmp_path, gpus={})
    bpf.set_count(8, SymbolId.CU_LAUNCH_KERNEL, 5)
    assert counter.drain(1.0) == []
    assert counter.unattributed_launches == 5


def test_gpu_going_quiet_reports_zero_once(tmp_path: Path) -> None:
    pids: dict[int, tuple[str, ...]] = {7: ("GPU-a",)}
    counter, bpf = make_counter(tmp_path, gpus=pids)
    bpf.set_count(7, SymbolId.CU_LAUNCH_KERNEL, 5)
    assert [e.launches for e in counter.drain(1.0)] == [5]
    pids.clear()  # the process left the GPU
    assert [(e.gpu_uuid, e.launches) for e in counter.drain(1.2)] == [("GPU-a", 0)]
    assert counter.drain(1.4) == []


def test_entries_of_exited_processes_are_deleted_after_their_last_read(tmp_path: Path) -> None:
    counter, bpf = make_counter(tmp_path, gpus={7: ("GPU-a",), 9: ("GPU-a",)})
    bpf.set_count(7, SymbolId.CU_LAUNCH_KERNEL, 1)
    bpf.set_count(9, SymbolId.CU_LAUNCH_KERNEL, 4)  # no /proc/9: exited
    [event] = counter.drain(1.0)
    assert event.launches == 5  # its last launches still count
    assert {struct.unpack("=II", k)[0] for k in bpf.tables["counts"]} == {7}


def test_libraries_are_rediscovered_periodically_and_attached_once(tmp_path: Path) -> None:
    libs = [DRIVER]
    counter, bpf = make_counter(tmp_path, libraries=libs, rediscover_s=30.0)
    libs.append(RUNTIME)
    counter.drain(100.0)
    counter.drain(120.0)
    assert len(counter.attached) == 1  # not yet
    counter.drain(130.0)
    assert [lib.path for lib, _ in counter.attached] == [DRIVER.path, RUNTIME.path]
    counter.drain(160.0)
    assert len([u for u in bpf.uprobes if u[0] == DRIVER.path]) == len(DRIVER_SYMBOLS)


def test_recent_samples_decode_the_ring_in_order(tmp_path: Path) -> None:
    counter, bpf = make_counter(tmp_path)
    assert counter.recent_samples() == []  # ring compiled out
    counter, bpf = make_counter(tmp_path, options=ProgramOptions(sample_ring_size=4))
    fmt = "=QIIIIIIIIIIQ"
    bpf.tables["samples"] = {
        b"0": struct.pack(fmt, 5, 7, 1, 1, 1, 1, 32, 1, 1, 0, 0, 0x10),
        b"1": struct.pack(fmt, 4, 7, 5, 2, 2, 2, 64, 1, 1, 128, 0, 0x20),
        b"2": b"\0" * struct.calcsize(fmt),
    }
    got = counter.recent_samples()
    assert [(s.seq, s.symbol, s.block, s.shared_mem_bytes) for s in got] == [
        (4, "cudaLaunchKernel", (64, 1, 1), 128),
        (5, "cuLaunchKernel", (32, 1, 1), 0),
    ]
    assert "-DSAMPLE_RING=4" in bpf.cflags


def test_close_is_idempotent_and_tolerates_missing_tracefs(tmp_path: Path) -> None:
    counter, bpf = make_counter(tmp_path)
    assert bpf.uprobe_fds
    counter.close()
    counter.close()
    assert bpf.cleaned == 1 and bpf.uprobe_fds == {}
    assert counter.drain(5.0) == [] and counter.recent_samples() == []


def test_open_launch_counter_reports_why_not(tmp_path: Path) -> None:
    counter, why = open_launch_counter("n1", dict, available=lambda: (False, "no CAP_BPF"))
    assert counter is None and why == "no CAP_BPF"

    def broken(text: str, cflags: list[str]) -> FakeBpf:
        raise Exception("Unable to find kernel headers")

    counter, why = open_launch_counter(
        "n1", dict, available=lambda: (True, "ok"), bpf_factory=broken, libraries=list
    )
    assert counter is None and "Unable to find kernel headers" in why
    counter, why = open_launch_counter(
        "n1",
        dict,
        available=lambda: (True, "BCC 0.26"),
        bpf_factory=lambda t, c: FakeBpf(t, c),
        libraries=list,
        kernel_source=tmp_path,
    )
    assert isinstance(counter, EbpfLaunchCounter) and why == "BCC 0.26"
    assert counter.name == "ebpf"
