"""``demo.free_port``: a child's API port that no other process's bind to port 0 can take first."""

from __future__ import annotations

import random
import socket

from p2pswarm.demo.procs import EPHEMERAL_RANGE, free_port


def test_a_free_port_is_drawn_below_the_ephemeral_range_and_binds():
    low = int(EPHEMERAL_RANGE.read_text().split()[0])
    rng = random.Random(7)
    ports = [free_port(rng) for _ in range(20)]
    assert all(port < low for port in ports)  # never one that bind(0) or connect() may hand out meanwhile
    for port in ports:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))
