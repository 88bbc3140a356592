"""A short-lived memory of the closest peers of each layer key.

A node re-announces every 5 s and looks layers up often, always for the same few keys, and the
Kademlia closest-peer search is ~90% of a lookup's cost. The closest set of a key changes only
when servers join or leave, so it is remembered for CLOSEST_CACHE_TTL; an entry is dropped as
soon as one of its peers fails a request. Writers and readers may briefly hold different sets
after a join; the sets overlap, and readers merge the answers of all members, so records stay
found. Pure: ``now`` is passed in.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

CLOSEST_CACHE_TTL = 30.0  # seconds; a new server near a key is used within this long
MAX_CACHED_KEYS = 4096  # one entry per layer key a node touches; bounds memory on odd usage


class ClosestPeersCache:
    """key → (closest peers, time found); full sets only, so a growing swarm is re-searched."""

    def __init__(self, want: int, ttl: float = CLOSEST_CACHE_TTL, max_keys: int = MAX_CACHED_KEYS) -> None:
        self._want, self._ttl, self._max_keys = want, ttl, max_keys
        self._entries: dict[bytes, tuple[tuple[Hashable, ...], float]] = {}

    def get(self, key: bytes, now: float) -> tuple[Hashable, ...] | None:
        entry = self._entries.get(key)
        if entry is None or not entry[1] <= now < entry[1] + self._ttl:
            return None
        return entry[0]

    def put(self, key: bytes, peers: Sequence[Hashable], now: float) -> None:
        if len(peers) < self._want:
            return  # a short set means the swarm is still small or growing: search again next time
        if key not in self._entries and len(self._entries) >= self._max_keys:
            self._entries = {k: e for k, e in self._entries.items() if now < e[1] + self._ttl}
            if len(self._entries) >= self._max_keys:
                return
        self._entries[key] = (tuple(peers), now)

    def forget_peer(self, peer: Hashable) -> int:
        """Drop every entry that holds ``peer``; returns how many were dropped."""
        stale = [key for key, (peers, _) in self._entries.items() if peer in peers]
        for key in stale:
            del self._entries[key]
        return len(stale)

    def __len__(self) -> int:
        return len(self._entries)
