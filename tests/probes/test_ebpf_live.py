"""The real eBPF path: BCC compiles the probe, uprobes attach to a gcc-built fake libcuda, and every
launch of a test program is counted in the kernel and decoded exactly.

Skips, saying why, only where :func:`ebpf_available` says BCC cannot run (or gcc is missing).
"""

from __future__ import annotations

import platform
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from flexpipe.schemas import KernelLaunches, ProcessLaunches
from probes.ebpf import EbpfLaunchCounter, ebpf_available
from probes.ebpf.decode import LaunchSample, SymbolId
from probes.ebpf.program import ProgramOptions
from probes.libfind import LibraryFinder
from tests.probes.fakes.cuda_build import RENAMED_CUDART, FakeCuda, build_fake_cuda, gcc_missing

pytestmark = [pytest.mark.bpf, pytest.mark.timeout(120)]

GPU = "GPU-live-0"
S = SymbolId

# What tests/probes/fakes/cuda/launcher.c does (keep in step with it).
EXPECTED_CALLS = {
    S.CU_LAUNCH_KERNEL: 3 + 5,  # 3 direct + 5 forwarded by the fake cudaLaunchKernel
    S.CU_LAUNCH_KERNEL_PTSZ: 2,
    S.CU_LAUNCH_KERNEL_EX: 4,
    S.CUDA_LAUNCH_KERNEL: 5,
    S.CU_GRAPH_LAUNCH: 6,
    S.CU_MEM_ALLOC: 2,  # the third allocation (0 bytes) fails and is not counted
    S.CU_MEM_FREE: 1,
}
ALLOC_BYTES = 4096 + (1 << 20)
FREE_BYTES = 4096


Dim3 = tuple[int, int, int]
SampleTuple = tuple[int, str, Dim3, Dim3, int, int]


def expected_samples(pid: int) -> list[SampleTuple]:
    """(pid, symbol, grid, block, shared bytes, stream) of every launch, in call order."""
    out: list[SampleTuple] = []
    for i in range(3):
        out.append(
            (pid, "cuLaunchKernel", (100 + i, 2, 3), (128, 4, 5 + i), 1024 * (i + 1), 0x5000 + i)
        )
    for i in range(2):
        out.append((pid, "cuLaunchKernel_ptsz", (200 + i, 1, 1), (64, 1, 1), 2048, 0x6000 + i))
    for i in range(4):
        out.append((pid, "cuLaunchKernelEx", (300 + i, 7, 8), (256, 2, 1), 4096 + i, 0x7000 + i))
    for i in range(5):
        args = ((400 + i, 9, 10), (32, 16, 2), 512 + i, 0x8000 + i)
        out.append((pid, "cudaLaunchKernel", *args))
        out.append((pid, "cuLaunchKernel", *args))  # the runtime forwarding to the driver
    for i in range(6):
        out.append((pid, "cuGraphLaunch", (0, 0, 0), (0, 0, 0), 0, 0x9000 + i))
    return out


@pytest.fixture(scope="module")
def fake_cuda(tmp_path_factory: pytest.TempPathFactory) -> FakeCuda:
    ok, why = ebpf_available()
    if not ok:
        pytest.skip(f"eBPF unavailable here: {why}")
    missing = gcc_missing()
    if missing:
        pytest.skip(f"cannot build the fake libcuda: {missing}")
    return build_fake_cuda(tmp_path_factory.mktemp("fake-cuda"))


class Launcher:
    """The test program, held at its start line until the probe is attached."""

    def __init__(self, exe: Path) -> None:
        self.proc = subprocess.Popen(
            [str(exe)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        ready = self.stdout.readline().split()
        assert ready[0] == "ready", ready
        self.pid = int(ready[1])

    def step(self, expect: str | None) -> None:
        """Release the program to its next stage and wait for its report."""
        self.stdin.write("go\n")
        self.stdin.flush()
        if expect is not None:
            assert self.stdout.readline().strip() == expect

    def finish(self) -> None:
        self.step(None)
        assert self.proc.wait(timeout=30) == 0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def launcher(fake_cuda: FakeCuda) -> Iterator[Launcher]:
    prog = Launcher(fake_cuda.launcher)
    yield prog
    prog.kill()


def open_counter(pid: int, ring: int = 64) -> EbpfLaunchCounter:
    """A counter that finds its libraries in ``pid``'s maps only (no host libcuda here)."""
    finder = LibraryFinder(ldconfig_output=lambda: "")
    return EbpfLaunchCounter(
        "node-live",
        lambda: {pid: (GPU,)},
        libraries=lambda: finder.find([pid]),
        options=ProgramOptions(sample_ring_size=ring),
    )


def test_every_launch_is_counted_and_its_arguments_decoded(
    fake_cuda: FakeCuda, launcher: Launcher
) -> None:
    counter = open_counter(launcher.pid)
    try:
        attached = {Path(lib.path).name: (lib.source, syms) for lib, syms in counter.attached}
        assert attached == {
            "libcuda.so.1": (
                f"maps:{launcher.pid}",
                (
                    "cuGraphLaunch",
                    "cuLaunchKernel",
                    "cuLaunchKernelEx",
                    "cuLaunchKernel_ptsz",
                    "cuMemAlloc_v2",
                    "cuMemFree_v2",
                ),
            ),
            RENAMED_CUDART: (f"maps:{launcher.pid}", ("cudaLaunchKernel",)),
        }
        assert counter.drain(10.0) == [KernelLaunches(GPU, "node-live", 0.2, 0, 0.0)]

        launcher.step("done")
        events = counter.drain(10.5)

        mine = [e for e in counter.last_counts if e.pid == launcher.pid]
        assert {S(e.sym_id): e.calls for e in mine} == EXPECTED_CALLS
        assert {S(e.sym_id): e.bytes for e in mine if e.bytes} == {
            S.CU_MEM_ALLOC: ALLOC_BYTES,
            S.CU_MEM_FREE: FREE_BYTES,
        }
        process = ProcessLaunches(
            pid=launcher.pid,
            comm="launcher",
            launches=14,  # max(driver 8 + 2 + 4, runtime 5)
            launches_per_s=28.0,
            graph_launches=6,
            mem_alloc_bytes=ALLOC_BYTES,
            mem_free_bytes=FREE_BYTES,
        )
        assert events == [KernelLaunches(GPU, "node-live", 0.5, 14, 28.0, (process,))]

        samples = [s for s in counter.recent_samples() if s.pid == launcher.pid]
        got = [(s.pid, s.symbol, s.grid, s.block, s.shared_mem_bytes, s.stream) for s in samples]
        if platform.machine() == "x86_64":
            assert got == expected_samples(launcher.pid)
        else:  # stack-passed arguments are decoded on x86-64 only
            assert [g[1] for g in got] == [e[1] for e in expected_samples(launcher.pid)]
        assert all(isinstance(s, LaunchSample) for s in samples)

        launcher.finish()
        assert counter.drain(11.0) == [KernelLaunches(GPU, "node-live", 0.5, 0, 0.0)]
        assert not [e for e in counter.last_counts if e.pid == launcher.pid]
    finally:
        counter.close()


def test_runtime_linked_into_the_executable_is_found_and_probed(fake_cuda: FakeCuda) -> None:
    prog = Launcher(fake_cuda.launcher_static_rt)
    counter = None
    try:
        counter = open_counter(prog.pid, ring=0)
        attached = {Path(lib.path).name: syms for lib, syms in counter.attached}
        assert attached["launcher-static-rt"] == ("cudaLaunchKernel",)
        counter.drain(1.0)
        prog.step("done")
        counter.drain(2.0)
        calls = {S(e.sym_id): e.calls for e in counter.last_counts if e.pid == prog.pid}
        assert calls[S.CUDA_LAUNCH_KERNEL] == 5 and calls[S.CU_LAUNCH_KERNEL] == 8
        assert counter.recent_samples() == []  # ring compiled out: counting only
        prog.finish()
    finally:
        if counter is not None:
            counter.close()
        prog.kill()
