"""A bootstrap node through thousands of connection lifetimes, and through a flood of silent streams.

Why: a public bootstrap or relay node sees peers come and go for months. py-libp2p 0.8.1 kept
each inbound connection's slot until the node stopped, so after 257 lifetimes every new peer
was refused (issue 13). This runs a real ``p2pswarm bootstrap`` process and, from this
process, ``--lifetimes`` fresh identities (``p2pswarm.testing.churn``: connect, one control
ping, leave; ``--parallel`` at a time). Every ``--report-every`` lifetimes it prints the accept
rate, the handshake latency p50/p99, and the node's open fds and RSS (from /proc); the last
block is compared with the first (the baseline is the node's own first thousand, same run).

Also in the same run, as baselines:
- ``--library N``: N lifetimes against a host with py-libp2p's own inbound handler (this
  script started with ``--serve-library``), reported per block of 100: the lock-out itself.
- the flood (``--no-flood`` skips it): 17 peers each hold 100 negotiated control streams and 100
  raw Yamux streams that never negotiate (what the probe of issue 13 did), for ``FLOOD_HOLD``
  seconds, then leave; the node's RSS is printed every 5 s for a minute against its level just
  before the flood. Run twice: with p2pswarm's default (glibc malloc, trimmed; ``p2pswarm.node.memory``)
  and with ``PYTHONMALLOC=pymalloc`` (CPython's own allocator) as the baseline.

Run: ``python bench/churn.py`` (defaults: 10,000 lifetimes, 8 at a time, library 600, both floods).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import trio
from common import machine_line, print_table, quiet_logs, ratio, stop_server

from p2pswarm import wire
from p2pswarm.allocator import ALLOCATOR_ENV
from p2pswarm.identity import generate_identity
from p2pswarm.net.control import CONTROL_PROTOCOL, ControlService
from p2pswarm.net.host import connect, open_host, peer_info_from_multiaddr
from p2pswarm.testing.churn import LOOPBACK, ChurnBlock, ProcessUsage, run_churn

FLOOD_PEERS = 17  # the probe's attackers
FLOOD_NEGOTIATED = 100  # control streams each attacker negotiates and leaves silent
FLOOD_RAW = 100  # raw Yamux streams each opens and never negotiates
FLOOD_HOLD = 20.0  # seconds the attackers hold their streams before leaving
RECOVERY_WINDOW = 60.0  # the target: RSS back within 10 % within a minute
WARMUP = 500  # lifetimes before the flood baseline, so the node's steady state is measured


def start_node(*args: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([sys.executable, "-m", "p2pswarm", *args], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True,
                               env={**os.environ, **env} if env else None)
    addr = process.stdout.readline().strip()
    if "/p2p/" not in addr:
        stop_server(process)
        raise SystemExit(f"node did not start: {addr!r}")
    return process, addr


def block_row(block: ChurnBlock, usage: ProcessUsage) -> list[object]:
    end = block.first + block.accepted + block.failed
    return [f"{block.first + 1}-{end}", f"{block.accept_rate:.1%}", f"{block.percentile(0.5) * 1000:.0f}",
            f"{block.percentile(0.99) * 1000:.0f}", usage.fds, f"{usage.rss_mb:.1f}"]


def churn_section(args) -> None:
    process, addr = start_node("bootstrap", "--listen", LOOPBACK[0])
    rows, usages, blocks = [], [], []
    started = time.monotonic()

    def on_block(block: ChurnBlock) -> None:
        usage = ProcessUsage.of(process.pid)
        usages.append(usage)
        blocks.append(block)
        rows.append(block_row(block, usage))
        print(f"  {rows[-1]} ({time.monotonic() - started:.0f} s)", flush=True)

    try:
        trio.run(lambda: run_churn(addr, args.lifetimes, parallel=args.parallel,
                                   report_every=args.report_every, on_block=on_block))
    finally:
        stop_server(process)
    print_table(f"{args.lifetimes} lifetimes against a p2pswarm bootstrap ({args.parallel} at a time, "
                f"{time.monotonic() - started:.0f} s)",
                ["lifetimes", "accepted", "handshake p50 ms", "p99 ms", "node fds", "node RSS MB"], rows)
    first, last = blocks[0], blocks[-1]
    print(f"last block / first block: handshake p99 {ratio(last.percentile(0.99), first.percentile(0.99))}, "
          f"RSS {ratio(usages[-1].rss_mb, usages[0].rss_mb)}, fds {usages[-1].fds} / {usages[0].fds}; "
          f"accepted {sum(b.accepted for b in blocks)} of {args.lifetimes}")


def library_section(args) -> None:
    process, addr = start_node_script("--serve-library")
    rows = []
    try:
        for block in trio.run(lambda: run_churn(addr, args.library, parallel=args.parallel, report_every=100)):
            rows.append(block_row(block, ProcessUsage.of(process.pid)))
    finally:
        stop_server(process)
    print_table("baseline: the same lifetimes against py-libp2p's own inbound handler (max_connections 256)",
                ["lifetimes", "accepted", "handshake p50 ms", "p99 ms", "node fds", "node RSS MB"], rows)


def start_node_script(flag: str) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([sys.executable, __file__, flag], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True)
    return process, json.loads(process.stdout.readline())["addr"]


def serve_library() -> None:
    """A p2pswarm host answering pings, with py-libp2p's own inbound handler put back."""
    async def main():
        async with open_host(generate_identity(), LOOPBACK) as host, trio.open_nursery() as nursery:
            del host.get_network()._handle_inbound_connection  # the library's method again
            ControlService(host, nursery).handle(wire.Ping, _pong)
            print(json.dumps({"addr": str(host.get_addrs()[0])}), flush=True)
            await trio.sleep_forever()

    trio.run(main)


async def _pong(peer: str, message: wire.Ping) -> wire.Pong:
    return wire.Pong(nonce=message.nonce + 1)


async def flood_peer(addr: str, done: trio.Event, opened: list[int]) -> None:
    """One attacker: negotiated control streams and raw streams, held silent until ``done``."""
    target = peer_info_from_multiaddr(addr)
    async with open_host(generate_identity(), LOOPBACK) as host:
        await connect(host, target)
        muxed = host.get_network().get_connections(target.peer_id)[0].muxed_conn
        muxed.stream_backlog_semaphore = trio.Semaphore(1 << 16)  # its own library would stop at 256
        held = []
        for _ in range(FLOOD_NEGOTIATED):
            try:
                held.append(await host.new_stream(target.peer_id, [CONTROL_PROTOCOL]))
            except Exception:  # refused past the per-protocol limit: what the node should do
                pass
        for _ in range(FLOOD_RAW):
            try:
                held.append(await muxed.open_stream())
            except Exception:
                break
        opened.append(len(held))
        await done.wait()


def flood_section(args, allocator: str | None) -> None:
    env = {ALLOCATOR_ENV: allocator} if allocator else None
    process, addr = start_node("bootstrap", "--listen", LOOPBACK[0], env=env)
    try:
        trio.run(lambda: run_churn(addr, WARMUP, parallel=args.parallel, report_every=WARMUP))
        time.sleep(5)
        before = ProcessUsage.of(process.pid)
        peak = trio.run(_flood, addr, process.pid)
        rows, left_at = [], time.monotonic()
        while (elapsed := time.monotonic() - left_at) <= RECOVERY_WINDOW + 0.1:
            usage = ProcessUsage.of(process.pid)
            rows.append([f"{elapsed:.0f}", f"{usage.rss_mb:.1f}", ratio(usage.rss_mb, before.rss_mb), usage.fds])
            time.sleep(5)
    finally:
        stop_server(process)
    chosen = f"{ALLOCATOR_ENV}={allocator} set by the operator" if allocator else "p2pswarm's default allocator"
    print_table(f"flood ({chosen}): {FLOOD_PEERS} peers x ({FLOOD_NEGOTIATED} control + {FLOOD_RAW} raw) "
                f"silent streams "
                f"held {FLOOD_HOLD:.0f} s; node before: {before.rss_mb:.1f} MB, {before.fds} fds; "
                f"peak {peak.rss_mb:.1f} MB, {peak.fds} fds",
                ["s after the flood left", "node RSS MB", "vs before", "fds"], rows)


async def _flood(addr: str, pid: int) -> ProcessUsage:
    done, opened = trio.Event(), []
    async with trio.open_nursery() as nursery:
        for _ in range(FLOOD_PEERS):
            nursery.start_soon(flood_peer, addr, done, opened)
        await trio.sleep(FLOOD_HOLD)
        peak = ProcessUsage.of(pid)
        print(f"  flood: {sum(opened)} streams held by {len(opened)} peers; node {peak}", flush=True)
        done.set()
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lifetimes", type=int, default=10_000)
    parser.add_argument("--report-every", type=int, default=1000)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--library", type=int, default=600, help="lifetimes against the library's handler (0: skip)")
    parser.add_argument("--no-flood", dest="flood", action="store_false")
    parser.add_argument("--serve-library", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    quiet_logs()
    if args.serve_library:
        serve_library()
        return
    print(machine_line())
    if args.library:
        library_section(args)
    if args.flood:
        flood_section(args, None)
        flood_section(args, "pymalloc")  # the baseline: CPython's own small-object allocator
    if args.lifetimes:
        churn_section(args)


if __name__ == "__main__":
    main()
