"""The NAT lab itself: a NATed p2pswarm peer reaches a public bootstrap, NAT mappings and filtering
behave as each NatKind promises at the packet level, and teardown never leaves a namespace behind.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from p2pswarm.testing.natlab import (
    NAME_PREFIX,
    STUN_OCTETS,
    SUBNET,
    NatKind,
    NatLab,
    p2pswarm_argv,
    read_line,
)

pytestmark = pytest.mark.timeout(60)

BOOT_PORT = 4001
BOOT_API, HOME_API = "127.0.0.1:8700", "127.0.0.1:8701"  # loopback of each node's own namespace
ECHO_PORT, STRAY_PORT = 7000, 7001
CLIENT_PORT = 40000  # the home host's UDP source port; an easy NAT keeps it
TCP_PORT = 5000
STUN_PORT, STUN_ALT_IP, STUN_ALT_PORT = 3478, f"{SUBNET}.0.{STUN_OCTETS[1]}", 3479  # stund's defaults
CONNECT_TIMEOUT = 1.5  # an unsolicited SYN is dropped silently, so failure is a timeout
STARTUP_TIMEOUT = 20.0
PROC_TIMEOUT = 50  # no lab process outlives its test


# Replies "seen IP:PORT" from ECHO_PORT; on "stray" also sends one datagram from STRAY_PORT first.
UDP_ECHO = f"""import socket
echo, stray = socket.socket(socket.AF_INET, socket.SOCK_DGRAM), socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
echo.bind(("0.0.0.0", {ECHO_PORT})); stray.bind(("0.0.0.0", {STRAY_PORT}))
print("ready", flush=True)
while True:
    data, peer = echo.recvfrom(100)
    if data == b"stray":
        stray.sendto(b"stray", peer)
        echo.sendto(b"done", peer)
    else:
        echo.sendto(f"seen {{peer[0]}}:{{peer[1]}}".encode(), peer)
"""

# From one socket: ask each server which address it saw, then whether a stray datagram gets in.
UDP_CLIENT = f"""import json, socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("0.0.0.0", {CLIENT_PORT})); s.settimeout(0.5)
strays = []
def ask(server, message):
    for _ in range(4):
        s.sendto(message, (server, {ECHO_PORT}))
        try:
            while True:
                data, peer = s.recvfrom(100)
                if peer == (server, {ECHO_PORT}):
                    return data.decode()
                strays.append(data.decode())
        except socket.timeout:
            pass
seen = [ask(server, b"map") for server in sys.argv[1:]]
done = ask(sys.argv[1], b"stray")  # the stray datagram, if let in, arrives before "done"
print(json.dumps({{"seen": seen, "done": done, "stray": strays == ["stray"]}}))
"""

TCP_LISTEN = f"""import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", {TCP_PORT}))
s.listen(); print("ready", flush=True)
conn, peer = s.accept(); print(peer[0], flush=True)
"""

TCP_CONNECT = f"""import socket, sys
try:
    socket.create_connection((sys.argv[1], {TCP_PORT}), timeout={CONNECT_TIMEOUT}); print("connected")
except OSError as exc:
    print("failed:", exc)
"""

# One RFC 3489 binding request; prints [MAPPED-ADDRESS, CHANGED-ADDRESS] as [ip, port] pairs, or nothing.
STUN_BINDING = f"""import json, os, socket, struct, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("0.0.0.0", {CLIENT_PORT})); s.settimeout(0.5)
s.sendto(struct.pack("!HH", 1, 0) + os.urandom(16), (sys.argv[1], {STUN_PORT}))
try:
    data = s.recv(2048)
except socket.timeout:
    sys.exit()
attrs, at = {{}}, 20
while at + 4 <= len(data):
    kind, size = struct.unpack_from("!HH", data, at)
    attrs[kind] = data[at + 4:at + 4 + size]; at += 4 + size
addr = lambda v: [socket.inet_ntoa(v[4:8]), struct.unpack("!H", v[2:4])[0]]
print(json.dumps([addr(attrs[1]), addr(attrs[5])]))
"""


def stats(lab: NatLab, host, api: str) -> dict | None:
    return lab.node_stats(host, api)


def wait_for(predicate, timeout: float, period: float = 0.3):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := predicate():
            return result
        time.sleep(period)
    return predicate()


def test_natted_peer_joins_public_bootstrap(lab, tmp_path):
    """Outbound through an easy NAT: p2pswarm join behind it connects to a public bootstrap."""
    boot, home = lab.public_host("boot"), lab.nat_host("home", NatKind.EASY)
    wan = lab.router(home)
    bootstrap = lab.run(boot, p2pswarm_argv("bootstrap", "--listen", f"/ip4/{boot.ip}/tcp/{BOOT_PORT}",
                                            "--api", BOOT_API), log_path=tmp_path / "boot.log", timeout=PROC_TIMEOUT)
    boot_addr = read_line(bootstrap, STARTUP_TIMEOUT).strip()
    assert boot_addr.startswith(f"/ip4/{boot.ip}/tcp/{BOOT_PORT}/p2p/12D3"), boot_addr
    boot_id = boot_addr.rsplit("/", 1)[1]
    lab.run(home, p2pswarm_argv("join", "--bootstrap", boot_addr, "--listen", f"/ip4/0.0.0.0/tcp/{BOOT_PORT}",
                                "--layers", "0:2", "--api", HOME_API, "--data-dir", str(tmp_path / "home")),
            log_path=tmp_path / "home.log", timeout=PROC_TIMEOUT)

    home_stats = wait_for(lambda: (s := stats(lab, home, HOME_API)) and boot_id in s["connected_peers"] and s,
                          timeout=STARTUP_TIMEOUT)
    assert home_stats, (stats(lab, home, HOME_API), (tmp_path / "home.log").read_text()[-2000:])
    home_id = home_stats["peer_id"]
    assert wait_for(lambda: home_id in ((stats(lab, boot, BOOT_API) or {}).get("connected_peers") or []), 10)
    # The connection really crossed the NAT: the router maps home -> bootstrap onto its wan address.
    table = lab.exec(wan, ["conntrack", "-L", "-p", "tcp"]).stdout
    assert any(f"src={home.ip} dst={boot.ip}" in line and f"dport={BOOT_PORT}" in line and f"dst={wan.ip}" in line
               for line in table.splitlines()), table


def test_mapping_and_filtering_per_nat_kind(lab):
    """EASY keeps one external port for every destination, SYMMETRIC picks one per destination;
    both drop a datagram from a port the home never sent to, DMZ lets it in."""
    servers = [lab.public_host("echo-a"), lab.public_host("echo-b")]
    for server in servers:
        assert read_line(lab.run(server, [sys.executable, "-c", UDP_ECHO], timeout=PROC_TIMEOUT), 10).strip() == "ready"
    home = lab.nat_host("home", NatKind.EASY)
    wan = lab.router(home)

    def probe() -> tuple[list[tuple[str, int]], bool]:
        out = json.loads(lab.exec(home, [sys.executable, "-c", UDP_CLIENT, *(s.ip for s in servers)]).stdout)
        assert all(out["seen"]) and out["done"] == "done", out
        seen = [seen.removeprefix("seen ").split(":") for seen in out["seen"]]
        return [(ip, int(port)) for ip, port in seen], out["stray"]

    seen, stray = probe()
    assert seen == [(wan.ip, CLIENT_PORT)] * 2  # endpoint-independent, port preserved
    assert not stray  # port-restricted filtering

    lab.set_nat_kind(home, NatKind.SYMMETRIC)
    seen, stray = probe()
    assert {ip for ip, _ in seen} == {wan.ip}
    assert seen[0][1] != seen[1][1], seen  # a new mapping per destination
    assert not stray

    lab.set_nat_kind(wan, NatKind.DMZ)
    seen, stray = probe()
    assert seen == [(wan.ip, CLIENT_PORT)] * 2
    assert stray  # everything sent to the wan address reaches the home host


@pytest.mark.parametrize("kind, reachable", [(NatKind.EASY, False), (NatKind.SYMMETRIC, False), (NatKind.DMZ, True)])
def test_unsolicited_inbound_tcp(lab, kind, reachable):
    outsider, home = lab.public_host("outsider"), lab.nat_host("home", kind)
    listener = lab.run(home, [sys.executable, "-c", TCP_LISTEN], timeout=PROC_TIMEOUT)
    assert read_line(listener, 10).strip() == "ready"
    result = lab.exec(outsider, [sys.executable, "-c", TCP_CONNECT, lab.router(home).ip]).stdout.strip()
    if reachable:
        assert result == "connected"
        assert read_line(listener, 5).strip() == outsider.ip  # dnat keeps the caller's address
    else:
        assert result == "failed: timed out", result  # dropped silently: no RST ("refused"), no answer


def test_stun_host_reports_the_mapping(lab):
    """stund on the two-address STUN host sees an easy NAT's wan address and preserved port."""
    stun, home = lab.stun_host(), lab.nat_host("home", NatKind.EASY)
    lab.run(stun, ["stund", "-h", stun.ip, "-a", STUN_ALT_IP], timeout=PROC_TIMEOUT)
    out = wait_for(lambda: lab.exec(home, [sys.executable, "-c", STUN_BINDING, stun.ip]).stdout.strip(), timeout=5)
    mapped, changed = json.loads(out)
    assert mapped == [lab.router(home).ip, CLIENT_PORT]
    assert changed == [STUN_ALT_IP, STUN_ALT_PORT]  # RFC 3489: the second address and port


def run_namespaces(prefix: str) -> list[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in listing.splitlines() if line.startswith(prefix)]


def test_teardown_after_exception_leaves_nothing():
    """An exception inside the lab still kills its processes (even TERM-ignoring or foreign ones)
    and deletes every namespace; the exception itself propagates."""
    ignore_term = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                   "print('up', flush=True); time.sleep(60)")
    with pytest.raises(RuntimeError, match="boom"), NatLab() as lab:
        host, home = lab.public_host("a"), lab.nat_host("home", NatKind.SYMMETRIC)
        stubborn = lab.run(home, [sys.executable, "-c", ignore_term], timeout=PROC_TIMEOUT)
        assert read_line(stubborn, 10).strip() == "up"
        foreign = subprocess.Popen(["ip", "netns", "exec", host.name, "sleep", "60"])
        assert len(run_namespaces(lab.prefix)) == 4  # internet, public, router, home
        raise RuntimeError("boom")
    assert run_namespaces(lab.prefix) == []
    this_run = re.compile(rf"{NAME_PREFIX}{os.getpid()}[a-z]")  # any lab of this process, not just this one
    assert [name for name in run_namespaces(NAME_PREFIX) if this_run.match(name)] == []
    assert stubborn.poll() is not None
    assert foreign.wait(timeout=5) is not None
