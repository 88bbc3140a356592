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
``--tune KEY=VALUE`` (``p2pswarm.run.tunables``) is passed to every peer it starts.

The processes and their status API are handled in ``demo.procs``; what the demo sees and says
at the end in ``demo.progress``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from p2pswarm.demo.procs import Peer, free_port, get_json, read_first_addr, spawn, stage_map, stop_all
from p2pswarm.demo.progress import Progress, latest_rounds, newest, print_summary
from p2pswarm.errors import ConfigError
from p2pswarm.model.catalog import DEFAULT_MODEL, ModelSpec, get_model
from p2pswarm.run.spec import load_run
from p2pswarm.run.tunables import parse_tunables

__all__ = [  # what the CLI, the link-shaped swarms (testing.linkswarm), tests and benches use
    "DEFAULT_DURATION", "DEFAULT_STAGES", "DEMO_GATHER_S", "DEMO_INNER_STEPS", "DEMO_OUTER_LR",
    "DEMO_OUTER_MOMENTUM", "DEMO_SNAPSHOT_PERIOD", "Progress", "free_port", "get_json", "latest_rounds",
    "newest", "read_first_addr", "run_demo", "spawn", "stop_all",
]

FORM_TIMEOUT = 180.0  # seconds for every stage to be served and found: a guard (a loaded 2-core machine took > 90)
POLL_PERIOD = 1.0  # seconds between looks while the swarm forms
SHOW_PERIOD = 5.0  # seconds between progress lines while it trains
DEFAULT_DURATION = 150.0  # seconds of training: with forming and stopping, under 3 minutes
DEFAULT_STAGES = 2
DEMO_INNER_STEPS = 40  # H in the demo: a stage replica takes ~4 steps/s here, so a round every ~10-15 s
DEMO_OUTER_MOMENTUM = 0.0  # a demo has ~10 outer rounds: plain averaging (lr 1, no momentum) learned most per
DEMO_OUTER_LR = 1.0  # token in the 1 x 2 arm (1.07x one process; lr 0.7 Nesterov 0.5: 1.09x;
# lr 1.0 Nesterov 0.5: 1.12x)
DEMO_GATHER_S = 10.0  # a ready replica waits this long for the other; it keeps training meanwhile
DEMO_SNAPSHOT_PERIOD = 30.0  # snapshots on disk every 30 s: several within one demo
RESTART_AFTER = 10.0  # seconds between --kill-one's SIGKILL and the restart of the same peer


def run_demo(peers: int, duration: float, directory: Path | None, *, stages: int = DEFAULT_STAGES,
             kill_one: bool = False, inner_steps: int = DEMO_INNER_STEPS, run: str | None = None,
             summary: Path | None = None, rounds: int | None = None, tune: tuple[str, ...] = ()) -> int:
    """Without ``run`` the default run on tiny-lm/``stages`` with the demo's DiLoCo values; with it, that
    run as it is (its model and [diloco] table: ``stages`` and ``inner_steps`` do not apply). ``tune``:
    ``KEY=VALUE`` strings (``--tune``) passed to every joining peer."""
    model = load_run(run).spec() if run else get_model(f"{DEFAULT_MODEL}/{stages}")
    agreed = ["--run", run] if run else ["--model", model.name, "--inner-steps", str(inner_steps),
                                         "--outer-momentum", str(DEMO_OUTER_MOMENTUM), "--outer-lr", str(DEMO_OUTER_LR)]
    _check_args(model, peers, duration, kill_one, inner_steps, rounds)
    parse_tunables(tune)  # a bad KEY=VALUE is a one-line error here, not a crash in every peer
    extra = [*agreed, *(arg for pair in tune for arg in ("--tune", pair))]
    workdir = Path(directory or tempfile.mkdtemp(prefix="p2pswarm-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"demo: {peers} peers train {model.name} ({model.n_layers} blocks in {model.n_stages} stages) on the "
          f"embedded corpus for {duration:.0f} s; keys and logs in {workdir}", flush=True)
    processes: list[subprocess.Popen] = []
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops every process it started, as Ctrl-C does
    try:
        members = _start_peers(model, peers, workdir, extra, processes)
        if not _wait_formed(members, processes, model.n_stages):
            return 1
        return _train(members, processes, model.n_stages, duration, kill_one, summary, rounds)
    except KeyboardInterrupt:
        print("\ndemo: interrupted", flush=True)
        return 0
    finally:
        print("demo: stopping every process it started", flush=True)
        stop_all(processes)


def _check_args(model: ModelSpec, peers: int, duration: float, kill_one: bool, inner_steps: int,
                rounds: int | None) -> None:
    """ConfigError, one line, for a demo that cannot run as asked."""
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


def _start_peers(model: ModelSpec, peers: int, workdir: Path, extra: list[str],
                 processes: list[subprocess.Popen]) -> list[Peer]:
    """The bootstrap node, then ``peers`` joining peers spread evenly over the stages; ``extra``: the
    run's flags and ``--tune`` pairs each peer gets. Every process started goes into ``processes``."""
    boot = spawn(["bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--data-dir", str(workdir / "bootstrap")],
                 workdir / "bootstrap.log")
    processes.append(boot)
    boot_addr = read_first_addr(boot, "the bootstrap node")
    threads = max(1, (os.cpu_count() or 1) // peers)
    members = []
    for i in range(peers):
        stage, api = i % model.n_stages, f"127.0.0.1:{free_port()}"
        start, end = model.stage_range(stage)
        args = ["join", "--bootstrap", boot_addr, "--listen", "/ip4/127.0.0.1/tcp/0",
                "--data-dir", str(workdir / f"peer{i}"), "--api", api, *extra,
                "--layers", f"{start}:{end}", "--threads", str(threads), "--gather", str(DEMO_GATHER_S),
                "--snapshot-period", str(DEMO_SNAPSHOT_PERIOD)]
        process = spawn(args, workdir / f"peer{i}.log")
        processes.append(process)
        members.append(Peer(i, stage, api, process, args, workdir / f"peer{i}.log"))
        print(f"demo: peer {i} trains stage {stage} (blocks [{start}, {end})), status API {api}", flush=True)
    return members


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
        assert victim.log_path is not None  # every demo peer logs to a file
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
            print(f"demo: live dashboard at http://{members[0].api}/ (every peer's API serves one)", flush=True)
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
    while time.time() - started < duration:
        time.sleep(SHOW_PERIOD)
        if victim:
            evaluated = max((a.round for a in progress.curve()), default=-1)
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
        back = victim is None or (victim.restarted and victim.index in progress.loads)  # reloaded its stage
        if rounds is not None and max((a.round for a in progress.curve()), default=-1) >= rounds and back:
            break  # as soon as it is seen, not a SHOW_PERIOD later
    if rounds is not None and max((a.round for a in progress.curve()), default=-1) < rounds:
        print(f"demo: outer round {rounds} was not evaluated within {duration:.0f} s", file=sys.stderr)
        print_summary(progress, time.time() - started, bool(victim), summary)
        return 1
    return print_summary(progress, time.time() - started, bool(victim), summary)

