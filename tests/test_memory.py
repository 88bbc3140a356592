"""A node command runs with Python objects in glibc's malloc, trimmed (``p2pswarm/node/memory.py``), so
that a flood's memory comes back (figures: docs/benchmarks.md, section 13). The operator's own
choice of allocator is kept."""

from __future__ import annotations

import subprocess
import sys

import pytest

from p2pswarm import allocator
from p2pswarm.node import memory
from tests.procs import Swarm

pytestmark = pytest.mark.skipif(allocator.libc() is None, reason="needs Linux with glibc (malloc_trim)")


def environment_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    return {k.decode(): v.decode() for k, v in pairs}


def started(swarm: Swarm, env: dict | None = None) -> int:
    process = swarm.start("bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", name="node", env=env)
    assert "/p2p/12D3" in process.stdout.readline()  # it listens, after re-executing itself
    return process.pid


def test_a_node_runs_with_the_system_allocator(tmp_path, monkeypatch):
    monkeypatch.delenv(allocator.ALLOCATOR_ENV, raising=False)
    swarm = Swarm(tmp_path)
    try:
        pid = started(swarm)
        assert environment_of(pid)[allocator.ALLOCATOR_ENV] == allocator.SYSTEM_ALLOCATOR  # same pid: execve
    finally:
        swarm.close()


def test_the_operators_allocator_is_kept(tmp_path):
    swarm = Swarm(tmp_path)
    try:
        pid = started(swarm, env={allocator.ALLOCATOR_ENV: "pymalloc"})
        assert environment_of(pid)[allocator.ALLOCATOR_ENV] == "pymalloc"
    finally:
        swarm.close()


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def test_trim_gives_back_freed_memory_that_malloc_keeps():
    # Holes in the middle of malloc's heap (every other 64 KiB block freed) stay resident: free()
    # returns only the top of the heap to the system. malloc_trim gives the holes back.
    blocks = [bytearray(b"x" * BLOCK) for _ in range(2 * HOLES)]
    kept = blocks[1::2]
    del blocks
    freed = rss_mb()
    assert memory.trim()
    assert rss_mb() < freed - HOLES * BLOCK / 2**20 / 2, (freed, rss_mb())
    assert len(kept) == HOLES


BLOCK = 64 * 1024  # below malloc's mmap threshold: from the heap
HOLES = 1024  # 64 MiB of holes


def test_exit_at_once_still_stops_worker_threads_runs_exit_handlers_and_keeps_the_code():
    """A node leaves without finalization, but what a normal exit does first still happens: an
    executor's idle workers are stopped (they are not daemons: a plain join would wait forever), the
    log is flushed, and the exit code is the node's."""
    code = (
        "from concurrent.futures import ThreadPoolExecutor\n"
        "import logging, sys\n"
        "from p2pswarm.allocator import exit_at_once\n"
        "ThreadPoolExecutor(2).submit(int, '7').result()\n"
        "logging.basicConfig(stream=sys.stderr)\n"
        "logging.getLogger('node').warning('the last line')\n"
        "exit_at_once(3)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 3, result.stderr
    assert result.stderr.strip().endswith("the last line"), result.stderr


def test_imports_are_frozen_once_and_a_block_that_imports_nothing_freezes_nothing(tmp_path, monkeypatch):
    """``allocator.imports_without_collections``: the collector is off inside the block and on again after it;
    what a block imported is frozen, and a block that imported nothing new (a node moving to another stage,
    a forked node) makes none of the process's own objects permanent."""
    import gc

    (tmp_path / "freshly_imported_module.py").write_text("TABLE = [[i] for i in range(1000)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    frozen = gc.get_freeze_count()
    try:
        with allocator.imports_without_collections():
            assert not gc.isenabled()
            import freshly_imported_module  # noqa: F401
        assert gc.isenabled() and gc.get_freeze_count() > frozen
        frozen = gc.get_freeze_count()
        with allocator.imports_without_collections():
            kept_alive = [[n] for n in range(1000)]  # the process's own objects, nothing imported
        # none of the 1,000 made permanent; the count may drop: a frozen object can still die meanwhile
        assert gc.isenabled() and gc.get_freeze_count() <= frozen and kept_alive
    finally:
        gc.unfreeze()
