"""Small helpers shared by the benchmarks in bench/: statistics, tables, server processes.

Exists so that every benchmark computes percentiles the same way, prints the same kind of
table, and starts/stops its server process the same way (by pid, never by name). Nothing
here is part of p2pswarm; it is imported as ``common`` because each benchmark is run as
``python bench/NAME.py`` (which puts bench/ on sys.path).
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import subprocess
import sys
from collections.abc import Sequence

import trio

from p2pswarm import wire

LOOPBACK = "/ip4/127.0.0.1/tcp/0"  # any free port, loopback only
LOOPBACK_HOST = "127.0.0.1"
SERVER_START_TIMEOUT = 30.0  # a libp2p host starts in well under a second; 30 s means it broke
SERVER_STOP_TIMEOUT = 5.0  # SIGTERM first, SIGKILL after this long


@wire.message("bench-ack")
class BenchAck(wire.Message):
    """A receiver's answer at the end of a transfer: bytes received and CPU it spent (µs)."""

    total: int
    cpu_us: int

    def check(self, payload_len: int) -> None:
        if payload_len:
            from p2pswarm.errors import RemoteProtocolError

            raise RemoteProtocolError("bench-ack carries no payload")


class RawStream:
    """A trio SocketStream with the ``read``/``write`` interface ``wire`` expects."""

    def __init__(self, stream) -> None:
        self._stream = stream

    async def read(self, max_bytes: int) -> bytes:
        return await self._stream.receive_some(max_bytes)

    async def write(self, data: bytes) -> None:
        await self._stream.send_all(data)


# --- statistics --------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.2f}"


def us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f}"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


# --- output ------------------------------------------------------------------------------


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A Markdown table, so that the output can be pasted into docs/benchmarks.md."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print(f"\n{title}\n")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells:
        print("| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |")
    sys.stdout.flush()


# --- server processes --------------------------------------------------------------------


def announce(info: dict) -> None:
    """A server's first stdout line: where to reach it, as JSON."""
    print(json.dumps(info), flush=True)


def start_server(script: str, *args: str) -> tuple[subprocess.Popen, dict]:
    """Run ``script --serve`` in a new process; return it and the JSON line it announced."""
    process = subprocess.Popen([sys.executable, script, "--serve", *args], stdout=subprocess.PIPE,
                               stdin=subprocess.DEVNULL, text=True)
    try:
        line = _readline_with_timeout(process, SERVER_START_TIMEOUT)
        return process, json.loads(line)
    except Exception:
        stop_server(process)
        raise


def _readline_with_timeout(process: subprocess.Popen, timeout: float) -> str:
    import selectors

    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout):
            raise RuntimeError(f"server pid {process.pid} announced nothing within {timeout:.0f} s")
    line = process.stdout.readline()
    if not line:
        raise RuntimeError(f"server pid {process.pid} exited (code {process.poll()}) before announcing")
    return line


def stop_server(process: subprocess.Popen) -> None:
    """End the server we started, by its pid: SIGTERM, then SIGKILL if it lingers."""
    if process.poll() is None:
        os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=SERVER_STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
    if process.stdout:
        process.stdout.close()


def quiet_logs() -> None:
    """Errors of ours on stderr only; py-libp2p's routine complaints (a peer that hung up
    during identify, say) silenced the way the p2pswarm CLI silences them."""
    import logging

    from p2pswarm.logs import quiet_libp2p, setup_logging

    setup_logging("warning")
    quiet_libp2p("warning")
    logging.getLogger("p2pswarm").setLevel(logging.ERROR)


def machine_line() -> str:
    import platform
    from importlib.metadata import version

    return (f"machine: {os.cpu_count()} cores, loopback 127.0.0.1, Python {platform.python_version()}, "
            f"py-libp2p {version('libp2p')}, trio {version('trio')}, "
            f"load average {os.getloadavg()[0]:.2f} at start")


def run_client_server(script: str, serve, client, report, *client_args) -> None:
    """The shape of every two-process benchmark: ``--serve`` runs ``serve``; otherwise start
    that server as a child process, run ``client(info, *client_args)`` against it, stop the
    server by pid, and ``report(results, *client_args)``."""
    if "--serve" in sys.argv[1:]:
        trio.run(serve)
        return
    print(machine_line())
    process, info = start_server(script)
    try:
        results = trio.run(client, info, *client_args)
    finally:
        stop_server(process)
    report(results, *client_args)


def one_process(model: str, eval_batches: int | None = None, rank: int = 0, seed: int = 0):
    """The demo's run (``tiny-lm``'s optimizer and micro-batches) on ``model`` in one process, as the
    benchmarks' baselines train it: a namespace of ``spec``, ``config``, ``stages``, ``params``, ``opt``
    (AdamW over the run's parameter groups), ``batches`` (the stdlib corpus, seed 1 by default) and ``evaluate()``
    (held-out bits/byte on the swarm's held-out set: its first ``eval_batches`` micro-batches, default
    the run's); ``rank`` > 0: the model constrained to a subspace of that many directions; ``seed``: the
    initial weights' (the batches take ``seed + 1``)."""
    from types import SimpleNamespace

    import torch

    from p2pswarm.model.catalog import get_model
    from p2pswarm.model.corpus import batches, heldout_batches, stdlib_corpus
    from p2pswarm.model.transformer import build_model, run_stages
    from p2pswarm.run.spec import load_run
    from p2pswarm.run.training import train_config
    from p2pswarm.swarm.engine import ids_tensor, param_groups
    from p2pswarm.swarm.evaluation import EVAL_BATCHES, EVAL_ROWS

    config = train_config(load_run("tiny-lm"))
    spec = get_model(model)
    stages = build_model(spec, seed, rank)
    groups = [g for m in stages for g in param_groups(m, config.weight_decay)]
    corpus = stdlib_corpus()
    rows = (eval_batches or EVAL_BATCHES) * EVAL_ROWS
    held = [ids_tensor(b.rows) for b in heldout_batches(corpus, spec.context, EVAL_ROWS, rows)]

    def evaluate() -> float:
        with torch.no_grad():
            nats = sum(torch.nn.functional.cross_entropy(run_stages(stages, h[:, :-1]).reshape(-1, spec.vocab),
                                                         h[:, 1:].reshape(-1), reduction="sum").item() for h in held)
        return nats / sum(h[:, 1:].numel() for h in held) / math.log(2)

    return SimpleNamespace(spec=spec, config=config, stages=stages, params=[p for m in stages for p in m.parameters()],
                           opt=torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps),
                           batches=batches(corpus, 0, 1, spec.context, config.rows, seed=seed + 1), evaluate=evaluate)
