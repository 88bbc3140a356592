"""A node's command line into its NodeConfig, every user error a ConfigError (one line, exit 1)."""

from __future__ import annotations

import argparse
import dataclasses

from p2pswarm.api.serve import check_api_exposure
from p2pswarm.errors import ConfigError
from p2pswarm.model.catalog import parse_layers
from p2pswarm.model.corpus import data_corpus
from p2pswarm.nat.relay_service import RelayConfig, load_relay_config
from p2pswarm.nat.stun import parse_stun_server
from p2pswarm.net.host import check_peer_multiaddr
from p2pswarm.node.config import (
    DEFAULT_BOOTSTRAP_LISTEN,
    DEFAULT_LISTEN,
    DEFAULT_RELAY_LISTEN,
    DhtMode,
    NodeConfig,
    Role,
)
from p2pswarm.run import diloco as dls
from p2pswarm.run.placement import resolve_placement
from p2pswarm.run.spec import RunSpec, run_for_join
from p2pswarm.run.training import Training
from p2pswarm.run.tunables import parse_tunables


def _join_run(args: argparse.Namespace) -> tuple[RunSpec, dls.DilocoSettings]:
    """The run ``join`` trains (``run.run_for_join``) and the DiLoCo settings: its agreed values, our local ones."""
    agreed = {"inner_steps": args.inner_steps, "outer_lr": args.outer_lr, "momentum": args.outer_momentum,
              "codec": args.codec, "aggregator": args.aggregator, "fragments": args.fragments}
    local = dls.DilocoSettings(verify=args.verify, gather_s=args.gather, snapshot_period=args.snapshot_period)
    problem = dataclasses.replace(local, **{k: v for k, v in agreed.items() if v is not None}).problem()
    if problem:
        raise ConfigError(problem)
    run = run_for_join(args.run, args.model, agreed)
    return run, run.diloco(local)


def config_from_args(args: argparse.Namespace) -> NodeConfig:
    role = Role(args.command)
    if args.api:
        check_api_exposure(args.api, args.api_token)  # ConfigError before the node listens and prints its addresses
    if args.max_connections < 1:
        raise ConfigError(f"--max-connections must be at least 1, not {args.max_connections}")
    for addr in args.bootstrap:
        check_peer_multiaddr(addr)  # ConfigError unless it ends in /p2p/<peer id>: before libp2p is imported
    default_listen = {Role.BOOTSTRAP: DEFAULT_BOOTSTRAP_LISTEN,
                      Role.RELAY: DEFAULT_RELAY_LISTEN}.get(role, DEFAULT_LISTEN)
    kwargs = dict(role=role, listen=tuple(args.listen or [default_listen]), bootstrap=tuple(args.bootstrap),
                  key_path=args.key, data_dir=args.data_dir, api=args.api, api_token=args.api_token,
                  stun=parse_stun_server(args.stun) if args.stun else None, max_connections=args.max_connections)
    if role is Role.RELAY:
        kwargs.update(relay=load_relay_config(args.config) if args.config else RelayConfig())
    if role is Role.JOIN:
        run, diloco = _join_run(args)
        model = run.spec()
        for relay in args.relay:
            check_peer_multiaddr(relay)  # ConfigError unless it ends in /p2p/<peer id>
        if args.threads is not None and args.threads < 1:
            raise ConfigError(f"--threads must be at least 1, not {args.threads}")
        if args.data is not None:
            data_corpus(args.data)  # ConfigError (one line) for a missing, empty or binary-only path
        if args.backup_budget_mb < 0:
            raise ConfigError(f"--backup-budget-mb must be at least 0, not {args.backup_budget_mb}")
        layers = parse_layers(args.layers, model)
        # ConfigError: a device we lack, fp16 (imports torch)
        placement = resolve_placement(args.device, args.precision)
        kwargs.update(rebalance=layers is None if args.rebalance is None else args.rebalance,
                      backup_budget_mb=args.backup_budget_mb)
        kwargs.update(layers=layers, dht_mode=DhtMode(args.dht_mode), relays=tuple(args.relay), data=args.data,
                      threads=args.threads, training=Training(run, diloco, placement, parse_tunables(args.tune)))
    return NodeConfig(**kwargs)
