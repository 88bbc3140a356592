"""STUN classification of each NAT kind through real routers, with p2pswarm's own bounded client.

stund runs on the lab's two-address STUN host; each client is ``p2pswarm.nat.stun.classify_nat``
run inside a lab host, bound to that host's address (as a node does).
"""

from __future__ import annotations

import json
import sys
import time

import pytest

from p2pswarm.nat.stun import MAX_CLASSIFY_PACKETS
from p2pswarm.testing.natlab import STUN_OCTETS, SUBNET, NatKind

pytestmark = pytest.mark.timeout(90)

STUN_ALT_IP = f"{SUBNET}.0.{STUN_OCTETS[1]}"
CLASSIFY = """import json, sys, trio
from p2pswarm.nat.stun import classify_nat
report = trio.run(lambda: classify_nat((sys.argv[1], 3478), source_ip=sys.argv[2], timeout=5.0))
print(json.dumps({"type": report.nat_type.value, "public": report.public, "packets": report.packets_sent}))
"""
EXPECTED = {  # host → the RFC 3489 class its router gives
    "public": "open-internet",
    NatKind.DMZ: "full-cone",
    NatKind.EASY: "port-restricted",
    NatKind.SYMMETRIC: "symmetric",
}


def test_stun_classifies_each_nat_kind(lab):
    stun = lab.stun_host()
    lab.run(stun, ["stund", "-h", stun.ip, "-a", STUN_ALT_IP], timeout=80)
    hosts = {"public": lab.public_host("pub")}
    hosts.update({kind: lab.nat_host(kind.value, kind) for kind in (NatKind.DMZ, NatKind.EASY, NatKind.SYMMETRIC)})
    time.sleep(0.5)  # stund binds its four sockets
    reports = {}
    for name, host in hosts.items():
        out = lab.exec(host, [sys.executable, "-c", CLASSIFY, stun.ip, host.ip], timeout=20).stdout
        reports[name] = json.loads(out)
    assert {name: r["type"] for name, r in reports.items()} == EXPECTED, reports
    for name, report in reports.items():
        assert report["packets"] <= MAX_CLASSIFY_PACKETS
        wan = hosts[name].ip if name == "public" else lab.router(hosts[name]).ip
        assert report["public"][0] == wan, (name, report)
