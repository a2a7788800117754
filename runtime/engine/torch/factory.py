"""The runtime's seam to the torch engine: an engine factory that builds a TorchEngine per replica.

The runtime's plans are gearbox's, for the deployment's configured model (80 layers for a
70B-class one); the torch engine runs a small stand-in model on this host's CPU. Each plan is
served as it stands — the same stages, GPUs (rank processes), TP degrees, PD split and
replicas — with its layer ranges mapped proportionally onto the stand-in's layers
(:func:`scaled_plan`). The factory's :class:`TokenLedger` (one per deployment) is shared by
that deployment's engines, so a shift's replay re-prefills exactly the tokens already emitted.
"""

from __future__ import annotations

import dataclasses
import multiprocessing.forkserver

from gearbox.plans import ExecutionPlan, Stage, StageRole
from runtime.deployment import EngineFactory
from runtime.engine.base import Engine, EngineFault, OpResult
from runtime.engine.simgpu import SimGpuPool
from runtime.engine.torch import procs
from runtime.engine.torch.config import LlamaConfig
from runtime.engine.torch.engine import TorchEngine, TorchEngineConfig
from runtime.engine.torch.tokens import TokenLedger
from runtime.timing import ReplicaTiming

# NOTE: 24 heads and KV heads, 192 MLP columns: every TP degree a block of up to 8 GPUs can
# form (1, 2, 3, 4, 6, 8) splits them evenly. 4 layers (pipelines of up to 4 stages): each layer
# costs a TP group two gloo all-reduces, and a TP8 ring of rank processes sharing two cores
# took ~0.5 s per step with 8 layers
DEMO_MODEL = LlamaConfig(
    vocab_size=512,
    hidden_size=96,
    intermediate_size=192,
    num_layers=4,
    num_heads=24,
    num_kv_heads=24,
    name="demo-llama-tiny",
)
DEMO_SOURCE = "random:7"
DEMO_SETTINGS = TorchEngineConfig(num_blocks=512, block_size=16, max_batch=32)


def _scaled_bounds(ends: list[int], total: int, num_layers: int) -> list[int]:
    """Stage end layers of a ``total``-layer pipeline mapped onto ``num_layers``, each stage
    keeping at least one layer."""
    if len(ends) > num_layers:
        raise ValueError(f"stages: {len(ends)} pipeline stages exceed the model's {num_layers}")
    out: list[int] = []
    for i, end in enumerate(ends):
        left = len(ends) - i - 1  # stages after this one, one layer each at least
        prev = out[-1] if out else 0
        out.append(min(max(round(end * num_layers / total), prev + 1), num_layers - left))
    return out


def _scale_pipeline(stages: list[Stage], num_layers: int) -> list[Stage]:
    total = stages[-1].layer_end
    ends = _scaled_bounds([s.layer_end for s in stages], total, num_layers)
    starts = [0, *ends[:-1]]
    return [
        dataclasses.replace(s, layer_start=a, layer_end=b)
        for s, a, b in zip(stages, starts, ends, strict=True)
    ]


def scaled_plan(plan: ExecutionPlan, num_layers: int) -> ExecutionPlan:
    """``plan`` with each pipeline's layer ranges mapped proportionally onto ``num_layers``."""
    prefill = [s for s in plan.stages if s.role is StageRole.PREFILL]
    rest = [s for s in plan.stages if s.role is not StageRole.PREFILL]
    stages = (_scale_pipeline(prefill, num_layers) if prefill else []) + _scale_pipeline(
        rest, num_layers
    )
    return dataclasses.replace(plan, stages=tuple(stages))


def warm_up() -> None:
    """Start the rank processes' fork server now (it imports torch once, seconds), so the
    first replica's load does not pay it while the runtime serves."""
    procs.context()
    multiprocessing.forkserver.ensure_running()


class SimulatedGpuTorchEngine(TorchEngine):
    """A TorchEngine whose "GPUs" belong to the runtime's simulated pool: when the pool loses
    one (a preemption, a fatal XID), the rank process on it is killed — the engine then fails
    as on a real cluster (``GPU_LOST``), and a load onto a lost GPU fails."""

    def __init__(
        self,
        pool: SimGpuPool,
        plan: ExecutionPlan,
        cfg: LlamaConfig,
        source: str,
        ledger: TokenLedger,
        settings: TorchEngineConfig,
        replica_id: str,
    ) -> None:
        super().__init__(plan, cfg, source, ledger, settings=settings, replica_id=replica_id)
        self._gpu_pool = pool
        self._pool_version = -1

    def _lost(self) -> list[str]:
        return [r.gpu_uuid for r in self.ranks if self._gpu_pool.is_lost(r.gpu_uuid)]

    def health(self) -> EngineFault | None:
        """As the base engine, after killing the ranks on GPUs the pool lost."""
        if self._gpu_pool.version != self._pool_version:
            self._pool_version = self._gpu_pool.version
            lost = set(self._lost())
            for r in self.ranks:
                rp = self._procs.get(r.rank)
                if r.gpu_uuid in lost and rp is not None and rp.proc.is_alive():
                    rp.proc.kill()
                    rp.proc.join(procs.LOAD_TIMEOUT_S)
        return super().health()

    def load_shard(self, stage_index: int, now_s: float) -> OpResult:
        """Refuse a stage with a lost or load-failing GPU, as a simulated engine does."""
        bad = [
            u
            for u in self.plan.stages[stage_index].gpu_uuids
            if self._gpu_pool.is_lost(u) or self._gpu_pool.load_fails(u)
        ]
        if bad:
            return OpResult(False, fault=EngineFault.LOAD_FAILED, detail=f"gpu {bad[0]}")
        return super().load_shard(stage_index, now_s)


def torch_engine_factory(
    ledger: TokenLedger,
    cfg: LlamaConfig = DEMO_MODEL,
    source: str = DEMO_SOURCE,
    settings: TorchEngineConfig = DEMO_SETTINGS,
) -> EngineFactory:
    """A deployment's engine factory: a TorchEngine of ``cfg`` for each replica's plan, all
    sharing the deployment's ``ledger``."""

    def make(timing: ReplicaTiming, pool: SimGpuPool, max_batch: int | None) -> Engine:
        knobs = (
            settings if max_batch is None else dataclasses.replace(settings, max_batch=max_batch)
        )
        return SimulatedGpuTorchEngine(
            pool,
            scaled_plan(timing.plan, cfg.num_layers),
            cfg,
            source,
            ledger,
            knobs,
            timing.replica_id,
        )

    return make
