"""The simulated backend of the node agent (``flexpipe agent --backend sim``)."""

from __future__ import annotations

import argparse
import time

from flexpipe.errors import FlexPipeError
from probes.agent import AgentClock
from probes.main import Backends
from sim.cluster import SimCluster, SimGpuSampler, SimLaunchCounter
from sim.scenario import load_scenario, scenario_path


def sim_backends(args: argparse.Namespace) -> Backends:
    """The simulated node agent's sources for ``flexpipe agent --backend sim``: one node of a
    scenario's simulated cluster, on the scenario's (sped-up) clock."""
    scenario = load_scenario(scenario_path(args.scenario))
    if args.node not in {n.name for n in scenario.nodes}:
        known = ", ".join(n.name for n in scenario.nodes)
        raise FlexPipeError(f"--node: {args.node!r} is not in {scenario.name} ({known})")
    cluster = SimCluster(scenario, args.seed)
    clock = AgentClock(
        wall=time.monotonic, origin_s=time.monotonic(), epoch_ms=scenario.epoch_ms, speed=args.speed
    )
    return Backends(SimGpuSampler(cluster, args.node), SimLaunchCounter(cluster, args.node), clock)
