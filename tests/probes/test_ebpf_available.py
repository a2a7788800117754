"""ebpf_available says why not, precisely; kernel header discovery."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from probes.ebpf.available import ebpf_available, find_kernel_source, has_capabilities

pytestmark = pytest.mark.unit

ALL_CAPS = "CapEff:\t000001ffffffffff\n"
BPF_PERFMON = f"CapEff:\t{(1 << 39) | (1 << 38):016x}\n"
SYS_ADMIN_ONLY = f"CapEff:\t{1 << 21:016x}\n"
BPF_ONLY = f"CapEff:\t{1 << 39:016x}\n"


def fake_bcc(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.BPF = object  # type: ignore[attr-defined]
    module.__version__ = "0.26.0"  # type: ignore[attr-defined]
    return module


@pytest.fixture
def host(tmp_path: Path) -> dict[str, Path]:
    """A host with every prerequisite; tests remove one at a time."""
    status = tmp_path / "status"
    status.write_text("Name:\tpython\n" + ALL_CAPS)
    pmu = tmp_path / "uprobe"
    pmu.mkdir()
    headers = tmp_path / "headers"
    (headers / "include").mkdir(parents=True)
    return {"status": status, "pmu": pmu, "headers": headers, "tmp": tmp_path}


def check(host: dict[str, Path], **overrides: object) -> tuple[bool, str]:
    args: dict[str, object] = {
        "importer": fake_bcc,
        "proc_status": host["status"],
        "uprobe_pmu": host["pmu"],
        "tracefs": (host["tmp"] / "no-tracefs",),
        "kernel_source": lambda: host["headers"],
        "kheaders": host["tmp"] / "no-kheaders",
    }
    args.update(overrides)
    return ebpf_available(**args)  # type: ignore[arg-type]


def test_all_prerequisites_met(host: dict[str, Path]) -> None:
    assert check(host) == (True, f"BCC 0.26.0, headers at {host['headers']}")


def test_no_bcc_module(host: dict[str, Path]) -> None:
    def missing(name: str) -> types.ModuleType:
        raise ModuleNotFoundError("No module named 'bcc'")

    ok, why = check(host, importer=missing)
    assert not ok and "No module named 'bcc'" in why and "deploy/bpf/setup.sh" in why


def test_the_wrong_bcc(host: dict[str, Path]) -> None:
    ok, why = check(host, importer=types.ModuleType)
    assert not ok and "lattice" in why


def test_no_privileges(host: dict[str, Path]) -> None:
    host["status"].write_text("CapEff:\t0000000000000000\n")
    ok, why = check(host)
    assert not ok and "CAP_BPF" in why


def test_no_uprobes(host: dict[str, Path]) -> None:
    ok, why = check(host, uprobe_pmu=host["tmp"] / "none")
    assert not ok and "uprobe" in why
    tracefs = host["tmp"] / "tracing"
    tracefs.mkdir()
    (tracefs / "uprobe_events").write_text("")
    assert check(host, uprobe_pmu=host["tmp"] / "none", tracefs=(tracefs,))[0]


def test_no_headers_and_kheaders_fallback(host: dict[str, Path]) -> None:
    ok, why = check(host, kernel_source=lambda: None)
    assert not ok and "kernel headers" in why and "setup.sh" in why
    kheaders = host["tmp"] / "kheaders.tar.xz"
    kheaders.write_bytes(b"")
    assert check(host, kernel_source=lambda: None, kheaders=kheaders) == (
        True,
        "BCC 0.26.0, headers from the kernel's kheaders",
    )


@pytest.mark.parametrize(
    ("status", "euid", "expected"),
    [
        (ALL_CAPS, 1000, True),
        (BPF_PERFMON, 1000, True),
        (SYS_ADMIN_ONLY, 1000, True),
        (BPF_ONLY, 0, False),  # root in a container that kept CAP_BPF but not CAP_PERFMON
        ("CapEff:\t0000000000000000\n", 0, False),
        ("", 0, True),  # no status file to read: fall back on euid
        ("", 1000, False),
    ],
)
def test_has_capabilities(status: str, euid: int, expected: bool) -> None:
    assert has_capabilities(status, euid) is expected


def test_find_kernel_source_prefers_the_environment(tmp_path: Path) -> None:
    build = tmp_path / "build"
    (build / "include").mkdir(parents=True)
    assert find_kernel_source({"BCC_KERNEL_SOURCE": "/x"}, [build]) == Path("/x")
    assert find_kernel_source({}, [tmp_path / "none", build]) == build
    assert find_kernel_source({}, [tmp_path / "none"]) is None


def test_a_header_tree_without_include_is_refused(host: dict[str, Path]) -> None:
    ok, why = check(host, kernel_source=lambda: host["tmp"] / "empty")
    assert not ok and "no include/" in why
