"""Building gearbox's snapshots from folded state (pure; ``now_s`` is an input).

A GPU is schedulable when its node is up (or unknown), the scheduler has not isolated it, no
other tenant holds it and its heartbeat has not timed out; it is healthy when its latest sample
says so and no fatal XID is open. Domain links come from the node agents' NODE_UP reports; when
nodes disagree on a domain's bandwidth the slowest report wins (conservative).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields

import orjson

from flexpipe.schemas import INTER_DOMAIN_ID
from gearbox.model import ModelSpec
from gearbox.types import Domain, Gpu, LinkClass, LoadSnapshot, TopologySnapshot
from streams.catalog import DEFAULT_INTER_DOMAIN_LINK, Catalog
from streams.load import ServingAggregate
from streams.state import GpuState, NodeState

__all__ = [
    "LoadSource",
    "NominalLoad",
    "TopologyBuilder",
    "build_load",
    "build_topology",
    "gpu_domain",
    "snapshot_digest",
]


def gpu_domain(state: GpuState) -> str:
    """The GPU's interconnect domain; a GPU without one is alone with its host."""
    return state.domain or f"host:{state.node}"


def _gpu(state: GpuState, node: NodeState | None, catalog: Catalog) -> Gpu:
    uuid = state.uuid
    schedulable = not state.timed_out and (
        node is None or (node.up and uuid not in node.isolated and uuid not in node.reserved)
    )
    healthy = state.healthy and (node is None or uuid not in node.failed)
    return Gpu(
        uuid=uuid,
        node=state.node,
        gpu_class=catalog.gpu_class(state.gpu_class, state.total_memory_bytes),
        domain=gpu_domain(state),
        total_memory_bytes=state.total_memory_bytes,
        free_memory_bytes=min(state.free_memory_bytes, state.total_memory_bytes),
        healthy=healthy,
        schedulable=schedulable,
        utilisation=state.utilisation,
        last_seen_s=state.last_seen_s,
    )


def _links(nodes: Iterable[NodeState], catalog: Catalog) -> dict[str, LinkClass]:
    links: dict[str, LinkClass] = {}
    for node in sorted(nodes, key=lambda n: n.node):
        for d in node.domains:
            link = catalog.link(d.link, d.bandwidth_gbps)
            known = links.get(d.domain_id)
            if known is None or (link.bandwidth_gbps, link.name) < (
                known.bandwidth_gbps,
                known.name,
            ):
                links[d.domain_id] = link
    return links


def build_topology(
    gpus: Mapping[str, GpuState],
    nodes: Mapping[str, NodeState],
    catalog: Catalog,
    now_s: float,
    heartbeat_timeout_s: float,
) -> TopologySnapshot:
    """The schedulable resource tree at ``now_s``, GPUs sorted by uuid."""
    return TopologyBuilder(catalog).build(gpus, nodes, now_s, heartbeat_timeout_s)


class TopologyBuilder:
    """:func:`build_topology` for a view that changes a few records at a time: a GPU's gearbox
    record is rebuilt only when its record or its node's record was replaced (the view replaces
    records, never changes them in place), so a decision on 1,000 GPUs converts the handful that
    moved instead of all of them. Returns what :func:`build_topology` returns."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self._gpus: dict[str, tuple[GpuState, NodeState | None, Gpu]] = {}
        # the node records the domains were last derived from, and those domains
        self._domains: tuple[list[NodeState], tuple[Domain, ...], LinkClass] | None = None

    def build(
        self,
        gpus: Mapping[str, GpuState],
        nodes: Mapping[str, NodeState],
        now_s: float,
        heartbeat_timeout_s: float,
    ) -> TopologySnapshot:
        """The schedulable resource tree at ``now_s``, GPUs sorted by uuid."""
        cache, out = self._gpus, []
        for uuid in sorted(gpus):
            state = gpus[uuid]
            node = nodes.get(state.node)
            known = cache.get(uuid)
            if known is None or known[0] is not state or known[1] is not node:
                known = (state, node, _gpu(state, node, self.catalog))
                cache[uuid] = known
            out.append(known[2])
        if len(cache) > len(gpus):
            for uuid in [u for u in cache if u not in gpus]:
                del cache[uuid]
        domains, inter = self._links(nodes)
        return TopologySnapshot(
            now_s=now_s,
            gpus=tuple(out),
            domains=domains,
            inter_domain_link=inter,
            heartbeat_timeout_s=heartbeat_timeout_s,
        )

    def _links(self, nodes: Mapping[str, NodeState]) -> tuple[tuple[Domain, ...], LinkClass]:
        """The domains and the inter-domain link, derived again only when a node record was
        replaced (cluster events, node reports: rare next to decisions)."""
        records = list(nodes.values())
        last = self._domains
        if (
            last is not None
            and len(last[0]) == len(records)
            and all(a is b for a, b in zip(last[0], records, strict=True))
        ):
            return last[1], last[2]
        links = _links(records, self.catalog)
        inter = links.pop(INTER_DOMAIN_ID, None) or self.catalog.link(DEFAULT_INTER_DOMAIN_LINK)
        domains = tuple(Domain(d, link) for d, link in sorted(links.items()))
        self._domains = (records, domains, inter)
        return domains, inter


@dataclass(frozen=True, slots=True)
class NominalLoad:
    """A deployment's configured load, used until serving telemetry arrives."""

    arrival_rps: float
    prompt_tokens: float
    output_tokens: float


class LoadSource:
    """Where a LoadSnapshot's numbers came from (shown in explanations)."""

    WINDOW = "window"
    NOMINAL = "nominal"


def build_load(
    agg: ServingAggregate, nominal: NominalLoad, model: ModelSpec, now_s: float
) -> tuple[LoadSnapshot, str]:
    """The deployment's LoadSnapshot and its source: the window when it holds reports, else
    the nominal load. Token means fall back to nominal when the window saw no arrivals."""
    if not agg.reports:
        return (
            LoadSnapshot(
                now_s=now_s,
                arrival_rate_rps=nominal.arrival_rps,
                mean_prompt_tokens=max(1.0, nominal.prompt_tokens),
                mean_output_tokens=max(1.0, nominal.output_tokens),
            ),
            LoadSource.NOMINAL,
        )
    kv_tokens = agg.kv_bytes // max(1, model.kv_bytes_per_token)
    return (
        LoadSnapshot(
            now_s=now_s,
            arrival_rate_rps=agg.arrival_rate_rps,
            mean_prompt_tokens=max(1.0, agg.mean_prompt_tokens or nominal.prompt_tokens),
            mean_output_tokens=max(1.0, agg.mean_output_tokens or nominal.output_tokens),
            queue_len=agg.queue_len,
            active_sequences=agg.active_sequences,
            active_kv_tokens=int(kv_tokens),
            ttft_p95_ms=agg.ttft_p95_ms,
            tbt_p95_ms=agg.tbt_p95_ms,
            window_ttft_p95_ms=agg.window_ttft_p95_ms,
            num_ttft_samples=agg.num_ttft_samples,
            num_ttft_refused=agg.num_ttft_refused,
            window_ttft_p95_censored=agg.window_ttft_p95_censored,
            p95_prompt_tokens=agg.p95_prompt_tokens,
            prompt_tokens_scv=agg.prompt_tokens_scv,
            prompt_lengths=agg.prompt_lengths,
        ),
        LoadSource.WINDOW,
    )


_last_topology: tuple[TopologySnapshot, hashlib._Hash] | None = None  # see snapshot_digest
_gpu_json: dict[int, tuple[Gpu, bytes]] = {}  # see _hash_topology


def snapshot_digest(topology: TopologySnapshot, load: LoadSnapshot) -> str:
    """A short content hash of a decision's inputs, so live and replay can be compared."""
    # NOTE: orjson serialises (slotted) dataclasses natively, in field order: fast and stable.
    # The hash is of ``orjson.dumps([topology, load])``, fed to the hash in parts: the state
    # after the topology is kept for the next call, since every deployment decided for one
    # trigger shares one topology object.
    global _last_topology
    last = _last_topology
    if last is None or last[0] is not topology:
        last = _last_topology = (topology, _hash_topology(topology))
    digest = last[1].copy()
    digest.update(b"," + orjson.dumps(load) + b"]")
    return digest.hexdigest()[:16]


def _hash_topology(topology: TopologySnapshot) -> hashlib._Hash:
    """A SHA-256 fed ``[`` and ``orjson.dumps(topology)``, each GPU's JSON reused from the last
    call when the snapshot holds the same :class:`Gpu` object (:class:`TopologyBuilder` reuses
    the unchanged ones).

    NOTE: dumping the whole topology at once (~330 kB on 1,000 GPUs: ~2.7 ms, and each copy of
    a buffer that size ~0.4 ms) was a sixth of a forced decision step's CPU; between two steps
    only the GPUs whose records moved are new, and the parts go to the hash without being
    joined.
    """
    global _gpu_json
    known, fresh = _gpu_json, {}
    digest = hashlib.sha256(b"[{")
    for i, f in enumerate(fields(topology)):
        digest.update(b'%s"%s":' % (b"," if i else b"", f.name.encode()))
        if f.name != "gpus":
            digest.update(orjson.dumps(getattr(topology, f.name)))
            continue
        digest.update(b"[")
        for j, gpu in enumerate(topology.gpus):
            hit = known.get(id(gpu))
            if hit is None or hit[0] is not gpu:  # NOTE: the object is kept: its id is not reused
                hit = (gpu, b"," + orjson.dumps(gpu))
            fresh[id(gpu)] = hit
            digest.update(hit[1] if j else hit[1][1:])
        digest.update(b"]")
    digest.update(b"}")
    _gpu_json = fresh
    return digest
