"""Entering a network namespace from Python: ``setns(2)`` on the file ``ip netns add`` binds.

Used by a process that must open something inside a lab namespace it was not started in (the
delay line's TAP devices) or that was forked outside one (the tests' fork server)."""

from __future__ import annotations

import ctypes
import os

NETNS_DIR = "/var/run/netns"  # where ``ip netns add`` binds a namespace
CLONE_NEWNET = 0x40000000  # <sched.h>: setns's network namespace type


def enter_namespace(name: str) -> None:
    """This process (single-threaded) into the network namespace ``ip netns`` calls ``name``."""
    fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name}")
    finally:
        os.close(fd)
