"""A real NAT lab on one machine: network namespaces, a bridge as "the internet", nftables routers.

Requires root, iproute2 (``ip netns``), nftables, conntrack and coreutils ``timeout``. Topology
(see docs/nat.md, "The NAT lab")::

    internet namespace: bridge br0, 10.99.0.0/24
      public hosts 10.99.0.11..   STUN host 10.99.0.20 + 10.99.0.21
      router i: wan 10.99.0.(101+i), lan 10.99.(1+i).1/24 -- home host 10.99.(1+i).2

Safety: every address lives inside namespaces this lab creates; nothing is linked to the root
namespace and no namespace has a route out (home hosts route only to their own router). IPv6 is
disabled in every lab namespace. Every process runs inside a lab namespace under ``timeout``; on exit
the lab kills each namespace's processes by pid and deletes the namespaces, even after an error.
Namespace names are ``p2l<pid><lab letters><role><index>``, unique per run, at most 15 characters.
"""

from __future__ import annotations

import enum
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol, Self

NAME_PREFIX = "p2l"  # every lab namespace starts with this, then the pid of the process that made it
MAX_NS_NAME = 15  # keep namespace names as short as interface names
SUBNET = "10.99"  # the lab's private /16
BRIDGE = "br0"  # the "internet" bridge inside the internet namespace
WAN_IF, LAN_IF, HOST_IF = "wan", "lan", "eth0"  # interface names inside routers and hosts
PUBLIC_OCTETS = [*range(11, 20), *range(30, 100)]  # public hosts on the internet bridge
STUN_OCTETS = (20, 21)  # RFC 3489 needs two addresses
ROUTER_WAN_BASE = 101  # router i gets wan SUBNET.0.(101+i)
MAX_ROUTERS = 99  # lan subnets SUBNET.1 .. SUBNET.99
CMD_TIMEOUT = 10.0  # seconds for one short setup command
KILL_AFTER = 5  # seconds `timeout` waits after TERM before KILL
TERM_GRACE = 3.0  # seconds teardown waits for started processes after SIGTERM
IPV6_OFF = ("net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1")

_lab_counter = itertools.count()


class NatKind(enum.Enum):
    EASY = "easy"  # endpoint-independent mapping, port-restricted filtering: masquerade
    SYMMETRIC = "symmetric"  # a new mapping per destination: masquerade fully-random
    DMZ = "dmz"  # easy, plus every wan tcp/udp packet to the router's address dnat'ed to the home host


@dataclass(frozen=True)
class Host:
    name: str  # network namespace name
    ip: str


class LabHost(Protocol):
    """What a lab's runner needs of a host: a NAT lab's Host, a link lab's LinkHost."""

    @property
    def name(self) -> str: ...  # network namespace name

    @property
    def ip(self) -> str: ...


@dataclass(frozen=True)
class _Router:
    host: Host  # router namespace and wan address
    home: Host


# argv[1] URL, argv[2] timeout: prints the JSON answer (an HTTP error's body plus http_status), or null
GET_JSON = """import json, sys, urllib.error, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[2])) as r: print(r.read().decode())
except urllib.error.HTTPError as e: print(json.dumps({"http_status": e.code, **json.load(e)}))
except OSError: print("null")
"""


def p2pswarm_argv(*args: str) -> list[str]:
    """The command line of ``p2pswarm ARGS`` with this interpreter (runs inside a namespace as is)."""
    return [sys.executable, "-m", "p2pswarm", *args]


def nat_ruleset(kind: NatKind, wan_ip: str, home_ip: str) -> str:
    """The whole nftables ruleset of a router of this kind (input and forward drop by default)."""
    random = " fully-random" if kind is NatKind.SYMMETRIC else ""
    dnat = (f'iifname "{WAN_IF}" ip daddr {wan_ip} meta l4proto {{ tcp, udp }} dnat to {home_ip}'
            if kind is NatKind.DMZ else "")
    dnat_forward = f'iifname "{WAN_IF}" oifname "{LAN_IF}" ct status dnat accept' if kind is NatKind.DMZ else ""
    return f"""flush ruleset
table ip natlab {{
  chain prerouting {{ type nat hook prerouting priority dstnat; policy accept;
    {dnat}
  }}
  chain postrouting {{ type nat hook postrouting priority srcnat; policy accept;
    oifname "{WAN_IF}" masquerade{random}
  }}
  chain input {{ type filter hook input priority filter; policy drop;
    ct state established,related accept
    iifname {{ "lo", "{LAN_IF}" }} accept
  }}
  chain forward {{ type filter hook forward priority filter; policy drop;
    ct state established,related accept
    iifname "{LAN_IF}" oifname "{WAN_IF}" accept
    {dnat_forward}
  }}
}}
"""


def _check(argv: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=CMD_TIMEOUT, check=True)


def letters(n: int) -> str:
    """0 -> 'a', 25 -> 'z', 26 -> 'ba': a counter that never ends in a digit."""
    out = ""
    while True:
        out = chr(ord("a") + n % 26) + out
        n //= 26
        if n == 0:
            return out


def netns_names() -> list[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=CMD_TIMEOUT,
                             check=False)
    return [line.split()[0] for line in listing.stdout.splitlines() if line.strip()]


def kill_netns(name: str) -> None:
    """SIGKILL every process in namespace NAME by pid, then delete the namespace."""
    for _ in range(3):
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=CMD_TIMEOUT,
                              check=False)
        found = [int(p) for p in pids.stdout.split() if p.isdigit()]
        if not found:
            break
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=CMD_TIMEOUT, check=False)


def lab_available() -> str | None:
    """None when a lab can be built here, else why not (checked by building a probe namespace)."""
    if os.geteuid() != 0:
        return "the NAT lab needs root (network namespaces and nftables)"
    for tool in ("ip", "nft", "conntrack", "timeout"):
        if shutil.which(tool) is None:
            return f"the NAT lab needs `{tool}` (apt-get install iproute2 nftables conntrack)"
    probe = f"{NAME_PREFIX}{os.getpid()}{letters(next(_lab_counter))}x"
    try:
        _check(["ip", "netns", "add", probe])
        _check(["ip", "-n", probe, "link", "add", "name", "pa", "type", "veth", "peer", "name", "pb"])
        _check(["ip", "netns", "exec", probe, "nft", "-f", "-"],
               stdin=nat_ruleset(NatKind.SYMMETRIC, f"{SUBNET}.0.1", f"{SUBNET}.1.2"))
        _check(["ip", "netns", "exec", probe, "conntrack", "-F"])
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        return f"cannot build a NAT lab here: {' '.join(str(detail).split())}"
    finally:
        kill_netns(probe)
    return None


def read_line(process: subprocess.Popen, timeout: float) -> str:
    """The next stdout line of PROCESS (text mode), or TimeoutError after TIMEOUT seconds."""
    result: list[str] = []
    stdout = process.stdout
    assert stdout is not None, "read_line needs a process started with stdout=PIPE"
    reader = threading.Thread(target=lambda: result.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not result:
        raise TimeoutError(f"no output line from pid {process.pid} within {timeout} s")
    return result[0]


class NamespaceLab:
    """Namespaces of one lab around a bridge in a core namespace: building blocks, processes run
    inside them under a time bound, and a teardown that always leaves nothing behind. ``NatLab``
    and ``linklab.LinkLab`` are both; use either as a context manager."""

    name_prefix = NAME_PREFIX  # namespace names: this, the pid, the lab's letters, a role, an index
    core_role = "i"  # the role letter of the namespace that holds the bridge
    # A hook the tests set (tests/forked.py): (namespace, argv, log path, timeout) -> a started process, or
    # None to start ARGV as below. It forks joins from a server that imported torch once.
    spawner: ClassVar[Callable[[str, list[str], str | Path | None, float], Any] | None] = None

    def __init__(self) -> None:
        self.prefix = f"{self.name_prefix}{os.getpid()}{letters(next(_lab_counter))}"
        self.namespaces: list[str] = []
        self.processes: list[subprocess.Popen] = []
        self._core = ""

    def __enter__(self) -> Self:
        try:
            self._core = self._namespace(self.core_role, 0)
            _check(["ip", "-n", self._core, "link", "add", BRIDGE, "type", "bridge"])
            _check(["ip", "-n", self._core, "link", "set", BRIDGE, "up"])
        except BaseException:
            self._teardown()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self._teardown()

    def _namespace(self, role: str, index: int) -> str:
        name = f"{self.prefix}{role}{index}"
        if len(name) > MAX_NS_NAME:
            raise ValueError(f"namespace name {name!r} is longer than {MAX_NS_NAME} characters")
        _check(["ip", "netns", "add", name])
        self.namespaces.append(name)
        _check(["ip", "netns", "exec", name, "sh", "-c",
                "sysctl -q -w " + " ".join(IPV6_OFF) + " 2>/dev/null; ip link set lo up"])
        return name

    # -- running --
    def _argv(self, host: LabHost, argv: list[str], timeout: float) -> list[str]:
        if host.name not in self.namespaces:
            raise ValueError(f"{host.name} is not a namespace of this lab")
        return ["ip", "netns", "exec", host.name, "timeout", f"--kill-after={KILL_AFTER}", f"{timeout:g}", *argv]

    def run(self, host: LabHost, argv: list[str], *, log_path: str | Path | None = None,
            timeout: float) -> subprocess.Popen:
        """Start ARGV in HOST, killed after TIMEOUT s; stdout is a text pipe, stderr goes to LOG_PATH."""
        command = self._argv(host, argv, timeout)
        spawned = NamespaceLab.spawner(host.name, argv, log_path, timeout) if NamespaceLab.spawner else None
        if spawned is not None:
            self.processes.append(spawned)
            return spawned
        stderr = open(log_path, "w") if log_path else subprocess.DEVNULL
        try:
            process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL,
                                       text=True)
        finally:
            if not isinstance(stderr, int):  # a file we opened, not DEVNULL
                stderr.close()
        self.processes.append(process)
        return process

    def exec(self, host: LabHost, argv: list[str], timeout: float = CMD_TIMEOUT) -> subprocess.CompletedProcess:
        """Run a short command in HOST and wait; CalledProcessError if it fails."""
        return subprocess.run(self._argv(host, argv, timeout), capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=timeout + KILL_AFTER + 1, check=True)

    def node_get(self, host: LabHost, api: str, path: str, timeout: float = 2.0) -> dict | None:
        """GET ``path`` of the node's API (on ``host``'s loopback): its JSON, with ``http_status``
        added when the answer is an error, or None when nothing answers."""
        argv = [sys.executable, "-c", GET_JSON, f"http://{api}{path}", str(timeout)]
        return json.loads(self.exec(host, argv, timeout=timeout + 5).stdout)

    # -- teardown --
    def _teardown(self) -> None:
        """Stop started processes by pid, kill what is left in each namespace, delete the namespaces."""
        for process in self.processes:
            if process.poll() is None:
                try:
                    process.send_signal(signal.SIGTERM)  # `timeout` passes it on to its command
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + TERM_GRACE
        for process in self.processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for name in reversed(self.namespaces):
            try:
                kill_netns(name)
            except Exception:
                pass
        for process in self.processes:
            try:
                process.wait(timeout=TERM_GRACE)
            except subprocess.TimeoutExpired:
                process.kill()  # the pid we started (killed in its namespace already, so a zombie at most)
                process.wait()
            if process.stdout:
                process.stdout.close()
        for _ in range(3):  # never leave a namespace behind
            try:
                leftover = [name for name in netns_names() if name in self.namespaces]
                if not leftover:
                    break
                for name in leftover:
                    kill_netns(name)
            except Exception:
                time.sleep(0.2)
        self.namespaces.clear()


class NatLab(NamespaceLab):
    """A throwaway internet with public hosts, a STUN host and NATed homes; use as a context manager."""

    def __init__(self) -> None:
        super().__init__()
        self.labels: dict[str, str] = {}  # namespace -> the label it was created with, for messages
        self._routers: dict[str, _Router] = {}  # by home and by router namespace
        self._public = iter(PUBLIC_OCTETS)
        self._links = itertools.count()
        self._nat_count = 0

    # -- building --
    def _link(self, ns_a: str, if_a: str, ns_b: str, if_b: str) -> None:
        _check(["ip", "link", "add", "name", if_a, "netns", ns_a, "type", "veth", "peer", "name", if_b, "netns", ns_b])
        for ns, ifname in ((ns_a, if_a), (ns_b, if_b)):
            _check(["ip", "-n", ns, "link", "set", ifname, "up"])

    def _attach(self, ns: str, ifname: str, ips: list[str], prefix_len: int = 24) -> None:
        """Link NS's IFNAME to the internet bridge with addresses IPS."""
        port = f"v{next(self._links)}"
        self._link(ns, ifname, self._core, port)
        _check(["ip", "-n", self._core, "link", "set", port, "master", BRIDGE])
        for ip in ips:
            _check(["ip", "-n", ns, "addr", "add", f"{ip}/{prefix_len}", "dev", ifname])

    def public_host(self, label: str = "") -> Host:
        """A host on the internet bridge with the next public address (LABEL goes to ``labels``)."""
        octet = next(self._public)
        ns = self._namespace("p", octet)
        self.labels[ns] = label
        ip = f"{SUBNET}.0.{octet}"
        self._attach(ns, HOST_IF, [ip])
        return Host(ns, ip)

    def stun_host(self) -> Host:
        """One host with two public addresses (STUN_OCTETS); run ``stund -h IP -a IP2`` in it."""
        ns = self._namespace("s", 0)
        self.labels[ns] = "stun"
        ips = [f"{SUBNET}.0.{octet}" for octet in STUN_OCTETS]
        self._attach(ns, HOST_IF, ips)
        return Host(ns, ips[0])

    def nat_host(self, label: str = "", kind: NatKind = NatKind.EASY) -> Host:
        """A home host behind a new router of KIND; returns the home host (``router(home)`` for the router)."""
        i = self._nat_count
        if i >= MAX_ROUTERS:
            raise ValueError(f"at most {MAX_ROUTERS} NATs per lab")
        router_ns, home_ns = self._namespace("r", i + 1), self._namespace("h", i + 1)
        self.labels.update({router_ns: f"router of {label}", home_ns: label})
        wan_ip, lan_net = f"{SUBNET}.0.{ROUTER_WAN_BASE + i}", f"{SUBNET}.{1 + i}"
        self._attach(router_ns, WAN_IF, [wan_ip])
        self._link(router_ns, LAN_IF, home_ns, HOST_IF)
        _check(["ip", "-n", router_ns, "addr", "add", f"{lan_net}.1/24", "dev", LAN_IF])
        _check(["ip", "-n", home_ns, "addr", "add", f"{lan_net}.2/24", "dev", HOST_IF])
        _check(["ip", "-n", home_ns, "route", "add", "default", "via", f"{lan_net}.1"])
        _check(["ip", "netns", "exec", router_ns, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
        self._nat_count += 1
        router = _Router(Host(router_ns, wan_ip), Host(home_ns, f"{lan_net}.2"))
        for key in (home_ns, router_ns):
            self._routers[key] = router
        self.set_nat_kind(router.home, kind)
        return router.home

    def router(self, home: Host) -> Host:
        """The router in front of HOME: its namespace and wan (public) address."""
        return self._routers[home.name].host

    def set_nat_kind(self, router_of: Host, kind: NatKind) -> None:
        """Give the router of ROUTER_OF (a home host or its router) behaviour KIND; forget all mappings."""
        router = self._routers[router_of.name]
        _check(["ip", "netns", "exec", router.host.name, "nft", "-f", "-"],
               stdin=nat_ruleset(kind, router.host.ip, router.home.ip))
        _check(["ip", "netns", "exec", router.host.name, "conntrack", "-F"])

    # -- running --
    def node_stats(self, host: Host, api: str) -> dict | None:
        """GET /api/stats of the p2pswarm node whose API is ``api`` on ``host``'s own loopback."""
        return self.node_get(host, api, "/api/stats")
