"""A shaped-link lab on one machine: each host on its own rate-limited line onto one bridge.

Where the NAT lab (``natlab.py``) asks "can these peers reach each other", this lab asks "how do
they train over home-sized links". Requires root, iproute2 (``ip netns``, ``tc`` with the ``tbf``
qdisc) and coreutils ``timeout``. Topology::

    core namespace: bridge br0 (no address of its own), 10.98.0.0/24
      port p<i> -- host namespace h<i>: eth0 10.98.0.(10+i)/24

Shaping is ``tc qdisc ... tbf``: a host's **uplink** on its own ``eth0`` inside its namespace (what
it sends), its **downlink** on its bridge port inside the core namespace (what the bridge hands
it). ``None`` leaves that direction unshaped (veth speed). **Latency**: the kernels this runs on may
lack netem, so a host with a one-way ``delay_ms`` is joined to the bridge through two TAP devices
instead of a veth pair, and a user-space delay line (``delayline.py``, one process per such host,
in the core namespace) holds what it sends ``delay_ms``. Between two hosts of one profile each
direction is then ``delay_ms`` late and a round trip ``2 * delay_ms``.

Safety, as in the NAT lab: every address lives inside namespaces this lab creates; nothing is
linked to the root namespace and no namespace has a route out (only the bridge's /24). IPv6 is
disabled in every lab namespace. Every process runs inside a lab namespace under ``timeout``; on
exit the lab stops its processes by pid (SIGTERM, then SIGKILL of whatever ``ip netns pids``
still lists) and deletes the namespaces, even after an error. Namespace names are
``p2k<pid><lab letters><role><index>``, unique per run, at most 15 characters.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

from p2pswarm.testing.delayline import Pair
from p2pswarm.testing.natlab import CMD_TIMEOUT, Host, LabHost, NamespaceLab, kill_netns, letters, read_line

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
DELAY_LINE_LIFETIME = 24 * 3600.0  # seconds: the lab's teardown stops a delay line long before
DELAY_LINE_START = 20.0  # seconds for a delay line's python to attach and print "ready" on a loaded machine

_lab_counter = itertools.count()


@dataclass(frozen=True)
class LinkProfile:
    name: str
    up_mbit: float | None  # what each host may send, Mbit/s; None: unshaped
    down_mbit: float | None  # what each host may receive, Mbit/s; None: unshaped
    delay_ms: float = 0.0  # one-way delay of what each host sends: 2 x this is a round trip between two


PROFILES = {p.name: p for p in (
    LinkProfile("unshaped", None, None),
    LinkProfile("datacenter", None, None, 0.5),  # one rack: veth speed, half a millisecond each way
    LinkProfile("dc100", 100, 100),  # a data-centre 100 Mbit/s port
    LinkProfile("home", 20, 100, 30),  # a common home line: 20 up, 100 down, 30 ms each way
    LinkProfile("weak", 5, 25, 50),  # a weak home line
    LinkProfile("thin", 1, 5, 50),  # a thin line (issue 26: the dense swarm trained nothing on it)
    # the home line scaled by this CPU's ~100x slower compute than a GPU's: link bytes per compute second
    # match a GPU peer's on a home line; the delay stays the home line's (latency does not scale with compute)
    LinkProfile("gpu-ratio", 0.2, 1, 30),
)}


@dataclass(frozen=True)
class LinkHost:
    name: str  # network namespace name
    ip: str
    label: str
    port: str  # its bridge port inside the core namespace (where its downlink is shaped)
    up_mbit: float | None
    down_mbit: float | None
    delay_ms: float = 0.0


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


def delay_line_available() -> str | None:
    """None when delayed lines can be built here (a link lab and TAP devices), else why not."""
    reason = link_lab_available()
    if reason is None and not os.path.exists("/dev/net/tun"):
        reason = "delayed lines need TAP devices (/dev/net/tun is missing)"
    return reason


class LinkLab(NamespaceLab):
    """Hosts on shaped lines onto one bridge; use as a context manager (teardown on exit)."""

    name_prefix = NAME_PREFIX
    core_role = "c"

    def __init__(self) -> None:
        super().__init__()
        self.hosts: list[LinkHost] = []

    def host(self, label: str, up_mbit: float | None = None, down_mbit: float | None = None,
             delay_ms: float = 0.0) -> LinkHost:
        """A new host on its own line: UP_MBIT out of it, DOWN_MBIT into it (None: unshaped), and what it
        sends DELAY_MS late (a delay line; 0: a plain veth pair)."""
        index = len(self.hosts) + 1
        if index > MAX_HOSTS:
            raise ValueError(f"at most {MAX_HOSTS} hosts per link lab")
        ns, port, ip = self._namespace("h", index), f"p{index}", f"{SUBNET}.{HOST_OCTET_BASE + index}"
        if delay_ms > 0:
            self._delay_line(Pair(ns, HOST_IF, self._core, port, delay_ms))
        else:
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
        host = LinkHost(ns, ip, label, port, up_mbit, down_mbit, delay_ms)
        self.hosts.append(host)
        return host

    def profile_host(self, label: str, profile: LinkProfile) -> LinkHost:
        """A new host on a ``profile`` line."""
        return self.host(label, profile.up_mbit, profile.down_mbit, profile.delay_ms)

    def _delay_line(self, pair: Pair) -> None:
        """Two TAP ends for ``pair`` and the process that copies frames between them (``delayline.py``)."""
        for namespace, ifname in ((pair.host_ns, pair.host_if), (pair.core_ns, pair.port_if)):
            _check(["ip", "-n", namespace, "tuntap", "add", "dev", ifname, "mode", "tap"])
        line = self.run(Host(self._core, ""), [sys.executable, "-m", "p2pswarm.testing.delayline", pair.arg()],
                        timeout=DELAY_LINE_LIFETIME)
        if read_line(line, DELAY_LINE_START).strip() != "ready":
            raise RuntimeError(f"the delay line of {pair.host_ns} did not start (exit code {line.poll()})")

    def get(self, host: LabHost, api: str, path: str, timeout: float = 2.0) -> dict | None:
        """GET PATH of the node whose API is API on HOST's own loopback (``NamespaceLab.node_get``)."""
        return self.node_get(host, api, path, timeout)


# -- checks of a line: round trips and a bulk transfer between two hosts, as ping and iperf would --
PROBE_PORT = 5001
PROBE_START = 10.0  # seconds for a probe's python to print "ready"
# Echoes UDP datagrams; prints "ready" first.
ECHO = f"""import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", {PROBE_PORT}))
print("ready", flush=True)
while True:
    data, peer = s.recvfrom(64)
    s.sendto(data, peer)
"""
# argv: ip count; prints the round trips in ms, user space to user space (what ``ping -U`` measures).
PINGER = f"""import json, socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(5.0)
rtts = []
for i in range(int(sys.argv[2])):
    began = time.monotonic()
    s.sendto(str(i).encode(), (sys.argv[1], {PROBE_PORT}))
    while s.recvfrom(64)[0] != str(i).encode():
        pass
    rtts.append((time.monotonic() - began) * 1000)
    time.sleep(0.02)
print(json.dumps(rtts))
"""
# argv: nbytes expected. Prints "ready", takes one connection, then {"bytes", "seconds"}: the bytes
# received and the seconds the second half of them took (past TCP's slow start: the line's rate).
RECEIVER = f"""import json, socket, sys, time
server = socket.create_server(("0.0.0.0", {PROBE_PORT}))
print("ready", flush=True)
conn, _ = server.accept()
total, half, last, middle = 0, int(sys.argv[1]) // 2, None, None
while chunk := conn.recv(1 << 16):
    last = time.monotonic()
    total += len(chunk)
    if middle is None and total >= half:
        middle, at_middle = last, total
print(json.dumps({{"bytes": total, "seconds": last - middle, "second_half": total - at_middle}}), flush=True)
"""
# argv: ip nbytes
SENDER = f"""import socket, sys
with socket.create_connection((sys.argv[1], {PROBE_PORT}), timeout=10) as s:
    s.sendall(bytes(int(sys.argv[2])))
"""


def round_trips(lab: LinkLab, source: LinkHost, target: LinkHost, count: int) -> list[float]:
    """``count`` UDP round trips from ``source`` to ``target``, in ms (the first resolves ARP too)."""
    echo = lab.run(target, [sys.executable, "-c", ECHO], timeout=count + 30)
    try:
        if read_line(echo, PROBE_START).strip() != "ready":
            raise RuntimeError("the echo server did not start")
        done = lab.exec(source, [sys.executable, "-c", PINGER, target.ip, str(count)], timeout=count + 20)
        return [float(ms) for ms in json.loads(done.stdout)]
    finally:
        echo.kill()


def transfer_mbit(lab: LinkLab, source: LinkHost, target: LinkHost, nbytes: int, timeout: float) -> tuple[int, float]:
    """A bulk TCP transfer of ``nbytes`` from ``source`` to ``target``: (bytes received, Mbit/s of the
    second half, as the receiver saw it: the line's rate once TCP's window has opened)."""
    server = lab.run(target, [sys.executable, "-c", RECEIVER, str(nbytes)], timeout=timeout + PROBE_START)
    if read_line(server, PROBE_START).strip() != "ready":
        raise RuntimeError("the receiver did not start")
    lab.exec(source, [sys.executable, "-c", SENDER, target.ip, str(nbytes)], timeout=timeout)
    result = json.loads(read_line(server, PROBE_START))
    return result["bytes"], result["second_half"] * 8 / max(result["seconds"], 1e-9) / 1e6
