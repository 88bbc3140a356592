"""A user-space delay line for the link lab: what a host sends arrives ``delay_ms`` later.

This machine's kernel has no ``netem``, so ``tc`` cannot add latency. The link lab (``linklab.py``)
then joins a delayed host to its bridge through two TAP devices instead of a veth pair: ``eth0``
inside the host's namespace and its bridge port inside the core namespace. One process per lab
(``python -m p2pswarm.testing.delayline``) holds both ends of every such pair and copies Ethernet
frames between them: what the host sends (after its uplink's ``tbf``) is held ``delay_ms``, what it
receives passes at once. Two hosts on delayed lines therefore see each direction delayed by the
sender's line, a round trip by both.

Frames are held on the far side of the sender's queue (read off the TAP device, so the kernel has
freed them): TCP's small-queue limit, which counts a socket's bytes not yet freed, does not throttle
the sender as a delay inside its own qdisc would. A line holds at most MAX_HELD_BYTES per direction
and drops beyond, as a router's buffer does.

``DelayLine`` is the pure core (time is ``now``); ``main`` is the driver: it enters each namespace
(``setns``), attaches to the TAP devices the lab made (``ip tuntap add``), prints ``ready`` and
copies frames until it is killed.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import select
import struct
import sys
import time
from collections import deque
from dataclasses import dataclass

from p2pswarm.testing.netns import enter_namespace

MAX_HELD_BYTES = 8 << 20  # per direction: a 100 Mbit/s line's 200 ms is 2.5 MB
MAX_FRAME = 65536  # bytes read per frame (an MTU of 1500 needs far less)
TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000
IDLE_POLL_S = 1.0  # the longest the driver sleeps when nothing is held


class DelayLine:
    """One direction of a line: frames leave in the order they came, ``delay`` seconds after."""

    def __init__(self, delay: float, max_held_bytes: int = MAX_HELD_BYTES) -> None:
        if delay < 0:
            raise ValueError(f"a delay cannot be negative: {delay}")
        self.delay = delay
        self._max = max_held_bytes
        self._held: deque[tuple[float, bytes]] = deque()
        self.held_bytes = 0
        self.dropped = 0

    def push(self, frame: bytes, now: float) -> bool:
        """Hold ``frame`` until ``now + delay``; False (dropped) when the line's buffer is full."""
        if self.held_bytes + len(frame) > self._max:
            self.dropped += 1
            return False
        self._held.append((now + self.delay, frame))
        self.held_bytes += len(frame)
        return True

    def due(self, now: float) -> list[bytes]:
        """The frames whose time has come, oldest first; they leave the line."""
        out = []
        while self._held and self._held[0][0] <= now:
            out.append(self._held.popleft()[1])
        self.held_bytes -= sum(len(f) for f in out)
        return out

    def next_due(self) -> float | None:
        """When the oldest held frame is due; None when nothing is held."""
        return self._held[0][0] if self._held else None


@dataclass(frozen=True)
class Pair:
    """A delayed host's two TAP ends: ``host_if`` in ``host_ns``, ``port_if`` in ``core_ns``."""
    host_ns: str
    host_if: str
    core_ns: str
    port_if: str
    delay_ms: float

    @classmethod
    def parse(cls, text: str) -> Pair:
        """``HOST_NS:HOST_IF:CORE_NS:PORT_IF:DELAY_MS``, as ``argv`` names it."""
        parts = text.split(":")
        if len(parts) != 5:
            raise ValueError(f"a pair is HOST_NS:HOST_IF:CORE_NS:PORT_IF:DELAY_MS, not {text!r}")
        host_ns, host_if, core_ns, port_if, delay = parts
        return cls(host_ns, host_if, core_ns, port_if, float(delay))

    def arg(self) -> str:
        return f"{self.host_ns}:{self.host_if}:{self.core_ns}:{self.port_if}:{self.delay_ms:g}"


def _attach(namespace: str, ifname: str) -> int:
    """A file descriptor for the TAP device ``ifname`` of ``namespace`` (made by ``ip tuntap add``)."""
    enter_namespace(namespace)
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", ifname.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def _drain(fd: int) -> list[bytes]:
    frames = []
    while True:
        try:
            frames.append(os.read(fd, MAX_FRAME))
        except BlockingIOError:
            return frames


def _send(fd: int, frame: bytes) -> None:
    try:
        os.write(fd, frame)
    except OSError:
        pass  # a full device queue drops the frame, as a line would


def forward(routes: dict[int, tuple[int, DelayLine]]) -> None:
    """Copy frames forever: each readable fd's frames go through its line to its out fd."""
    poller = select.epoll()
    for fd in routes:
        poller.register(fd, select.EPOLLIN)
    while True:
        pending = [due for _, line in routes.values() if (due := line.next_due()) is not None]
        wait = max(0.0, min(pending) - time.monotonic()) if pending else IDLE_POLL_S
        for fd, _ in poller.poll(wait):
            out, line = routes[fd]
            now = time.monotonic()
            for frame in _drain(fd):
                if line.delay == 0 and line.next_due() is None:
                    _send(out, frame)
                else:
                    line.push(frame, now)
        now = time.monotonic()
        for out, line in routes.values():
            for frame in line.due(now):
                _send(out, frame)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m p2pswarm.testing.delayline", description=__doc__.split("\n")[0])
    parser.add_argument("pairs", nargs="+", help="HOST_NS:HOST_IF:CORE_NS:PORT_IF:DELAY_MS per delayed host")
    args = parser.parse_args(argv)
    routes: dict[int, tuple[int, DelayLine]] = {}
    for pair in map(Pair.parse, args.pairs):
        host, port = _attach(pair.host_ns, pair.host_if), _attach(pair.core_ns, pair.port_if)
        routes[host] = (port, DelayLine(pair.delay_ms / 1000))  # what the host sends: delayed
        routes[port] = (host, DelayLine(0.0))  # what it receives: at once
    print("ready", flush=True)
    forward(routes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
