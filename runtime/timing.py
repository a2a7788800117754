"""Per-replica timing and memory figures from gearbox's cost model.

The SimEngine's iteration times and the router's completion predictions come from the same
formulas gearbox uses to rank plans (:mod:`gearbox.cost`), so the simulated runtime, the decision
loop and the benchmarks agree on what a plan can do. Token counts are bucketed so the memoised
cost functions are hit instead of recomputed on every iteration; each replica also keeps its own
table of the two hot figures, keyed by the bucketed integers, because hashing the frozen shape,
model and config for gearbox's caches on every call was most of an eight-hour simulation's time.
Values are identical by construction: the table stores what the same code computed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from gearbox.config import GearboxConfig
from gearbox.cost import (
    ReplicaShape,
    pipeline_decode_cycle_s,
    pipeline_prefill_s,
    prefill_chunk_tokens,
    replica_shape,
)
from gearbox.model import ModelSpec
from gearbox.plans import ExecutionPlan

_GB = 1e9
_US = 1e-6
TOKEN_BUCKET = 64  # prefill/context lengths are rounded up to this for memo hits


def _bucket(tokens: float) -> int:
    return max(TOKEN_BUCKET, math.ceil(tokens / TOKEN_BUCKET) * TOKEN_BUCKET)


@dataclass(frozen=True, slots=True)
class ReplicaTiming:
    """What one replica (an :class:`ExecutionPlan`) costs per token, per step and per GPU."""

    replica_id: str
    plan: ExecutionPlan
    model: ModelSpec
    config: GearboxConfig
    shape: ReplicaShape
    weight_bytes_per_gpu: Mapping[str, int]  # this GPU's shard of the weights
    kv_bytes_per_token_per_gpu: Mapping[str, int]  # this GPU's share of one token's KV
    memory_bytes_per_gpu: Mapping[str, int]  # datasheet memory of each GPU
    kv_capacity_tokens: int  # tokens of KV the replica holds under the memory_utilisation cap
    # Memo tables (bucketed tokens → s; (batch, bucketed context) → s); not part of identity.
    _prefill_memo: dict[int, float] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )
    _decode_memo: dict[tuple[int, int], float] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )

    @classmethod
    def build(cls, plan: ExecutionPlan, model: ModelSpec, config: GearboxConfig) -> ReplicaTiming:
        """Figures for ``plan`` with each GPU's full datasheet memory available."""
        memory = {u: s.gpu_class.memory_bytes for s in plan.stages for u in s.gpu_uuids}
        weights: dict[str, int] = {}
        kv: dict[str, int] = {}
        for stage in plan.stages:
            share = stage.num_layers / model.num_layers
            for uuid in stage.gpu_uuids:
                weights[uuid] = math.ceil(model.weight_bytes * share / stage.tp)
                # NOTE: prefill stages of a PD split hold a prompt's KV only until the hand-off;
                # the steady KV footprint sits on the decode stages, so only they are charged.
                holds_kv = stage in plan.decode_stages
                kv[uuid] = math.ceil(model.kv_bytes_per_token * share / stage.tp) if holds_kv else 0
        capacity = min(
            math.floor(
                (memory[u] * config.memory_utilisation - config.runtime_overhead_bytes - weights[u])
                / kv[u]
            )
            for u in kv
            if kv[u] > 0
        )
        return cls(
            replica_id=plan.plan_id,
            plan=plan,
            model=model,
            config=config,
            shape=replica_shape(plan, memory),
            weight_bytes_per_gpu=weights,
            kv_bytes_per_token_per_gpu=kv,
            memory_bytes_per_gpu=memory,
            kv_capacity_tokens=max(0, capacity),
        )

    @property
    def gpu_uuids(self) -> tuple[str, ...]:
        """The replica's GPUs."""
        return self.plan.gpu_uuids

    def prefill_s(self, num_tokens: int) -> float:
        """Latency of one prompt through the prefill pipeline (KV hand-off included)."""
        key = _bucket(num_tokens)
        value = self._prefill_memo.get(key)
        if value is None:
            value = self._prefill_memo[key] = _prefill_s(self.shape, self.model, key, self.config)
        return value

    @property
    def prefill_chunk_tokens(self) -> int:
        """Prompt tokens per iteration with chunked prefill; 0 = whole prompts (gearbox.cost)."""
        return prefill_chunk_tokens(self.shape, self.model, self.config)

    def decode_cycle_s(self, batch: int, context_tokens: float) -> float:
        """One decode step for ``batch`` sequences of mean context ``context_tokens``."""
        if batch <= 0:
            return 0.0
        key = (batch, _bucket(context_tokens))
        value = self._decode_memo.get(key)
        if value is None:
            value = self._decode_memo[key] = pipeline_decode_cycle_s(
                self.shape.decode_pipeline,
                self.shape.pp_link,
                self.model,
                batch,
                float(key[1]),
                self.config,
            )
        return value

    def weight_load_s(self) -> float:
        """Time for the slowest GPU to load its weight shard (local NVMe / page cache)."""
        largest = max(self.weight_bytes_per_gpu.values())
        return largest / (self.config.weight_load_gbps * _GB)

    def kv_bytes_for(self, num_tokens: int) -> dict[str, int]:
        """Per-GPU bytes of KV for ``num_tokens`` tokens (GPUs holding no KV omitted)."""
        return {u: b * num_tokens for u, b in self.kv_bytes_per_token_per_gpu.items() if b > 0}


@functools.lru_cache(maxsize=16_384)
def _prefill_s(shape: ReplicaShape, model: ModelSpec, tokens: int, config: GearboxConfig) -> float:
    latency, _ = pipeline_prefill_s(shape.prefill, shape.pp_link, model, tokens, config)
    link = shape.handoff_link
    if link is not None:
        rate = link.bandwidth_gbps * _GB * config.kv_transfer_efficiency
        latency += tokens * model.kv_bytes_per_token / rate + link.latency_us * _US
    return latency
