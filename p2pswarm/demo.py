"""``p2pswarm demo``: a whole swarm training a model on this machine, as real processes on loopback.

Starts one ``p2pswarm bootstrap`` and N ``p2pswarm join`` peers, spread evenly over the S stages
of ``tiny-lm/S`` (default 4 peers: 2 stages x 2 replicas), waits until every stage is served,
then shows training as it happens: the held-out loss in bits per byte after each DiLoCo outer
round (the agreed weights of that round, evaluated by the last stage on the fixed held-out set
through every chain of replicas, with the spread between chains: 0 when the replicas agree),
tokens/s, peers per stage, failovers and lost micro-batches.
Replicas of a stage meet every ``--inner-steps`` local steps for a DiLoCo outer round; the demo
prints each round as it completes (members, seconds, bytes, rejected contributions). Peers train
the default run (``p2pswarm.run.spec``) on ``tiny-lm/S`` with the demo's DiLoCo values, or with
``--run NAME|PATH`` that run as it is (its model, its stages, its [diloco] table).
``--kill-one`` SIGKILLs one replica halfway through, to show training go on without it, and
restarts it ``RESTART_AFTER`` seconds later: it loads its stage's current state from the other
replica (a hot snapshot) and rejoins the rounds. At the end it prints a summary and stops every
process it started (by pid). Exit code 0 when the
held-out loss of the last evaluated outer round is below round 0's (the untrained model) and no
process crashed (the one it killed aside), 1 otherwise. ``--rounds N`` trains until round N's
figure is in (``--duration`` is then a limit, and ``--kill-one`` kills after round N/2);
``--summary PATH`` writes the figures as JSON (``bench/swarm_train.py`` reads them).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from p2pswarm.errors import ConfigError, StartupError
from p2pswarm.model.catalog import DEFAULT_MODEL, get_model
from p2pswarm.run.spec import load_run
from p2pswarm.swarm.evaluation import EvalRound, RoundAgreement, agreement

FORM_TIMEOUT = 180.0  # seconds for every stage to be served and found: a guard (a loaded 2-core machine took > 90)
POLL_PERIOD = 1.0  # seconds between looks while the swarm forms
SHOW_PERIOD = 5.0  # seconds between progress lines while it trains
STOP_TIMEOUT = 15.0  # seconds a peer gets to shut down cleanly after SIGTERM
DEFAULT_DURATION = 150.0  # seconds of training: with forming and stopping, under 3 minutes
DEFAULT_STAGES = 2
RECENT_ROUNDS = 3  # held-out rounds averaged for the verdict "it learned"
DEMO_INNER_STEPS = 40  # H in the demo: a stage replica takes ~4 steps/s here, so a round every ~10-15 s
DEMO_OUTER_MOMENTUM = 0.0  # a demo has ~10 outer rounds: plain averaging (lr 1, no momentum) learned most per
DEMO_OUTER_LR = 1.0  # token in the 1 x 2 arm (1.07x one process; lr 0.7 Nesterov 0.5: 1.09x; lr 1.0 Nesterov 0.5: 1.12x)
DEMO_GATHER_S = 10.0  # a ready replica waits this long for the other; it keeps training meanwhile
DEMO_SNAPSHOT_PERIOD = 30.0  # snapshots on disk every 30 s: several within one demo
RESTART_AFTER = 10.0  # seconds between --kill-one's SIGKILL and the restart of the same peer


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def spawn(args: list[str], log_path: Path) -> subprocess.Popen:
    log_file = open(log_path, "w")
    return subprocess.Popen([sys.executable, "-m", "p2pswarm", *args], stdout=subprocess.PIPE,
                            stderr=log_file, stdin=subprocess.DEVNULL, text=True)


def read_first_addr(process: subprocess.Popen, what: str) -> str:
    line = process.stdout.readline().strip()
    if not line:
        raise StartupError(f"{what} exited before printing its address (exit code {process.wait()})")
    return line


def get_json(api: str, path: str) -> dict:
    try:
        with urllib.request.urlopen(f"http://{api}{path}", timeout=3) as response:
            return json.load(response)
    except (OSError, ValueError):
        return {}


def stage_map(api: str) -> dict:
    """Stage number (text) -> {"start", "end", "peers"}, as a node's /api/stages shows it."""
    return get_json(api, "/api/stages").get("stages", {})


def stop_all(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + STOP_TIMEOUT
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class Peer:
    index: int
    stage: int
    api: str
    process: subprocess.Popen
    args: list[str] = field(default_factory=list)
    log_path: Path | None = None
    killed: bool = False
    killed_at: float = 0.0
    restarted: bool = False


def latest_rounds(rounds: list[dict]) -> dict[str, tuple[int, float, float]]:
    """Per stage-0 replica (``source``), its highest evaluation round: (round, when, bits per byte).

    A round's micro-batches may be split between last-stage replicas, each reporting its part:
    the parts are combined, weighted by their bytes."""
    parts: dict[tuple[str, int], list[dict]] = {}
    for r in rounds:
        parts.setdefault((r["source"], r["round"]), []).append(r)
    latest: dict[str, tuple[int, float, float]] = {}
    for (source, round_), group in sorted(parts.items()):
        tokens = sum(r["tokens"] for r in group)
        latest[source] = (round_, max(r["at"] for r in group), sum(r["bpb"] * r["tokens"] for r in group) / tokens)
    return latest



def newest(seen: dict[str, tuple[int, float, float]],
           now: dict[str, tuple[int, float, float]]) -> dict[str, tuple[int, float, float]]:
    """Per stage-0 replica, the higher of two (round, when, bits per byte) evaluations. Once the last-stage
    replica that took a session's later rounds is gone, the survivors still report older rounds
    of it (often round 0, the untrained model): they must not replace a newer figure."""
    merged = dict(seen)
    for source, latest in now.items():
        if source not in merged or latest[0] >= merged[source][0]:
            merged[source] = latest
    return merged


@dataclass
class Progress:
    """What the demo saw: held-out rounds, tokens, failovers."""

    heldout: list[tuple[float, float]] = field(default_factory=list)  # (seconds into training, mean bpb)
    tokens: int = 0
    tokens_per_s: float = 0.0
    failovers: int = 0
    lost: int = 0
    duplicates: int = 0  # re-sent micro-batches a receiver dropped (never computed twice)
    timeouts: int = 0
    train_bpb: float | None = None
    busy: dict[int, float] = field(default_factory=dict)  # peer -> compute-busy fraction since its first micro-batch
    latest: dict[str, tuple[int, float, float]] = field(default_factory=dict)  # stage-0 replica -> (round, at, bpb)
    outer: dict[tuple[int, int], dict] = field(default_factory=dict)  # (stage, round) -> a member's account
    loads: dict[int, dict] = field(default_factory=dict)  # peer -> where it loaded its stage from
    evaluations: dict[tuple, EvalRound] = field(default_factory=dict)  # every evaluation seen, by who and what
    round_tokens: dict[tuple[int, int], int] = field(default_factory=dict)  # (stage-0 peer, outer round) -> its tokens
    shown: set[int] = field(default_factory=set)  # outer rounds whose held-out line was printed

    def curve(self) -> list[RoundAgreement]:
        """The held-out figure per outer round: every chain on that round's agreed weights (``agreement``)."""
        return agreement(list(self.evaluations.values()))

    def tokens_at(self, round_: int) -> int | None:
        """Tokens the stage-0 replicas had trained when outer ``round_`` was agreed (round 0: none): each
        replica's count when it finished that round, or (left out of it) the first round after; a
        replica with no round since counts its last. An upper bound: the comparison is never flattered."""
        if round_ == 0:
            return 0
        per_peer: dict[int, dict[int, int]] = {}
        for (peer, r), n in self.round_tokens.items():
            per_peer.setdefault(peer, {})[r] = n
        if not any(r >= round_ for rounds in per_peer.values() for r in rounds):
            return None
        return sum(rounds[min((r for r in rounds if r >= round_), default=max(rounds))]
                   for rounds in per_peer.values())

    def heldout_text(self) -> str:
        """The newest outer round's figure and spread; without outer rounds, the mean over stage-0
        replicas of their latest held-out round (live weights), and each one's."""
        curve = self.curve()
        if curve:
            last = curve[-1]
            return f"{last.bits_per_byte:.3f} (round {last.round}, {len(last.chains)} chain(s), spread {last.spread:.3f})"
        if not self.heldout:
            return "  -  "
        each = ", ".join(f"{b:.2f}" for *_, b in sorted(self.latest.values(), key=lambda v: v[1]))
        return f"{self.heldout[-1][1]:.3f} ({each})" if len(self.latest) > 1 else f"{self.heldout[-1][1]:.3f}"

    def new_round_lines(self) -> list[str]:
        """A line for each outer round whose held-out figure came in since the last look (its chains
        may still grow: a round is shown once at least two chains, or every stage-0 replica, measured it)."""
        lines, curve = [], self.curve()
        for a in curve[:-1]:  # the newest may be missing chains yet
            if a.round in self.shown:
                continue
            self.shown.add(a.round)
            tokens = self.tokens_at(a.round)
            each = ", ".join(f"{b:.3f}" for b in a.chains.values())
            lines.append(f"demo: held-out after outer round {a.round}: {a.bits_per_byte:.3f} bits/byte "
                         f"({'?' if tokens is None else tokens} tokens; {len(a.chains)} chain(s): {each}; "
                         f"spread {a.spread:.3f})")
        return lines

    def remember(self, entries: list[dict]) -> None:
        """Keep every evaluation a last-stage peer reports (a killed one's stay, for the curve)."""
        for e in entries:
            rounds, chain = e.get("rounds"), e.get("chain")
            r = EvalRound(e["source"].encode(), e["round"], e["bpb"], e["tokens"], 1, e["at"],
                          rounds=None if rounds is None else tuple(rounds), chain=None if chain is None else tuple(chain),
                          complete=e.get("complete", True))
            self.evaluations[(e["source"], e["round"], r.chain)] = r

    def look(self, peers: list[Peer], n_stages: int, since: float) -> dict:
        docs = {p.index: get_json(p.api, "/api/swarm") for p in peers if not p.killed}
        docs = {i: d for i, d in docs.items() if d}
        first = [d for d in docs.values() if d.get("first")]
        last = [d for d in docs.values() if d.get("last")]
        self.tokens = max(self.tokens, sum(d.get("tokens", 0) for d in first))
        self.tokens_per_s = sum(d.get("tokens_per_s", 0.0) for d in first)
        self.failovers = max(self.failovers, sum(d["delivery"].get("rerouted", 0) for d in docs.values()))
        self.lost = max(self.lost, sum(d["delivery"].get("lost", 0) for d in docs.values()))
        self.duplicates = max(self.duplicates, sum(d["counts"].get("duplicates_dropped", 0) for d in docs.values()))
        self.timeouts = max(self.timeouts, sum(d["delivery"].get("timeouts", 0) for d in docs.values()))
        self.busy.update({i: d["engine"].get("busy_since_first", d["engine"]["busy_fraction"])
                          for i, d in docs.items()})  # since its first micro-batch: forming is no idle compute
        losses = [d["train_loss_bpb"] for d in last if d.get("train_loss_bpb") is not None]
        self.train_bpb = sum(losses) / len(losses) if losses else self.train_bpb
        self.remember([r for d in last for r in d.get("heldout", [])])
        self.latest = newest(self.latest, latest_rounds([r for d in last for r in d.get("heldout", [])]))
        if self.latest:
            mean = sum(b for *_, b in self.latest.values()) / len(self.latest)
            if not self.heldout or mean != self.heldout[-1][1]:
                self.heldout.append((max(a for _, a, _ in self.latest.values()) - since, mean))
        return {s: sum(1 for d in docs.values() if d.get("stage") == s) for s in range(n_stages)}

    def outer_rounds(self, peers: list[Peer]) -> list[str]:
        """Lines for the outer rounds completed since the last look, one per stage and round."""
        lines = []
        for peer in peers:
            doc = {} if peer.killed else get_json(peer.api, "/api/diloco")
            if (doc.get("loaded_from") or {}).get("peer") and doc["loaded_from"] != self.loads.get(peer.index):
                self.loads[peer.index] = doc["loaded_from"]
                lines.append(_loaded_text(peer, doc["loaded_from"]))
            for r in doc.get("rounds", []):
                if doc.get("stage") == 0 and "tokens" in r:
                    self.round_tokens[(peer.index, r["round"] + 1)] = r["tokens"]  # round r agreed weights r + 1
                key = (doc["stage"], r["round"])
                if key not in self.outer:
                    self.outer[key] = r
                    lines.append(f"demo: outer round {r['round']} of stage {doc['stage']} done: "
                                 f"{len(r['members'])} replica(s), {r['seconds']:.1f} s, "
                                 f"{r['bytes_sent'] / 1e6:.2f} MB sent by one, |pseudo-gradient| "
                                 f"{r['pseudo_gradient_norm']:.3f}, rejected "
                                 f"{sum(doc.get('rejected_contributions', {}).values())}")
        return lines


def _loaded_text(peer: Peer, loaded: dict) -> str:
    return (f"demo: peer {peer.index} loaded stage {peer.stage} from {loaded['peer'][-8:]}: outer round "
            f"{loaded['round']}, inner step {loaded['step']}, {loaded['bytes'] / 1e6:.1f} MB in {loaded['seconds']:.1f} s"
            + ("; its own progress kept (rebased)" if loaded.get("rebased") else ""))


def run_demo(peers: int, duration: float, directory: Path | None, *, stages: int = DEFAULT_STAGES,
             kill_one: bool = False, inner_steps: int = DEMO_INNER_STEPS, run: str | None = None,
             summary: Path | None = None, rounds: int | None = None) -> int:
    """Without ``run`` the default run on tiny-lm/``stages`` with the demo's DiLoCo values; with it, that
    run as it is (its model and [diloco] table: ``stages`` and ``inner_steps`` do not apply)."""
    model = load_run(run).spec() if run else get_model(f"{DEFAULT_MODEL}/{stages}")
    agreed = ["--run", run] if run else ["--model", model.name, "--inner-steps", str(inner_steps),
                                         "--outer-momentum", str(DEMO_OUTER_MOMENTUM), "--outer-lr", str(DEMO_OUTER_LR)]
    if peers < model.n_stages:
        raise ConfigError(f"--peers must be at least {model.n_stages}: {model.name} has {model.n_stages} "
                          f"stages and each peer serves one")
    if kill_one and peers < 2 * model.n_stages:
        raise ConfigError(f"--kill-one needs a stage with two replicas: --peers at least {2 * model.n_stages}")
    if duration <= 0:
        raise ConfigError(f"--duration must be positive, not {duration:g}")
    if inner_steps < 1:
        raise ConfigError(f"--inner-steps must be at least 1, not {inner_steps}")
    if rounds is not None and rounds < 1:
        raise ConfigError(f"--rounds must be at least 1, not {rounds}")
    workdir = Path(directory or tempfile.mkdtemp(prefix="p2pswarm-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // peers)
    print(f"demo: {peers} peers train {model.name} ({model.n_layers} blocks in {model.n_stages} stages) on the "
          f"embedded corpus for {duration:.0f} s; keys and logs in {workdir}", flush=True)
    processes: list[subprocess.Popen] = []
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops every process it started, as Ctrl-C does
    try:
        boot = spawn(["bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--data-dir", str(workdir / "bootstrap")],
                     workdir / "bootstrap.log")
        processes.append(boot)
        boot_addr = read_first_addr(boot, "the bootstrap node")
        members = []
        for i in range(peers):
            stage, api = i % model.n_stages, f"127.0.0.1:{free_port()}"
            start, end = model.stage_range(stage)
            args = ["join", "--bootstrap", boot_addr, "--listen", "/ip4/127.0.0.1/tcp/0",
                    "--data-dir", str(workdir / f"peer{i}"), "--api", api, *agreed,
                    "--layers", f"{start}:{end}", "--threads", str(threads), "--gather", str(DEMO_GATHER_S), "--snapshot-period", str(DEMO_SNAPSHOT_PERIOD)]
            process = spawn(args, workdir / f"peer{i}.log")
            processes.append(process)
            members.append(Peer(i, stage, api, process, args, workdir / f"peer{i}.log"))
            print(f"demo: peer {i} trains stage {stage} (blocks [{start}, {end})), status API {api}", flush=True)
        if not _wait_formed(members, processes, model.n_stages):
            return 1
        return _train(members, processes, model.n_stages, duration, kill_one, summary, rounds)
    except KeyboardInterrupt:
        print("\ndemo: interrupted", flush=True)
        return 0
    finally:
        print("demo: stopping every process it started", flush=True)
        stop_all(processes)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _crashed(processes: list[subprocess.Popen], members: list[Peer]) -> list[subprocess.Popen]:
    killed = {p.process for p in members if p.killed} | set(_KILLED)
    return [p for p in processes if p.poll() is not None and p not in killed]


_KILLED: list[subprocess.Popen] = []  # processes the demo SIGKILLed on purpose (--kill-one)


def _kill_and_restart(victim: Peer, processes: list[subprocess.Popen], elapsed: float, halfway: bool) -> None:
    """--kill-one: SIGKILL the victim halfway through, start it again RESTART_AFTER seconds later."""
    if not victim.killed and not victim.restarted and halfway:
        victim.process.kill()
        _KILLED.append(victim.process)
        victim.killed, victim.killed_at = True, elapsed
        print(f"demo: SIGKILLed peer {victim.index} (stage {victim.stage}); training goes on, restart in "
              f"{RESTART_AFTER:.0f} s", flush=True)
    elif victim.killed and elapsed >= victim.killed_at + RESTART_AFTER:
        victim.process.wait()
        victim.process = spawn(victim.args, victim.log_path.with_suffix(".restart.log"))
        processes.append(victim.process)
        victim.killed, victim.restarted = False, True
        print(f"demo: restarted peer {victim.index}: it loads stage {victim.stage} from a replica", flush=True)


def _wait_formed(members: list[Peer], processes: list[subprocess.Popen], n_stages: int) -> bool:
    started = time.monotonic()
    while time.monotonic() - started < FORM_TIMEOUT:
        if _crashed(processes, members):
            print("demo: a process exited during start-up; see the logs", file=sys.stderr)
            return False
        served = [s for s, doc in stage_map(members[0].api).items() if doc["peers"]]
        if len(served) == n_stages:
            print(f"demo: every stage served after {time.monotonic() - started:.1f} s; training "
                  f"(try: p2pswarm status --api {members[0].api})", flush=True)
            return True
        time.sleep(POLL_PERIOD)
    print(f"demo: the stages were not all served within {FORM_TIMEOUT:.0f} s", file=sys.stderr)
    return False


def _train(members: list[Peer], processes: list[subprocess.Popen], n_stages: int, duration: float,
           kill_one: bool, summary: Path | None = None, rounds: int | None = None) -> int:
    """Until ``duration`` passes, or with ``rounds`` until that outer round's held-out figure is in (and a
    killed peer is back and has loaded its stage from a replica): then ``duration`` is only the limit."""
    progress, started = Progress(), time.time()
    victim = next(p for p in reversed(members) if p.stage == n_stages - 1) if kill_one else None
    while (elapsed := time.time() - started) < duration:
        time.sleep(SHOW_PERIOD)
        evaluated = max((a.round for a in progress.curve()), default=-1)
        back = victim is None or (victim.restarted and victim.index in progress.loads)  # reloaded its stage
        if rounds is not None and evaluated >= rounds and back:
            break
        if victim:
            halfway = evaluated >= rounds // 2 if rounds is not None else time.time() - started >= duration / 2
            _kill_and_restart(victim, processes, time.time() - started, halfway)
            if victim.killed:
                progress.loads.pop(victim.index, None)  # its load after the restart is the one to wait for
        crashed = _crashed(processes, members)
        if crashed:
            print(f"demo: a process exited with code {crashed[0].returncode}; see the logs", file=sys.stderr)
            return 1
        per_stage = progress.look(members, n_stages, started)
        train = f"{progress.train_bpb:.3f}" if progress.train_bpb is not None else "  -  "
        print(f"demo: t={time.time() - started:5.0f}s  held-out {progress.heldout_text()} bits/byte  train {train}  "
              f"{progress.tokens_per_s:7.0f} tok/s  stages {' '.join(f'S{s}:{n}' for s, n in per_stage.items())}  "
              f"failovers {progress.failovers}  lost {progress.lost}", flush=True)
        for line in progress.outer_rounds(members) + progress.new_round_lines():
            print(line, flush=True)
    if rounds is not None and max((a.round for a in progress.curve()), default=-1) < rounds:
        print(f"demo: outer round {rounds} was not evaluated within {duration:.0f} s", file=sys.stderr)
        _summary(progress, time.time() - started, bool(victim), summary)
        return 1
    return _summary(progress, time.time() - started, bool(victim), summary)


def _summary(progress: Progress, seconds: float, killed: bool, path: Path | None = None) -> int:
    print(f"demo: summary: {progress.tokens} tokens in {seconds:.0f} s ({progress.tokens / seconds:.0f} tok/s), "
          f"{progress.failovers} failovers, {progress.timeouts} timeouts, {progress.lost} micro-batches lost, "
          f"{progress.duplicates} duplicates dropped"
          f"{', one peer SIGKILLed and restarted' if killed else ''}, 0 crashed processes", flush=True)
    per_stage: dict[int, int] = {}
    for stage, _ in progress.outer:
        per_stage[stage] = per_stage.get(stage, 0) + 1
    print(f"demo: outer rounds completed: {', '.join(f'stage {s}: {n}' for s, n in sorted(per_stage.items())) or 'none'}",
          flush=True)
    busy = sorted(progress.busy.values())
    if busy:
        print(f"demo: compute-busy fraction per peer since its first micro-batch {', '.join(f'{b:.3f}' for b in busy)} "
              f"(mean {sum(busy) / len(busy):.3f})", flush=True)
    curve = [(progress.tokens_at(a.round), a) for a in progress.curve()]
    if path is not None:
        _write_summary(path, progress, seconds, curve)
    if curve:
        return _round_verdict(curve)
    return _live_verdict(progress.heldout)


def _round_verdict(curve: list[tuple[int | None, RoundAgreement]]) -> int:
    """The held-out figure of the agreed weights round after round: it learned if the last round is
    below the first (round 0: the untrained model, the same on every replica)."""
    print("demo: held-out by outer round (agreed weights, every chain): " + ", ".join(
        f"{a.round}: {a.bits_per_byte:.3f}" for _, a in curve), flush=True)
    spreads = [a.spread for _, a in curve if len(a.chains) > 1]
    if spreads:
        print(f"demo: spread between chains after a round: at most {max(spreads):.3f} bits/byte "
              f"over {len(spreads)} round(s) measured by 2 or more chains", flush=True)
    if len(curve) < 2:
        print("demo: too few outer rounds evaluated to tell whether the model learned", file=sys.stderr)
        return 1
    first, last = curve[0][1].bits_per_byte, curve[-1][1].bits_per_byte
    tokens = curve[-1][0]
    print(f"demo: held-out loss {first:.3f} -> {last:.3f} bits/byte at outer round {curve[-1][1].round}"
          f"{'' if tokens is None else f' after {tokens} tokens'} (8 = knowing nothing)", flush=True)
    return 0 if last < first else 1


def _live_verdict(heldout: list[tuple[float, float]]) -> int:
    """Without outer rounds (live weights): the mean of the last RECENT_ROUNDS rounds below the first."""
    if len(heldout) < 2:
        print("demo: too few held-out evaluations to tell whether the model learned", file=sys.stderr)
        return 1
    first, last = heldout[0][1], heldout[-1][1]
    best = min(b for _, b in heldout)
    recent = [b for _, b in heldout[-RECENT_ROUNDS:]]
    late = sum(recent) / len(recent)  # one round can spike: replicas differ until DiLoCo averages them
    print(f"demo: held-out loss {first:.3f} -> {last:.3f} bits/byte (mean of the last {len(recent)} rounds "
          f"{late:.3f}, best {best:.3f}; 8 = knowing nothing)", flush=True)
    return 0 if late < first else 1


def _write_summary(path: Path, progress: Progress, seconds: float,
                   curve: list[tuple[int | None, RoundAgreement]]) -> None:
    """The run as JSON (--summary), for benches: tokens, rates, the held-out curve by outer round."""
    doc = {"tokens": progress.tokens, "seconds": round(seconds, 1), "tokens_per_s": progress.tokens / seconds,
           "failovers": progress.failovers, "lost": progress.lost, "timeouts": progress.timeouts,
           "busy": sorted(progress.busy.values()),
           "outer_rounds": sorted(f"{s}:{r}" for s, r in progress.outer),
           "curve": [{"round": a.round, "tokens": tokens, "bpb": a.bits_per_byte, "spread": a.spread,
                      "chains": len(a.chains)} for tokens, a in curve],
           "live": [{"at": at, "bpb": bpb} for at, bpb in progress.heldout],
           "sources": sorted({source for source, _, _ in progress.evaluations})}  # stage-0 replicas evaluated
    Path(path).write_text(json.dumps(doc, indent=1))
