"""``p2pswarm export``: the swarm's model as a Hugging Face directory (``model.hf_export`` writes it).

Two sources of the stages' snapshots:

- ``--api HOST:PORT``: a running node's status API names the model, the run and the stage map
  (``/api/stats``, ``/api/stages``; ``/api/swarm`` for the tokens and the held-out figure when the
  node trains the last stage, which measures it). An ephemeral libp2p host of our own then fetches
  each stage's newest snapshot from a live replica over ``/p2pswarm/snapshot/1.0.0``, the replica
  with the highest outer round first, the next one when it fails.
- ``--snapshots DIR...``: snapshot files on disk. A DIR is a stage's snapshot directory
  (``DATA_DIR/snapshots/<model>-<run>-stage<N>``: its newest snapshot that loads), a folder of such
  directories (``DATA_DIR/snapshots``), or one snapshot file.

The tokenizer comes from the run: ``--run NAME|PATH.toml``, else the packaged run of the stages'
identity, else the byte-level tokenizer when the vocabulary is 256 (a BPE run has more). Every
failure is one ``ConfigError`` line and exit 1 (``cli.main``); progress goes to stderr.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import trio

from p2pswarm.api.client import get_json
from p2pswarm.dht.records import FLAG_SNAPSHOT
from p2pswarm.diloco.snapshots import fetch_snapshot
from p2pswarm.errors import ConfigError, DialError, ProtocolError
from p2pswarm.identity import generate_identity
from p2pswarm.logs import quiet_libp2p
from p2pswarm.model import hf_export
from p2pswarm.model.hf_export import MAX_ROUND_SPREAD, Card, StageSnapshot
from p2pswarm.model.tokenizer import BYTE_VOCAB
from p2pswarm.net.connect import Connector
from p2pswarm.net.host import open_host
from p2pswarm.net.pool import StreamPool
from p2pswarm.run.spec import BYTES_TOKENIZER, RunSpec, load_run, packaged_runs

EPHEMERAL_LISTEN = "/ip4/127.0.0.1/tcp/0"  # the exporter only dials out: a loopback port it never announces
SNAPSHOT_FILE = re.compile(r"snapshot-(\d+)-r(\d+)-s(\d+)\.\w+")  # checkpoint.SnapshotStore's names
STAGE_DIR = re.compile(r"(?P<model>.+)-(?P<run>[0-9a-f]{16})-stage(?P<stage>\d+)")  # node.py's snapshot dirs
MB = 1e6
RULE = (f"The stages must be every stage of one model of one run, with outer rounds within {MAX_ROUND_SPREAD} of "
        "each other (the stages of a swarm run their rounds at about the same inner steps); otherwise the "
        "export stops with one line and exit 1.")


def add_parser(sub, token_option) -> None:
    """The ``export`` subcommand's arguments (registered by ``cli.build_parser``, which gives ``--api-token``)."""
    parser = sub.add_parser(
        "export", help="write the swarm's model as a Hugging Face directory (transformers loads it)",
        description="Collect every stage's agreed weights (DiLoCo's, of the latest outer round) from the swarm "
                    "(--api) or from snapshot files (--snapshots) and write DIR: config.json, model.safetensors "
                    "(sharded beyond 5 GB), generation_config.json, tokenizer files and a model card. " + RULE +
                    " DIR is written beside itself and renamed: a failed export leaves nothing half-written.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--api", metavar="HOST:PORT", help="a running node's status API: fetch from live replicas")
    source.add_argument("--snapshots", nargs="+", type=Path, metavar="DIR",
                        help="stage snapshot directories (DATA_DIR/snapshots/...-stageN), a folder of them, "
                             "or snapshot files: the newest loadable one per stage")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR", help="the directory to write")
    parser.add_argument("--force", action="store_true", help="replace DIR if it exists and is not empty")
    parser.add_argument("--run", metavar="NAME|PATH.toml",
                        help="the run file, for its tokenizer (needed for a BPE run that is not packaged)")
    token_option(parser)  # --api-token: a node whose API demands one (bound beyond loopback)


def progress(text: str) -> None:
    print(f"export: {text}", file=sys.stderr, flush=True)


# --- snapshot files ----------------------------------------------------------------------------


def _stage_files(directory: Path) -> list[Path]:
    """The snapshot files of a stage directory, newest first (by sequence number, as the store names them)."""
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := SNAPSHOT_FILE.fullmatch(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def _expand(paths: list[Path]) -> list[tuple[Path, list[Path]]]:
    """(stage directory or file, candidate files newest first) for each given path."""
    out = []
    for path in paths:
        if path.is_file():
            out.append((path, [path]))
        elif path.is_dir():
            files = _stage_files(path)
            subdirs = sorted(p for p in path.iterdir() if p.is_dir() and _stage_files(p))
            if files or not subdirs:
                out.append((path, files))
            out.extend((sub, _stage_files(sub)) for sub in subdirs if not files)
        else:
            raise ConfigError(f"--snapshots {path}: no such file or directory")
    return out


def _run_of(path: Path) -> str | None:
    match = STAGE_DIR.fullmatch((path if path.is_dir() else path.parent).name)
    return match.group("run") if match else None


def _named_round(path: Path) -> int | None:
    """The outer round a snapshot file's name gives (the store's names), None for another name."""
    match = SNAPSHOT_FILE.fullmatch(path.name)
    return int(match.group(2)) if match else None


def _fits(path: Path, target: int | None) -> bool:
    round_ = _named_round(path)
    return round_ is None or target is None or target - MAX_ROUND_SPREAD <= round_ <= target


def load_file_snapshots(paths: list[Path]) -> list[StageSnapshot]:
    """One loadable snapshot of each given stage directory (or each given file): the newest set whose
    outer rounds fit the rule, else the newest of each (the rule's check then says why not). Stages
    snapshot at their own times, so the newest files of two stages can be rounds apart while older
    kept ones match; files are decoded only when chosen."""
    from p2pswarm.diloco.checkpoint import decode_state  # lazy: imports torch, which export --help need not load

    loaded: dict[Path, StageSnapshot | None]
    groups, loaded = _expand(paths), {}

    def load(where: Path, path: Path) -> StageSnapshot | None:
        if path not in loaded:
            try:
                loaded[path] = hf_export.stage_snapshot(decode_state(path.read_bytes()), str(path), _run_of(where))
            except (OSError, ProtocolError, ConfigError, ValueError) as exc:
                progress(f"skipping {path}: {exc}")
                loaded[path] = None
        return loaded[path]

    def pick(target: int | None) -> list[StageSnapshot] | None:
        chosen = []
        for where, files in groups:
            snapshot = next((s for p in files if _fits(p, target) and (s := load(where, p)) is not None), None)
            if snapshot is None:
                return None
            chosen.append(snapshot)
        return chosen

    targets = sorted({r for _, files in groups for p in files if (r := _named_round(p)) is not None}, reverse=True)
    for target in targets:
        chosen = pick(target)
        if chosen and max(s.round for s in chosen) - min(s.round for s in chosen) <= MAX_ROUND_SPREAD:
            break
    else:
        chosen = pick(None)
    if chosen is None:
        where = next(w for w, files in groups if all(load(w, p) is None for p in files))
        raise ConfigError(f"--snapshots {where}: no loadable snapshot in it")
    for snapshot in chosen:
        progress(f"stage {snapshot.stage} from {snapshot.source}: outer round {snapshot.round}, "
                 f"{Path(snapshot.source).stat().st_size / MB:.1f} MB")
    return chosen


# --- from the swarm -----------------------------------------------------------------------------


def stage_peers(stages: dict, api: str) -> dict[int, list[tuple[str, tuple[str, ...]]]]:
    """Per stage, the peers that serve snapshots of it: those the node counts as working first (its claims
    are only claims), then the highest outer round first; ConfigError for a stage with none."""
    try:
        n_stages, by_stage = int(stages["n_stages"]), stages["stages"]
        peers = {stage: sorted((p for p in by_stage.get(str(stage), {}).get("peers", [])
                                if p["flags"] & FLAG_SNAPSHOT),
                               key=lambda p: (not p.get("working", False), -p["outer_round"]))
                 for stage in range(n_stages)}
        plan = {stage: [(p["peer_id"], tuple(p["addrs"])) for p in found] for stage, found in peers.items()}
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(f"{api}: /api/stages is not a stage map ({exc!r:.80})") from None
    for stage, found in plan.items():
        if not found:
            raise ConfigError(f"stage {stage} of {stages['model']}: no peer serves it (the stage map of {api})")
    return plan


async def _fetch_stage(pool, connector, model: str, stage: int, peers, run: str) -> StageSnapshot:
    from p2pswarm.diloco.checkpoint import decode_state  # lazy: imports torch

    problems = []
    for peer, addrs in peers:
        try:
            await connector.connect(peer, addrs)
            fetched = await fetch_snapshot(pool, peer, model, stage, run=bytes.fromhex(run))
            state = await trio.to_thread.run_sync(decode_state, fetched.data)
            snapshot = hf_export.stage_snapshot(state, f"peer {peer}", run)
            if (snapshot.model, snapshot.stage) != (model, stage):
                raise ConfigError(f"it sent stage {snapshot.stage} of {snapshot.model}")
        except (DialError, ProtocolError, ConfigError, OSError, ValueError) as exc:  # ValueError: a bad address
            progress(f"stage {stage}: peer {peer} failed ({str(exc)[:160]}); trying the next")
            problems.append(f"{peer[-8:]}: {str(exc)[:80]}")
            continue
        progress(f"stage {stage} from peer {peer}: outer round {snapshot.round}, {len(fetched.data) / MB:.1f} MB "
                 f"in {fetched.seconds:.1f} s")
        return snapshot
    raise ConfigError(f"stage {stage}: no peer served its snapshot ({'; '.join(problems)})")


async def _fetch_all(model: str, plan: dict, run: str) -> list[StageSnapshot]:
    async with open_host(generate_identity(), [EPHEMERAL_LISTEN]) as host, trio.open_nursery() as nursery:
        connector = Connector(host, nursery)
        pool = StreamPool(host, nursery, connector)
        snapshots = [await _fetch_stage(pool, connector, model, stage, peers, run) for stage, peers in plan.items()]
        nursery.cancel_scope.cancel()
    return snapshots


def fetch_from_api(api: str, token: str | None = None) -> tuple[list[StageSnapshot], dict, dict | None]:
    """(the stages' snapshots, /api/stats, /api/swarm or None) from the swarm behind ``api`` (``token``: its
    API token, when it demands one)."""
    stats, stages = get_json(api, "/api/stats", token=token), get_json(api, "/api/stages", token=token)
    swarm = get_json(api, "/api/swarm", token=token) if stats.get("role") == "join" else None
    run = stages.get("run") or (stats.get("run") or {}).get("identity")
    if not isinstance(run, str) or not re.fullmatch(r"[0-9a-f]{16}", run):
        raise ConfigError(f"{api}: the node names no run identity")
    plan = stage_peers(stages, api)
    quiet_libp2p("info")
    return trio.run(_fetch_all, stages["model"], plan, run), stats, swarm


# --- run, tokenizer, card ---------------------------------------------------------------------


def resolve_run(given: str | None, identity: str | None, model: str) -> RunSpec | None:
    """The run of the stages: ``--run`` (checked against them), else the packaged run of their identity."""
    if given:
        run = load_run(given)
        if identity is not None and run.identity != identity:
            raise ConfigError(f"--run {given} is run {run.identity}; the stages are of run {identity}")
        if run.model != model:
            raise ConfigError(f"--run {given} trains {run.model}; the stages are of {model}")
        return run
    if identity is None:
        return None
    return next((run for run in map(load_run, packaged_runs()) if run.identity == identity), None)


def tokenizer_file(run: RunSpec | None, vocab: int) -> Path | None:
    """The run's tokenizer.json; None for the byte-level tokenizer; ConfigError when it cannot be known."""
    if run is not None:
        return None if run.tokenizer == BYTES_TOKENIZER else Path(run.tokenizer)
    if vocab == BYTE_VOCAB:
        return None  # a BPE vocabulary has at least one merge beyond the 256 bytes
    raise ConfigError(f"the stages have a vocabulary of {vocab} tokens (a BPE run): pass --run PATH.toml so its "
                      f"tokenizer goes into the export")


def fixed_parts(run: RunSpec | None, spec):
    """A subspace run's fixed basis and embedding (``model.subspace``), which its export folds in; else None."""
    if run is None or not run.subspace:
        return None
    from p2pswarm.model import subspace  # torch

    return subspace.build(spec, run.seed, run.subspace)


def heldout_figure(swarm: dict | None, rounds: list[int]) -> tuple[float | None, str]:
    """The swarm's held-out bits per byte of exactly these per-stage outer rounds, and where it came from."""
    if swarm is None:
        return None, "the API's node does not train: a last-stage peer's API reports the figure"
    if len(set(rounds)) == 1:
        for entry in swarm.get("heldout_by_round", []):
            if entry.get("outer_round") == rounds[0]:
                return entry["bpb"], f"the swarm's figure for outer round {rounds[0]}, {entry['chains']} chain(s)"
    same = [h["bpb"] for h in swarm.get("heldout", []) if h.get("rounds") == rounds and h.get("complete")]
    if same:
        return sum(same) / len(same), f"the mean of {len(same)} evaluation(s) of outer rounds {rounds}"
    return None, f"no held-out evaluation of outer rounds {rounds} on the API's node (the last stage measures it)"


def cmd_export(args: argparse.Namespace) -> int:
    started = time.monotonic()
    out = Path(args.out).expanduser()
    hf_export.check_out_dir(out, args.force)
    stats: dict
    swarm: dict | None
    stats, swarm = {}, None
    if args.api:
        snapshots, stats, swarm = fetch_from_api(args.api, args.api_token)
        source = f"the swarm, through the API at {args.api}"
    else:
        snapshots = load_file_snapshots(args.snapshots)
        source = "snapshot files"
    identity = next((s.run for s in snapshots if s.run), None)
    run = resolve_run(args.run, identity, snapshots[0].model if snapshots else "")
    spec = hf_export.check_stages(snapshots, vocab=run.vocab if run else None)
    identity = identity or (run.identity if run else None)
    rounds = [s.round for s in sorted(snapshots, key=lambda s: s.stage)]
    bpb, note = heldout_figure(swarm, rounds) if args.api else (None, "exported from files: no swarm was asked")
    tokens = max([s.tokens for s in snapshots] + [int((swarm or {}).get("tokens") or 0)])
    run_name = run.name if run else (stats.get("run") or {}).get("name") or "unknown"
    card = Card(identity or "unknown", run_name, tokens, bpb, note,
                datetime.now(UTC).isoformat(timespec="seconds"), source)
    written = hf_export.write_export(out, spec, snapshots, card, tokenizer_file=tokenizer_file(run, spec.vocab),
                                     force=args.force, fixed=fixed_parts(run, spec))
    progress(f"wrote {out}: {spec.name}, outer rounds {rounds}, {written.weight_bytes / MB:.1f} MB of weights, "
             f"{len(written.files)} files, in {time.monotonic() - started:.1f} s")
    return 0
