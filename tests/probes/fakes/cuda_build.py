"""Build the fake CUDA libraries and the launcher (tests/probes/fakes/cuda/*.c) with gcc.

The runtime is built under a renamed file with a matching soname, as auditwheel bundles it in
wheels (``libcudart-<hash>.so.12``), so the live test also exercises discovery of renamed
libraries through ``/proc/<pid>/maps``.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

SOURCES = Path(__file__).parent / "cuda"
RENAMED_CUDART = "libcudart-5ca1ab1e.so.12"


@dataclass(frozen=True, slots=True)
class FakeCuda:
    """Paths of one build."""

    libcuda: Path  # libcuda.so.1
    libcudart: Path  # the renamed runtime
    launcher: Path  # dynamically linked against both
    launcher_static_rt: Path  # runtime compiled into the executable (kept .symtab)
    launcher_stripped: Path  # the same, stripped


def gcc_missing() -> str | None:
    """Why the fakes cannot be built here, or None."""
    return None if shutil.which("gcc") else "gcc is not installed"


def _gcc(*args: str | Path) -> None:
    subprocess.run(["gcc", "-O2", "-Wall", "-Werror", *map(str, args)], check=True)


def build_fake_cuda(out: Path) -> FakeCuda:
    """Compile everything into ``out`` (created); raises CalledProcessError on a compile error."""
    out.mkdir(parents=True, exist_ok=True)
    inc = f"-I{SOURCES}"
    libcuda = out / "libcuda.so.1"
    _gcc(
        "-shared",
        "-fPIC",
        inc,
        "-Wl,-soname,libcuda.so.1",
        "-o",
        libcuda,
        SOURCES / "fake_libcuda.c",
    )
    (out / "libcuda.so").unlink(missing_ok=True)
    (out / "libcuda.so").symlink_to("libcuda.so.1")
    libcudart = out / RENAMED_CUDART
    _gcc(
        "-shared",
        "-fPIC",
        inc,
        f"-Wl,-soname,{RENAMED_CUDART}",
        "-o",
        libcudart,
        SOURCES / "fake_libcudart.c",
        f"-L{out}",
        "-lcuda",
    )
    launcher = out / "launcher"
    rpath = f"-Wl,-rpath,{out}"
    _gcc(
        inc,
        "-o",
        launcher,
        SOURCES / "launcher.c",
        f"-L{out}",
        f"-l:{RENAMED_CUDART}",
        "-lcuda",
        rpath,
    )
    static_rt = out / "launcher-static-rt"
    _gcc(
        inc,
        "-o",
        static_rt,
        SOURCES / "launcher.c",
        SOURCES / "fake_libcudart.c",
        f"-L{out}",
        "-lcuda",
        rpath,
    )
    stripped = out / "launcher-stripped"
    shutil.copy(static_rt, stripped)
    subprocess.run(["strip", str(stripped)], check=True)
    return FakeCuda(libcuda, libcudart, launcher, static_rt, stripped)
