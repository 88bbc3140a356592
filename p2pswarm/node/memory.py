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
(``allocator.use_system_malloc``), and ``serve_memory_upkeep`` collects cyclic garbage and asks glibc every
``TRIM_PERIOD`` to return its free pages (``malloc_trim``, in a worker thread). Both together: 118 MB after the flood →
98 MB, against 96 MB before it. Elsewhere than Linux with glibc both are no-ops.
"""

from __future__ import annotations

import gc
import logging
import time

import trio

from p2pswarm.allocator import libc

log = logging.getLogger(__name__)

TRIM_PERIOD = 30.0  # seconds; a flood's memory is back within a minute of its end (the target)


def trim() -> bool:
    """Collect cyclic garbage, then ask glibc to give its free pages back to the system; False
    where there is no glibc. A flood leaves cycles (tasks, exceptions and their frames) that
    CPython's automatic collector reaches only at its rare full collections."""
    glibc = libc()
    if glibc is None:
        return False
    gc.collect()
    glibc.malloc_trim(0)
    return True


async def serve_memory_upkeep(period: float = TRIM_PERIOD) -> None:
    """Trim every ``period`` seconds, off the event loop, until cancelled."""
    if libc() is None:
        return
    while True:
        await trio.sleep(period)
        started = time.perf_counter()
        await trio.to_thread.run_sync(trim)
        log.debug("memory trimmed in %.1f ms", (time.perf_counter() - started) * 1000)
