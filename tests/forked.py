"""Node processes forked from a server that imported torch and libp2p once (the tests' ``Swarm``).

A ``python -m p2pswarm join`` spends ~3.7 s of CPU importing torch (2.5 s) and libp2p (1.2 s)
before it does anything, and a test's peers start together on 2 shared cores: over a suite, a few
minutes of imports. ``multiprocessing``'s fork server imports them once (``PRELOAD``); each node
is then forked from it: a real process with its own pid, sockets, signals and files, running
``p2pswarm.cli.main`` on the command line ``python -m p2pswarm`` would run, in glibc's malloc as
``p2pswarm.allocator`` arranges for a node, and leaving through ``exit_at_once`` as a node does.
What it skips is the interpreter's start and those imports. The command line's own start (the
re-exec into glibc's malloc, the lazy imports) stays tested where tests run ``python -m p2pswarm``
themselves: ``test_cli``, ``test_memory``, the demo's test, and the NAT lab's bootstrap and relay nodes.

The NAT lab's joins are forked too (``spawn_in_namespace``): the child enters the lab host's network
namespace (``setns``, as ``ip netns exec`` does) and is bounded in time by ``alarm`` (as ``timeout``
bounds a started one).
"""

from __future__ import annotations

import functools
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from multiprocessing import forkserver
from pathlib import Path

from p2pswarm import allocator
from p2pswarm.allocator import command_of
from p2pswarm.testing.natlab import p2pswarm_argv
from p2pswarm.testing.netns import enter_namespace

PRELOAD = ["torch", "p2pswarm.cli", "p2pswarm.node.running", "p2pswarm.swarm.service", "p2pswarm.diloco.service",
           "p2pswarm.diloco.backup_service", "p2pswarm.diloco.loading",  # what a training join imports
           "tests.forked_freeze"]  # then what a node does once its imports are done, once for all
PROGRAM = p2pswarm_argv()  # a node's command line, as the NAT lab starts one
FORKED_COMMANDS = {"join"}  # a bootstrap or relay never imports torch: forked with it, its every GC would walk
#                             torch's objects too (the churn test's bootstrap took 99 s instead of 75)
LINE_DEADLINE = 120.0  # seconds readline waits for a node's first line (its address): a guard only
POLL_S = 0.05


@functools.cache
def _context() -> multiprocessing.context.ForkServerContext:
    """The fork server, started once, with the allocator a node re-executes into (it is chosen at start)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    before = os.environ.get(allocator.ALLOCATOR_ENV)
    os.environ[allocator.ALLOCATOR_ENV] = allocator.SYSTEM_ALLOCATOR
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ[allocator.ALLOCATOR_ENV]
        else:
            os.environ[allocator.ALLOCATOR_ENV] = before
    return context


def _node_main(argv: list[str], out_path: str, err_path: str, namespace: str | None = None,
               life_s: float | None = None) -> None:
    """In the forked child: into ``namespace`` and bounded to ``life_s`` seconds (SIGALRM ends it) if given;
    standard streams as a started process has them; then the node's command."""
    if namespace is not None:
        enter_namespace(namespace)
    if life_s is not None:
        signal.alarm(max(1, math.ceil(life_s)))
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(os.open(out_path, os.O_WRONLY | os.O_APPEND), 1)
    os.dup2(os.open(err_path, os.O_WRONLY | os.O_APPEND), 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    from p2pswarm.cli import main

    allocator.exit_at_once(main(argv))


class Lines:
    """``readline`` of a file another process writes: waits for a whole line while it lives."""

    def __init__(self, path: Path, alive) -> None:
        self._file = open(path)
        self._alive = alive
        self._partial = ""

    def readline(self) -> str:
        deadline = time.monotonic() + LINE_DEADLINE
        while True:
            self._partial += self._file.readline()
            if self._partial.endswith("\n") or not self._alive() or time.monotonic() > deadline:
                line, self._partial = self._partial, ""
                return line
            time.sleep(POLL_S)

    def close(self) -> None:
        self._file.close()


class ForkedNode:
    """What the tests use of ``subprocess.Popen``, for a node forked by the server."""

    def __init__(self, args: list[str], stdout_path: Path, stderr_path: Path, namespace: str | None = None,
                 life_s: float | None = None) -> None:
        self.args = args
        stdout_path.write_text("")
        self._process = _context().Process(target=_node_main, daemon=True,  # one left running ends with the tests
                                           args=(args, str(stdout_path), str(stderr_path), namespace, life_s))
        self._process.start()
        self.stdout = Lines(stdout_path, lambda: self.poll() is None)

    @property
    def pid(self) -> int:
        assert self._process.pid is not None, "started in __init__"
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self._process.exitcode


def spawn_in_namespace(namespace: str, argv: list[str], log_path: str | Path | None,
                       timeout: float) -> ForkedNode | None:
    """``NamespaceLab``'s hook for ``python -m p2pswarm join ...`` (``argv`` as the lab would start it): forked
    into ``namespace``, its stderr to ``log_path``, ended after ``timeout`` s; None for any other command."""
    args = argv[len(PROGRAM):]
    if argv[:len(PROGRAM)] != PROGRAM or command_of(args) not in FORKED_COMMANDS or log_path is None:
        return None
    log_path = Path(log_path)
    log_path.write_text("")
    return ForkedNode(args, log_path.with_suffix(".out"), log_path, namespace=namespace, life_s=timeout)
