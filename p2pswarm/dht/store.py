"""The record store a DHT node keeps for the layer keys it is Kademlia-close to.

Each key holds a dictionary with one entry per serving peer, each entry with its own expiry
(the hivemind/Petals "dictionary value" template), so many peers can announce the same layer
without overwriting each other. The store is pure bookkeeping: no I/O, no clock (every call
takes ``now``), no signature checks (the caller verifies a record before ``put`` and the
store keeps the signed bytes to serve them as-is).

Rules, all bounded so a hostile peer cannot grow the store without limit:

* A record is refused if it is expired, if its timestamp is more than ``max_clock_skew``
  seconds ahead of ``now``, or if the entry held for the same peer is as new or newer.
* A full key evicts the entry expiring soonest, but only for a record expiring later.
* A new key beyond ``max_keys`` is refused once expired entries have been pruned.

An expired entry behaves as if it vanished the instant it expired: it is never returned,
never blocks a record from its peer and never counts toward a limit. ``prune`` only
reclaims memory; calling it or not never changes what the store answers.
"""

from __future__ import annotations

from dataclasses import dataclass

from p2pswarm.dht.records import LayerRecord, routing_rank
from p2pswarm.errors import ConfigError

MAX_KEYS = 4096  # layer keys one node holds; a 4096-layer model fits with room for other models
MAX_ENTRIES_PER_KEY = 64  # serving peers remembered per layer; routing needs only the best few
MAX_CLOCK_SKEW = 30.0  # seconds a record's timestamp may lie in the future (unsynced clocks)


@dataclass(frozen=True)
class StoredRecord:
    """A verified record and the signed bytes it was decoded from."""

    record: LayerRecord
    raw: bytes  # the signed bytes, served as-is to readers


class RecordStore:
    """Bounded per-key dictionaries of layer records, one entry per peer."""

    def __init__(
        self,
        max_keys: int = MAX_KEYS,
        max_entries_per_key: int = MAX_ENTRIES_PER_KEY,
        max_clock_skew: float = MAX_CLOCK_SKEW,
    ) -> None:
        if max_keys < 1 or max_entries_per_key < 1 or not max_clock_skew >= 0:
            raise ConfigError(
                f"record store limits must be positive: max_keys={max_keys}, "
                f"max_entries_per_key={max_entries_per_key}, max_clock_skew={max_clock_skew}"
            )
        self._max_keys = max_keys
        self._max_entries_per_key = max_entries_per_key
        self._max_clock_skew = max_clock_skew
        self._keys: dict[bytes, dict[str, StoredRecord]] = {}

    def put(self, key: bytes, stored: StoredRecord, now: float) -> bool:
        """Store ``stored`` under ``key``; False if a rule refuses it."""
        record = stored.record
        if not record.is_fresh(now) or record.timestamp > now + self._max_clock_skew:
            return False
        entries = self._live_entries(key, now)
        if entries is None:
            if not self._room_for_new_key(now):
                return False
            entries = self._keys[key] = {}
        held = entries.get(record.peer_id)
        if held is not None:
            if held.record.timestamp >= record.timestamp:
                return False
        elif len(entries) >= self._max_entries_per_key and not _evict_for(entries, record):
            return False
        entries[record.peer_id] = stored
        return True

    def get(self, key: bytes, now: float) -> list[StoredRecord]:
        """The fresh entries under ``key``, best for routing first."""
        fresh = [s for s in self._keys.get(key, {}).values() if s.record.is_fresh(now)]
        return sorted(fresh, key=lambda stored: routing_rank(stored.record))

    def prune(self, now: float) -> int:
        """Drop expired entries and emptied keys; return the number of entries dropped."""
        dropped = 0
        for key in list(self._keys):
            before = len(self._keys[key])
            remaining = self._live_entries(key, now)
            dropped += before - (0 if remaining is None else len(remaining))
        return dropped

    def __len__(self) -> int:
        """Keys held, counting keys whose entries have expired but are not yet pruned."""
        return len(self._keys)

    def entry_count(self) -> int:
        """Entries held, counting expired entries not yet pruned."""
        return sum(len(entries) for entries in self._keys.values())

    def _live_entries(self, key: bytes, now: float) -> dict[str, StoredRecord] | None:
        """Drop the expired entries of ``key``; its remaining entries, or None if none remain."""
        entries = self._keys.get(key)
        if entries is None:
            return None
        for peer_id in [p for p, s in entries.items() if not s.record.is_fresh(now)]:
            del entries[peer_id]
        if not entries:
            del self._keys[key]
            return None
        return entries

    def _room_for_new_key(self, now: float) -> bool:
        if len(self._keys) >= self._max_keys:
            self.prune(now)
        return len(self._keys) < self._max_keys


def _evict_for(entries: dict[str, StoredRecord], record: LayerRecord) -> bool:
    """Evict the entry expiring soonest if ``record`` outlives it; whether room was made."""
    victim = min(entries.values(), key=lambda s: (s.record.expires_at, s.record.peer_id))
    if record.expires_at <= victim.record.expires_at:
        return False
    del entries[victim.record.peer_id]
    return True
