"""CUDA library discovery: ldconfig, maps of CUDA processes, container roots, ELF symbols."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from probes.libfind import (
    DRIVER_SYMBOLS,
    LAUNCH_SYMBOLS,
    LibraryFinder,
    MapsEntry,
    elf_defined_symbols,
    is_cuda_process,
    parse_ldconfig,
    parse_maps,
)
from tests.probes.fakes.cuda_build import FakeCuda, build_fake_cuda, gcc_missing

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "proc"
HOST_LIBCUDA = "usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15"
CONTAINER_PID = 2002


def read_fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def lay_out_proc(tmp_path: Path) -> tuple[Path, Path]:
    """Copy the maps fixtures into ``proc/`` and create every mapped file under each pid's root.

    Host processes' ``root`` links to ``host/``; the container's is its own tree, where the driver
    is a hard link to the host's file (what a bind mount of the host driver looks like).
    """
    host, proc = tmp_path / "host", tmp_path / "proc"
    for pid_dir in sorted(p for p in FIXTURES.iterdir() if p.name.isdigit()):
        dest = proc / pid_dir.name
        dest.mkdir(parents=True)
        shutil.copy(pid_dir / "maps", dest / "maps")
        root = tmp_path / f"ctr{pid_dir.name}" if int(pid_dir.name) == CONTAINER_PID else host
        root.mkdir(exist_ok=True)
        (dest / "root").symlink_to(root)
        for entry in parse_maps((dest / "maps").read_text()):
            target = root / entry.path.lstrip("/")
            if entry.path.startswith("/dev/") or target.exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            if root != host and entry.path.endswith(HOST_LIBCUDA.split("/")[-1]):
                os.link(host / HOST_LIBCUDA, target)
            else:
                target.write_text(entry.path)
    libdir = host / "usr/lib/x86_64-linux-gnu"
    (host / "lib").symlink_to("usr/lib")
    (libdir / "libcuda.so.1").symlink_to("libcuda.so.550.54.15")
    (libdir / "libcuda.so").symlink_to("libcuda.so.1")
    cuda = host / "usr/local/cuda-12.4/targets/x86_64-linux/lib"
    cuda.mkdir(parents=True)
    (cuda / "libcudart.so.12").write_text("cudart")
    (cuda / "libcudart.so").symlink_to("libcudart.so.12")
    return host, proc


class FakeSymbols:
    """Symbol reader keyed by file name; records which files it was asked about."""

    def __init__(self) -> None:
        self.asked: list[Path] = []

    def __call__(self, path: Path, wanted: frozenset[str]) -> frozenset[str]:
        self.asked.append(path)
        if path.name.startswith("libcuda.so"):
            return frozenset(DRIVER_SYMBOLS) & wanted
        if path.name.startswith("libcudart") or path.name == "llama-server":
            return frozenset({"cudaLaunchKernel", "cudaLaunchKernel_ptsz"}) & wanted
        return frozenset()


@pytest.fixture
def proc_tree(tmp_path: Path) -> tuple[Path, Path]:
    return lay_out_proc(tmp_path)


def make_finder(host: Path, proc: Path, symbols: FakeSymbols) -> LibraryFinder:
    return LibraryFinder(
        proc_root=proc,
        ldconfig_output=lambda: read_fixture("ldconfig-p.txt"),
        symbols_of=symbols,
        host_root=host,
    )


# -- parsers --------------------------------------------------------------------------------


def test_parse_ldconfig_keeps_64_bit_cuda_libraries_in_order() -> None:
    assert parse_ldconfig(read_fixture("ldconfig-p.txt")) == [
        "/usr/local/cuda-12.4/targets/x86_64-linux/lib/libcudart.so.12",
        "/usr/local/cuda-12.4/targets/x86_64-linux/lib/libcudart.so",
        "/lib/x86_64-linux-gnu/libcuda.so.1",
        "/lib/x86_64-linux-gnu/libcuda.so",
    ]
    assert parse_ldconfig("") == []


def test_parse_maps_keeps_file_mappings_only() -> None:
    entries = parse_maps(read_fixture("1001/maps"))
    paths = [e.path for e in entries]
    assert "/dev/nvidia0" in paths
    assert all(p.startswith("/") for p in paths)
    assert not any("deleted" in p or p.startswith("[") for p in paths)
    assert MapsEntry("r-xp", "/usr/lib/x86_64-linux-gnu/libc.so.6") in entries
    spaced = parse_maps(read_fixture("2002/maps"))
    assert MapsEntry("r-xp", "/models/my model/kernels/libcustom_ops.so") in spaced


@pytest.mark.parametrize(
    ("pid", "expected"), [("1001", True), ("2002", True), ("3003", True), ("4004", False)]
)
def test_is_cuda_process(pid: str, expected: bool) -> None:
    assert is_cuda_process(parse_maps(read_fixture(f"{pid}/maps"))) is expected


# -- discovery ------------------------------------------------------------------------------


def test_finder_covers_ldconfig_host_processes_containers_and_static_runtimes(
    proc_tree: tuple[Path, Path],
) -> None:
    host, proc = proc_tree
    found = make_finder(host, proc, FakeSymbols()).find()
    got = [(lib.path, lib.source, lib.symbols) for lib in found]
    cudart = ("cudaLaunchKernel", "cudaLaunchKernel_ptsz")
    assert got == [
        (
            f"{host}/usr/local/cuda-12.4/targets/x86_64-linux/lib/libcudart.so.12",
            "ldconfig",
            cudart,
        ),
        (f"{host}/lib/x86_64-linux-gnu/libcuda.so.1", "ldconfig", tuple(sorted(DRIVER_SYMBOLS))),
        (
            f"{host}/opt/venv/lib/python3.10/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12",
            "maps:1001",
            cudart,
        ),
        (
            f"{proc}/2002/root/usr/local/lib/python3.11/dist-packages/torch/lib/"
            "libcudart-d0da41ae.so.11.0",
            "maps:2002",
            cudart,
        ),
        (f"{host}/usr/local/bin/llama-server", "maps:3003", cudart),
    ]
    assert len({(lib.dev, lib.inode) for lib in found}) == len(found)


def test_same_inode_reached_by_many_paths_is_one_library(proc_tree: tuple[Path, Path]) -> None:
    host, proc = proc_tree
    found = make_finder(host, proc, FakeSymbols()).find()
    driver = [lib for lib in found if "cuLaunchKernel" in lib.symbols]
    # ldconfig's libcuda.so.1 and .so, the host maps' libcuda.so.550 and the container's bind mount
    assert len(driver) == 1
    st = os.stat(host / HOST_LIBCUDA)
    assert (driver[0].dev, driver[0].inode) == (st.st_dev, st.st_ino)


def test_non_cuda_processes_and_plain_libraries_cost_no_symbol_reads(
    proc_tree: tuple[Path, Path],
) -> None:
    host, proc = proc_tree
    symbols = FakeSymbols()
    finder = make_finder(host, proc, symbols)
    finder.find()
    names = {p.name for p in symbols.asked}
    assert "bash" not in names  # 4004 is not a CUDA process
    assert "nvidiactl" not in names and "nvidia0" not in names
    assert "_C.abi3.so" not in names  # deleted mapping
    first = len(symbols.asked)
    inodes = {(os.stat(p).st_dev, os.stat(p).st_ino) for p in symbols.asked}
    assert first == len(inodes)  # each file once, even when mapped by several pids
    finder.find()
    assert len(symbols.asked) == first  # cached by (dev, inode, size, mtime)


def test_finder_can_be_limited_to_pids_and_skips_vanished_ones(
    proc_tree: tuple[Path, Path],
) -> None:
    host, proc = proc_tree
    found = make_finder(host, proc, FakeSymbols()).find(pids=[CONTAINER_PID, 99999])
    assert [lib.source for lib in found] == ["ldconfig", "ldconfig", "maps:2002"]


def test_finder_without_ldconfig_or_proc_finds_nothing(tmp_path: Path) -> None:
    finder = LibraryFinder(
        proc_root=tmp_path / "no-proc", ldconfig_output=lambda: "", symbols_of=FakeSymbols()
    )
    assert finder.find() == []


# -- ELF symbol tables ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def fake_cuda(tmp_path_factory: pytest.TempPathFactory) -> FakeCuda:
    why = gcc_missing()
    if why:
        pytest.skip(why)
    return build_fake_cuda(tmp_path_factory.mktemp("fake-cuda"))


def test_elf_reader_finds_defined_exports_only(fake_cuda: FakeCuda) -> None:
    assert elf_defined_symbols(fake_cuda.libcuda, LAUNCH_SYMBOLS) == frozenset(
        {
            "cuLaunchKernel",
            "cuLaunchKernel_ptsz",
            "cuLaunchKernelEx",
            "cuGraphLaunch",
            "cuMemAlloc_v2",
            "cuMemFree_v2",
        }
    )
    # the runtime *references* cuLaunchKernel (undefined) and defines cudaLaunchKernel
    assert elf_defined_symbols(fake_cuda.libcudart, LAUNCH_SYMBOLS) == {"cudaLaunchKernel"}
    assert elf_defined_symbols(fake_cuda.launcher, LAUNCH_SYMBOLS) == frozenset()


def test_elf_reader_sees_a_statically_linked_runtime_unless_stripped(fake_cuda: FakeCuda) -> None:
    assert elf_defined_symbols(fake_cuda.launcher_static_rt, LAUNCH_SYMBOLS) == {"cudaLaunchKernel"}
    assert elf_defined_symbols(fake_cuda.launcher_stripped, LAUNCH_SYMBOLS) == frozenset()


def test_elf_reader_on_the_system_libc() -> None:
    libc = Path("/lib/x86_64-linux-gnu/libc.so.6")
    if not libc.exists():
        pytest.skip("no x86-64 glibc at the Debian path")
    assert elf_defined_symbols(libc, frozenset({"malloc", "printf", "cuLaunchKernel"})) == {
        "malloc",
        "printf",
    }


def test_elf_reader_never_raises_on_bad_files(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("cuLaunchKernel\0")
    empty = tmp_path / "empty.so"
    empty.write_bytes(b"")
    truncated = tmp_path / "truncated.so"
    truncated.write_bytes(b"\x7fELF\x02\x01\x01" + b"\0" * 20)
    for path in (text, empty, truncated, tmp_path / "missing.so", tmp_path):
        assert elf_defined_symbols(path, LAUNCH_SYMBOLS) == frozenset()


def test_elf_reader_handles_a_truncated_real_library(fake_cuda: FakeCuda, tmp_path: Path) -> None:
    data = fake_cuda.libcuda.read_bytes()
    cut = tmp_path / "cut.so"
    cut.write_bytes(data[: len(data) // 2])
    assert elf_defined_symbols(cut, LAUNCH_SYMBOLS) <= LAUNCH_SYMBOLS  # no exception


def test_finder_reads_real_elf_files_through_proc_maps(fake_cuda: FakeCuda, tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "77").mkdir(parents=True)
    (proc / "77" / "root").symlink_to("/")
    (proc / "77" / "maps").write_text(
        f"7f00-7f01 r-xp 00000000 fe:00 1 {fake_cuda.libcuda}\n"
        f"7f02-7f03 r-xp 00000000 fe:00 2 {fake_cuda.libcudart}\n"
        f"7f04-7f05 r-xp 00000000 fe:00 3 {fake_cuda.launcher}\n"
    )
    found = LibraryFinder(proc_root=proc, ldconfig_output=lambda: "").find()
    assert [(Path(lib.path), lib.source) for lib in found] == [
        (fake_cuda.libcuda, "maps:77"),
        (fake_cuda.libcudart, "maps:77"),
    ]
