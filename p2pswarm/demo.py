"""``p2pswarm demo``: a whole swarm on this machine, as separate real processes on loopback.

Starts one ``p2pswarm bootstrap`` and several ``p2pswarm join`` peers (each serving one stage
of the default model), waits until every stage is announced, shows the stage map while the
swarm runs, then stops every process it started. Training joins the demo when the training
issues land; today it shows discovery working end to end.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from p2pswarm.errors import ConfigError, StartupError
from p2pswarm.model.catalog import DEFAULT_MODEL, get_model

FORM_TIMEOUT = 60.0  # seconds for the swarm to announce every layer on a loaded 2-core machine
POLL_PERIOD = 1.0  # seconds between looks at the stage map
STOP_TIMEOUT = 15.0  # seconds a peer gets to shut down cleanly after SIGTERM


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


def stage_map(api: str) -> dict:
    """Stage number (text) -> {"start", "end", "peers"}, as a node's /api/stages shows it."""
    try:
        with urllib.request.urlopen(f"http://{api}/api/stages", timeout=2) as response:
            return json.load(response)["stages"]
    except (OSError, ValueError, KeyError):
        return {}


def show_map(stages: dict) -> str:
    return "  ".join(f"S{stage}:{len(doc['peers'])}" for stage, doc in stages.items())


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


def run_demo(peers: int, duration: float, directory: Path | None) -> int:
    model = get_model(DEFAULT_MODEL)
    if peers < model.n_stages:
        raise ConfigError(f"--peers must be at least {model.n_stages}: {model.name} has {model.n_stages} "
                          f"stages and each peer serves one")
    workdir = Path(directory or tempfile.mkdtemp(prefix="p2pswarm-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"demo: {peers} peers serving the {model.n_stages} stages of {model.name} ({model.n_layers} layers); "
          f"no training yet (it comes with the next issue); keys and logs in {workdir}", flush=True)
    processes: list[subprocess.Popen] = []
    try:
        boot = spawn(["bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--data-dir", str(workdir / "bootstrap")],
                     workdir / "bootstrap.log")
        processes.append(boot)
        boot_addr = read_first_addr(boot, "the bootstrap node")
        print(f"demo: bootstrap node at {boot_addr}", flush=True)
        apis = []
        for i in range(peers):
            api = f"127.0.0.1:{free_port()}"
            start, end = model.stage_range(i % model.n_stages)
            processes.append(spawn(["join", "--bootstrap", boot_addr, "--listen", "/ip4/127.0.0.1/tcp/0",
                                    "--data-dir", str(workdir / f"peer{i}"), "--api", api,
                                    "--layers", f"{start}:{end}"], workdir / f"peer{i}.log"))
            apis.append(api)
            print(f"demo: peer {i} serves stage {i % model.n_stages} (layers [{start}, {end})), "
                  f"status API {api}", flush=True)
        return _watch(processes, apis, model.n_stages, duration)
    except KeyboardInterrupt:
        print("\ndemo: interrupted", flush=True)
        return 0
    finally:
        print("demo: stopping every process it started", flush=True)
        stop_all(processes)


def _watch(processes: list[subprocess.Popen], apis: list[str], n_stages: int, duration: float) -> int:
    started = time.monotonic()
    formed_at = None
    while True:
        dead = [p for p in processes if p.poll() is not None]
        if dead:
            print(f"demo: a process exited with code {dead[0].returncode}; see the logs", file=sys.stderr)
            return 1
        stages = stage_map(apis[-1])
        covered = sum(1 for doc in stages.values() if doc["peers"])
        elapsed = time.monotonic() - started
        print(f"demo: t={elapsed:5.1f}s  stages served {covered}/{n_stages}  {show_map(stages)}", flush=True)
        if formed_at is None and covered == n_stages:
            formed_at = elapsed
            print(f"demo: swarm formed in {formed_at:.1f} s; try: p2pswarm status --api {apis[0]}", flush=True)
        if formed_at is None and elapsed > FORM_TIMEOUT:
            print(f"demo: the swarm did not form within {FORM_TIMEOUT:.0f} s", file=sys.stderr)
            return 1
        if formed_at is not None and duration and elapsed - formed_at >= duration:
            return 0
        time.sleep(POLL_PERIOD if formed_at is None else 5.0)
