"""Which records of a stage come first: what we saw ourselves before what a record claims.

A stage record is signed by its peer, but everything in it is that peer's say-so: its capacity,
its addresses, even that it is one machine rather than one of 64 identities made on one. Ranking
by claims alone let such identities, each claiming 4 PB free, take every place of a stage's top
k (issue 13). So a stage's records are ranked, best first:

1. by **standing**, what we know: our own record, then peers counted as *working* (``dht.work``:
   work we saw, or that peers we trust attest), then peers that *vouched* for themselves by
   answering our round trip recently (``dht.candidates``), then strangers. No stranger ever
   displaces our own record, a working or a vouched peer, whatever it claims;
2. within a standing, by the record's claims bounded to plausible values (``records.best_first``);
3. and peers that did no work we know of (vouched and strangers) only **a few per address**: at
   most MAX_PER_IP of one IP address and MAX_PER_SUBNET of one /24 (IPv4) or /48 (IPv6) among a
   stage's top k, vouched peers taking their address's places first. A ping costs nothing, so
   answering one buys no more places than a record does. The address is the IP of a record's first
   multiaddr (its best one; for a relayed peer, its relay's); a record with none shares one group
   with every other such record. Crowded peers are not dropped: they stay at the end of the pool a
   node checks (and routes to), and one that works needs no place: working peers are never capped,
   so a CGNAT's honest peers all count once they work.

No address class is exempt: a loopback or private address in a record is as easy to claim as any
other. A swarm on one machine (the demo, the tests: every peer on 127.0.0.1) is unaffected as long
as a stage has at most MAX_PER_IP peers in a view that did no work yet, and its peers see each
other work within a few micro-batches. Pure functions: no I/O, no clock.
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from enum import IntEnum
from typing import TypeVar

from p2pswarm.dht.records import StageRecord, routing_rank

MAX_PER_IP = 2  # strangers of one IP address in a stage's top k: one machine, or a household's NAT
MAX_PER_SUBNET = 3  # strangers of one /24 or /48 in a stage's top k: one provider's block, one site
IPV4_SUBNET_BITS = 24  # the block a provider hands out whole (and an attacker rents whole)
IPV6_SUBNET_BITS = 48  # a site's usual IPv6 allocation: one /48 holds 2^80 addresses of one owner
NO_ADDRESS = ("", "")  # group of records whose first address carries no IP or DNS name

_T = TypeVar("_T")


class Standing(IntEnum):
    """What we know first-hand of a record's peer; lower ranks first."""

    OWN = 0  # our own record
    WORKING = 1  # did work we saw or a peer we trust attests (dht.work): never capped per address
    VOUCHED = 2  # answered our round trip recently (or pinged us): alive and reachable, nothing more
    STRANGER = 3  # only its record speaks for it


def network_of(addr: str) -> tuple[str, str]:
    """(address, subnet) of a multiaddr's first component: an IP with its /24 or /48, or a DNS
    name standing for both. Text that is no IP multiaddr falls into NO_ADDRESS."""
    parts = addr.split("/")
    if len(parts) < 3 or parts[0]:
        return NO_ADDRESS
    proto, value = parts[1], parts[2]
    if proto in ("dns", "dns4", "dns6", "dnsaddr") and value:
        return f"dns:{value.lower()}", f"dns:{value.lower()}"
    if proto not in ("ip4", "ip6"):
        return NO_ADDRESS
    try:
        ip = ipaddress.ip_address(value)
    except ValueError:
        return NO_ADDRESS
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # one IPv4 address, however it is spelled
    bits = IPV4_SUBNET_BITS if ip.version == 4 else IPV6_SUBNET_BITS
    return str(ip), str(ipaddress.ip_network(f"{ip}/{bits}", strict=False))


def source_network(ip: str) -> tuple[str, str]:
    """(address, subnet) of a connection's source IP (a record store's view of who stored)."""
    return network_of(f"/ip6/{ip}" if ":" in ip else f"/ip4/{ip}") if ip else NO_ADDRESS


def record_network(record: StageRecord) -> tuple[str, str]:
    """The group a record counts in: its first address's IP and subnet."""
    return network_of(record.addrs[0]) if record.addrs else NO_ADDRESS


def is_loopback(ip: str) -> bool:
    """Whether a connection's source IP is this machine's own (127/8, ::1)."""
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        return False
    return address.is_loopback or (address.version == 6 and address.ipv4_mapped is not None
                                   and address.ipv4_mapped.is_loopback)


def spread(items: Sequence[_T], network: Callable[[_T], tuple[str, str] | None]) -> list[bool]:
    """For ``items`` in rank order, whether each is *crowded*: its address already has MAX_PER_IP
    uncrowded items before it, or its subnet MAX_PER_SUBNET. A ``network`` of None is never
    crowded and counts toward nothing."""
    per_ip: Counter[str] = Counter()
    per_subnet: Counter[str] = Counter()
    crowded = []
    for item in items:
        group = network(item)
        full = group is not None and (per_ip[group[0]] >= MAX_PER_IP or per_subnet[group[1]] >= MAX_PER_SUBNET)
        if group is not None and not full:
            per_ip[group[0]] += 1
            per_subnet[group[1]] += 1
        crowded.append(full)
    return crowded


def ranked(records: Iterable[StageRecord], standing: Callable[[str], Standing]) -> list[tuple[StageRecord, bool]]:
    """Every record with whether it is crowded, best first: own and working, then uncrowded
    vouched peers and strangers (by standing), then the crowded; within each, by bounded claims.
    A total order: input order never matters."""
    order = sorted(records, key=lambda r: (standing(r.peer_id), routing_rank(r)))
    stands = [standing(r.peer_id) for r in order]
    capped = [s >= Standing.VOUCHED for s in stands]
    flags = iter(spread([r for r, c in zip(order, capped) if c], record_network))
    crowded = [next(flags) if c else False for c in capped]
    best = sorted(range(len(order)), key=lambda i: (crowded[i], stands[i], i))
    return [(order[i], crowded[i]) for i in best]


def pool(records: Iterable[StageRecord], standing: Callable[[str], Standing], limit: int) -> list[StageRecord]:
    """The ``limit`` records a node keeps and checks for a stage, best first, the crowded last."""
    return [r for r, _ in ranked(records, standing)][:limit]


def top(records: Iterable[StageRecord], standing: Callable[[str], Standing], k: int) -> list[StageRecord]:
    """A stage's top ``k``: our own record, every working peer, then vouched peers and strangers a few
    per address."""
    return [r for r, crowded in ranked(records, standing) if not crowded][:k]
