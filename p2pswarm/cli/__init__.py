"""The ``p2pswarm`` command: parse arguments into a NodeConfig and run the node under trio.

Every user error ends as one line on stderr and exit code 1. SIGINT and SIGTERM shut the node
down cleanly (host closed, listeners gone) and exit 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

import trio

from p2pswarm.allocator import imports_without_collections
from p2pswarm.api.client import cmd_generate
from p2pswarm.cli.node_config import config_from_args
from p2pswarm.cli.parser import build_parser
from p2pswarm.cli.status import cmd_ping, cmd_status, format_diloco, format_status, format_swarm
from p2pswarm.demo import run_demo
from p2pswarm.errors import P2PSwarmError, first_error
from p2pswarm.export import cmd_export
from p2pswarm.identity import generate_identity, write_key
from p2pswarm.logs import quiet_libp2p, setup_logging
from p2pswarm.model import catalog
from p2pswarm.model.catalog import MODELS
from p2pswarm.model.tokenizer import cmd_train
from p2pswarm.node.config import NodeConfig
from p2pswarm.run.spec import format_run, format_runs_table, load_run, packaged_runs

__all__ = ["build_parser", "config_from_args", "format_diloco", "format_status", "format_swarm", "main"]

log = logging.getLogger("p2pswarm")

def _print_addrs(addrs: list[str]) -> None:
    for addr in addrs:
        print(addr)
    sys.stdout.flush()


async def _run_until_signalled(config: NodeConfig, run_node) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: run_node(config, on_listening=_print_addrs))
            async for signum in signals:
                log.info("got %s, shutting down", signal.Signals(signum).name)
                nursery.cancel_scope.cancel()
                break


def cmd_models(args: argparse.Namespace) -> int:
    if args.run:
        print(format_run(load_run(args.run)))
        return 0
    tiers = getattr(catalog, "format_tier_table", None)
    print("models: " + ", ".join(MODELS) + "   (NAME/S cuts NAME into S stages)")
    if tiers is not None:
        print("\n" + tiers())
    print("\n" + format_runs_table([load_run(name) for name in packaged_runs()]))
    return 0


def cmd_keygen(args: argparse.Namespace) -> int:
    identity = generate_identity()
    write_key(args.path, identity)
    print(identity.peer_id_text)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    try:
        if args.command == "keygen":
            return cmd_keygen(args)
        if args.command == "status":
            return cmd_status(args)
        if args.command == "ping":
            return cmd_ping(args)
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "models":
            return cmd_models(args)
        if args.command == "export":
            return cmd_export(args)
        if args.command == "tokenizer":
            return cmd_train(args.data, args.vocab, args.out)
        if args.command == "demo":
            return run_demo(args.peers, args.duration, args.dir, stages=args.stages, kill_one=args.kill_one,
                            inner_steps=args.inner_steps, run=args.run, summary=args.summary,
                            rounds=args.rounds, tune=tuple(args.tune))
        config = config_from_args(args)
        with imports_without_collections():  # libp2p's objects live as long as the node (allocator)
            quiet_libp2p(args.log_level)
            # lazy: the node's services import libp2p (and a training peer torch), which --help, keygen,
            # status and every one-line error need not wait for
            from p2pswarm.node.running import run_node
        trio.run(_run_until_signalled, config, run_node)
        return 0
    except BaseException as exc:
        error = first_error(exc)
        if isinstance(error, P2PSwarmError):
            print(f"p2pswarm: error: {error}", file=sys.stderr)
            return 1
        if isinstance(error, KeyboardInterrupt):
            return 130
        raise

