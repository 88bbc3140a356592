"""The closest-peers cache against a reference model."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from p2pswarm.dht.closest import ClosestPeersCache

WANT, TTL, MAX_KEYS = 3, 30.0, 4
KEYS = st.sampled_from([b"a", b"b", b"c", b"d", b"e", b"f"])
PEERS = st.lists(st.sampled_from("pqrstuvw"), min_size=0, max_size=4, unique=True)


def test_basic_rules():
    cache = ClosestPeersCache(want=3, ttl=30.0)
    cache.put(b"k", ["p", "q"], now=0)
    assert cache.get(b"k", now=0) is None  # short sets are not kept
    cache.put(b"k", ["p", "q", "r"], now=0)
    assert cache.get(b"k", now=29.9) == ("p", "q", "r")
    assert cache.get(b"k", now=30) is None
    assert cache.forget_peer("q") == 1 and cache.get(b"k", now=1) is None


class CacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.cache = ClosestPeersCache(WANT, TTL, MAX_KEYS)
        self.model: dict[bytes, tuple[tuple, float]] = {}
        self.now = 0.0

    @rule(dt=st.floats(0, 20))
    def advance(self, dt):
        self.now += dt

    @rule(key=KEYS, peers=PEERS)
    def put(self, key, peers):
        self.cache.put(key, peers, self.now)
        if len(peers) < WANT:
            return
        live = {k: e for k, e in self.model.items() if self.now < e[1] + TTL}
        if key in self.model or len(self.model) < MAX_KEYS:
            self.model[key] = (tuple(peers), self.now)
        elif len(live) < MAX_KEYS:
            self.model = live
            self.model[key] = (tuple(peers), self.now)
        else:
            self.model = live

    @rule(peer=st.sampled_from("pqrstuvw"))
    def forget(self, peer):
        self.cache.forget_peer(peer)
        self.model = {k: e for k, e in self.model.items() if peer not in e[0]}

    @rule(key=KEYS)
    def get(self, key):
        entry = self.model.get(key)
        expected = entry[0] if entry and self.now < entry[1] + TTL else None
        assert self.cache.get(key, self.now) == expected

    @invariant()
    def bounded(self):
        assert len(self.cache) <= MAX_KEYS


TestCacheMachine = CacheMachine.TestCase
