"""`flexpipe agent`: assemble a node agent from its backends and run it until signalled.

``--backend nvml,ebpf`` (the default) runs the hardware backends: NVML is required, eBPF is
enrichment and, when it cannot run, is reported once and exported as ``backend_up 0``.
``--backend sim`` runs one simulated node of a scenario, time-compressed by ``--speed``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, start_http_server

from flexpipe.config import FlexPipeConfig
from flexpipe.errors import FlexPipeError
from flexpipe.kafka import make_producer
from probes.agent import Agent, AgentClock, AgentMetrics
from probes.base import GpuSampler, LaunchCounter
from probes.publisher import BufferedPublisher, PublisherMetrics, cached_partitioner

log = logging.getLogger(__name__)
BACKENDS = {"nvml", "ebpf", "sim"}


@dataclass(frozen=True, slots=True)
class Backends:
    """The sources one agent runs, and the clock they share."""

    sampler: GpuSampler
    launches: LaunchCounter | None
    clock: AgentClock


def parse_backends(text: str) -> frozenset[str]:
    """``"nvml,ebpf"`` → {"nvml", "ebpf"}; unknown names or sim mixed with hardware are errors."""
    names = frozenset(p.strip() for p in text.split(",") if p.strip())
    if not names or names - BACKENDS:
        raise FlexPipeError(f"--backend: choose from nvml, ebpf, sim (got {text!r})")
    if "sim" in names and len(names) > 1:
        raise FlexPipeError("--backend: sim replaces the hardware backends; use it alone")
    return names


OpenSim = Callable[[argparse.Namespace], "Backends"]


def build_backends(
    args: argparse.Namespace, metrics: AgentMetrics, open_sim: OpenSim | None = None
) -> Backends:
    """Open the requested backends; raises FlexPipeError when the GPU sampler cannot run.

    The simulated backend lives with the simulator (:mod:`sim.agent`), which the caller passes
    in as ``open_sim``: the agent itself never imports the simulated world.
    """
    names = parse_backends(args.backend)
    if "sim" in names:
        if open_sim is None:
            raise FlexPipeError("--backend sim: this entry point has no simulated cluster")
        return open_sim(args)
    from probes.nvml import open_nvml_sampler

    sampler, why = open_nvml_sampler(args.node)
    if sampler is None:
        raise FlexPipeError(f"NVML backend unavailable: {why} (use --backend sim to simulate)")
    launches: LaunchCounter | None = None
    if "ebpf" in names:
        from probes.ebpf.counter import open_launch_counter

        launches, why = open_launch_counter(args.node, sampler.gpus_of_pid)
        if launches is None:
            log.warning("eBPF backend off: %s; NVML keeps running", why)
            metrics.backend_up.labels("ebpf").set(0)
    clock = AgentClock(wall=time.time, origin_s=0.0, epoch_ms=0)
    return Backends(sampler, launches, clock)


async def run_agent(
    cfg: FlexPipeConfig, args: argparse.Namespace, open_sim: OpenSim | None = None
) -> int:
    """Run the agent until SIGINT/SIGTERM; flush what the broker takes, report what it did not."""
    registry = CollectorRegistry()
    metrics = AgentMetrics(registry)
    backends = build_backends(args, metrics, open_sim)
    publisher = BufferedPublisher(
        lambda: make_producer(cfg, partitioner=cached_partitioner),
        PublisherMetrics(registry),
        max_buffer=args.max_buffer,
    )
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=args.metrics_addr, registry=registry)
    agent = Agent(
        cfg, args.node, backends.sampler, backends.launches, publisher, metrics, backends.clock,
        batch_per_node=args.batch_per_node,
    )  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if args.duration:
        loop.call_later(args.duration, stop.set)
    print(
        f"agent {args.node}: backends {args.backend}, publishing to {cfg.kafka.bootstrap_servers}"
    )
    await agent.run(stop)
    left = len(publisher)
    print(
        f"agent {args.node}: published {publisher.published}, dropped {publisher.dropped}, "
        f"unsent at exit {left}"
    )
    return 0 if left == 0 else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `flexpipe agent` options."""
    parser.add_argument("--backend", default="nvml,ebpf", help="nvml,ebpf (default) or sim")
    parser.add_argument("--node", default=socket.gethostname(), help="node name (default: host)")
    parser.add_argument("--scenario", default=None, help="sim: scenario file or shipped name")
    parser.add_argument("--seed", type=int, default=7, help="sim: seed (default 7)")
    parser.add_argument("--speed", type=float, default=1.0, help="sim: simulated s per wall s")
    parser.add_argument("--duration", type=float, default=None, help="stop after N wall seconds")
    parser.add_argument("--max-buffer", type=int, default=100_000, help="events kept in outages")
    parser.add_argument("--metrics-port", type=int, default=9400, help="Prometheus port; 0 = off")
    parser.add_argument("--metrics-addr", default="0.0.0.0", help="Prometheus listen address")
    parser.add_argument(
        "--batch-per-node",
        action="store_true",
        help="one message per node per round on the node topic (NodeSamples), not one per GPU",
    )
