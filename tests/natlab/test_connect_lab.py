"""connect() through real NAT routers: who reaches whom, how, and whether data still flows.

One swarm: a bootstrap node, a relay and a public peer on the lab internet; two peers behind
easy NATs and two behind symmetric NATs, all real ``p2pswarm`` processes. Once the NATed peers are
PRIVATE and hold a relay reservation, peers ping each other by peer id (addresses from the layer
map) over fresh connections:

- public -> easy: relayed first, then direct (the easy peer dials the public one back);
- easy -> easy: relayed first, then direct by hole punch (DCUtR, started by the receiving side);
- easy -> symmetric and symmetric -> symmetric: punching cannot work, the relayed connection
  carries the data;
- easy -> public: direct.
"""

from __future__ import annotations

import pytest

from p2pswarm.testing.labswarm import LabSwarm
from p2pswarm.testing.natlab import NatKind

pytestmark = pytest.mark.timeout(240)

READY_TIMEOUT = 110.0  # PRIVATE after ~20 s, then a reservation round; slower on a loaded 2-core machine
MAP_TIMEOUT = 60.0  # a guard: records are re-announced every 5 s (six lab processes share two cores)
NBYTES = 512 * 1024  # well inside the relay's per-circuit byte limit
# the API's most: the punch is retried after PUNCH_BACKOFF (10 s), so a first and a second attempt
# lost on a loaded machine get a third (one upgrade took 20 s in CI)
UPGRADE_WAIT = 30.0
NO_UPGRADE_WAIT = 8.0  # to a symmetric NAT: a punch cannot work, the relayed path must stay (suite time: not 25 s)


def test_connection_matrix_direct_punched_and_relayed(lab, tmp_path):
    swarm = LabSwarm(lab, tmp_path, proc_timeout=230)
    boot = swarm.start_public("boot", lab.public_host("boot"), ["bootstrap"])
    relay = swarm.start_public("relay", lab.public_host("relay"), ["relay", "--bootstrap", boot.addr])
    join = ["join", "--bootstrap", boot.addr, "--layers", "0:2", "--relay", relay.addr]
    swarm.start("pub", lab.public_host("pub"), join)
    natted = {"easy1": NatKind.EASY, "easy2": NatKind.EASY, "sym1": NatKind.SYMMETRIC, "sym2": NatKind.SYMMETRIC}
    for name, kind in natted.items():
        swarm.start(name, lab.nat_host(name, kind), join)

    ready = swarm.wait_relayed(list(natted), READY_TIMEOUT)
    logs = {name: swarm.log_tail(name, 800) for name in natted}
    assert all(doc.get("circuit_addrs") for doc in ready.values()), (ready, logs)
    swarm.stats("pub")

    results = {}
    for src, dst in [("pub", "easy1"), ("easy1", "easy2"), ("easy1", "sym1"), ("sym1", "sym2"), ("easy2", "pub")]:
        if dst in natted:
            assert swarm.wait_in_stage_map(src, dst, MAP_TIMEOUT), f"{src} never saw {dst}'s circuit address"
        wait = 0 if dst not in natted else NO_UPGRADE_WAIT if natted[dst] is NatKind.SYMMETRIC else UPGRADE_WAIT
        results[src, dst] = swarm.ping(src, dst, NBYTES, upgrade_wait=wait)
        print(src, "->", dst, results[src, dst])
    for pair, doc in results.items():
        assert doc.get("bytes") == NBYTES, (pair, doc, swarm.log_tail(pair[0]))
    for pair in [("pub", "easy1"), ("easy1", "easy2")]:
        doc = results[pair]
        # The bytes go over the relayed connection, or over the direct one when the punch finished
        # first (a slow first round trip on a loaded machine gives it time): both are right.
        assert doc["method"] == "relay" and doc["push_path"] in ("relayed", "direct"), (pair, doc)
        assert doc["path"] == "direct" and doc["upgrade_ms"] is not None, (pair, doc, swarm.log_tail(pair[1]))
    for pair in [("easy1", "sym1"), ("sym1", "sym2")]:
        doc = results[pair]
        assert doc["method"] == "relay" and doc["path"] == "relayed" and doc["upgrade_ms"] is None, (pair, doc)
    assert results["easy2", "pub"]["method"] == "direct" and results["easy2", "pub"]["path"] == "direct"

    # Who upgraded: the receiving side, once per connection, never both (no crossed exchanges).
    stats = {name: swarm.stats(name) for name in ["pub", *natted]}
    # easy1 dials pub back. Usually through its unilateral upgrade; but easy1 also talks to pub on
    # its own (DHT announcements and lookups, DiLoCo), and when such a dial lands just as the fresh
    # relayed connection opens there is nothing left to upgrade (seen once in CI: the direct
    # connection was there 0.3 ms after the relayed one). The upgrade itself is asserted between
    # real hosts in tests/test_connect.py; here the pair must end direct (asserted above).
    # The easy pair was joined by a punch, from either side: the receiving side of a relayed connection
    # punches, and easy2 (a replica of easy1's stage) may reach easy1 over the relay for its own DHT or
    # DiLoCo traffic before the test's ping (seen under stress-ng: easy1 "punched after 0.57 s" to easy2,
    # easy2's 0 attempts). easy1's other peers cannot count: pub is a unilateral upgrade, sym1 fails.
    easy_punched = [stats[name]["holepunch"]["punched"] for name in ("easy1", "easy2")]
    assert sum(easy_punched) >= 1, (stats["easy1"]["holepunch"], stats["easy2"]["holepunch"])
    # sym2 tried to punch to sym1 (a failing punch takes ~20 s: three rounds) and never got through; the
    # pair stayed relayed (asserted above). A unilateral upgrade is no punch: sym2 dials a public peer
    # that reached it over the relay (pub, for its own DHT or DiLoCo traffic) directly, which a symmetric
    # NAT allows (seen once: "hole punch to <pub>: unilateral after 0.23 s", before the pings began).
    sym2 = stats["sym2"]["holepunch"]
    assert sym2["punched"] == 0 and sym2["failed"] + sym2["running"] >= 1, sym2
    assert all(doc["holepunch"]["refused_second_initiator"] == 0 for doc in stats.values()), stats
    assert stats["pub"]["connect"]["relay"]["successes"] >= 1 and stats["pub"]["connect"]["holepunch"]["successes"] >= 1
