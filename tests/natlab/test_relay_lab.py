"""Relay reservations through real NAT routers: peers behind an easy and a symmetric NAT become
PRIVATE, then reserve on the configured public relay and advertise a /p2p-circuit address."""

from __future__ import annotations

import time

import pytest

from p2pswarm.testing.natlab import NatKind, NatLab, p2pswarm_argv, read_line
from tests.natlab.test_lab import stats

pytestmark = pytest.mark.timeout(170)

PORT = 4001
API = "127.0.0.1:8700"  # each node's API on its own namespace's loopback
TIMEOUT = 110.0  # the PRIVATE verdict takes ~25 s, then one reservation round (2 s tick)
PROC_TIMEOUT = 160  # no lab process outlives the test


def start(lab: NatLab, host, args: list[str], name: str, tmp_path):
    return lab.run(host, p2pswarm_argv(*args, "--listen", f"/ip4/0.0.0.0/tcp/{PORT}", "--api", API,
                                       "--data-dir", str(tmp_path / name)),
                   log_path=tmp_path / f"{name}.log", timeout=PROC_TIMEOUT)


def first_addr_on(process, ip: str) -> str:
    return next(a for a in (read_line(process, 20).strip(), read_line(process, 5).strip()) if f"/ip4/{ip}/" in a)


def test_natted_joins_reserve_on_the_relay_and_advertise_circuit_addresses(lab, tmp_path):
    boot, relay, public = lab.public_host("boot"), lab.public_host("relay"), lab.public_host("pub")
    natted = {kind: lab.nat_host(kind.value, kind) for kind in (NatKind.EASY, NatKind.SYMMETRIC)}
    boot_addr = first_addr_on(start(lab, boot, ["bootstrap"], "boot", tmp_path), boot.ip)
    relay_addr = first_addr_on(start(lab, relay, ["relay", "--bootstrap", boot_addr], "relay", tmp_path), relay.ip)
    join = ["join", "--bootstrap", boot_addr, "--layers", "0:2", "--relay", relay_addr]
    start(lab, public, join, "pub", tmp_path)
    for kind, host in natted.items():
        start(lab, host, join, kind.value, tmp_path)

    names = {"easy": natted[NatKind.EASY], "symmetric": natted[NatKind.SYMMETRIC]}
    began, private_at, circuit_at = time.monotonic(), {}, {}
    current = {}
    while time.monotonic() - began < TIMEOUT and len(circuit_at) < len(names):
        current = {name: (stats(lab, host, API) or {}) for name, host in names.items()}
        for name, doc in current.items():
            if doc.get("reachability") == "private":
                private_at.setdefault(name, time.monotonic() - began)
            if doc.get("circuit_addrs"):
                circuit_at.setdefault(name, time.monotonic() - began)
        time.sleep(1)
    logs = {name: (tmp_path / f"{name}.log").read_text()[-1500:] for name in [*names, "relay"]}
    print(f"PRIVATE after {private_at}, circuit address after {circuit_at} (s since start)")
    assert set(circuit_at) == set(names), (current, logs)
    relay_id = relay_addr.rsplit("/p2p/", 1)[1]
    for doc in current.values():
        expected = f"{relay_addr}/p2p-circuit/p2p/{doc['peer_id']}"
        assert doc["reachability"] == "private" and doc["circuit_addrs"] == [expected], doc
        assert expected in doc["addrs"]
        assert [r["peer"] for r in doc["relays"]] == [relay_id] and doc["relays"][0]["expires_in_s"] > 60
    pub = stats(lab, public, API)
    assert pub["reachability"] == "public" and pub["circuit_addrs"] == [] and pub["relays"] == [], pub
    relay_stats = stats(lab, relay, API)
    assert relay_stats["relay"]["reservations_active"] == 2, relay_stats["relay"]
