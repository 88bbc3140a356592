"""The ``p2pswarm`` command: parse arguments into a NodeConfig and run the node under trio.

Every user error ends as one line on stderr and exit code 1. SIGINT and SIGTERM shut the node
down cleanly (host closed, listeners gone) and exit 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import signal
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import trio

from p2pswarm import __version__
from p2pswarm.api.serve import check_api_exposure, parse_host_port
from p2pswarm.node.config import (DEFAULT_BACKUP_BUDGET_MB, DEFAULT_BOOTSTRAP_LISTEN, DEFAULT_LISTEN, DEFAULT_RELAY_LISTEN,
                             DhtMode, NodeConfig, Role)
from p2pswarm.errors import ConfigError, P2PSwarmError, first_error
from p2pswarm.demo import DEMO_INNER_STEPS
from p2pswarm.run import diloco as dls
from p2pswarm.logs import LOG_FORMATS, quiet_libp2p, setup_logging
from p2pswarm.node.memory import use_system_malloc
from p2pswarm.model import catalog
from p2pswarm.model.catalog import DEFAULT_MODEL, MODELS, parse_layers
from p2pswarm.run.spec import DEFAULT_RUN, RunSpec, format_run, format_runs_table, load_run, packaged_runs, run_for_join
from p2pswarm.model.corpus import data_corpus
from p2pswarm.nat.relay_service import RelayConfig, load_relay_config
from p2pswarm.nat.stun import parse_stun_server
from p2pswarm.net.host import DEFAULT_LIMITS, peer_info_from_multiaddr
from p2pswarm.swarm.device import PRECISIONS, resolve_placement

log = logging.getLogger("p2pswarm")

STATUS_TIMEOUT = 5.0  # seconds to wait for a node's API before saying it is not answering
API_TOKEN_ENV = "P2PSWARM_API_TOKEN"  # --api-token's default: keeps the token out of process listings


def api_token_option(parser: argparse.ArgumentParser, serving: bool = False) -> None:
    """``--api-token``: the token a node's API demands (``serving``) or that a client sends."""
    parser.add_argument("--api-token", default=os.environ.get(API_TOKEN_ENV), metavar="TOKEN",
                        help=("every API request must carry 'Authorization: Bearer TOKEN'; needed to bind --api "
                              "beyond loopback" if serving else "the node's API token") + f" (default ${API_TOKEN_ENV})")


def _node_options(parser: argparse.ArgumentParser, default_listen: str) -> None:
    parser.add_argument("--listen", action="append", metavar="MULTIADDR",
                        help=f"address to listen on, repeatable (default {default_listen})")
    parser.add_argument("--key", type=Path, metavar="PATH",
                        help="Ed25519 key file, created on first use (default DATA_DIR/node.key; "
                             "without --data-dir an ephemeral key)")
    parser.add_argument("--data-dir", type=Path, metavar="DIR", help="where the node keeps its files")
    parser.add_argument("--api", metavar="HOST:PORT",
                        help="serve the HTTP API (status, /v1 completions) here, e.g. 127.0.0.1:8700; a host "
                             "other than loopback needs --api-token")
    api_token_option(parser, serving=True)
    parser.add_argument("--stun", metavar="HOST[:PORT]",
                        help="STUN server (RFC 3489, two IPs for a full answer) to learn the public "
                             "address and NAT type; none by default")
    parser.add_argument("--max-connections", type=int, default=DEFAULT_LIMITS.max_connections, metavar="N",
                        help="peers connected at once, in and out (default %(default)s); beyond it new "
                             "inbound connections are refused until some close")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="p2pswarm",
        description="A peer of a decentralized swarm that trains one language model together.",
        epilog="Quick start: 'p2pswarm demo' runs a whole swarm on this machine.")
    parser.add_argument("--version", action="version", version=f"p2pswarm {__version__}")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--log-format", default="human", choices=LOG_FORMATS,
                        help="human-readable lines or one JSON object per line (stderr)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    keygen = sub.add_parser("keygen", help="write a new Ed25519 key file (mode 0600), print its peer id")
    keygen.add_argument("path", type=Path)

    boot = sub.add_parser("bootstrap", help="run a public bootstrap node (a DHT server)",
                          description="Run a bootstrap node. Prints its dialable multiaddrs on stdout, one per line.")
    _node_options(boot, DEFAULT_BOOTSTRAP_LISTEN)
    boot.add_argument("--bootstrap", action="append", default=[], metavar="MULTIADDR",
                      help="other bootstrap nodes to link with (optional)")

    relay = sub.add_parser("relay", help="run a public circuit relay v2 node (also a DHT server)",
                           description="Run a relay for peers behind NATs (circuit relay v2, with enforced "
                                       "limits). Prints its dialable multiaddrs on stdout, one per line.")
    _node_options(relay, DEFAULT_RELAY_LISTEN)
    relay.add_argument("--bootstrap", action="append", default=[], metavar="MULTIADDR",
                       help="bootstrap nodes to link with (optional)")
    relay.add_argument("--config", type=Path, metavar="relay.toml",
                       help="relay limits (TOML; see relay/relay.toml); built-in defaults without it")

    join = sub.add_parser("join", help="join a swarm and serve one stage of the model's layers",
                          description="Join a swarm through bootstrap peers, announce the stage this "
                                      "peer serves, keep them announced until interrupted.")
    join.add_argument("--bootstrap", action="append", required=True, metavar="MULTIADDR",
                      help="a bootstrap peer's multiaddr ending in /p2p/<peer id>; repeatable")
    _node_options(join, DEFAULT_LISTEN)
    join.add_argument("--run", metavar="NAME|PATH.toml",
                      help=f"the run to train: a packaged run (p2pswarm models lists them) or a run file; every "
                           f"peer of a swarm trains the same run (default {DEFAULT_RUN})")
    join.add_argument("--model", help=f"model to train ({', '.join(MODELS)}) with the default run's settings "
                                      f"(default {DEFAULT_MODEL}; with --run only its own model)")
    join.add_argument("--layers", default="auto", metavar="START:END|auto",
                      help="layer range to serve; auto picks the least-served stage (default)")
    join.add_argument("--data", metavar="PATH",
                      help="training text for stage 0: a file or a folder of text files, streamed (default: "
                           "the Python standard library's sources, embedded, no download)")
    join.add_argument("--threads", type=int, metavar="N",
                      help="torch compute threads (default: all cores; use 1 when several peers share a machine)")
    join.add_argument("--device", default="auto", metavar="auto|cpu|cuda|cuda:N|mps",
                      help="where this peer computes (default auto: the first CUDA GPU if torch sees one, else "
                           "Apple's mps, else the CPU); the weights and optimizer states stay fp32 there")
    join.add_argument("--precision", default="auto", metavar="|".join(PRECISIONS),
                      help="auto (default): bf16 autocast on CUDA (fp32 master weights and AdamW states), fp32 "
                           "on the CPU and mps; bf16 is allowed on the CPU too; fp16 is refused (it needs a "
                           "pipeline-wide loss scale)")
    _diloco_options(join)
    _heal_options(join)
    join.add_argument("--dht-mode", default="auto", choices=[m.value for m in DhtMode],
                      help="Kademlia server or client mode (auto: client until found publicly reachable)")
    join.add_argument("--relay", action="append", default=[], metavar="MULTIADDR",
                      help="a circuit relay v2 to reserve on while this peer is unreachable (behind a NAT); "
                           "repeatable; relays among connected peers are used too")

    status = sub.add_parser("status", help="show a running node's state and the swarm's stage map")
    status.add_argument("--api", required=True, metavar="HOST:PORT", help="the node's status API")
    status.add_argument("--json", action="store_true", help="print the raw JSON")
    api_token_option(status)

    ping = sub.add_parser("ping", help="ask a running node to reach a peer and measure the path",
                          description="Ask the node behind --api to connect to PEER (direct, hole punch or "
                                      "relay), time a round trip and push --bytes over the connection. "
                                      "Exit 1 if the peer cannot be reached.")
    ping.add_argument("peer", help="a peer id (addresses from the stage map) or a multiaddr ending in /p2p/<id>")
    ping.add_argument("--api", required=True, metavar="HOST:PORT", help="the asking node's status API")
    ping.add_argument("--bytes", type=int, default=1024 * 1024, help="bytes to push (default 1 MiB; 0: none)")
    ping.add_argument("--json", action="store_true", help="print the raw JSON")
    api_token_option(ping)
    from p2pswarm.api.client import add_parser as _generate_parser

    _generate_parser(sub, api_token_option)

    demo = sub.add_parser("demo", help="train a model on a local swarm: bootstrap plus peers on loopback",
                          description="Start a bootstrap node and N peers on this machine, spread over the "
                                      "stages of tiny-lm, and show the held-out loss falling as they train.")
    demo.add_argument("--peers", type=int, default=4, help="joining peers to start (default 4)")
    demo.add_argument("--stages", type=int, default=2, help="stages to cut tiny-lm into (default 2: 1, 2, 3, 4 or 8)")
    demo.add_argument("--duration", type=float, default=150.0, help="seconds of training (default 150)")
    demo.add_argument("--kill-one", action="store_true",
                      help="SIGKILL one replica halfway through and restart it 10 s later (it reloads its stage "
                           "from the other replica)")
    demo.add_argument("--inner-steps", type=int, default=DEMO_INNER_STEPS, metavar="H",
                      help="local steps between DiLoCo outer rounds (default 40: a round every ~10-15 s)")
    demo.add_argument("--dir", type=Path, default=None, help="where peers keep keys and logs (default: a temp dir)")
    demo.add_argument("--rounds", type=int, default=None, metavar="N",
                      help="train until the held-out figure of outer round N is in (--duration is then the limit; "
                           "--kill-one kills after round N/2)")
    demo.add_argument("--summary", type=Path, default=None, metavar="PATH",
                      help="also write the run's figures (tokens, rates, held-out by outer round) to PATH as JSON")
    demo.add_argument("--run", metavar="NAME|PATH.toml",
                      help="train this run as it is (its model and [diloco] values; --stages and --inner-steps "
                           "then do not apply); default: tiny-lm with the demo's DiLoCo values")
    _tokenizer_parser(sub)
    from p2pswarm.export import add_parser as _export_parser

    _export_parser(sub)
    models = sub.add_parser("models", help="list the models, their tiers and the packaged runs",
                            description="List the catalog's models with the tier table and the packaged runs "
                                        "(name, model, identity, tokenizer, lr, micro-batch, dtype); with --run, "
                                        "print that one run resolved, with its identity.")
    models.add_argument("--run", metavar="NAME|PATH.toml", help="print this run resolved instead")
    return parser


def _tokenizer_parser(sub) -> None:
    from p2pswarm.model.tokenizer import MAX_BPE_VOCAB, MIN_BPE_VOCAB

    tokenizer = sub.add_parser("tokenizer", help="make a tokenizer for a run file ('tokenizer = PATH')")
    actions = tokenizer.add_subparsers(dest="tokenizer_command", required=True, metavar="ACTION")
    train = actions.add_parser(
        "train", help="train a byte-level BPE tokenizer on local text",
        description="Train a byte-level BPE tokenizer (Hugging Face tokenizers) on the training part of "
                    "--data (the files --data would train on, the held-out part left unseen) and write it "
                    "to OUT.json atomically. Name OUT.json in a run file ('tokenizer = \"OUT.json\"'); "
                    "the first stage-0 start tokenizes the corpus once into shards beside --data.")
    train.add_argument("--data", required=True, metavar="PATH", help="a text file, or a folder of text files")
    train.add_argument("--vocab", required=True, type=int, metavar="N",
                       help=f"vocabulary size, {MIN_BPE_VOCAB}..{MAX_BPE_VOCAB} (the 256 byte symbols, then merges)")
    train.add_argument("out", type=Path, metavar="OUT.json", help="where to write the tokenizer (its folder must exist)")


def _diloco_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("DiLoCo between the replicas of a stage",
                                      "H, outer lr, momentum, codec and aggregator are part of the run: refused "
                                      "with --run (its [diloco] table fixes them)")
    group.add_argument("--inner-steps", type=int, metavar="H",
                       help=f"local optimizer steps between outer rounds (default {dls.INNER_STEPS})")
    group.add_argument("--outer-lr", type=float, help=f"outer learning rate (default {dls.OUTER_LR})")
    group.add_argument("--outer-momentum", type=float, help=f"outer Nesterov momentum (default {dls.OUTER_MOMENTUM})")
    group.add_argument("--codec", choices=dls.CODECS,
                       help=f"pseudo-gradients on the wire (default {dls.CODEC}: per-chunk scales)")
    group.add_argument("--aggregator", choices=dls.AGGREGATORS,
                       help=f"how the replicas' pseudo-gradients are combined (default {dls.AGGREGATOR})")
    group.add_argument("--no-verify", dest="verify", action="store_false",
                       help="do not check each contribution against the others before combining")
    group.add_argument("--gather", type=float, default=dls.GATHER_S, metavar="SEC",
                       help=f"how long a ready replica waits for the others (default {dls.GATHER_S:.0f} s)")
    group.add_argument("--snapshot-period", type=float, default=dls.SNAPSHOT_PERIOD, metavar="SEC",
                       help=f"seconds between snapshots in --data-dir (default {dls.SNAPSHOT_PERIOD:.0f}; "
                            "the last 5 are kept)")


def _heal_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("self-healing", "moving to an under-served stage, holding other stages' backups")
    group.add_argument("--rebalance", action=argparse.BooleanOptionalAction, default=None,
                       help="move to an under-served or down stage at runtime (default: on with --layers auto, "
                            "off with a pinned --layers; off, this peer announces itself pinned and never moves)")
    group.add_argument("--backup-budget-mb", type=int, default=DEFAULT_BACKUP_BUDGET_MB, metavar="MB",
                       help="disk for the backups of other stages this peer holds (default %(default)s)")


def _join_run(args: argparse.Namespace) -> tuple[RunSpec, dls.DilocoSettings]:
    """The run ``join`` trains (``run.run_for_join``) and the DiLoCo settings: its agreed values, our local ones."""
    agreed = {"inner_steps": args.inner_steps, "outer_lr": args.outer_lr, "momentum": args.outer_momentum,
              "codec": args.codec, "aggregator": args.aggregator}
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
        peer_info_from_multiaddr(addr)  # ConfigError unless it ends in /p2p/<peer id>: before torch is imported
    default_listen = {Role.BOOTSTRAP: DEFAULT_BOOTSTRAP_LISTEN, Role.RELAY: DEFAULT_RELAY_LISTEN}.get(role, DEFAULT_LISTEN)
    kwargs = dict(role=role, listen=tuple(args.listen or [default_listen]), bootstrap=tuple(args.bootstrap),
                  key_path=args.key, data_dir=args.data_dir, api=args.api, api_token=args.api_token,
                  stun=parse_stun_server(args.stun) if args.stun else None, max_connections=args.max_connections)
    if role is Role.RELAY:
        kwargs.update(relay=load_relay_config(args.config) if args.config else RelayConfig())
    if role is Role.JOIN:
        run, diloco = _join_run(args)
        model = run.spec()
        for relay in args.relay:
            peer_info_from_multiaddr(relay)  # ConfigError unless it ends in /p2p/<peer id>
        if args.threads is not None and args.threads < 1:
            raise ConfigError(f"--threads must be at least 1, not {args.threads}")
        if args.data is not None:
            data_corpus(args.data)  # ConfigError (one line) for a missing, empty or binary-only path
        if args.backup_budget_mb < 0:
            raise ConfigError(f"--backup-budget-mb must be at least 0, not {args.backup_budget_mb}")
        layers = parse_layers(args.layers, model)
        placement = resolve_placement(args.device, args.precision)  # ConfigError: a device we lack, fp16 (imports torch)
        kwargs.update(rebalance=layers is None if args.rebalance is None else args.rebalance,
                      backup_budget_mb=args.backup_budget_mb)
        kwargs.update(model=model.name, layers=layers, dht_mode=DhtMode(args.dht_mode),
                      relays=tuple(args.relay), data=args.data, threads=args.threads,
                      device=placement.device, precision=placement.precision,
                      diloco=diloco, run=run)
    return NodeConfig(**kwargs)


def _print_addrs(addrs: list[str]) -> None:
    for addr in addrs:
        print(addr)
    sys.stdout.flush()


async def _run_until_signalled(config: NodeConfig) -> None:
    from p2pswarm.node import run_node

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
    from p2pswarm.identity import generate_identity, write_key

    identity = generate_identity()
    write_key(args.path, identity)
    print(identity.peer_id_text)
    return 0


def _get_json(api: str, path: str, timeout: float = STATUS_TIMEOUT, token: str | None = None) -> dict:
    host, port = parse_host_port(api)
    token = token or os.environ.get(API_TOKEN_ENV)
    request = urllib.request.Request(f"http://{host}:{port}{path}",
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:  # the node answered: a bad request or an unreachable peer
        try:
            reason = json.load(exc).get("error", exc.reason)
        except (ValueError, OSError, AttributeError):
            reason = exc.reason
        raise ConfigError(str(reason.get("message", reason) if isinstance(reason, dict) else reason)) from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ConfigError(f"no p2pswarm node answers at {api}: {getattr(exc, 'reason', exc)}") from None


def _stage(stats: dict) -> str:
    layers = stats.get("layers")
    return f"{stats['stage']} (layers [{layers[0]}, {layers[1]}))" if layers else "none"


def _stun(stats: dict) -> str:
    stun = stats.get("stun")
    if not stun:
        return "not asked"
    public = stun["public"] or "no public address"
    return f"{stun['nat_type']}, {public}"


def _inbound(stats: dict) -> str:
    inbound = stats.get("inbound_connections")
    if not inbound:
        return ""
    return (f"   inbound {inbound['open']}/{inbound['limit']} open, {inbound['accepted']} accepted, "
            f"{inbound['refused']} refused at the limit")


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def format_swarm(swarm: dict) -> list[str]:
    """The training lines of ``status``, from ``/api/swarm``."""
    engine, delivery, counts = swarm["engine"], swarm["delivery"], swarm["counts"]
    return [
        f"training      step {swarm['step']}  {swarm['tokens']} tokens  {swarm['tokens_per_s']:.0f} tok/s  "
        f"held-out {_fmt(swarm['heldout_bpb'])} bits/byte  train {_fmt(swarm['train_loss_bpb'])}"
        f"{'  NOT TRAINING: ' + swarm['blocked'] if swarm.get('blocked') else ''}",
        f"engine        busy {engine['busy_fraction']:.1%}  local-only {engine['local_only']}  drops "
        f"{engine['drops']}  in flight {swarm['in_flight']}  inbound {swarm['inbound']['items']}/"
        f"{swarm['inbound']['capacity']} (mean fill {swarm['inbound']['mean_fill']:.1%})",
        f"delivery      sent {delivery.get('sent', 0)}  acked {delivery.get('acked', 0)}  busy {delivery.get('busy', 0)}"
        f"  failovers {delivery.get('rerouted', 0)} (p50 {_fmt(delivery.get('failover_ms_p50'), '.0f')} ms)  lost "
        f"{delivery.get('lost', 0)}  timeouts {delivery.get('timeouts', 0)}  duplicates dropped "
        f"{counts.get('duplicates_dropped', 0)}  ack p50/p99 {_fmt(delivery.get('ack_ms_p50'), '.0f')}/"
        f"{_fmt(delivery.get('ack_ms_p99'), '.0f')} ms  garbage frames {counts.get('garbage_frames', 0)}",
        *(_link_line(peer, doc) for peer, doc in swarm["router"]["peers"].items()),
    ]


def _link_line(peer: str, doc: dict) -> str:
    """One next-stage peer as the router sees it: path, deadline in force, throughput, window."""
    rate = doc.get("throughput_mbit_s")
    slow = f"  SLOW: {doc['slow']}" if doc.get("slow") else ""
    return (f"  -> {peer[-8:]}  stage {doc['stage']}  {'relayed' if doc['relayed'] else 'direct'}"
            f"{'' if doc['live'] else ' (backed off)'}  deadline {_fmt(doc.get('deadline_ms'), '.0f')} ms  "
            f"throughput {'-' if rate is None else f'{rate:.1f} Mbit/s'}  window {doc.get('window', 0):.1f} "
            f"({doc.get('on_the_way', 0)} on the way){slow}")


def format_diloco(doc: dict) -> list[str]:
    """The DiLoCo lines of ``status``, from ``/api/diloco``."""
    last = doc.get("last_round")
    rejected = sum(doc.get("rejected_contributions", {}).values())
    lines = [f"diloco        outer round {doc['outer_round']} ({doc['phase']})  inner step "
             f"{doc['inner_steps_this_round']}/{doc['inner_steps_per_round']} of this round  sent "
             f"{doc['bytes_sent'] / 1e6:.1f} MB  received {doc['bytes_received'] / 1e6:.1f} MB  rejected {rejected}  "
             f"communicating {doc['communicating_s']:.0f} s / computing {doc['computing_s']:.0f} s"]
    if last:
        lines.append(f"last round    {last['round']}: {len(last['members'])} replica(s) "
                     f"({', '.join(m[-8:] for m in last['members'])}), {last['seconds']:.1f} s, "
                     f"{len(last['missing_shards'])} shard(s) missing")
    if doc.get("loaded_from"):
        source = doc["loaded_from"].get("peer") or doc["loaded_from"].get("file")
        lines.append(f"loaded from   {source[-40:]} (outer round {doc['loaded_from']['round']})")
    return lines


def format_status(stats: dict, stages: dict, swarm: dict | None = None, diloco: dict | None = None) -> str:
    lines = [
        f"peer          {stats['peer_id']}  ({stats['role']}, p2pswarm {stats['version']})",
        f"addresses     {', '.join(stats['addrs']) or '-'}",
        f"reachability  {stats['reachability']}   DHT mode {stats['dht_mode']}   NAT (STUN) {_stun(stats)}",
        f"connected     {len(stats['connected_peers'])} peer(s)   routing table {stats['routing_table_size']}"
        f"{_inbound(stats)}",
        f"serving       {stats['model']} stage {_stage(stats)}   uptime {stats['uptime_s']:.0f} s",
        f"stage map     {stages['model']}, {stages['n_layers']} layers in {stages['n_stages']} stages",
    ]
    relay = stats.get("relay")
    if relay:
        refused = ", ".join(f"{reason} {n}" for reason, n in sorted(relay["refused"].items())) or "none"
        lines.insert(5, f"relay         {relay['reservations_active']} reservation(s), "
                        f"{relay['circuits_active']} circuit(s) active; refused: {refused}")
    if stats.get("relays"):
        held = ", ".join(f"{r['peer'][-8:]} ({r['expires_in_s']:.0f} s)" for r in stats["relays"])
        lines.insert(5, f"relays        {held}; {len(stats.get('circuit_addrs', []))} circuit address(es)")
    blocked = stages.get("health", {}).get("blocked")
    if blocked:
        lines.append(f"blocked:      {blocked}")
    for stage, doc in stages["stages"].items():
        peers = ", ".join(f"{r['peer_id'][-8:]} (queue {r['queue_depth']}{', answered' if r.get('answered') else ''})"
                          for r in doc["peers"]) or "(nobody)"
        served = f"{doc['health']}, {doc['replicas']} replica(s)" if "health" in doc else f"{len(doc['peers'])} peer(s)"
        lines.append(f"  stage {int(stage):>3}  layers [{doc['start']}, {doc['end']})  {served}  {peers}{_backups(doc)}")
    if swarm:
        lines[5:5] = format_swarm(swarm) + (format_diloco(diloco) if diloco else [])
    return "\n".join(lines)


def _backups(stage: dict) -> str:
    """A stage's backup holders, the freshest first: "  backups: 2 (round 7, 0 behind, 40 s old)"."""
    if "backups" not in stage:  # a node from before backups
        return ""
    backups = stage["backups"]
    if not backups:
        return "  backups: 0"
    best = backups[0]
    behind = "" if best["rounds_behind"] is None else f", {best['rounds_behind']} behind"
    age = "" if best["age_s"] is None else f", {best['age_s']:.0f} s old"
    return f"  backups: {len(backups)} (round {best['round']}{behind}{age})"


def cmd_status(args: argparse.Namespace) -> int:
    get = functools.partial(_get_json, args.api, token=args.api_token)
    stats, stages = get("/api/stats"), get("/api/stages")
    joined = stats.get("role") == "join"
    swarm = get("/api/swarm") if joined else None
    diloco = get("/api/diloco") if joined else None
    if args.json:
        print(json.dumps({"stats": stats, "stages": stages, "swarm": swarm, "diloco": diloco}, indent=1,
                         sort_keys=True))
    else:
        print(format_status(stats, stages, swarm, diloco))
    return 0


def format_ping(doc: dict) -> str:
    rate = f", {doc['mib_per_s']} MiB/s" if doc["mib_per_s"] is not None else ""
    return (f"{doc['peer']}: reached by {doc['method']} in {doc['connect_ms']} ms, round trip {doc['rtt_ms']} ms, "
            f"first byte after {doc['first_byte_ms']} ms; {doc['bytes']} bytes in {doc['transfer_ms']} ms{rate}; "
            f"path now {doc['path']}")


def cmd_ping(args: argparse.Namespace) -> int:
    from p2pswarm.net.probe import PROBE_TIMEOUT

    query = urllib.parse.urlencode({"peer": args.peer, "bytes": args.bytes})
    doc = _get_json(args.api, f"/api/ping?{query}", timeout=PROBE_TIMEOUT + STATUS_TIMEOUT, token=args.api_token)
    print(json.dumps(doc, indent=1, sort_keys=True) if args.json else format_ping(doc))
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
            from p2pswarm.api.client import cmd_generate

            return cmd_generate(args)
        if args.command == "models":
            return cmd_models(args)
        if args.command == "export":
            from p2pswarm.export import cmd_export

            return cmd_export(args)
        if args.command == "tokenizer":
            from p2pswarm.model.tokenizer import cmd_train

            return cmd_train(args.data, args.vocab, args.out)
        if args.command == "demo":
            from p2pswarm.demo import run_demo

            return run_demo(args.peers, args.duration, args.dir, stages=args.stages, kill_one=args.kill_one,
                            inner_steps=args.inner_steps, run=args.run, summary=args.summary,
                            rounds=args.rounds)
        config = config_from_args(args)
        if argv is None:  # run as the program (not called from Python): memory that comes back
            use_system_malloc(sys.argv[1:])
        quiet_libp2p(args.log_level)
        trio.run(_run_until_signalled, config)
        return 0
    except BaseException as exc:  # noqa: BLE001 - the one place errors become exit codes
        error = first_error(exc)
        if isinstance(error, P2PSwarmError):
            print(f"p2pswarm: error: {error}", file=sys.stderr)
            return 1
        if isinstance(error, KeyboardInterrupt):
            return 130
        raise
