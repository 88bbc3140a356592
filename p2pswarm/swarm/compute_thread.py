"""One long-lived thread for a stage's compute, driven from trio.

A CUDA device's current-device setting, its current stream and torch's autocast state are all
per thread, and so are the caches torch keeps behind them: the engine must run every call on the
*same* thread, not on whichever of trio's cached worker threads is free. ``ComputeThread`` is that
thread: jobs run one at a time, in the order submitted, so whatever goes through it never runs
concurrently with the engine's other work.

Two lanes: a job submitted with ``urgent=True`` (an inference step, ``swarm/inference.py``)
runs before every ordinary job still queued, after the job running now; FIFO within a lane.

``await thread.run(fn, *args)`` submits ``fn(*args)`` and waits for its result (or exception)
without blocking the trio loop: the thread wakes the waiting task through the loop's trio token.
When the waiting task is cancelled, the job still runs to its end (a half-done optimizer step
would be worse than a late one) and its result is dropped; jobs submitted after it wait their
turn behind it. ``open_compute_thread`` starts the thread and stops it on the way out (the jobs
queued by then run first); the thread is a daemon, so a process that exits does not wait on it.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

import outcome
import trio

from p2pswarm.errors import LocalProtocolError

_STOP = object()  # the sentinel that ends the thread's loop
URGENT, ORDINARY, LAST = 0, 1, 2  # lanes: inference steps, the rest, the stop sentinel after both


class ComputeThread:
    """A dedicated thread that runs submitted jobs in order (module docstring)."""

    def __init__(self, name: str = "p2pswarm-compute") -> None:
        self.name = name
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()  # (lane, submission number, job)
        self._numbers = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False  # stop() was called: a job submitted now would never run

    def start(self) -> None:
        if self._thread is not None:
            raise LocalProtocolError(f"{self.name} was started already")
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Let the queued jobs run, then end the thread (without waiting for it)."""
        if self._thread is not None and not self._stopping:
            self._stopping = True
            self._jobs.put((LAST, next(self._numbers), _STOP))

    @property
    def ident(self) -> int | None:
        """The thread's id once started: every job runs with ``threading.get_ident()`` equal to it."""
        return self._thread.ident if self._thread else None

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()[2]
            if job is _STOP:
                return
            job()

    async def run(self, fn: Callable[..., Any], *args: Any, urgent: bool = False) -> Any:
        """``fn(*args)`` on the thread; its result, or its exception raised here. ``urgent``: ahead of
        the ordinary jobs queued (module docstring)."""
        if self._thread is None or self._stopping:
            raise LocalProtocolError(f"{self.name} is not running")
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        box: list[outcome.Outcome] = []

        def job() -> None:
            box.append(outcome.capture(fn, *args))
            try:
                token.run_sync_soon(done.set)
            except trio.RunFinishedError:  # the loop is gone: nobody waits for this result
                pass

        self._jobs.put((URGENT if urgent else ORDINARY, next(self._numbers), job))
        await done.wait()  # (cancelled: the job still runs; its result is dropped)
        return box[0].unwrap()


@asynccontextmanager
async def open_compute_thread(name: str = "p2pswarm-compute"):
    """A started ``ComputeThread``, stopped when the block is left."""
    thread = ComputeThread(name)
    thread.start()
    try:
        yield thread
    finally:
        thread.stop()
