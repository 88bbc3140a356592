"""Reachability verdicts through real NAT routers: public and DMZ peers are PUBLIC, peers behind
an easy or a symmetric NAT are PRIVATE (and become DHT clients), and no NATed peer is ever
called PUBLIC on the way there."""

from __future__ import annotations

import time

import pytest

from p2pswarm.testing.natlab import NatKind, NatLab, p2pswarm_argv, read_line
from tests.natlab.test_lab import stats

pytestmark = pytest.mark.timeout(150)

PORT = 4001
API = "127.0.0.1:8700"  # each node's API on its own namespace's loopback
VERDICT_TIMEOUT = 90.0  # first check after 2 s, dial-backs time out after 5 s, retries every 10 s
PROC_TIMEOUT = 140  # no lab process outlives the test


def start(lab: NatLab, host, args: list[str], name: str, tmp_path):
    return lab.run(host, p2pswarm_argv(*args, "--listen", f"/ip4/0.0.0.0/tcp/{PORT}", "--api", API,
                                       "--data-dir", str(tmp_path / name)),
                   log_path=tmp_path / f"{name}.log", timeout=PROC_TIMEOUT)


def test_reachability_verdicts_across_nat_kinds(lab, tmp_path):
    boot, public = lab.public_host("boot"), lab.public_host("pub")
    natted = {kind: lab.nat_host(kind.value, kind) for kind in (NatKind.EASY, NatKind.SYMMETRIC, NatKind.DMZ)}
    boot_proc = start(lab, boot, ["bootstrap"], "boot", tmp_path)
    boot_addr = next(a for a in (read_line(boot_proc, 20).strip(), read_line(boot_proc, 5).strip())
                     if f"/ip4/{boot.ip}/" in a)
    join = ["join", "--bootstrap", boot_addr, "--layers", "0:2"]
    start(lab, public, join, "pub", tmp_path)
    for kind, host in natted.items():
        start(lab, host, join, kind.value, tmp_path)

    expected = {"boot": (boot, "public"), "pub": (public, "public"),
                "easy": (natted[NatKind.EASY], "private"), "symmetric": (natted[NatKind.SYMMETRIC], "private"),
                "dmz": (natted[NatKind.DMZ], "public")}
    seen: dict[str, set[str]] = {name: set() for name in expected}
    deadline = time.monotonic() + VERDICT_TIMEOUT
    while time.monotonic() < deadline:
        current = {name: (stats(lab, host, API) or {}) for name, (host, _) in expected.items()}
        for name, doc in current.items():
            seen[name].add(doc.get("reachability", "down"))
        if all(current[name].get("reachability") == want for name, (_, want) in expected.items()):
            break
        time.sleep(1)
    final = {name: (stats(lab, host, API) or {}) for name, (host, _) in expected.items()}
    logs = {name: (tmp_path / f"{name}.log").read_text()[-1500:] for name in expected}
    assert {n: d.get("reachability") for n, d in final.items()} == {n: w for n, (_, w) in expected.items()}, logs
    # Zero false PUBLIC: a NATed peer was never called public, not even for one poll.
    assert "public" not in seen["easy"] | seen["symmetric"], seen
    # --dht-mode auto: private peers are DHT clients, public ones servers.
    assert final["easy"]["dht_mode"] == final["symmetric"]["dht_mode"] == "client"
    assert final["pub"]["dht_mode"] == final["dmz"]["dht_mode"] == "server"
    # What a PUBLIC verdict rests on: the router's WAN address for the DMZ peer.
    dmz_wan = lab.router(natted[NatKind.DMZ]).ip
    assert any(f"/ip4/{dmz_wan}/tcp/{PORT}" == a for a in final["dmz"]["reachable_addrs"]), final["dmz"]
    # ... and it is advertised, since the host itself only sees its LAN address
    assert f"/ip4/{dmz_wan}/tcp/{PORT}/p2p/{final['dmz']['peer_id']}" in final["dmz"]["addrs"], final["dmz"]
