"""The pure dial planner and connect statistics of ``p2pswarm/net/dialplan.py``.

``plan_dials`` is checked with hypothesis on realistic multiaddr lists: every generated address
carries a tag saying what it is (a dialable direct address, a loopback one, an unspecified one,
port 0, a circuit, one for another peer, garbage), so the expected plan is derived from the tags
rather than from the planner's own predicates. ``percentile``, ``MethodStats`` and
``ConnectStats`` are checked on examples.
"""

from __future__ import annotations

import math
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pswarm.net.dialplan import (
    CIRCUIT,
    DIRECT,
    HOLEPUNCH,
    MAX_CIRCUIT_ADDRS,
    MAX_DIRECT_ADDRS,
    METHODS,
    RELAY,
    SAMPLE_WINDOW,
    ConnectStats,
    DialPlan,
    MethodStats,
    percentile,
    plan_dials,
    relay_address,
)

FAST = settings(max_examples=200, deadline=None)
SCENARIOS = settings(max_examples=100, deadline=None)  # each scenario is a list of up to 24 addresses

# --- strategies -------------------------------------------------------------------------

# Tags: what an address is once the target's trailing /p2p/<peer id> is stripped.
DIALABLE = "dialable"  # a direct address that is not loopback
LOOPBACK = "loopback"  # a direct address on 127.0.0.0/8 or ::1
CIRCUIT_OK = "circuit"  # <relay addr>/p2p/<relay id>/p2p-circuit, relay id != target
INVALID = "invalid"  # anything the planner must drop

ids = st.text(string.ascii_letters + string.digits, min_size=1, max_size=6)
# A few ports and hosts repeat often, so duplicates and collisions with own_addrs happen.
ports = st.sampled_from([1, 4001, 4002, 65535]) | st.integers(1, 65535)
octet = st.integers(0, 255)
public_ip4 = st.sampled_from(["203.0.113.7", "198.51.100.1", "192.168.1.20", "10.0.0.5"]) | st.builds(
    "{}.{}.{}.{}".format, st.integers(1, 223).filter(lambda a: a != 127), octet, octet, octet)
loopback_ip4 = st.sampled_from(["127.0.0.1"]) | st.builds("127.{}.{}.{}".format, octet, octet, octet)


@st.composite
def direct_host(draw):
    """(``/ip4|ip6|dns4/<host>/tcp``, tag) for a host that may be dialed."""
    kind = draw(st.sampled_from(["ip4", "ip6", "dns4", "loop4", "loop6"]))
    if kind == "ip4":
        return f"/ip4/{draw(public_ip4)}/tcp", DIALABLE
    if kind == "ip6":
        return f"/ip6/2001:db8::{draw(st.integers(1, 0xffff)):x}/tcp", DIALABLE
    if kind == "dns4":
        return f"/dns4/{draw(st.sampled_from(['node.example.org', 'relay.example.net']))}/tcp", DIALABLE
    if kind == "loop4":
        return f"/ip4/{draw(loopback_ip4)}/tcp", LOOPBACK
    return "/ip6/::1/tcp", LOOPBACK


@st.composite
def bare_address(draw):
    """(bare address, tag) with no /p2p/ part: direct, loopback, unspecified or port 0."""
    choice = draw(st.sampled_from(["direct", "direct", "direct", "unspec4", "unspec6", "port0"]))
    if choice == "unspec4":
        return f"/ip4/0.0.0.0/tcp/{draw(ports)}", INVALID
    if choice == "unspec6":
        return f"/ip6/::/tcp/{draw(ports)}", INVALID
    host, tag = draw(direct_host())
    if choice == "port0":
        return f"{host}/0", INVALID
    return f"{host}/{draw(ports)}", tag


@st.composite
def circuit_address(draw, peer_id):
    """(``<relay addr>/p2p/<relay id>/p2p-circuit``, tag), the relay id sometimes the target."""
    relay, relay_tag = draw(bare_address())
    relay_id = draw(st.sampled_from(["RelayA", "RelayB", peer_id]) | ids)
    tag = CIRCUIT_OK if relay_tag != INVALID and relay_id != peer_id else INVALID
    return f"{relay}/p2p/{relay_id}{CIRCUIT}", tag


@st.composite
def garbage(draw):
    """Text that is no dialable TCP address, of the plausible and the random kind."""
    return draw(st.sampled_from([
        "", "/", "/ip4", "/ip4/1.2.3.4", "/ip4/1.2.3.4/udp/4001/quic-v1", "/udp/53",
        "/p2p-circuit", "/p2p/QmRelay/p2p-circuit", "tcp/4001", "/unix/tmp/sock",
    ]) | st.text(st.characters(blacklist_characters="/"), max_size=20))


@st.composite
def scenario(draw):
    """(peer id, [(address, tag)], own_addrs, own_real): a peer's advertised list and ours."""
    peer_id = draw(st.sampled_from(["QmPeer", "RelayA"]) | ids)
    entries = []
    for _ in range(draw(st.integers(0, 24))):
        kind = draw(st.sampled_from(["bare"] * 4 + ["circuit"] * 2 + ["other", "garbage", "repeat"]))
        if kind == "repeat" and entries:  # the same address again, maybe with the target suffix
            _, addr, tag = draw(st.sampled_from(entries))
        elif kind in ("bare", "repeat"):
            addr, tag = draw(bare_address())
        elif kind == "circuit":
            addr, tag = draw(circuit_address(peer_id))
        elif kind == "other":  # an address of some other peer, or a circuit to some other peer
            other = draw(ids.filter(lambda i: i != peer_id))
            base = draw(st.one_of(bare_address(), circuit_address(peer_id)))[0]
            addr, tag = f"{base}/p2p/{other}", INVALID
        else:
            addr, tag = draw(garbage()), INVALID
        suffixed = draw(st.booleans()) and kind != "other" and tag != INVALID
        entries.append((f"{addr}/p2p/{peer_id}" if suffixed else addr, addr, tag))
    # Our own listen addresses: sometimes borrowed from the peer's list (a NAT hairpin,
    # the same machine), sometimes wildcard or loopback only.
    own = draw(st.lists(st.one_of(
        bare_address().map(lambda p: p[0]),
        st.sampled_from([bare for _, bare, tag in entries if tag in (DIALABLE, LOOPBACK)] or ["/ip4/0.0.0.0/tcp/4001"]),
    ), max_size=4))
    own_real = any(not a.startswith(("/ip4/127.", "/ip6/::1/", "/ip4/0.0.0.0/", "/ip6/::/")) for a in own)
    return peer_id, entries, own, own_real


def expected_plan(entries, own, own_real) -> DialPlan:
    """The plan the tags call for: first appearance, loopback last if we have a real address, capped."""
    direct, circuits = [], []
    for _, bare, tag in entries:
        if tag in (DIALABLE, LOOPBACK) and bare not in own and bare not in direct:
            direct.append(bare)
        elif tag == CIRCUIT_OK and bare not in circuits:
            circuits.append(bare)
    if own_real:
        direct = [a for a in direct if not is_loopback(a)] + [a for a in direct if is_loopback(a)]
    return DialPlan(tuple(direct[:MAX_DIRECT_ADDRS]), tuple(circuits[:MAX_CIRCUIT_ADDRS]))


def is_loopback(addr: str) -> bool:
    return addr.startswith(("/ip4/127.", "/ip6/::1/"))


def is_unspecified(addr: str) -> bool:
    return addr.startswith(("/ip4/0.0.0.0/", "/ip6/::/"))


# Any mix of the above and arbitrary text, for the properties that must hold on anything.
any_addresses = st.lists(st.one_of(
    bare_address().map(lambda p: p[0]),
    circuit_address("QmPeer").map(lambda p: p[0]),
    circuit_address("QmPeer").map(lambda p: p[0] + "/p2p/QmPeer"),
    bare_address().map(lambda p: p[0] + "/p2p/QmPeer"),
    garbage(),
    st.text(max_size=40),
), max_size=30)


# --- plan_dials: properties ------------------------------------------------------------


def check_invariants(plan: DialPlan, peer_id: str, own) -> None:
    """What every plan satisfies, whatever it was given."""
    own = set(own)
    for addr in plan.direct + plan.circuits:
        assert not is_unspecified(addr), addr
        assert addr not in own, addr
    for addr in plan.direct:
        assert "/p2p/" not in addr, addr
        assert not addr.endswith("/tcp/0"), addr
    for circuit in plan.circuits:
        assert circuit.endswith(CIRCUIT), circuit
        relay, relay_id = relay_address(circuit)
        assert relay_id and "/" not in relay_id and relay_id != peer_id, circuit
        assert f"/p2p/{relay_id}" in circuit
        assert f"{relay}/p2p/{relay_id}{CIRCUIT}" == circuit
        assert not is_unspecified(relay) and not relay.endswith("/tcp/0"), circuit
        assert "/p2p/" not in relay, circuit
    assert len(set(plan.direct)) == len(plan.direct)
    assert len(set(plan.circuits)) == len(plan.circuits)
    assert len(plan.direct) <= MAX_DIRECT_ADDRS
    assert len(plan.circuits) <= MAX_CIRCUIT_ADDRS
    assert plan.empty() == (not plan.direct and not plan.circuits)


@SCENARIOS
@given(scenario())
def test_plan_matches_the_tags(case):
    peer_id, entries, own, own_real = case
    plan = plan_dials(peer_id, [addr for addr, _, _ in entries], own)
    check_invariants(plan, peer_id, own)
    assert plan == expected_plan(entries, own, own_real)


@FAST
@given(peer_id=st.sampled_from(["QmPeer"]) | ids, addrs=any_addresses,
       own=st.lists(bare_address().map(lambda p: p[0]) | st.text(max_size=20), max_size=4))
def test_invariants_hold_on_any_input(peer_id, addrs, own):
    check_invariants(plan_dials(peer_id, addrs, own), peer_id, own)


@SCENARIOS
@given(scenario())
def test_first_appearance_order_and_loopback_last(case):
    peer_id, entries, own, own_real = case
    addrs = [addr for addr, _, _ in entries]
    plan = plan_dials(peer_id, addrs, own)
    stripped = [addr.removesuffix(f"/p2p/{peer_id}") for addr in addrs]

    def first_seen(addr):
        return stripped.index(addr)

    assert list(plan.circuits) == sorted(plan.circuits, key=first_seen)
    if own_real:
        kinds = [is_loopback(a) for a in plan.direct]
        assert kinds == sorted(kinds), "a loopback address comes before a real one"
        real = [a for a in plan.direct if not is_loopback(a)]
        loop = [a for a in plan.direct if is_loopback(a)]
        assert real == sorted(real, key=first_seen) and loop == sorted(loop, key=first_seen)
    else:
        assert list(plan.direct) == sorted(plan.direct, key=first_seen)


@SCENARIOS
@given(scenario())
def test_target_suffix_is_stripped(case):
    peer_id, entries, own, _ = case
    bare = plan_dials(peer_id, [b for _, b, _ in entries], own)
    suffixed = plan_dials(peer_id, [f"{b}/p2p/{peer_id}" for _, b, _ in entries], own)
    assert suffixed == bare
    for addr in suffixed.direct + suffixed.circuits:
        assert not addr.endswith(f"/p2p/{peer_id}")


@SCENARIOS
@given(scenario())
def test_deterministic_and_any_iterable(case):
    peer_id, entries, own, _ = case
    addrs = [addr for addr, _, _ in entries]
    first = plan_dials(peer_id, addrs, own)
    assert plan_dials(peer_id, list(addrs), list(own)) == first
    assert plan_dials(peer_id, iter(addrs), iter(own)) == first  # one-shot iterables
    assert plan_dials(peer_id, tuple(addrs), frozenset(own)) == first


@FAST
@given(peer_id=ids, relay=bare_address().filter(lambda p: p[1] != INVALID).map(lambda p: p[0]),
       relay_id=ids)
def test_relay_address_inverts_the_circuit_form(peer_id, relay, relay_id):
    circuit = f"{relay}/p2p/{relay_id}{CIRCUIT}"
    assert relay_address(circuit) == (relay, relay_id)
    plan = plan_dials(peer_id, [circuit, f"{circuit}/p2p/{peer_id}"], [])
    assert plan.circuits == (() if relay_id == peer_id else (circuit,))


# --- plan_dials: examples -------------------------------------------------------------


def test_natted_peer_typical_address_list():
    """What identify reports for a peer behind a NAT with two relay reservations."""
    peer = "12D3KooWPeer"
    relay1, relay2 = "/ip4/198.51.100.1/tcp/4001", "/ip4/198.51.100.2/tcp/4001"
    addrs = [
        "/ip4/127.0.0.1/tcp/4001",
        "/ip4/0.0.0.0/tcp/4001",
        "/ip4/192.168.1.20/tcp/4001",
        f"/ip4/203.0.113.7/tcp/53211/p2p/{peer}",  # observed address, with the target suffix
        "/ip4/203.0.113.7/tcp/53211",  # the same again, bare
        "/ip6/::/tcp/4001",
        "/ip4/203.0.113.7/tcp/0",
        f"{relay1}/p2p/RelayOne/p2p-circuit",
        f"{relay1}/p2p/RelayOne/p2p-circuit/p2p/{peer}",  # the same circuit with the target
        f"{relay2}/p2p/RelayTwo/p2p-circuit/p2p/{peer}",
        f"{relay2}/p2p/RelayTwo/p2p-circuit/p2p/SomeoneElse",
        f"/ip4/10.0.0.9/tcp/4001/p2p/{peer}/p2p-circuit",  # "through" the peer itself
        "/ip4/192.168.1.20/udp/4001/quic-v1",
    ]
    own = ["/ip4/10.1.1.1/tcp/4001", "/ip4/127.0.0.1/tcp/4001"]
    plan = plan_dials(peer, addrs, own)
    assert plan.direct == ("/ip4/192.168.1.20/tcp/4001", "/ip4/203.0.113.7/tcp/53211")
    assert plan.circuits == (f"{relay1}/p2p/RelayOne/p2p-circuit", f"{relay2}/p2p/RelayTwo/p2p-circuit")
    assert [relay_address(c) for c in plan.circuits] == [(relay1, "RelayOne"), (relay2, "RelayTwo")]
    assert not plan.empty()


def test_loopback_kept_first_when_we_only_listen_on_loopback_or_wildcard():
    addrs = ["/ip4/127.0.0.1/tcp/5000", "/ip4/192.168.1.20/tcp/5000"]
    for own in ([], ["/ip4/127.0.0.1/tcp/4001"], ["/ip4/0.0.0.0/tcp/4001", "/ip6/::/tcp/4001"]):
        assert plan_dials("P", addrs, own).direct == tuple(addrs)
    assert plan_dials("P", addrs, ["/ip4/10.0.0.1/tcp/4001"]).direct == tuple(reversed(addrs))


def test_caps_keep_the_first_addresses_and_loopback_only_if_room_is_left():
    real = [f"/ip4/203.0.113.{i}/tcp/4001" for i in range(1, 12)]
    loops = ["/ip4/127.0.0.1/tcp/1", "/ip6/::1/tcp/1"]
    plan = plan_dials("P", loops + real, ["/ip4/10.0.0.1/tcp/1"])
    assert plan.direct == tuple(real[:MAX_DIRECT_ADDRS])
    circuits = [f"/ip4/198.51.100.{i}/tcp/4001/p2p/R{i}/p2p-circuit" for i in range(1, 8)]
    assert plan_dials("P", circuits, []).circuits == tuple(circuits[:MAX_CIRCUIT_ADDRS])


def test_nothing_to_dial():
    assert plan_dials("P", [], []).empty()
    assert plan_dials("P", ["/ip4/0.0.0.0/tcp/1", "garbage", "/ip4/1.2.3.4/tcp/1/p2p/Q"], []).empty()
    assert plan_dials("P", ["/ip4/1.2.3.4/tcp/1"], ["/ip4/1.2.3.4/tcp/1"]).empty()


# --- percentile -----------------------------------------------------------------------


def test_percentile_nearest_rank():
    hundred = list(range(1, 101))
    assert percentile(hundred, 0.95) == 95
    assert percentile(hundred, 0.5) == 50
    assert percentile(hundred, 0.0) == 1
    assert percentile(hundred, 1.0) == 100
    assert percentile(reversed(hundred), 0.95) == 95  # any order, any iterable
    assert percentile([], 0.5) is None
    assert percentile(iter([]), 0.95) is None
    for q in (0.0, 0.01, 0.5, 0.95, 1.0):
        assert percentile([7.5], q) == 7.5
    assert percentile([3, 1, 2], 0.5) == 2
    assert percentile([1, 2], 0.5) == 1  # nearest rank: ceil(0.5 * 2) = 1st


@FAST
@given(st.lists(st.floats(0, 1e6), min_size=1, max_size=50), st.floats(0, 1))
def test_percentile_is_an_element_at_the_nearest_rank(samples, q):
    value = percentile(samples, q)
    ordered = sorted(samples)
    assert value in ordered
    rank = max(1, math.ceil(q * len(ordered)))  # 1-based nearest rank
    assert value == ordered[min(rank, len(ordered)) - 1]
    assert percentile(samples, 0) == ordered[0] and percentile(samples, 1) == ordered[-1]


# --- MethodStats / ConnectStats ---------------------------------------------------------


def test_method_stats_summary_counts_and_milliseconds():
    stats = MethodStats()
    assert stats.summary() == {"attempts": 0, "successes": 0, "failures": 0, "p50_ms": None, "p95_ms": None}
    stats.record(False, 9.0)
    stats.record(False, 0.001)
    assert stats.summary() == {"attempts": 2, "successes": 0, "failures": 2, "p50_ms": None, "p95_ms": None}
    for seconds in (0.01234, 0.02, 0.5):
        stats.record(True, seconds)
    assert stats.summary() == {"attempts": 5, "successes": 3, "failures": 2, "p50_ms": 20.0, "p95_ms": 500.0}
    one = MethodStats()
    one.record(True, 0.01234)
    assert one.summary()["p50_ms"] == 12.3 and one.summary()["p95_ms"] == 12.3  # ms, 0.1 ms


def test_method_stats_keeps_a_bounded_window():
    stats = MethodStats()
    for i in range(SAMPLE_WINDOW + 100):
        stats.record(True, float(i))
    assert len(stats.seconds) == SAMPLE_WINDOW
    assert min(stats.seconds) == 100.0  # the oldest samples were dropped
    summary = stats.summary()
    assert summary["attempts"] == summary["successes"] == SAMPLE_WINDOW + 100
    assert summary["p50_ms"] == 1000 * (100 + SAMPLE_WINDOW // 2 - 1)


@FAST
@given(st.lists(st.tuples(st.sampled_from(METHODS), st.booleans(), st.floats(0, 60)), max_size=40))
def test_connect_stats_counts_per_method(events):
    stats = ConnectStats()
    for method, ok, seconds in events:
        stats.record(method, ok, seconds)
    summary = stats.summary()
    assert set(summary) == {"reused", *METHODS}
    assert summary["reused"] == 0
    for method in METHODS:
        mine = [(ok, s) for m, ok, s in events if m == method]
        ok_times = [s for ok, s in mine if ok]
        doc = summary[method]
        assert doc["attempts"] == len(mine)
        assert doc["successes"] == len(ok_times)
        assert doc["failures"] == len(mine) - len(ok_times)
        if ok_times:
            assert doc["p50_ms"] == round(1000 * percentile(ok_times, 0.5), 1)
            assert doc["p95_ms"] == round(1000 * percentile(ok_times, 0.95), 1)
        else:
            assert doc["p50_ms"] is None and doc["p95_ms"] is None


def test_connect_stats_example_and_reused():
    stats = ConnectStats()
    stats.record(DIRECT, True, 0.05)
    stats.record(RELAY, False, 1.0)
    stats.record(RELAY, True, 0.25)
    stats.reused += 2
    summary = stats.summary()
    assert summary["reused"] == 2
    assert summary[DIRECT] == {"attempts": 1, "successes": 1, "failures": 0, "p50_ms": 50.0, "p95_ms": 50.0}
    assert summary[RELAY] == {"attempts": 2, "successes": 1, "failures": 1, "p50_ms": 250.0, "p95_ms": 250.0}
    assert summary[HOLEPUNCH]["attempts"] == 0 and summary[HOLEPUNCH]["p50_ms"] is None
    with pytest.raises(KeyError):
        stats.record("carrier-pigeon", True, 1.0)
