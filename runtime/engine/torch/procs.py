"""The driver's side of a plan's rank processes: spawn, request/reply with deadlines, reap.

Waits poll each pipe with a deadline and check the process is alive, so a dead rank becomes a
fault value (:class:`RankFailure`) within a poll interval instead of a hang.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.multiprocessing  # receives shared pools (shm on CPU, CUDA IPC on GPUs)

from runtime.engine.torch.rank import RankBoot, rank_main

_POLL_S = 0.05
LOAD_TIMEOUT_S = 180.0
STEP_TIMEOUT_S = 120.0


class RankFailure(Exception):
    """A rank died, timed out or reported an error (caught by the engine, made a fault)."""


@dataclass
class RankProc:
    """One rank process and the driver's end of its pipe."""

    boot: RankBoot
    proc: BaseProcess
    conn: Connection
    pool: torch.Tensor | None = None


def context() -> Any:
    """A fork server that has imported torch and the rank code once: ranks fork from it in
    milliseconds instead of importing torch each (seconds); it never runs torch ops itself."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["runtime.engine.torch.rank"])
    return ctx


def spawn(boots: Iterable[RankBoot]) -> list[RankProc]:
    """Start one process per boot record (forked from the preloaded fork server)."""
    ctx = context()
    out = []
    for boot in boots:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=rank_main, args=(child, boot), daemon=True)
        proc.start()
        child.close()
        out.append(RankProc(boot, proc, parent))
    return out


def receive(rp: RankProc, timeout_s: float) -> tuple[Any, ...]:
    """The rank's next reply; :class:`RankFailure` when it dies or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if rp.conn.poll(_POLL_S):
                msg: tuple[Any, ...] = rp.conn.recv()
                if msg[0] == "error":
                    raise RankFailure(f"rank {rp.boot.spec.rank}: {msg[1]}")
                return msg
        except (EOFError, OSError) as exc:
            raise RankFailure(f"rank {rp.boot.spec.rank}: pipe closed ({exc!r})") from exc
        if not rp.proc.is_alive():
            raise RankFailure(f"rank {rp.boot.spec.rank}: exited {rp.proc.exitcode}")
        if time.monotonic() > deadline:
            raise RankFailure(f"rank {rp.boot.spec.rank}: no reply in {timeout_s} s")


def send(rp: RankProc, msg: tuple[Any, ...]) -> None:
    """Send a command; a closed pipe is a :class:`RankFailure`."""
    try:
        rp.conn.send(msg)
    except (BrokenPipeError, OSError) as exc:
        raise RankFailure(f"rank {rp.boot.spec.rank}: cannot send ({exc!r})") from exc


def request_all(
    procs: Sequence[RankProc], msgs: Sequence[tuple[Any, ...]], timeout_s: float
) -> list[tuple[Any, ...]]:
    """Send each rank its command, then collect every reply (ranks run concurrently)."""
    for rp, msg in zip(procs, msgs, strict=True):
        send(rp, msg)
    return [receive(rp, timeout_s) for rp in procs]


def stop(procs: Iterable[RankProc], timeout_s: float = 5.0) -> None:
    """Ask ranks to exit, then kill stragglers; idempotent."""
    procs = list(procs)
    for rp in procs:
        if rp.proc.is_alive():
            with contextlib.suppress(BrokenPipeError, OSError):
                rp.conn.send(("shutdown",))
    deadline = time.monotonic() + timeout_s
    for rp in procs:
        rp.proc.join(max(0.0, deadline - time.monotonic()))
        if rp.proc.is_alive():
            rp.proc.kill()
            rp.proc.join(timeout_s)
        rp.conn.close()
