"""The demo's processes: spawning ``p2pswarm`` peers, reading their status API, stopping them.

Plain blocking helpers on ``subprocess`` and ``urllib`` (benches and test helpers use them too);
a peer's status documents come back as dicts, ``{}`` when it does not answer.
"""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from p2pswarm.errors import StartupError

STOP_TIMEOUT = 15.0  # seconds a peer gets to shut down cleanly after SIGTERM


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")  # the ports bind(0) and connect() hand out
QUIET_SPAN = 8192  # ports just below that range a free port is drawn from
PORT_TRIES = 64


def free_port(rng: random.Random | None = None) -> int:
    """A loopback port free now, for a child's API, drawn below the kernel's ephemeral range when there is
    room: a port of that range, free when checked, could be taken by any process's bind to port 0 or
    outgoing connection before the child binds it (a test's node once lost its API port that way)."""
    rng = rng or random.Random()
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    if low - QUIET_SPAN >= 1024:
        for _ in range(PORT_TRIES):
            port = rng.randrange(low - QUIET_SPAN, low)
            with socket.socket() as probe:
                try:
                    probe.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def spawn(args: list[str], log_path: Path) -> subprocess.Popen:
    log_file = open(log_path, "w")
    return subprocess.Popen([sys.executable, "-m", "p2pswarm", *args], stdout=subprocess.PIPE,
                            stderr=log_file, stdin=subprocess.DEVNULL, text=True)


def read_first_addr(process: subprocess.Popen, what: str) -> str:
    assert process.stdout is not None, "spawn pipes stdout"
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
