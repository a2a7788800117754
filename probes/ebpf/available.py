"""Can the eBPF launch probe run here, and if not, why not (one clear line for the log)."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType

# Linux capability bits (include/uapi/linux/capability.h).
CAP_SYS_ADMIN = 21
CAP_PERFMON = 38
CAP_BPF = 39

# Where deploy/bpf/setup.sh leaves the merged Debian headers, relative to the repository root.
REPO_HEADERS = Path(".cache/kernel-headers/current")
_REPO_ROOT = Path(__file__).resolve().parents[2]


def default_header_candidates(release: str) -> list[Path]:
    """Where kernel headers for BCC may be, best first (``release`` is ``uname -r``)."""
    return [
        Path("/lib/modules") / release / "build",
        Path("/usr/src") / f"linux-headers-{release}",
        _REPO_ROOT / REPO_HEADERS,
    ]


def find_kernel_source(
    env: Mapping[str, str] | None = None,
    candidates: list[Path] | None = None,
) -> Path | None:
    """A kernel header tree for BCC, or None.

    ``BCC_KERNEL_SOURCE`` wins when set. Returns None also when the running kernel ships its own
    headers (``CONFIG_IKHEADERS``): BCC then needs no tree, and :func:`ebpf_available` says so.
    """
    env = os.environ if env is None else env
    if env.get("BCC_KERNEL_SOURCE"):
        return Path(env["BCC_KERNEL_SOURCE"])
    if candidates is None:
        candidates = default_header_candidates(os.uname().release)
    for path in candidates:
        if (path / "include").is_dir():
            return path
    return None


def has_capabilities(status_text: str, euid: int) -> bool:
    """True when ``/proc/self/status``'s effective set allows loading BPF and uprobes.

    Root is not enough on its own (containers drop capabilities), so the effective set decides:
    CAP_BPF with CAP_PERFMON, or CAP_SYS_ADMIN (kernels before 5.8 have only that).
    """
    for line in status_text.splitlines():
        if line.startswith("CapEff:"):
            eff = int(line.split()[1], 16)
            bpf_perfmon = (eff >> CAP_BPF) & 1 and (eff >> CAP_PERFMON) & 1
            return bool(bpf_perfmon or (eff >> CAP_SYS_ADMIN) & 1)
    return euid == 0


def ebpf_available(
    importer: Callable[[str], ModuleType] = importlib.import_module,
    proc_status: Path = Path("/proc/self/status"),
    uprobe_pmu: Path = Path("/sys/bus/event_source/devices/uprobe"),
    tracefs: tuple[Path, ...] = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing")),
    kernel_source: Callable[[], Path | None] = find_kernel_source,
    kheaders: Path = Path("/sys/kernel/kheaders.tar.xz"),
) -> tuple[bool, str]:
    """``(True, what will be used)`` or ``(False, why not and what to do)``; never raises."""
    try:
        bcc = importer("bcc")
    except Exception as exc:  # ImportError, or libbcc failing to load inside the import
        return False, f"BCC's Python module is not importable ({exc}); run deploy/bpf/setup.sh"
    if not hasattr(bcc, "BPF"):
        return False, "the importable 'bcc' is not BCC (PyPI's lattice 'bcc'?); run setup.sh"
    try:
        status = proc_status.read_text()
    except OSError:
        status = ""
    if not has_capabilities(status, os.geteuid()):
        return False, "no CAP_BPF+CAP_PERFMON (or CAP_SYS_ADMIN): run the agent privileged"
    if not uprobe_pmu.exists() and not any((t / "uprobe_events").exists() for t in tracefs):
        return False, "the kernel offers no uprobes (no uprobe PMU, no tracefs uprobe_events)"
    source = kernel_source()
    if source is not None and not (source / "include").is_dir():
        return False, f"kernel headers at {source} have no include/ (check BCC_KERNEL_SOURCE)"
    if source is None and not kheaders.exists():
        return False, (
            "no kernel headers for BCC (no /lib/modules/$(uname -r)/build, no kheaders, no "
            "BCC_KERNEL_SOURCE); run deploy/bpf/setup.sh"
        )
    where = f"headers at {source}" if source else "headers from the kernel's kheaders"
    version = getattr(bcc, "__version__", "?")
    return True, f"BCC {version}, {where}"
