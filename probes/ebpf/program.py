"""The launch probe's BPF C text and the compile flags that parameterise it.

The C source lives beside this module (``launches.bpf.c``, package data); the symbol ids come from
:class:`probes.ebpf.decode.SymbolId` as ``-D`` flags so Python and C cannot drift apart.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from importlib import resources

from probes.ebpf.decode import SymbolId

SOURCE_NAME = "launches.bpf.c"

# NOTE: kernel headers newer than BCC's clang trip dozens of warnings that say nothing about our
# program (Debian's 6.12 tree with BCC 0.26's clang 14); silence warnings so a real compile error
# stands out in the log.
_QUIET = ("-w",)


@dataclass(frozen=True, slots=True)
class ProgramOptions:
    """Sizes compiled into the BPF program."""

    max_processes: int = 16384  # (process, symbol) counter entries
    max_live_allocs: int = 65536  # outstanding cuMemAlloc_v2 allocations tracked for cuMemFree_v2
    sample_ring_size: int = 0  # debug: keep the last N launches' arguments; 0 compiles it out


def program_text() -> str:
    """The BPF C source, read from the package."""
    return resources.files("probes.ebpf").joinpath(SOURCE_NAME).read_text(encoding="utf-8")


def program_cflags(options: ProgramOptions, machine: str | None = None) -> list[str]:
    """``-D`` flags for the symbol ids, sizes and architecture, plus warning filters.

    ``machine`` is ``platform.machine()`` by default. Stack-passed launch arguments (the debug
    ring's blockDimZ, shared memory and stream) are decoded on x86-64 only; elsewhere they read 0.
    """
    if options.max_processes <= 0 or options.max_live_allocs <= 0:
        raise ValueError("max_processes and max_live_allocs must be positive")
    if options.sample_ring_size < 0:
        raise ValueError("sample_ring_size must be >= 0")
    flags = [f"-DSYM_{sym.name}={int(sym)}" for sym in SymbolId]
    flags += [
        f"-DMAX_PROCS={options.max_processes}",
        f"-DMAX_LIVE_ALLOCS={options.max_live_allocs}",
        f"-DSAMPLE_RING={options.sample_ring_size}",
    ]
    if (machine or platform.machine()) in ("x86_64", "AMD64"):
        # NOTE: BCC 0.26 does not define __TARGET_ARCH_x86 for the program, so say it ourselves.
        flags.append("-DFLEXPIPE_X86_64=1")
    return flags + list(_QUIET)
