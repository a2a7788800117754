"""One rank's process: load its shard, allocate its KV pool, join the group, run forwards.

The driver (:class:`runtime.engine.torch.engine.TorchEngine`) talks to each rank over its own
pipe (control); activations and all-reduces go over ``torch.distributed`` (data) — the two never
share a channel. The pool is allocated in shared memory (CUDA IPC on a GPU) and handed to the
driver once, so KV hand-offs and migrations copy straight between pools. A rank exits when its
pipe closes or its parent dies (``PR_SET_PDEATHSIG``), so a SIGKILLed runtime leaves no orphans.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import time
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing  # registers tensor sharing for pipes

from runtime.engine.torch.config import LlamaConfig
from runtime.engine.torch.layout import RankSpec
from runtime.engine.torch.model import SeqChunk, embed, forward_layers, greedy, new_pool
from runtime.engine.torch.weights import load_shard

_PR_SET_PDEATHSIG = 1
GROUP_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class RankBoot:
    """Everything a rank process needs to start."""

    spec: RankSpec
    world_size: int
    tp_groups: tuple[tuple[int, ...], ...]  # every stage's ranks, same order in every rank
    cfg: LlamaConfig
    source: str  # "random:<seed>" or a Hugging Face directory
    num_blocks: int
    block_size: int
    init_file: str  # torch.distributed file store of this engine
    device: str = "cpu"
    backend: str = "gloo"


def _die_with_parent() -> None:
    # NOTE: not Linux: the closed pipe still ends the loop
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class _Rank:
    def __init__(self, boot: RankBoot) -> None:
        self.boot = boot
        self.spec = boot.spec
        self.cfg = boot.cfg
        weights = load_shard(boot.source, boot.cfg, boot.spec)
        self.weights = {k: v.to(boot.device) for k, v in weights.items()}
        self.pool = new_pool(
            boot.cfg,
            boot.spec.num_layers,
            boot.spec.num_kv_heads,
            boot.num_blocks,
            boot.block_size,
            boot.device,
        )
        if boot.device == "cpu":
            self.pool.share_memory_()
        self.tp_group: Any = None

    def connect(self) -> None:
        b = self.boot
        dist.init_process_group(
            b.backend,
            init_method=f"file://{b.init_file}",
            rank=self.spec.rank,
            world_size=b.world_size,
            timeout=timedelta(seconds=GROUP_TIMEOUT_S),
        )
        for group in b.tp_groups:  # NOTE: every rank must create every group, in order
            made = dist.new_group(list(group))
            if group == self.spec.tp_group:
                self.tp_group = made

    def allreduce(self, t: torch.Tensor) -> None:
        if self.spec.tp_size > 1:
            dist.all_reduce(t, group=self.tp_group)

    def allreduce_probe(self, rows: int, num_calls: int) -> tuple[float, float]:
        """(wall, busy) seconds of ``num_calls`` all-reduces of a ``rows`` × hidden activation
        on the rank's TP group — the collective a forward runs twice per layer, alone."""
        t = torch.zeros(rows, self.cfg.hidden_size, device=self.boot.device)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(num_calls):
            self.allreduce(t)
        if self.boot.device != "cpu":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, time.process_time() - c0

    def forward(
        self, tokens: list[int], chunks: list[SeqChunk], rows: list[int]
    ) -> list[int] | None:
        spec = self.spec
        num_tokens = sum(c.n for c in chunks)
        if spec.is_first:
            hidden = embed(self.weights, tokens)
        else:
            hidden = torch.empty(num_tokens, self.cfg.hidden_size, device=self.boot.device)
            assert spec.prev_leader is not None
            dist.recv(hidden, src=spec.prev_leader)
        layers = (spec.layer_start, spec.layer_end)
        hidden = forward_layers(
            self.cfg, self.weights, layers, hidden, chunks, self.pool, self.allreduce
        )
        if spec.is_leader:
            for dst in spec.next_stage:
                dist.send(hidden.contiguous(), dst=dst)
        if spec.is_last and spec.is_leader:
            return greedy(self.cfg, self.weights, hidden, rows)
        return None


def rank_main(conn: Connection, boot: RankBoot) -> None:
    """Process entry: serve the driver's commands until shutdown or a closed pipe."""
    _die_with_parent()
    torch.set_num_threads(1)
    try:
        rank = _Rank(boot)
    except Exception as exc:  # NOTE: a fault value for the driver, not a traceback
        conn.send(("error", f"load failed: {exc!r}"))
        return
    conn.send(("loaded", rank.pool))
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "connect":
                rank.connect()
                conn.send(("connected",))
            elif msg[0] == "forward":
                t0, c0 = time.perf_counter(), time.process_time()
                out = rank.forward(msg[1], msg[2], msg[3])
                if boot.device != "cpu":
                    torch.cuda.synchronize()
                # NOTE: CPU time of every thread (gloo's included); a blocked wait on a peer
                # or on a neighbour holding the core costs none — the rank's busy time
                busy = time.process_time() - c0
                conn.send(("done", out, time.perf_counter() - t0, busy))
            elif msg[0] == "allreduce_probe":
                conn.send(("probed", *rank.allreduce_probe(msg[1], msg[2])))
            elif msg[0] == "shutdown":
                break
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
