"""Relays through real NAT routers: a full relay refuses cleanly, and a peer whose relay dies
moves to its second relay and stays reachable.

Two relays, the second limited to one reservation by its relay.toml. A peer behind an easy NAT
reserves on both. A second NATed peer, configured with only the full relay, is refused with
RESERVATION_REFUSED (counted by the relay, the peer keeps running). Then the first relay is
killed: the peer drops it, keeps advertising the second one only, and a public peer still
reaches it by peer id (the dead relay's address fails, the live one carries the connection).
"""

from __future__ import annotations

import pytest

from p2pswarm.testing.labswarm import LabSwarm
from p2pswarm.testing.natlab import NatKind

pytestmark = pytest.mark.timeout(240)

READY_TIMEOUT = 110.0  # PRIVATE after ~20 s, then a reservation round
MOVE_TIMEOUT = 30.0  # the relay client notices a lost relay within one 2 s tick
NBYTES = 256 * 1024


def test_full_relay_refuses_and_a_dead_relay_is_replaced_by_the_second(lab, tmp_path):
    swarm = LabSwarm(lab, tmp_path, proc_timeout=230)
    boot = swarm.start_public("boot", lab.public_host("boot"), ["bootstrap"])
    r1 = swarm.start_public("r1", lab.public_host("r1"), ["relay", "--bootstrap", boot.addr])
    small = tmp_path / "small-relay.toml"
    small.write_text("max_reservations = 1\n")
    r2 = swarm.start_public("r2", lab.public_host("r2"), ["relay", "--bootstrap", boot.addr, "--config", str(small)])
    join = ["join", "--bootstrap", boot.addr, "--layers", "0:2"]
    swarm.start("pub", lab.public_host("pub"), join)
    swarm.start("c1", lab.nat_host("c1", NatKind.EASY), [*join, "--relay", r1.addr, "--relay", r2.addr])

    ready = swarm.wait_until(["c1"], lambda d: len(d.get("relays", [])) == 2, READY_TIMEOUT)["c1"]
    assert sorted(r["peer"] for r in ready.get("relays", [])) == sorted([r1.peer_id, r2.peer_id]), (
        ready, swarm.log_tail("c1"))

    # r2 is full: a second NATed peer that names only r2 is refused, cleanly
    swarm.start("c2", lab.nat_host("c2", NatKind.EASY), [*join, "--relay", r2.addr])
    full = swarm.wait_until(["r2"], lambda d: d.get("relay", {}).get("refused", {}).get("reservations_total"),
                            READY_TIMEOUT)["r2"]
    assert full["relay"]["refused"].get("reservations_total", 0) >= 1, (full, swarm.log_tail("c2"))
    assert full["relay"]["reservations_active"] == 1
    c2 = swarm.stats("c2")
    assert c2.get("reachability") == "private" and r2.peer_id not in [r["peer"] for r in c2["relays"]], c2
    assert "cannot reserve" in swarm.log_path("c2").read_text() or "RESERVATION_REFUSED" in swarm.log_tail("c2")

    # r1 dies: c1 keeps r2 and advertises only it
    swarm.stop("r1")
    moved = swarm.wait_until(["c1"], lambda d: [r["peer"] for r in d.get("relays", [])] == [r2.peer_id]
                             and all(r2.peer_id in a for a in d.get("circuit_addrs", [])), MOVE_TIMEOUT)["c1"]
    assert [r["peer"] for r in moved["relays"]] == [r2.peer_id], (moved, swarm.log_tail("c1"))
    assert moved["circuit_addrs"] and all(r1.peer_id not in a for a in moved["circuit_addrs"]), moved

    # ... and is still reachable by peer id through r2
    swarm.stats("pub")
    assert swarm.wait_in_stage_map("pub", "c1", 30), "pub never saw c1's circuit address"
    result = swarm.ping("pub", "c1", NBYTES, upgrade_wait=5)
    assert result.get("bytes") == NBYTES and result["method"] == "relay", (result, swarm.log_tail("pub"))
