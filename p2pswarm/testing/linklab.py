"""A shaped-link lab on one machine: each host on its own rate-limited line onto one bridge.

Where the NAT lab (``natlab.py``) asks "can these peers reach each other", this lab asks "how do
they train over home-sized links". Requires root, iproute2 (``ip netns``, ``tc`` with the ``tbf``
qdisc) and coreutils ``timeout``. Topology::

    core namespace: bridge br0 (no address of its own), 10.98.0.0/24
      port p<i> -- host namespace h<i>: eth0 10.98.0.(10+i)/24

Shaping is ``tc qdisc ... tbf`` (rate only: the kernels this runs on may lack netem, so no delay
or loss here): a host's **uplink** on its own ``eth0`` inside its
namespace (what it sends), its **downlink** on its bridge port inside the core namespace (what the
bridge hands it). ``None`` leaves that direction unshaped (veth speed).

Safety, as in the NAT lab: every address lives inside namespaces this lab creates; nothing is
linked to the root namespace and no namespace has a route out (only the bridge's /24). IPv6 is
disabled in every lab namespace. Every process runs inside a lab namespace under ``timeout``; on
exit the lab stops its processes by pid (SIGTERM, then SIGKILL of whatever ``ip netns pids``
still lists) and deletes the namespaces, even after an error. Namespace names are
``p2k<pid><lab letters><role><index>``, unique per run, at most 15 characters.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from dataclasses import dataclass

from p2pswarm.testing.natlab import CMD_TIMEOUT, LabHost, NamespaceLab, kill_netns, letters

NAME_PREFIX = "p2k"  # every link-lab namespace starts with this, then the pid of the process that made it
SUBNET = "10.98.0"  # the lab's /24 (the NAT lab uses 10.99)
HOST_OCTET_BASE = 10  # host i gets SUBNET.(10+i)
MAX_HOSTS = 200
BRIDGE, HOST_IF = "br0", "eth0"
# tbf: burst 64 KiB is above rate/HZ at every rate used here (100 Mbit/s / 250 Hz = 50 KB), so the
# bucket can refill to the full rate between timer ticks, yet a burst is only ~5 ms at 100 Mbit/s and
# ~100 ms at 5 Mbit/s. latency 400 ms sizes the queue like a home router's (1 MB at 20 Mbit/s): TCP
# sees queueing delay, as on a real bloated line, not a drop at every burst.
TBF_BURST, TBF_LATENCY = "64kb", "400ms"

_lab_counter = itertools.count()


@dataclass(frozen=True)
class LinkProfile:
    name: str
    up_mbit: float | None  # what each host may send, Mbit/s; None: unshaped
    down_mbit: float | None  # what each host may receive, Mbit/s; None: unshaped


PROFILES = {p.name: p for p in (
    LinkProfile("unshaped", None, None),
    LinkProfile("dc100", 100, 100),  # a data-centre 100 Mbit/s port
    LinkProfile("home", 20, 100),  # a common home line: 20 up, 100 down
    LinkProfile("weak", 5, 25),  # a weak home line
    LinkProfile("thin", 1, 5),  # a thin line (issue 26: the dense swarm trained nothing on it)
    LinkProfile("gpu-ratio", 0.2, 1),  # the home line scaled by this CPU's ~100x slower compute than a GPU's
)}


@dataclass(frozen=True)
class LinkHost:
    name: str  # network namespace name
    ip: str
    label: str
    port: str  # its bridge port inside the core namespace (where its downlink is shaped)
    up_mbit: float | None
    down_mbit: float | None


def _check(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=CMD_TIMEOUT, check=True)


def _tbf(namespace: str, ifname: str, mbit: float) -> None:
    _check(["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", ifname, "root", "tbf",
            "rate", f"{mbit:g}mbit", "burst", TBF_BURST, "latency", TBF_LATENCY])


def link_lab_available() -> str | None:
    """None when a link lab can be built here, else why not (checked by shaping a probe veth)."""
    if os.geteuid() != 0:
        return "the link lab needs root (network namespaces and tc)"
    for tool in ("ip", "tc", "timeout"):
        if shutil.which(tool) is None:
            return f"the link lab needs `{tool}` (apt-get install iproute2 coreutils)"
    probe = f"{NAME_PREFIX}{os.getpid()}{letters(next(_lab_counter))}x"
    try:
        _check(["ip", "netns", "add", probe])
        _check(["ip", "-n", probe, "link", "add", "name", "pa", "type", "veth", "peer", "name", "pb"])
        _tbf(probe, "pa", 20)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        return f"cannot build a link lab here (tc tbf): {' '.join(str(detail).split())}"
    finally:
        kill_netns(probe)
    return None


class LinkLab(NamespaceLab):
    """Hosts on shaped lines onto one bridge; use as a context manager (teardown on exit)."""

    name_prefix = NAME_PREFIX
    core_role = "c"

    def __init__(self) -> None:
        super().__init__()
        self.hosts: list[LinkHost] = []

    def host(self, label: str, up_mbit: float | None = None, down_mbit: float | None = None) -> LinkHost:
        """A new host on its own line: UP_MBIT out of it, DOWN_MBIT into it (None: unshaped)."""
        index = len(self.hosts) + 1
        if index > MAX_HOSTS:
            raise ValueError(f"at most {MAX_HOSTS} hosts per link lab")
        ns, port, ip = self._namespace("h", index), f"p{index}", f"{SUBNET}.{HOST_OCTET_BASE + index}"
        _check(["ip", "link", "add", "name", HOST_IF, "netns", ns, "type", "veth", "peer", "name", port,
                "netns", self._core])
        _check(["ip", "-n", self._core, "link", "set", port, "master", BRIDGE])
        for namespace, ifname in ((ns, HOST_IF), (self._core, port)):
            _check(["ip", "-n", namespace, "link", "set", ifname, "up"])
        _check(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", HOST_IF])
        if up_mbit is not None:
            _tbf(ns, HOST_IF, up_mbit)
        if down_mbit is not None:
            _tbf(self._core, port, down_mbit)
        host = LinkHost(ns, ip, label, port, up_mbit, down_mbit)
        self.hosts.append(host)
        return host

    def get(self, host: LabHost, api: str, path: str, timeout: float = 2.0) -> dict | None:
        """GET PATH of the node whose API is API on HOST's own loopback (``NamespaceLab.node_get``)."""
        return self.node_get(host, api, path, timeout)
