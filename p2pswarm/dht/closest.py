"""A short-lived memory of where a node stores its records: the closest peers of each key.

A node re-announces every 5 s, always to the same few layer keys, and the Kademlia closest-peer
search is ~90% of the cost. The closest set of a key changes only when servers join or leave,
so a writer remembers it for CLOSEST_CACHE_TTL and drops an entry as soon as one of its peers
fails a request. Readers do not use it: a remembered set that is wrong (views differ while the
swarm grows) would hide records from a reader for the whole TTL, whereas a writer's wrong set
costs only until the next fresh search. Pure: ``now`` is passed in.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

CLOSEST_CACHE_TTL = 15.0  # seconds (three announcements); a new server near a key gets records this soon
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
