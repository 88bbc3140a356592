"""Memory a node gives back once a flood of peers or streams has gone.

Measured (issue 13, ``bench/churn.py``): 17 peers holding ~2,300 silent streams raised a
bootstrap's RSS from 94 to 115 MB, and it stayed there after they left, although the number of
live Python objects was back where it started. Two allocators kept it:
- CPython's own small-object allocator (pymalloc) returns a 1 MiB arena to the system only when
  every object in it is gone; the few objects that outlive a flood (peerstore entries, caches,
  log state) are spread over many arenas and pin them all (860 empty pools, 14 MB, after one);
- glibc's malloc keeps freed memory in its heaps until asked to trim.

So a node command runs with ``PYTHONMALLOC=malloc`` (Python objects from glibc, which can give
back any free page), set by re-executing itself at start unless the operator chose an allocator
(``use_system_malloc``), and ``serve_memory_upkeep`` collects cyclic garbage and asks glibc every
``TRIM_PERIOD`` to return its free pages (``malloc_trim``, in a worker thread). Both together: 118 MB after the flood →
98 MB, against 96 MB before it. Elsewhere than Linux with glibc both are no-ops.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import logging
import os
import sys
import time

import trio

log = logging.getLogger(__name__)

ALLOCATOR_ENV = "PYTHONMALLOC"
SYSTEM_ALLOCATOR = "malloc"
TRIM_PERIOD = 30.0  # seconds; a flood's memory is back within a minute of its end (the target)


def use_system_malloc(argv: list[str]) -> None:
    """Re-execute ``python -m p2pswarm argv`` with Python objects in glibc's malloc; returns only
    when that is not needed or not possible (the variable is set already, or no glibc)."""
    if os.environ.get(ALLOCATOR_ENV) or _libc() is None:
        return
    environment = {**os.environ, ALLOCATOR_ENV: SYSTEM_ALLOCATOR}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "p2pswarm", *argv], environment)


def trim() -> bool:
    """Collect cyclic garbage, then ask glibc to give its free pages back to the system; False
    where there is no glibc. A flood leaves cycles (tasks, exceptions and their frames) that
    CPython's automatic collector reaches only at its rare full collections."""
    libc = _libc()
    if libc is None:
        return False
    gc.collect()
    libc.malloc_trim(0)
    return True


async def serve_memory_upkeep(period: float = TRIM_PERIOD) -> None:
    """Trim every ``period`` seconds, off the event loop, until cancelled."""
    if _libc() is None:
        return
    while True:
        await trio.sleep(period)
        started = time.perf_counter()
        await trio.to_thread.run_sync(trim)
        log.debug("memory trimmed in %.1f ms", (time.perf_counter() - started) * 1000)


@functools.cache
def _libc():
    """glibc, or None (musl, macOS, Windows: no malloc_trim)."""
    name = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None
