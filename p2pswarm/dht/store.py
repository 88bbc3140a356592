"""The record store a DHT node keeps for the stage keys it is Kademlia-close to.

Each key holds a dictionary with one entry per serving peer, each entry with its own expiry
(the hivemind/Petals "dictionary value" template), so many peers can announce the same stage
without overwriting each other. The store is pure bookkeeping: no I/O, no clock (every call
takes ``now``), no signature checks (the caller verifies a record, and that it came from the
peer it names, before ``put``; the store keeps the signed bytes to serve them as-is).

Rules, all bounded so a hostile peer cannot grow the store, or crowd honest peers out of it:

* A record is refused if it is expired, if its timestamp is more than ``max_clock_skew``
  seconds ahead of ``now``, or if the entry held for the same peer is as new or newer.
* One peer holds entries under at most ``max_keys_per_peer`` keys; one source IP address holds
  at most ``max_entries_per_ip_per_key`` entries under a key and ``max_entries_per_ip`` in all
  (so identities made by the thousand on one machine get a handful of places, not all). A
  loopback source is this machine itself, so a whole local swarm (the demo, the tests) shares
  it: it holds up to ``max_loopback_entries_per_key`` under a key. A private (LAN) source is
  one machine of a site like any public one.
* Behind one shared address (a CGNAT), identities made by the thousand must not keep the site's
  honest peers out: once an address's places under a key are full, a record whose peer is
  *attested* (named in the ``worked`` field of a live record held here, one that came from another
  address or is our own) takes the place of an unattested entry of that address, the one refreshed
  least recently. Work is seen by a peer's neighbours, on other addresses; identities on one
  address vouch for nothing there.
* ``get`` answers best first, a few per source: an entry beyond the first MAX_PER_IP of its
  source address or MAX_PER_SUBNET of its /24 (/48) comes after every other source's
  (``dht.ranking``), so one address's identities cannot fill the top of a reply either.
* A full key gives way to a newcomer only by evicting the entry refreshed least recently, and
  only if that entry has gone ``refresh_deadline`` seconds without a refresh. A peer that keeps
  re-announcing keeps its place, whatever TTL a newcomer claims (a long TTL buys nothing).
* A new key beyond ``max_keys`` is refused once expired entries have been pruned.

An expired entry behaves as if it vanished the instant it expired: it is never returned,
never blocks a record from its peer and never counts toward a limit. ``prune`` only
reclaims memory; calling it or not never changes what the store answers.
"""

from __future__ import annotations

from dataclasses import dataclass

from p2pswarm.dht.ranking import is_loopback, source_network, spread
from p2pswarm.dht.records import StageRecord, routing_rank
from p2pswarm.errors import ConfigError

MAX_KEYS = 4096  # stage keys one node holds; thousands of stages of several models
MAX_ENTRIES_PER_KEY = 64  # serving peers remembered per stage; routing needs only the best few
MAX_CLOCK_SKEW = 30.0  # seconds a record's timestamp may lie in the future (unsynced clocks)
MAX_KEYS_PER_PEER = 8  # a peer serves one stage; room for a few models or a stage change
MAX_ENTRIES_PER_IP_PER_KEY = 4  # machines behind one NAT (a household, a small lab) serving one stage
MAX_LOOPBACK_ENTRIES_PER_KEY = 32  # a whole local swarm on this machine (demo, tests); no remote peer
#                                    connects from loopback
MAX_ENTRIES_PER_IP = 256  # all keys together, for one source address
REFRESH_DEADLINE = 12.0  # announcers refresh every 5 s: two missed beats and a place may be taken
LOCAL_SOURCE = ""  # source_ip of a record we stored ourselves: no per-IP limit applies


@dataclass(frozen=True)
class StoredRecord:
    """A verified record, the signed bytes it was decoded from, and where it came from."""

    record: StageRecord
    raw: bytes  # the signed bytes, served as-is to readers
    source_ip: str = LOCAL_SOURCE  # IP address of the connection the record arrived on


@dataclass(frozen=True)
class _Entry:
    stored: StoredRecord
    refreshed_at: float  # when the store last accepted a record of this peer under this key


class RecordStore:
    """Bounded per-key dictionaries of stage records, one entry per peer."""

    def __init__(
        self,
        max_keys: int = MAX_KEYS,
        max_entries_per_key: int = MAX_ENTRIES_PER_KEY,
        max_clock_skew: float = MAX_CLOCK_SKEW,
        *,
        max_keys_per_peer: int = MAX_KEYS_PER_PEER,
        max_entries_per_ip_per_key: int = MAX_ENTRIES_PER_IP_PER_KEY,
        max_entries_per_ip: int = MAX_ENTRIES_PER_IP,
        max_loopback_entries_per_key: int = MAX_LOOPBACK_ENTRIES_PER_KEY,
        refresh_deadline: float = REFRESH_DEADLINE,
    ) -> None:
        counts = (max_keys, max_entries_per_key, max_keys_per_peer, max_entries_per_ip_per_key, max_entries_per_ip,
                  max_loopback_entries_per_key)
        if min(counts) < 1 or not max_clock_skew >= 0 or not refresh_deadline >= 0:
            raise ConfigError(
                f"record store limits must be positive: max_keys={max_keys}, "
                f"max_entries_per_key={max_entries_per_key}, max_clock_skew={max_clock_skew}, "
                f"max_keys_per_peer={max_keys_per_peer}, max_entries_per_ip_per_key={max_entries_per_ip_per_key}, "
                f"max_entries_per_ip={max_entries_per_ip}, "
                f"max_loopback_entries_per_key={max_loopback_entries_per_key}, refresh_deadline={refresh_deadline}"
            )
        self._max_keys = max_keys
        self._max_entries_per_key = max_entries_per_key
        self._max_clock_skew = max_clock_skew
        self._max_keys_per_peer = max_keys_per_peer
        self._max_per_ip_key = max_entries_per_ip_per_key
        self._max_per_ip = max_entries_per_ip
        self._max_loopback_per_key = max_loopback_entries_per_key
        self._refresh_deadline = refresh_deadline
        self._keys: dict[bytes, dict[str, _Entry]] = {}
        self._by_ip: dict[str, set[tuple[bytes, str]]] = {}  # source ip -> (key, peer) of its entries
        self._by_peer: dict[str, set[bytes]] = {}  # peer -> keys it holds entries under
        self._attesters: dict[str, set[tuple[bytes, str]]] = {}  # peer -> (key, author) of entries naming it

    def put(self, key: bytes, stored: StoredRecord, now: float) -> bool:
        """Store ``stored`` under ``key``; False if a rule refuses it."""
        record, peer = stored.record, stored.record.peer_id
        if not record.is_fresh(now) or record.timestamp > now + self._max_clock_skew:
            return False
        entries = self._live_entries(key, now)
        held = entries.get(peer) if entries else None
        if held is not None and held.stored.record.timestamp >= record.timestamp:
            return False
        if held is None and not self._peer_has_room(peer, now):
            return False
        if (held is None or held.stored.source_ip != stored.source_ip) and not self._ip_has_room(
                stored.source_ip, key, now) and not self._room_for_attested(key, stored, now):
            return False
        if entries is None and not self._room_for_new_key(now):
            return False
        if held is None and entries is not None and len(entries) >= self._max_entries_per_key:
            if not self._evict_one(key, entries, now):
                return False
        if held is not None:
            self._remove(key, peer)
        self._insert(key, _Entry(stored, now))
        return True

    def get(self, key: bytes, now: float) -> list[StoredRecord]:
        """The fresh entries under ``key``, best for routing first, a few per source address first
        (our own entries are never pushed back)."""
        fresh = [e.stored for e in self._keys.get(key, {}).values() if e.stored.record.is_fresh(now)]
        order = sorted(fresh, key=lambda stored: routing_rank(stored.record))
        crowded = spread(order, lambda s: None if s.source_ip == LOCAL_SOURCE else source_network(s.source_ip))
        return [s for _, _, s in sorted(zip(crowded, range(len(order)), order), key=lambda e: e[:2])]

    def prune(self, now: float) -> int:
        """Drop expired entries and emptied keys; return the number of entries dropped."""
        before = self.entry_count()
        for key in list(self._keys):
            self._live_entries(key, now)
        return before - self.entry_count()

    def __len__(self) -> int:
        """Keys held, counting keys whose entries have expired but are not yet pruned."""
        return len(self._keys)

    def entry_count(self) -> int:
        """Entries held, counting expired entries not yet pruned."""
        return sum(len(entries) for entries in self._keys.values())

    # --- bookkeeping -------------------------------------------------------------------

    def _insert(self, key: bytes, entry: _Entry) -> None:
        peer = entry.stored.record.peer_id
        self._keys.setdefault(key, {})[peer] = entry
        self._by_peer.setdefault(peer, set()).add(key)
        if entry.stored.source_ip != LOCAL_SOURCE:
            self._by_ip.setdefault(entry.stored.source_ip, set()).add((key, peer))
        for named, _ in entry.stored.record.worked:
            self._attesters.setdefault(named, set()).add((key, peer))

    def _remove(self, key: bytes, peer: str) -> None:
        entries = self._keys[key]
        entry = entries.pop(peer)
        if not entries:
            del self._keys[key]
        _discard(self._by_peer, peer, key)
        if entry.stored.source_ip != LOCAL_SOURCE:
            _discard(self._by_ip, entry.stored.source_ip, (key, peer))
        for named, _ in entry.stored.record.worked:
            _discard(self._attesters, named, (key, peer))

    def _expired(self, key: bytes, peer: str, now: float) -> bool:
        return not self._keys[key][peer].stored.record.is_fresh(now)

    def _live_entries(self, key: bytes, now: float) -> dict[str, _Entry] | None:
        """Drop the expired entries of ``key``; its remaining entries, or None if none remain."""
        entries = self._keys.get(key)
        if entries is None:
            return None
        for peer in [p for p in entries if self._expired(key, p, now)]:
            self._remove(key, peer)
        return self._keys.get(key)

    def _peer_has_room(self, peer: str, now: float) -> bool:
        for key in [k for k in self._by_peer.get(peer, ()) if self._expired(k, peer, now)]:
            self._remove(key, peer)
        return len(self._by_peer.get(peer, ())) < self._max_keys_per_peer

    def _ip_has_room(self, ip: str, key: bytes, now: float) -> bool:
        if ip == LOCAL_SOURCE:
            return True
        for held_key, peer in [e for e in self._by_ip.get(ip, ()) if self._expired(*e, now)]:
            self._remove(held_key, peer)
        held = self._by_ip.get(ip, set())
        per_key = self._max_loopback_per_key if is_loopback(ip) else self._max_per_ip_key
        return len(held) < self._max_per_ip and sum(k == key for k, _ in held) < per_key

    def _attested(self, peer: str, ip: str, now: float) -> bool:
        """Whether a live record held here, not from ``ip``, names ``peer`` among its workers."""
        return any(not self._expired(key, author, now) and self._keys[key][author].stored.source_ip != ip
                   for key, author in self._attesters.get(peer, ()))

    def _room_for_attested(self, key: bytes, stored: StoredRecord, now: float) -> bool:
        """Evict an unattested entry of a full address for an attested newcomer (module docstring)."""
        ip = stored.source_ip
        if not self._attested(stored.record.peer_id, ip, now):
            return False
        unattested = [self._keys[k][p] for k, p in self._by_ip.get(ip, ()) if k == key
                      and p != stored.record.peer_id and not self._attested(p, ip, now)]
        if not unattested:
            return False
        victim = min(unattested, key=lambda e: (e.refreshed_at, e.stored.record.peer_id))
        self._remove(key, victim.stored.record.peer_id)
        return self._ip_has_room(ip, key, now)

    def _room_for_new_key(self, now: float) -> bool:
        if len(self._keys) >= self._max_keys:
            self.prune(now)
        return len(self._keys) < self._max_keys

    def _evict_one(self, key: bytes, entries: dict[str, _Entry], now: float) -> bool:
        """Evict the entry refreshed least recently if it is overdue; whether room was made."""
        victim = min(entries.values(), key=lambda e: (e.refreshed_at, e.stored.record.peer_id))
        if now - victim.refreshed_at <= self._refresh_deadline:
            return False
        self._remove(key, victim.stored.record.peer_id)
        return True


def _discard(index: dict, name, item) -> None:
    items = index.get(name)
    if items is not None:
        items.discard(item)
        if not items:
            del index[name]
