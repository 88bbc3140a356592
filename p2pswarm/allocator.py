"""Which allocator a node process runs with: glibc's malloc, chosen by re-executing at start.

A node's Python objects live in glibc's malloc (``PYTHONMALLOC=malloc``), which can give back any
free page (``node/memory.py`` says why and trims). The variable must be set before the interpreter
starts, so a node command re-executes itself, unless the operator chose an allocator or there is no
glibc. ``python -m p2pswarm`` and the ``p2pswarm`` command do it first thing, before the package's
imports (libp2p, torch): a node's start pays for them once, not twice. A node that has shut
down cleanly leaves without the interpreter's finalization (``exit_at_once``).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import functools
import gc
import os
import sys
import threading
from collections.abc import Iterator
from typing import NoReturn

ALLOCATOR_ENV = "PYTHONMALLOC"
SYSTEM_ALLOCATOR = "malloc"
NODE_COMMANDS = frozenset({"bootstrap", "relay", "join"})  # the commands that run a node (and may run for months)
_GLOBAL_OPTIONS_WITH_VALUE = frozenset({"--log-level", "--log-format"})  # options before the command


def command_of(argv: list[str]) -> str | None:
    """The subcommand of a ``p2pswarm`` command line (``argv`` without the program), or None."""
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in _GLOBAL_OPTIONS_WITH_VALUE:
            skip = True
        elif not arg.startswith("-"):
            return arg
    return None


def use_system_malloc(argv: list[str]) -> None:
    """Re-execute ``python -m p2pswarm argv`` with Python objects in glibc's malloc when ``argv`` is a
    node command; returns when that is not needed or not possible (another command, the variable is
    set already, no glibc)."""
    if command_of(argv) not in NODE_COMMANDS or os.environ.get(ALLOCATOR_ENV) or libc() is None:
        return
    environment = {**os.environ, ALLOCATOR_ENV: SYSTEM_ALLOCATOR}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "p2pswarm", *argv], environment)


@functools.cache
def libc() -> ctypes.CDLL | None:
    """glibc, or None (musl, macOS, Windows: no malloc_trim)."""
    name = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    try:
        found = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return found if found is not None and hasattr(found, "malloc_trim") else None


@contextlib.contextmanager
def imports_without_collections(keep: bool = True) -> Iterator[None]:
    """Heavy imports (libp2p, torch) with the cyclic garbage collector off; then, when ``keep`` (a process
    that lives on: a node), one collection and the survivors moved out of the collector's sight.

    The imports create ~265,000 objects that live as long as the process. With the collector on, the
    allocations of an import trigger full collections that walk them all and find nothing: 0.5-1 s of
    a node's start (measured, 2 cores). Once frozen (``gc.freeze``) they are no longer walked by the
    full collections a node still runs (``node/memory.py`` asks for one every 30 s: ~0.3-0.4 s each
    before, ~0 after), and a fork server's children do not copy their pages to write the collector's
    marks. The one collection first frees the ~10,000 cyclic objects the imports left as garbage.
    What is frozen is never collected: only objects alive once the imports are done, nearly all of
    them modules, classes and functions. When the block imported nothing new (a node that moves to
    another stage trains again; a forked node's server imported everything already), nothing is
    collected or frozen: the node's own objects of that moment are not made permanent.
    """
    was_enabled = gc.isenabled()
    modules_before = len(sys.modules)
    gc.disable()
    try:
        yield
    finally:
        if keep and len(sys.modules) > modules_before:
            gc.collect()
            gc.freeze()
        if was_enabled:
            gc.enable()


def exit_at_once(code: int) -> NoReturn:
    """End a node process that has shut down cleanly, without the interpreter's finalization.

    By now the node's host is closed and its files are written. What finalization would still do
    is free each of the ~400,000 objects torch and libp2p create at import, one ``free`` at a time
    in glibc's malloc: 2.5-3 s on a 2-core machine (measured), paid by every Ctrl-C and by every
    test that stops a node. The OS takes the memory back at once. Before leaving, what a normal
    exit does first still happens: non-daemon threads are waited for and the exit handlers run
    (logging's flush among them).
    """
    # what a normal exit runs first: the threading module's exit hooks (concurrent.futures stops its
    # workers there), then a join of every non-daemon thread
    wait_for_threads = getattr(threading, "_shutdown", None)
    if wait_for_threads is not None:
        wait_for_threads()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can reach it
            pass
    os._exit(code)
