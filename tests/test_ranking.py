"""The pure ranking of a stage's records: standing first, bounded claims, a few per address of the
peers that did no work we know of (vouched peers and strangers)."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from p2pswarm.dht.ranking import (
    MAX_PER_IP,
    MAX_PER_SUBNET,
    NO_ADDRESS,
    Standing,
    is_loopback,
    network_of,
    pool,
    ranked,
    record_network,
    source_network,
    top,
)
from p2pswarm.dht.records import MAX_FREE_MEMORY_MB, MAX_THROUGHPUT, Capacity, StageRecord

K = 8  # a stage map's top k (DEFAULT_K)
ADDRS = ["/ip4/203.0.113.7/tcp/4001", "/ip4/203.0.113.8/tcp/4001", "/ip4/198.51.100.1/tcp/4001",
         "/ip4/127.0.0.1/tcp/4001", "/ip6/2001:db8:1::1/tcp/4001", "/ip6/2001:db8:2::1/tcp/4001",
         "/dns4/peer.example.org/tcp/443", "/ip4/192.0.2.1/tcp/1/p2p/R/p2p-circuit", "not an address"]


def rec(peer: str, addr: str | None = None, mem: int = 0, queue: int = 0, tput: float = 0.0) -> StageRecord:
    return StageRecord(peer, (addr,) if addr else (), "m", 0, 0, 1, Capacity(mem, queue, 0, tput), 0.0, 60.0)


records_st = st.lists(
    st.builds(lambda addr, mem, queue: (addr, mem, queue), st.sampled_from([None, *ADDRS]),
              st.integers(0, MAX_FREE_MEMORY_MB), st.integers(0, 3)),
    max_size=24,
).map(lambda rows: [rec(f"p{i:02d}", addr, mem, queue) for i, (addr, mem, queue) in enumerate(rows)])
standings_st = st.dictionaries(st.sampled_from([f"p{i:02d}" for i in range(24)]),
                               st.sampled_from([Standing.VOUCHED, Standing.WORKING, Standing.OWN]), max_size=12)


def standing_of(known: dict):
    """Peers of ``known`` as marked, the first one marked OWN our own record (any other OWN: working);
    the rest strangers."""
    own = min((p for p, s in known.items() if s is Standing.OWN), default=None)

    def standing(peer: str) -> Standing:
        if peer == own:
            return Standing.OWN
        if peer in known:
            return Standing.VOUCHED if known[peer] is Standing.VOUCHED else Standing.WORKING
        return Standing.STRANGER

    return standing


@given(records_st, standings_st, st.randoms())
def test_ranking_is_a_permutation_and_ignores_input_order(records, known, rng):
    standing = standing_of(known)
    order = [r for r, _ in ranked(records, standing)]
    assert sorted(r.peer_id for r in order) == sorted(r.peer_id for r in records)
    shuffled = list(records)
    rng.shuffle(shuffled)
    assert ranked(shuffled, standing) == ranked(records, standing)


@given(records_st, standings_st)
def test_no_claim_outranks_our_own_record_or_a_working_peer(records, known):
    standing = standing_of(known)
    for view in (top(records, standing, K), pool(records, standing, K)):
        levels = [min(standing(r.peer_id), Standing.VOUCHED) for r in view]
        assert levels == sorted(levels)  # own, then working, then the rest (claims rank only within each)
        proven = [r.peer_id for r in records if standing(r.peer_id) <= Standing.WORKING]
        if len(proven) <= K:
            assert set(proven) <= {r.peer_id for r in view}  # never displaced, whatever the others claim


@given(records_st, standings_st)
def test_the_top_holds_a_few_peers_per_address_and_subnet_of_those_that_did_no_work(records, known):
    """A ping costs nothing: vouched peers are capped per address as strangers are; working peers are not."""
    standing = standing_of(known)
    view = top(records, standing, K)
    capped = [r for r in view if standing(r.peer_id) >= Standing.VOUCHED]
    assert max(Counter(record_network(r)[0] for r in capped).values(), default=0) <= MAX_PER_IP
    assert max(Counter(record_network(r)[1] for r in capped).values(), default=0) <= MAX_PER_SUBNET
    uncrowded = [standing(r.peer_id) for r in view if standing(r.peer_id) >= Standing.VOUCHED]
    assert uncrowded == sorted(uncrowded)  # of those, vouched peers take an address's places first


@given(records_st, standings_st)
def test_the_crowded_stay_in_the_pool_after_every_uncrowded_one(records, known):
    standing = standing_of(known)
    both = ranked(records, standing)
    flags = [crowded for _, crowded in both]
    assert flags == sorted(flags)
    assert not any(crowded for r, crowded in both if standing(r.peer_id) <= Standing.WORKING)
    assert [r for r, crowded in both if not crowded] == top(records, standing, len(records))


def test_working_peers_behind_one_address_all_count_and_pinging_ones_do_not():
    """A CGNAT: five honest peers that work share one public address with 20 identities that answer
    pings. Every working peer is in the top; the pinging ones get MAX_PER_IP places."""
    cgnat = "/ip4/100.64.0.1/tcp/4001"
    honest = [rec(f"honest{i}", cgnat, 100) for i in range(5)]
    pingers = [rec(f"pinger{i:02d}", cgnat, MAX_FREE_MEMORY_MB, 0, MAX_THROUGHPUT) for i in range(20)]

    def standing(peer):
        return Standing.WORKING if peer.startswith("honest") else Standing.VOUCHED

    view = [r.peer_id for r in top(pingers + honest, standing, K)]
    assert view[:5] == sorted(r.peer_id for r in honest)
    assert sum(p.startswith("pinger") for p in view) == MAX_PER_IP


@given(records_st, st.sampled_from(ADDRS), st.integers(0, 2**20))
def test_a_stranger_alone_on_its_subnet_is_behind_few_places(records, addr, mem):
    """However many records each address claims, a stranger whose subnet nobody else uses has at
    most MAX_PER_SUBNET strangers of each other subnet ahead of it (and the working peers)."""
    honest = rec("honest", addr, mem)
    others = [r for r in records if record_network(r)[1] != record_network(honest)[1]]
    order = top([*others, honest], lambda peer: Standing.STRANGER, len(others) + 1)
    ahead = order[:order.index(honest)]
    assert len(ahead) <= MAX_PER_SUBNET * len({record_network(r)[1] for r in others})


def test_64_identities_of_one_address_claiming_everything_leave_honest_peers_in_the_top():
    """The probe of issue 13: 64 self-made identities on one IP, each claiming 4 PB free and 10^12
    tokens/s, took all 8 places of a stage. Now they get MAX_PER_IP of them."""
    fakes = [rec(f"fake{i:02d}", f"/ip4/203.0.113.7/tcp/{4001 + i}", MAX_FREE_MEMORY_MB, 0, MAX_THROUGHPUT)
             for i in range(64)]
    honest = [rec("me", "/ip4/127.0.0.1/tcp/5000", 100), rec("replica", "/ip4/127.0.0.1/tcp/5001", 100),
              rec("far", "/ip4/198.51.100.4/tcp/4001", 100)]
    everyone = fakes + honest
    random.Random(0).shuffle(everyone)

    def standing(peer):
        return Standing.OWN if peer == "me" else Standing.VOUCHED if peer == "replica" else Standing.STRANGER

    view = [r.peer_id for r in top(everyone, standing, K)]
    assert view[:2] == ["me", "replica"] and "far" in view
    assert sum(p.startswith("fake") for p in view) == MAX_PER_IP
    stranger_view = [r.peer_id for r in top(everyone, lambda peer: Standing.STRANGER, K)]
    assert {"me", "replica", "far"} <= set(stranger_view)  # even before anyone answered anyone
    assert len(pool(everyone, standing, 24)) == 24  # the crowd stays checkable, at the end


def test_network_of_addresses():
    assert network_of("/ip4/203.0.113.7/tcp/4001") == ("203.0.113.7", "203.0.113.0/24")
    assert network_of("/ip6/2001:db8:1:2::1/udp/4001/quic-v1") == ("2001:db8:1:2::1", "2001:db8:1::/48")
    assert network_of("/ip6/::ffff:203.0.113.7/tcp/1") == network_of("/ip4/203.0.113.7/tcp/1")
    assert network_of("/dns4/Peer.Example.org/tcp/443") == ("dns:peer.example.org", "dns:peer.example.org")
    assert network_of("/ip4/192.0.2.1/tcp/1/p2p/R/p2p-circuit/p2p/X")[0] == "192.0.2.1"  # a relayed peer: its relay's
    for bad in ("", "/", "/ip4/", "/ip4/999.1.1.1/tcp/1", "ip4/1.2.3.4", "/tcp/1", "not an address"):
        assert network_of(bad) == NO_ADDRESS
    assert source_network("198.51.100.9") == ("198.51.100.9", "198.51.100.0/24")
    assert source_network("::1")[0] == "::1" and source_network("?") == NO_ADDRESS
    assert is_loopback("127.0.0.1") and is_loopback("127.8.0.1") and is_loopback("::1")
    assert is_loopback("::ffff:127.0.0.1")
    assert not is_loopback("192.168.1.2") and not is_loopback("?") and not is_loopback("")


@given(st.text(max_size=60))
def test_network_of_is_total(text):
    ip, subnet = network_of(text)
    assert isinstance(ip, str) and isinstance(subnet, str)
