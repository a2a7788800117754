"""Find the CUDA driver and runtime libraries to put uprobes on.

Three sources, because the library a process really runs is often not the one on the host's
library path:

* ``ldconfig -p``: the host's ``libcuda.so*`` / ``libcudart.so*``.
* ``/proc/<pid>/maps`` of running CUDA processes (those mapping ``/dev/nvidia*`` or a ``libcuda``
  file): every executable file mapping is checked for exported launch symbols, so a runtime bundled
  under a renamed file (``libcudart-9335f6a2.so.12`` in a wheel) or linked statically into the
  executable is found too.
* Container root filesystems: a path in a containerised process's maps is opened through
  ``/proc/<pid>/root/``, which is that process's view of the filesystem.

A library is identified by ``(st_dev, st_ino)``: uprobes attach to an inode, so one inode reached
by several paths is probed once. The symbol check reads ELF symbol tables in pure Python
(:func:`elf_defined_symbols`), with a substring pre-filter on the string table so that a large
library without CUDA symbols costs one ``find``.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import struct
import subprocess
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DRIVER_SYMBOLS = (
    "cuLaunchKernel",
    "cuLaunchKernel_ptsz",
    "cuLaunchKernelEx",
    "cuLaunchKernelEx_ptsz",
    "cuGraphLaunch",
    "cuGraphLaunch_ptsz",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
)
RUNTIME_SYMBOLS = ("cudaLaunchKernel", "cudaLaunchKernel_ptsz")
LAUNCH_SYMBOLS = frozenset(DRIVER_SYMBOLS + RUNTIME_SYMBOLS)

SymbolReader = Callable[[Path, frozenset[str]], frozenset[str]]


@dataclass(frozen=True, slots=True)
class CudaLibrary:
    """A file that defines launch symbols, as the host can open it."""

    path: str  # host-openable path (through /proc/<pid>/root/ for another mount namespace)
    dev: int  # st_dev of that path
    inode: int  # st_ino of that path
    symbols: tuple[str, ...]  # launch symbols it defines, sorted
    source: str  # "ldconfig" or "maps:<pid>"


@dataclass(frozen=True, slots=True)
class MapsEntry:
    """One file-backed line of ``/proc/<pid>/maps``."""

    perms: str
    path: str


# ---------------------------------------------------------------------------------------------
# ELF symbol tables
# ---------------------------------------------------------------------------------------------

_SHT_SYMTAB = 2
_SHT_DYNSYM = 11
_SHN_UNDEF = 0
_STT_FUNC = 2
_STT_GNU_IFUNC = 10


def elf_defined_symbols(path: Path, wanted: frozenset[str]) -> frozenset[str]:
    """Which of ``wanted`` the ELF file at ``path`` defines as functions (.dynsym or .symtab).

    Not an ELF file, unreadable, or truncated: the empty set (never an exception).
    """
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return _defined_in(m, wanted)
    except (OSError, ValueError, struct.error):
        return frozenset()


def _defined_in(m: mmap.mmap, wanted: frozenset[str]) -> frozenset[str]:
    if m[:4] != b"\x7fELF":
        return frozenset()
    is64 = m[4] == 2
    end = "<" if m[5] == 1 else ">"
    if is64:  # Elf64_Ehdr: e_shoff at 0x28, e_shentsize at 0x3A, e_shnum at 0x3C
        shoff, shentsize, shnum = (
            _unpack(m, end + "Q", 0x28),
            _u16(m, end, 0x3A),
            _u16(m, end, 0x3C),
        )
        sh_fmt, sym_fmt = end + "IIQQQQIIQQ", end + "IBBHQQ"
    else:  # Elf32_Ehdr: e_shoff at 0x20, e_shentsize at 0x2E, e_shnum at 0x30
        shoff, shentsize, shnum = (
            _unpack(m, end + "I", 0x20),
            _u16(m, end, 0x2E),
            _u16(m, end, 0x30),
        )
        sh_fmt, sym_fmt = end + "IIIIIIIIII", end + "IIIBBH"
    if not shoff or shentsize < struct.calcsize(sh_fmt):
        return frozenset()
    # Section header fields used: [1] sh_type, [4] sh_offset, [5] sh_size, [6] sh_link.
    sections = [struct.unpack_from(sh_fmt, m, shoff + i * shentsize) for i in range(shnum)]
    found: set[str] = set()
    for sh in sections:
        sh_type, sh_offset, sh_size, sh_link = sh[1], sh[4], sh[5], sh[6]
        if sh_type not in (_SHT_SYMTAB, _SHT_DYNSYM) or sh_link >= len(sections):
            continue
        strtab = sections[sh_link]
        offsets = _name_offsets(m, strtab[4], strtab[5], wanted - found)
        if offsets:
            found |= _defined_names(m, sh_offset, sh_size, sym_fmt, is64, offsets)
    return frozenset(found)


def _unpack(m: mmap.mmap, fmt: str, offset: int) -> int:
    value: int = struct.unpack_from(fmt, m, offset)[0]
    return value


def _u16(m: mmap.mmap, end: str, offset: int) -> int:
    return _unpack(m, end + "H", offset)


def _name_offsets(m: mmap.mmap, start: int, size: int, names: Iterable[str]) -> dict[int, str]:
    """String-table offsets at which each name starts (a name may also end a longer string)."""
    offsets: dict[int, str] = {}
    for name in names:
        needle = name.encode() + b"\0"
        pos = m.find(needle, start, start + size)
        while pos >= 0:
            offsets[pos - start] = name
            pos = m.find(needle, pos + 1, start + size)
    return offsets


def _defined_names(
    m: mmap.mmap, offset: int, size: int, sym_fmt: str, is64: bool, names: dict[int, str]
) -> set[str]:
    found: set[str] = set()
    ent = struct.calcsize(sym_fmt)
    for sym in struct.iter_unpack(sym_fmt, m[offset : offset + size - size % ent]):
        name = names.get(sym[0])
        if name is None:
            continue
        info, shndx = (sym[1], sym[3]) if is64 else (sym[3], sym[5])
        if shndx != _SHN_UNDEF and (info & 0xF) in (_STT_FUNC, _STT_GNU_IFUNC):
            found.add(name)
    return found


# ---------------------------------------------------------------------------------------------
# ldconfig and /proc
# ---------------------------------------------------------------------------------------------

_LDCONFIG_LINE = re.compile(r"^\s*(\S+)\s+\(([^)]*)\)(?:[^=]*)=>\s*(\S+)\s*$")


def run_ldconfig(root: Path = Path("/")) -> str:
    """``ldconfig -p`` output for the filesystem at ``root``, or "" when ldconfig fails."""
    args = ["-p"] if root == Path("/") else ["-r", str(root), "-p"]
    for exe in ("ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig"):
        try:
            done = subprocess.run(
                [exe, *args], capture_output=True, text=True, timeout=10, check=False
            )
        except (OSError, subprocess.SubprocessError):
            continue
        if done.returncode == 0:
            return done.stdout
    return ""


def parse_ldconfig(text: str) -> list[str]:
    """Paths of 64-bit ``libcuda.so*`` and ``libcudart.so*`` in ``ldconfig -p`` output, in order.

    32-bit copies (flags plain ``libc6`` on x86-64, next to ``libc6,x86-64``) are skipped: no
    inference process loads them.
    """
    paths: list[str] = []
    for line in text.splitlines():
        match = _LDCONFIG_LINE.match(line)
        if match and re.match(r"libcuda(rt)?\.so", match.group(1)) and "64" in match.group(2):
            paths.append(match.group(3))
    return paths


def parse_maps(text: str) -> list[MapsEntry]:
    """File-backed entries of a maps file (anonymous, ``[special]`` and deleted ones dropped)."""
    out: list[MapsEntry] = []
    for line in text.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or not parts[5].startswith("/") or parts[5].endswith(" (deleted)"):
            continue
        out.append(MapsEntry(perms=parts[1], path=parts[5]))
    return out


def is_cuda_process(entries: Iterable[MapsEntry]) -> bool:
    """A process is a CUDA process once it maps an NVIDIA device node or a libcuda file."""
    return any(
        e.path.startswith("/dev/nvidia") or os.path.basename(e.path).startswith("libcuda.so")
        for e in entries
    )


def _pids(proc_root: Path) -> Iterator[int]:
    try:
        names = os.listdir(proc_root)
    except OSError:
        return
    for name in names:
        if name.isdigit():
            yield int(name)


# ---------------------------------------------------------------------------------------------
# Discovery
# ---------------------------------------------------------------------------------------------


class LibraryFinder:
    """Discovers CUDA libraries; caches symbol checks per file so rediscovery stays cheap.

    ``proc_root``, ``host_root`` (where the host's filesystem is: "/" for an agent on the host,
    e.g. "/host" for a container with the host mounted) and the ``ldconfig -p`` provider are
    parameters so tests can feed recorded fixtures; ``symbols_of`` reads a file's defined symbols
    (default: :func:`elf_defined_symbols`).
    """

    def __init__(
        self,
        proc_root: Path = Path("/proc"),
        ldconfig_output: Callable[[], str] | None = None,
        symbols_of: SymbolReader = elf_defined_symbols,
        host_root: Path = Path("/"),
    ) -> None:
        self._proc_root = proc_root
        self._host_root = host_root
        self._ldconfig_output = ldconfig_output or (lambda: run_ldconfig(host_root))
        self._symbols_of = symbols_of
        # (dev, inode, size, mtime_ns) -> defined launch symbols
        self._cache: dict[tuple[int, int, int, int], frozenset[str]] = {}

    def find(self, pids: Iterable[int] | None = None) -> list[CudaLibrary]:
        """Unique libraries from ldconfig, then from the maps of CUDA processes (all, or ``pids``).

        Processes that vanish or deny access are skipped; the result is ordered by first sighting.
        """
        found: dict[tuple[int, int], CudaLibrary] = {}
        for listed in parse_ldconfig(self._ldconfig_output()):
            self._add(found, self._host_root / listed.lstrip("/"), "ldconfig")
        for pid in sorted(_pids(self._proc_root) if pids is None else pids):
            for mapped in self._process_candidates(pid):
                self._add(found, mapped, f"maps:{pid}")
        return list(found.values())

    def _process_candidates(self, pid: int) -> list[Path]:
        pid_dir = self._proc_root / str(pid)
        try:
            entries = parse_maps((pid_dir / "maps").read_text(errors="replace"))
        except OSError:
            return []
        if not is_cuda_process(entries):
            return []
        paths: dict[str, None] = {}
        for e in entries:
            if "x" in e.perms and not e.path.startswith("/dev/"):
                paths.setdefault(e.path)
        return [self._host_path(pid_dir, p) for p in paths]

    def _host_path(self, pid_dir: Path, path: str) -> Path:
        """Where to open a mapped file: the host path when it is the same file, else via root."""
        via_root = pid_dir / "root" / path.lstrip("/")
        on_host = self._host_root / path.lstrip("/")
        try:
            plain = os.stat(on_host)
            seen = os.stat(via_root)
        except OSError:
            return via_root
        same = (plain.st_dev, plain.st_ino) == (seen.st_dev, seen.st_ino)
        return on_host if same else via_root

    def _add(self, found: dict[tuple[int, int], CudaLibrary], path: Path, source: str) -> None:
        try:
            st = os.stat(path)
        except OSError:
            return
        ident = (st.st_dev, st.st_ino)
        if ident in found:
            return
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        symbols = self._cache.get(key)
        if symbols is None:
            symbols = self._symbols_of(path, LAUNCH_SYMBOLS)
            self._cache[key] = symbols
        if symbols:
            found[ident] = CudaLibrary(
                str(path), st.st_dev, st.st_ino, tuple(sorted(symbols)), source
            )
