"""The ``p2pswarm`` command's arguments: every subcommand and option, with its help."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from p2pswarm import __version__
from p2pswarm.api.client import API_TOKEN_ENV
from p2pswarm.api.client import add_parser as add_generate_parser
from p2pswarm.demo import DEMO_INNER_STEPS
from p2pswarm.export import add_parser as add_export_parser
from p2pswarm.logs import LOG_FORMATS
from p2pswarm.model.catalog import DEFAULT_MODEL, MODELS
from p2pswarm.model.tokenizer import MAX_BPE_VOCAB, MIN_BPE_VOCAB
from p2pswarm.net.host import DEFAULT_LIMITS
from p2pswarm.node.config import (
    DEFAULT_BACKUP_BUDGET_MB,
    DEFAULT_BOOTSTRAP_LISTEN,
    DEFAULT_LISTEN,
    DEFAULT_RELAY_LISTEN,
    DhtMode,
)
from p2pswarm.run import diloco as dls
from p2pswarm.run.placement import PRECISIONS
from p2pswarm.run.spec import DEFAULT_RUN
from p2pswarm.run.tunables import Tunables


def api_token_option(parser: argparse.ArgumentParser, serving: bool = False) -> None:
    """``--api-token``: the token a node's API demands (``serving``) or that a client sends."""
    parser.add_argument("--api-token", default=os.environ.get(API_TOKEN_ENV), metavar="TOKEN",
                        help=("every API request must carry 'Authorization: Bearer TOKEN'; needed to bind --api "
                              "beyond loopback" if serving else "the node's API token")
                        + f" (default ${API_TOKEN_ENV})")


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

    _add_keygen(sub)
    _add_bootstrap(sub)
    _add_relay(sub)
    _add_join(sub)
    _add_status_and_ping(sub)
    add_generate_parser(sub, api_token_option)

    _add_demo(sub)
    _tokenizer_parser(sub)
    add_export_parser(sub, api_token_option)
    _add_models(sub)
    return parser


def _add_keygen(sub: argparse._SubParsersAction) -> None:
    """``keygen PATH``."""
    keygen = sub.add_parser("keygen", help="write a new Ed25519 key file (mode 0600), print its peer id")
    keygen.add_argument("path", type=Path)


def _add_bootstrap(sub: argparse._SubParsersAction) -> None:
    """``bootstrap``: a public DHT server."""
    boot = sub.add_parser("bootstrap", help="run a public bootstrap node (a DHT server)",
                          description="Run a bootstrap node. Prints its dialable multiaddrs on stdout, one per line.")
    _node_options(boot, DEFAULT_BOOTSTRAP_LISTEN)
    boot.add_argument("--bootstrap", action="append", default=[], metavar="MULTIADDR",
                      help="other bootstrap nodes to link with (optional)")


def _add_relay(sub: argparse._SubParsersAction) -> None:
    """``relay``: a public circuit relay v2."""
    relay = sub.add_parser("relay", help="run a public circuit relay v2 node (also a DHT server)",
                           description="Run a relay for peers behind NATs (circuit relay v2, with enforced "
                                       "limits). Prints its dialable multiaddrs on stdout, one per line.")
    _node_options(relay, DEFAULT_RELAY_LISTEN)
    relay.add_argument("--bootstrap", action="append", default=[], metavar="MULTIADDR",
                       help="bootstrap nodes to link with (optional)")
    relay.add_argument("--config", type=Path, metavar="relay.toml",
                       help="relay limits (TOML; see relay/relay.toml); built-in defaults without it")


def _add_join(sub: argparse._SubParsersAction) -> None:
    """``join``: a training peer."""
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
    tune_option(join)
    join.add_argument("--dht-mode", default="auto", choices=[m.value for m in DhtMode],
                      help="Kademlia server or client mode (auto: client until found publicly reachable)")
    join.add_argument("--relay", action="append", default=[], metavar="MULTIADDR",
                      help="a circuit relay v2 to reserve on while this peer is unreachable (behind a NAT); "
                           "repeatable; relays among connected peers are used too")


def _add_status_and_ping(sub: argparse._SubParsersAction) -> None:
    """``status`` and ``ping``: ask a running node."""
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


def _add_demo(sub: argparse._SubParsersAction) -> None:
    """``demo``: a whole swarm on this machine."""
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
    tune_option(demo)


def _add_models(sub: argparse._SubParsersAction) -> None:
    """``models``: the catalog and the packaged runs."""
    models = sub.add_parser("models", help="list the models, their tiers and the packaged runs",
                            description="List the catalog's models with the tier table and the packaged runs "
                                        "(name, model, identity, tokenizer, lr, micro-batch, dtype); with --run, "
                                        "print that one run resolved, with its identity.")
    models.add_argument("--run", metavar="NAME|PATH.toml", help="print this run resolved instead")


def tune_option(parser: argparse.ArgumentParser) -> None:
    """``--tune KEY=VALUE``: a knob of this peer that benches and tests turn (``run.tunables``)."""
    keys = ", ".join(f.name for f in dataclasses.fields(Tunables))
    parser.add_argument("--tune", action="append", default=[], metavar="KEY=VALUE",
                        help=f"a benchmark's or test's knob, repeatable; not part of the run ({keys}); "
                             "a real peer leaves them at their defaults")


def _tokenizer_parser(sub) -> None:
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
    train.add_argument("out", type=Path, metavar="OUT.json",
                       help="where to write the tokenizer (its folder must exist)")


def _diloco_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("DiLoCo between the replicas of a stage",
                                      "H, outer lr, momentum, codec, aggregator and fragments are part of the run: "
                                      "refused "
                                      "with --run (its [diloco] table fixes them)")
    group.add_argument("--inner-steps", type=int, metavar="H",
                       help=f"local optimizer steps between outer rounds (default {dls.INNER_STEPS})")
    group.add_argument("--outer-lr", type=float, help=f"outer learning rate (default {dls.OUTER_LR})")
    group.add_argument("--outer-momentum", type=float, help=f"outer Nesterov momentum (default {dls.OUTER_MOMENTUM})")
    group.add_argument("--codec", choices=dls.CODECS,
                       help=f"pseudo-gradients on the wire (default {dls.CODEC}: per-chunk scales; sparse: the top "
                            "1.56 %% of each chunk at 2 bits, with --aggregator chunk_clip or mean)")
    group.add_argument("--aggregator", choices=dls.AGGREGATORS,
                       help=f"how the replicas' pseudo-gradients are combined (default {dls.AGGREGATOR}; chunk_clip: "
                            "the mean, each chunk clipped to the members' median scale, for --codec sparse)")
    group.add_argument("--fragments", type=int, metavar="F",
                       help="Streaming DiLoCo: a round every H/F inner steps synchronises one of F pieces of the "
                            "stage, 1/F of the bytes each (default 1: the whole stage every H steps)")
    group.add_argument("--no-verify", dest="verify", action="store_false",
                       help="do not check each contribution against the others before combining")
    group.add_argument("--gather", type=float, default=dls.GATHER_S, metavar="SEC",
                       help=f"how long a ready replica waits for the others (default {dls.GATHER_S:.0f} s; "
                            "half of its own last round where that is longer)")
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
