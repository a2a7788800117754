"""Pure decoding of the launch probe's maps into events, and the C/Python contract (no kernel)."""

from __future__ import annotations

import re
import struct

import pytest

from flexpipe.schemas import KernelLaunches, ProcessLaunches
from probes.ebpf.decode import (
    COUNT_KEY_SIZE,
    COUNT_VAL_SIZE,
    PROBES,
    SAMPLE_SIZE,
    Category,
    CountEntry,
    CounterDeltas,
    LaunchSample,
    SymbolId,
    aggregate_processes,
    decode_count,
    decode_sample,
    to_kernel_launches,
)
from probes.ebpf.program import ProgramOptions, program_cflags, program_text
from probes.libfind import LAUNCH_SYMBOLS

pytestmark = pytest.mark.unit

S = SymbolId


def raw_count(
    pid: int, sym: int, calls: int, nbytes: int = 0, comm: bytes = b"python"
) -> tuple[bytes, bytes]:
    """Bytes of one ``counts`` entry exactly as the BPF structs lay them out."""
    return struct.pack("=II", pid, sym), struct.pack("=QQ16s", calls, nbytes, comm)


def entry(pid: int, sym: SymbolId, calls: int, nbytes: int = 0, comm: str = "python") -> CountEntry:
    return CountEntry(pid, int(sym), calls, nbytes, comm)


# -- raw records ----------------------------------------------------------------------------


def test_struct_sizes_match_the_c_layout() -> None:
    assert (COUNT_KEY_SIZE, COUNT_VAL_SIZE, SAMPLE_SIZE) == (8, 32, 56)


def test_decode_count_entry() -> None:
    key, value = raw_count(4242, S.CU_LAUNCH_KERNEL, 17, 0, b"vllm-worker\0\0\0\0\0")
    assert decode_count(key, value) == CountEntry(4242, 1, 17, 0, "vllm-worker")


def test_decode_count_tolerates_a_full_comm_and_bad_utf8() -> None:
    key, value = raw_count(1, S.CU_MEM_ALLOC, 2, 1 << 40, b"\xffabcdefghijklmno")
    got = decode_count(key, value)
    assert got.bytes == 1 << 40 and got.comm.endswith("abcdefghijklmno")


def test_decode_sample_and_empty_slot() -> None:
    raw = struct.pack(
        "=QIIIIIIIIIIQ", 7, 99, int(S.CU_LAUNCH_KERNEL_EX), 300, 7, 8, 256, 2, 1, 4096, 0, 0x7000
    )
    assert decode_sample(raw) == LaunchSample(7, 99, 3, (300, 7, 8), (256, 2, 1), 4096, 0x7000)
    assert decode_sample(raw).symbol == "cuLaunchKernelEx"  # type: ignore[union-attr]
    assert decode_sample(b"\0" * SAMPLE_SIZE) is None
    unknown = LaunchSample(1, 1, 200, (0, 0, 0), (0, 0, 0), 0, 0)
    assert unknown.symbol == "sym#200"


# -- cumulative counters to deltas -----------------------------------------------------------


def test_deltas_first_read_is_whole_then_differences() -> None:
    deltas = CounterDeltas()
    assert deltas.update([entry(1, S.CU_LAUNCH_KERNEL, 10)]) == [entry(1, S.CU_LAUNCH_KERNEL, 10)]
    got = deltas.update([entry(1, S.CU_LAUNCH_KERNEL, 25), entry(2, S.CU_GRAPH_LAUNCH, 3)])
    assert got == [entry(1, S.CU_LAUNCH_KERNEL, 15), entry(2, S.CU_GRAPH_LAUNCH, 3)]


def test_deltas_omit_unchanged_and_restart_after_a_reset() -> None:
    deltas = CounterDeltas()
    deltas.update([entry(1, S.CU_LAUNCH_KERNEL, 10), entry(1, S.CU_MEM_ALLOC, 1, 4096)])
    assert (
        deltas.update([entry(1, S.CU_LAUNCH_KERNEL, 10), entry(1, S.CU_MEM_ALLOC, 1, 4096)]) == []
    )
    # entry deleted (process exited) and its pid reused: counts from zero again
    assert deltas.update([entry(1, S.CU_LAUNCH_KERNEL, 4)]) == [entry(1, S.CU_LAUNCH_KERNEL, 4)]


def test_deltas_forget_entries_that_disappear() -> None:
    deltas = CounterDeltas()
    deltas.update([entry(1, S.CU_LAUNCH_KERNEL, 10)])
    deltas.update([])
    assert deltas.update([entry(1, S.CU_LAUNCH_KERNEL, 10)]) == [entry(1, S.CU_LAUNCH_KERNEL, 10)]


# -- per process ----------------------------------------------------------------------------


def test_process_launches_are_max_of_driver_and_runtime() -> None:
    entries = [
        entry(7, S.CU_LAUNCH_KERNEL, 8),
        entry(7, S.CU_LAUNCH_KERNEL_PTSZ, 2),
        entry(7, S.CU_LAUNCH_KERNEL_EX, 4),
        entry(7, S.CUDA_LAUNCH_KERNEL, 5),  # forwarded through cuLaunchKernel: already in the 8
        entry(7, S.CU_GRAPH_LAUNCH, 6),
        entry(7, S.CU_MEM_ALLOC, 2, 1_052_672),
        entry(7, S.CU_MEM_FREE, 1, 4096),
    ]
    assert aggregate_processes(entries, 0.5) == [
        ProcessLaunches(7, "python", 14, 28.0, 6, 1_052_672, 4096)
    ]


def test_runtime_only_process_counts_runtime_launches() -> None:
    entries = [entry(3, S.CUDA_LAUNCH_KERNEL, 9), entry(3, S.CUDA_LAUNCH_KERNEL_PTSZ, 1)]
    [proc] = aggregate_processes(entries, 2.0)
    assert (proc.launches, proc.launches_per_s) == (10, 5.0)


def test_aggregate_sorts_by_pid_ignores_unknown_ids_and_guards_zero_interval() -> None:
    entries = [
        entry(9, S.CU_LAUNCH_KERNEL, 1),
        CountEntry(2, 999, 50, 0, "x"),
        entry(2, S.CU_LAUNCH_KERNEL, 3),
    ]
    procs = aggregate_processes(entries, 0.0)
    assert [(p.pid, p.launches, p.launches_per_s) for p in procs] == [(2, 3, 0.0), (9, 1, 0.0)]


def test_graph_only_process_has_zero_kernel_launches() -> None:
    [proc] = aggregate_processes([entry(5, S.CU_GRAPH_LAUNCH_PTSZ, 12)], 1.0)
    assert (proc.launches, proc.graph_launches) == (0, 12)


# -- per GPU --------------------------------------------------------------------------------


def proc(pid: int, launches: int) -> ProcessLaunches:
    return ProcessLaunches(pid, f"p{pid}", launches, launches / 0.2)


def test_launches_attributed_to_every_gpu_of_the_process() -> None:
    events = to_kernel_launches(
        [proc(1, 10), proc(2, 4), proc(3, 7)],
        {1: ("GPU-a", "GPU-b"), 2: ("GPU-b",)},  # pid 3 holds no GPU memory: unattributed
        "n1",
        0.2,
    )
    assert events == [
        KernelLaunches("GPU-a", "n1", 0.2, 10, 50.0, (proc(1, 10),)),
        KernelLaunches("GPU-b", "n1", 0.2, 14, 70.0, (proc(1, 10), proc(2, 4))),
    ]


def test_idle_gpus_with_processes_and_previously_loud_gpus_report_zero() -> None:
    events = to_kernel_launches([], {5: ("GPU-c",)}, "n1", 0.2, quiet_gpus=["GPU-z"])
    assert [(e.gpu_uuid, e.launches, e.processes) for e in events] == [
        ("GPU-c", 0, ()),
        ("GPU-z", 0, ()),
    ]
    assert to_kernel_launches([], {}, "n1", 0.2) == []


# -- the C program and the Python tables agree ---------------------------------------------


def test_every_probe_function_exists_in_the_c_program() -> None:
    text = program_text()
    for spec in PROBES:
        assert re.search(rf"\bint {spec.fn_name}\(struct pt_regs \*ctx\)", text), spec.fn_name
        if spec.ret_fn_name:
            assert f"int {spec.ret_fn_name}(struct pt_regs *ctx)" in text
        assert spec.symbol in LAUNCH_SYMBOLS


def test_every_symbol_id_used_in_c_is_defined_by_the_flags() -> None:
    used = set(re.findall(r"\bSYM_([A-Z_]+)\b", program_text()))
    defined = {f.split("=")[0].removeprefix("-DSYM_") for f in program_cflags(ProgramOptions())}
    assert used <= defined
    assert {s.name for s in SymbolId} == {s.name for s in (p.sym_id for p in PROBES)}


def test_cflags_carry_sizes_and_architecture() -> None:
    flags = program_cflags(ProgramOptions(max_processes=64, sample_ring_size=8), machine="x86_64")
    assert {
        "-DMAX_PROCS=64",
        "-DSAMPLE_RING=8",
        "-DFLEXPIPE_X86_64=1",
        "-DSYM_CU_MEM_FREE=10",
    } <= set(flags)
    assert "-DFLEXPIPE_X86_64=1" not in program_cflags(ProgramOptions(), machine="aarch64")


@pytest.mark.parametrize(
    "options",
    [
        ProgramOptions(max_processes=0),
        ProgramOptions(max_live_allocs=-1),
        ProgramOptions(sample_ring_size=-1),
    ],
)
def test_bad_program_options_are_rejected(options: ProgramOptions) -> None:
    with pytest.raises(ValueError):
        program_cflags(options)


def test_categories_cover_the_issue_list() -> None:
    by_symbol = {p.symbol: p.category for p in PROBES}
    assert by_symbol["cuLaunchKernel"] is Category.DRIVER_LAUNCH
    assert by_symbol["cuLaunchKernel_ptsz"] is Category.DRIVER_LAUNCH
    assert by_symbol["cuLaunchKernelEx"] is Category.DRIVER_LAUNCH
    assert by_symbol["cudaLaunchKernel"] is Category.RUNTIME_LAUNCH
    assert by_symbol["cuGraphLaunch"] is Category.GRAPH_LAUNCH
    assert by_symbol["cuMemAlloc_v2"] is Category.MEM_ALLOC
    assert by_symbol["cuMemFree_v2"] is Category.MEM_FREE
