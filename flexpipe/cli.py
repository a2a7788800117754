"""The `flexpipe` command: one entry point, one validated config, subcommands per component.

Every subcommand loads the configuration once here and hands it down; any FlexPipeError ends as one
line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Sequence

from flexpipe.config import FlexPipeConfig, load_config
from flexpipe.errors import FlexPipeError

Handler = Callable[[argparse.Namespace, FlexPipeConfig], int]


def _kafka(args: argparse.Namespace, cfg: FlexPipeConfig) -> int:
    from flexpipe.kafka_local import LocalKafka

    local = LocalKafka(cfg.local_kafka, name=args.name)
    if args.action == "up":
        print(f"kafka up: {local.up(fresh=args.fresh)} (log {local.log})")
    elif args.action == "down":
        print("kafka down: stopped" if local.down() else "kafka down: was not running")
    elif args.action == "jars":
        print(f"kafka jars: {local.ensure_jars()}")
    else:
        st = local.status()
        state = f"running pid {st.pid} on {st.bootstrap}" if st.running else "not running"
        print(f"kafka status: {state} (run dir {st.run_dir})")
        return 0 if st.running else 1
    return 0


def _topics(args: argparse.Namespace, cfg: FlexPipeConfig) -> int:
    from flexpipe.kafka import create_topics

    created = asyncio.run(create_topics(cfg))
    print("topics created: " + (", ".join(created) if created else "none (all existed)"))
    return 0


def _sim(args: argparse.Namespace, cfg: FlexPipeConfig) -> int:
    from sim.run import run_sim_publish

    return asyncio.run(run_sim_publish(cfg, args))


def _agent(args: argparse.Namespace, cfg: FlexPipeConfig) -> int:
    from flexpipe.kafka import bootstrap_servers, with_bootstrap
    from probes.main import parse_backends, run_agent

    open_sim = None
    if "sim" in parse_backends(args.backend):
        from sim.agent import sim_backends

        open_sim = sim_backends
    return asyncio.run(run_agent(with_bootstrap(cfg, bootstrap_servers(cfg)), args, open_sim))


def _run(args: argparse.Namespace, cfg: FlexPipeConfig) -> int:
    from sim.run import run_main_job

    return asyncio.run(run_main_job(cfg, args))


def _up(args: argparse.Namespace, cfg: FlexPipeConfig) -> int:
    from sim.up import run_up

    return asyncio.run(run_up(cfg, args))


def _runtime(args: argparse.Namespace, cfg: FlexPipeConfig) -> int:
    from runtime.cli import run_worker

    return asyncio.run(run_worker(cfg, args))


def _streams(args: argparse.Namespace, cfg: FlexPipeConfig) -> int:
    from streams.worker import run_worker

    return run_worker(cfg, args.worker_id)


def _audit(args: argparse.Namespace, cfg: FlexPipeConfig) -> int:
    from streams.audit import run_audit

    return run_audit(args, cfg)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="flexpipe",
        description="FlexPipe: gear-shifting LLM inference on fragmented GPU clusters.",
    )
    parser.add_argument("--config", help="YAML config file (default $FLEXPIPE_CONFIG)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("kafka", help="manage the local single-node Kafka (KRaft)")
    p.add_argument("action", choices=["up", "down", "status", "jars"])
    p.add_argument("--name", default="default", help="run directory name (default: default)")
    p.add_argument("--fresh", action="store_true", help="wipe the broker's data before starting")
    p.set_defaults(handler=_kafka)

    p = sub.add_parser("topics", help="create FlexPipe's topics (idempotent)")
    p.add_argument("action", choices=["create"])
    p.set_defaults(handler=_topics)

    p = sub.add_parser("agent", help="run a node agent (NVML + eBPF, or simulated)")
    from probes.main import add_arguments

    add_arguments(p)
    p.set_defaults(handler=_agent)

    for name, handler, text in (
        ("sim", _sim, "publish a simulated fragmented cluster's telemetry to Kafka"),
        ("run", _run, "the main job: local Kafka, simulated cluster, live per-block view"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("--scenario", default=None, help="scenario YAML (default: seed-fragmented)")
        p.add_argument("--seed", type=int, default=7, help="simulation seed (default 7)")
        p.add_argument("--speed", type=float, default=None, help="simulated s per wall s")
        p.add_argument("--duration", type=float, default=None, help="simulated seconds to run")
        p.set_defaults(handler=handler)
    p = sub.add_parser("up", help="the whole loop on a simulated cluster (what `make run` runs)")
    p.add_argument("--scenario", default=None, help="scenario YAML (default: demo-shift)")
    p.add_argument("--seed", type=int, default=7, help="simulation seed (default 7)")
    p.add_argument("--speed", type=float, default=None, help="simulated s per wall s")
    p.add_argument("--duration", type=float, default=None, help="simulated seconds to run")
    p.add_argument("--out", default="out", help="report directory (default out/)")
    p.add_argument(
        "--chaos",
        action="store_true",
        help="on a broker of its own: SIGKILL the stream worker once (and restart it), stop the"
        " broker for 10 s during a shift; the invariants must still hold",
    )
    p.add_argument(
        "--keep-topics",
        action="store_true",
        help="keep the run's topics on the broker (default: deleted once read back), e.g. to"
        " audit its decisions afterwards with `flexpipe audit`",
    )
    p.add_argument(
        "--engine",
        choices=["sim", "torch"],
        default="sim",
        help="sim: SimEngine (default); torch: the torch reference engine on CPU, a small model,"
        " requests cut to a few dozen tokens (see sim/torchup.py)",
    )
    p.set_defaults(handler=_up)

    from runtime.flags import add_arguments as add_runtime_arguments

    p = sub.add_parser("runtime", help="a runtime worker: transitions, routing, HTTP API")
    add_runtime_arguments(p)
    p.set_defaults(handler=_runtime)

    p = sub.add_parser("streams", help="run a stream-processing worker (telemetry → decisions)")
    p.add_argument("action", choices=["worker"])
    p.add_argument("--worker-id", default=None, help="names this worker in decisions")
    p.set_defaults(handler=_streams)

    p = sub.add_parser("audit", help="decisions for a person: tail them, or replay offline")
    p.add_argument("action", choices=["tail", "replay"])
    p.add_argument("--from-beginning", action="store_true", help="tail: from the first decision")
    p.add_argument("--deployment", default=None, help="tail: only this deployment")
    p.add_argument("--limit", type=int, default=None, help="tail: stop after N decisions")
    p.add_argument("--idle-exit-s", type=float, default=None, help="tail: stop when idle S s")
    p.add_argument("--json", action="store_true", help="tail: print the raw JSON envelopes")
    p.set_defaults(handler=_audit)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `flexpipe` console script."""
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args.config)
        code: int = args.handler(args, cfg)
        return code
    except FlexPipeError as exc:
        print(f"flexpipe {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
