"""Peers that come and go: fresh identities connecting to a node, working briefly, leaving.

Each *lifetime* is one new Ed25519 identity with its own host: it connects to the target (the
handshake is timed: TCP, Noise, Yamux), does one piece of work over the control channel (a
``Ping``) or on a relay (a circuit v2 reservation), and closes its host. ``run_churn`` runs
``count`` lifetimes, ``parallel`` at a time, and reports each block of ``report_every`` as a
``ChurnBlock``. Used by the regression tests (tests/test_integration_churn.py) and by
``bench/churn.py``; the node under test is a real process, watched through ``ProcessUsage``.

``churn_in_processes`` runs the lifetimes from fresh client processes
(``python -m p2pswarm.testing.churn``, one JSON line per block): a client's CPU per lifetime
(~40 ms, py-libp2p's handshake, identify and Yamux) exceeds the node's (~26 ms), so one client is
the bottleneck, and a test runner's big heap (torch imported) slowed it by a further ~60 %.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import trio

from p2pswarm import wire
from p2pswarm.identity import generate_identity
from p2pswarm.net.connect import HOP_PROTOCOL
from p2pswarm.net.control import ControlService
from p2pswarm.net.host import connect, open_host, peer_info_from_multiaddr

LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)
NO_LISTENER = ()  # a lifetime only dials out, as a peer behind a NAT does: no port to open and close
LIFETIME_TIMEOUT = 10.0  # one connect + one exchange; an honest node on loopback answers in milliseconds


@dataclass(frozen=True)
class ChurnBlock:
    """One block of lifetimes: how many were accepted, and their handshake latencies (seconds)."""

    first: int  # index of the block's first lifetime
    accepted: int
    failed: int
    handshakes: tuple[float, ...]
    errors: tuple[str, ...]  # the first few failures, for the report

    @property
    def accept_rate(self) -> float:
        return self.accepted / max(1, self.accepted + self.failed)

    def percentile(self, q: float) -> float:
        values = sorted(self.handshakes)
        if not values:
            return float("nan")
        return values[min(len(values) - 1, int(q * len(values)))]


async def ping_work(host, target, control: ControlService) -> None:
    """A lifetime's work on a bootstrap or a training peer: one control round trip."""
    reply = await control.request(target.peer_id, wire.Ping(nonce=7))
    if not isinstance(reply, wire.Pong):
        raise RuntimeError(f"a Ping was answered with {reply!r}")


async def reserve_work(host, target, control: ControlService) -> None:
    """A lifetime's work on a relay: one circuit v2 reservation, which must be accepted."""
    from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
    from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

    stream = await host.new_stream(target.peer_id, [HOP_PROTOCOL])
    try:
        await write_delimited_msg(stream, HopMessage(type=HopMessage.RESERVE))
        reply = await read_delimited_msg(stream, HopMessage)
    finally:
        await stream.close()
    if reply.status != 100:  # STATUS_OK
        raise RuntimeError(f"reservation refused (status {reply.status})")


Work = Callable[[object, object, ControlService], Awaitable[None]]


async def one_lifetime(target_addr, work: Work = ping_work) -> float:
    """A fresh peer connects to ``target_addr`` (a multiaddr, or its PeerInfo), works, and leaves; its
    handshake time in seconds."""
    target = peer_info_from_multiaddr(target_addr) if isinstance(target_addr, str) else target_addr
    async with open_host(generate_identity(), NO_LISTENER) as host, trio.open_nursery() as nursery:
        control = ControlService(host, nursery)
        with trio.fail_after(LIFETIME_TIMEOUT):
            began = trio.current_time()
            await connect(host, target)
            handshake = trio.current_time() - began
            await work(host, target, control)
        nursery.cancel_scope.cancel()
    return handshake


async def run_churn(target_addr: str, count: int, *, parallel: int = 4, report_every: int = 1000,
                    work: Work = ping_work, on_block: Callable[[ChurnBlock], None] = lambda block: None,
                    ) -> list[ChurnBlock]:
    """``count`` lifetimes against ``target_addr``, ``parallel`` at a time; one report per block."""
    blocks: list[ChurnBlock] = []
    target = peer_info_from_multiaddr(target_addr)  # parsed once: ~5 ms of the client's CPU per lifetime
    for first in range(0, count, report_every):
        size = min(report_every, count - first)
        handshakes: list[float] = []
        errors: list[str] = []
        next_index = iter(range(size))

        async def worker(next_index: Iterator[int], handshakes: list[float], errors: list[str]) -> None:
            for _ in next_index:
                try:
                    handshakes.append(await one_lifetime(target, work))
                except Exception as exc:  # counted: a refused or failed lifetime is the measurement
                    errors.append(describe(exc))

        async with trio.open_nursery() as nursery:
            for _ in range(parallel):
                nursery.start_soon(worker, next_index, handshakes, errors)
        block = ChurnBlock(first, len(handshakes), len(errors), tuple(handshakes), tuple(errors[:3]))
        blocks.append(block)
        on_block(block)
    return blocks


WORKS: dict[str, Work] = {"ping": ping_work, "reserve": reserve_work}


def churn_in_processes(target_addr: str, count: int, *, clients: int = 2, parallel: int = 16,
                       report_every: int = 500, work: str = "ping",
                       on_block: Callable[[ChurnBlock], None] = lambda block: None) -> list[ChurnBlock]:
    """``count`` lifetimes from ``clients`` client processes, ``parallel`` at a time in all; their blocks in
    order (each block's ``first`` counts across clients), reported once every client is done."""
    shares = [count // clients + (1 if k < count % clients else 0) for k in range(clients)]
    firsts = [sum(shares[:k]) for k in range(clients)]
    started = [subprocess.Popen(
        [sys.executable, "-m", "p2pswarm.testing.churn", target_addr, str(share), "--first", str(first),
         "--parallel", str(max(1, parallel // clients)), "--report-every", str(report_every), "--work", work],
        stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        for share, first in zip(shares, firsts, strict=True) if share]
    blocks: list[ChurnBlock] = []
    try:
        with ThreadPoolExecutor(len(started)) as readers:  # each pipe drained as its client writes it
            outputs = list(readers.map(lambda process: process.communicate()[0], started))
        for process, output in zip(started, outputs, strict=True):
            if process.returncode != 0:
                raise RuntimeError(f"churn client {process.args!r} exited with {process.returncode}")
            for line in output.splitlines():
                doc = json.loads(line)
                blocks.append(ChurnBlock(**{**doc, "handshakes": tuple(doc["handshakes"]),
                                            "errors": tuple(doc["errors"])}))
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
                process.wait()
    blocks.sort(key=lambda block: block.first)
    for block in blocks:
        on_block(block)
    return blocks


def main(argv: list[str] | None = None) -> None:
    """A churn client: COUNT lifetimes against TARGET, one JSON line per block on stdout."""
    parser = argparse.ArgumentParser(prog="python -m p2pswarm.testing.churn", description=main.__doc__)
    parser.add_argument("target", help="the node's multiaddr, ending in /p2p/<peer id>")
    parser.add_argument("count", type=int)
    parser.add_argument("--first", type=int, default=0, help="the index of this client's first lifetime")
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--report-every", type=int, default=1000)
    parser.add_argument("--work", choices=sorted(WORKS), default="ping")
    args = parser.parse_args(argv)

    def report(block: ChurnBlock) -> None:
        print(json.dumps({**asdict(block), "first": args.first + block.first}), flush=True)

    trio.run(lambda: run_churn(args.target, args.count, parallel=args.parallel, report_every=args.report_every,
                               work=WORKS[args.work], on_block=report))


def describe(exc: BaseException) -> str:
    """The innermost error of ``exc`` (trio wraps one in exception groups), in one short line."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"[:200]


@dataclass(frozen=True)
class ProcessUsage:
    """What a process holds now: resident memory and open file descriptors (Linux /proc)."""

    rss_mb: float
    fds: int

    @classmethod
    def of(cls, pid: int) -> ProcessUsage:
        rss_kb = 0
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    rss_kb = int(line.split()[1])
        return cls(rss_mb=rss_kb / 1024, fds=len(os.listdir(f"/proc/{pid}/fd")))


if __name__ == "__main__":
    main()
