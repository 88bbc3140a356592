"""Start and stop real ``p2pswarm`` processes for integration tests, always by pid."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from p2pswarm.allocator import command_of
from p2pswarm.demo import free_port
from p2pswarm.run import diloco as dls
from tests.forked import FORKED_COMMANDS, ForkedNode

TEST_ROWS = 2  # sequences per micro-batch in small_batch_run: a quarter of tiny-lm's 8, so that a test's peers,
#                sharing 2 cores, pay a quarter of the compute and the bytes per micro-batch; no mechanism tested
#                with it depends on the batch's size (the heal test compares losses: it keeps tiny-lm's batch)
TEST_EVAL_BATCHES = 2  # held-out micro-batches per evaluation round in small_batch_run: a quarter of the run's 8
#                        (8 KiB of text): a figure per round to compare, which no test needs to 0.01 bits/byte


def small_batch_run(workdir: Path, model: str, inner_steps: int = dls.INNER_STEPS, outer_lr: float = dls.OUTER_LR,
                    momentum: float = dls.OUTER_MOMENTUM, codec: str = dls.CODEC,
                    aggregator: str = dls.AGGREGATOR, fragments: int = 1) -> tuple[str, str]:
    """``--run FILE`` for a run file written in ``workdir``: the tiny-lm run's seed, optimizer, codec and
    aggregator on ``model``, with ``TEST_ROWS`` rows per micro-batch, ``TEST_EVAL_BATCHES`` held-out micro-batches
    per evaluation round and these DiLoCo values."""
    path = workdir / f"run-{model.replace('/', '-')}-h{inner_steps}-{codec}-f{fragments}.toml"
    path.write_text(f'name = "test"\nmodel = "{model}"\n\n'
                    f"[batch]\nrows = {TEST_ROWS}\neval_batches = {TEST_EVAL_BATCHES}\n\n"
                    f"[diloco]\ninner_steps = {inner_steps}\nouter_lr = {outer_lr!r}\nmomentum = {momentum!r}\n"
                    f'codec = "{codec}"\naggregator = "{aggregator}"\nfragments = {fragments}\n')
    return "--run", str(path)


P2PSWARM = ("-m", "p2pswarm")


class Swarm:
    """Processes started by one test; ``close()`` ends each of them by pid."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.processes: list[subprocess.Popen | ForkedNode] = []

    def start(self, *args: str, name: str, env: dict | None = None,
              program: tuple[str, ...] = P2PSWARM) -> subprocess.Popen | ForkedNode:
        """``python PROGRAM ARGS``: ``p2pswarm`` (a join is forked with its imports done, ``tests.forked``), or
        in an interpreter of its own with more ``env`` or a test's script that wraps it (``attacking_peer.py``)."""
        log_path = self.workdir / f"{name}.log"
        process: subprocess.Popen | ForkedNode
        if env is None and program == P2PSWARM and command_of(list(args)) in FORKED_COMMANDS:
            log_path.write_text("")
            process = ForkedNode(list(args), self.workdir / f"{name}.out", log_path)
        else:
            process = subprocess.Popen([sys.executable, *program, *args], stdout=subprocess.PIPE,
                                       stderr=open(log_path, "w"), stdin=subprocess.DEVNULL, text=True,
                                       env={**os.environ, **env} if env else None)
        self.processes.append(process)
        return process

    def bootstrap(self) -> str:
        process = self.start("bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", name="bootstrap")
        addr = process.stdout.readline().strip()
        assert addr.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/12D3" in addr, addr
        return addr

    def join(self, boot_addr: str, layers: str, name: str, *extra: str, api: str | None = None,
             log_name: str | None = None, env: dict | None = None,
             program: tuple[str, ...] = ("-m", "p2pswarm")) -> tuple[subprocess.Popen, str]:
        """A ``join`` peer keeping its key and files in ``workdir/name`` (a restart passes the same
        name, and its old ``api``); ``extra`` are more flags."""
        api = api or f"127.0.0.1:{free_port()}"
        process = self.start("join", "--bootstrap", boot_addr, "--listen", "/ip4/127.0.0.1/tcp/0",
                             "--layers", layers, "--api", api, "--data-dir", str(self.workdir / name),
                             "--threads", "1", *extra, name=log_name or name, env=env,
                             program=program)  # peers share 2 cores
        return process, api

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(process.pid, signal.SIGKILL)
                process.wait()
            if process.stdout:
                process.stdout.close()


def get_json(api: str, path: str) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://{api}{path}", timeout=3) as response:
            return json.load(response)
    except OSError:
        return None


def wait_until(predicate, timeout: float, period: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(period)
    return predicate()
