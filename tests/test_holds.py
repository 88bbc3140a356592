"""``dht.holds``: which peers stage-record requests leave out, checked against a plain model."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from p2pswarm.dht import holds
from p2pswarm.dht.holds import FIRST_FAILURE_HOLD, MAX_FAILURE_HOLD, NOT_A_SERVER_MEMORY, RequestHolds

PEERS = st.sampled_from(["a", "b", "c"])


def test_one_failure_holds_a_peer_out_for_seconds_and_a_series_doubles_up_to_a_minute():
    book = RequestHolds()
    book.failed("a", 100.0)
    assert book.held("a", 100.0 + FIRST_FAILURE_HOLD - 0.01, advertises_kademlia=True)
    assert not book.held("a", 100.0 + FIRST_FAILURE_HOLD, advertises_kademlia=True)
    for n in range(2, 12):
        book.failed("a", 200.0)
        assert book.hold_of("a") == min(MAX_FAILURE_HOLD, FIRST_FAILURE_HOLD * 2 ** (n - 1))
    assert book.hold_of("a") == MAX_FAILURE_HOLD
    book.answered("a")  # one answer ends the series
    assert book.hold_of("a") == 0.0 and not book.held("a", 200.0, advertises_kademlia=True)
    book.failed("a", 300.0)
    assert book.hold_of("a") == FIRST_FAILURE_HOLD


def test_a_client_is_left_out_until_it_advertises_kademlia():
    book = RequestHolds()
    book.said_not_server("a", 0.0)
    assert book.held("a", NOT_A_SERVER_MEMORY - 1, advertises_kademlia=False)
    assert not book.held("a", 1.0, advertises_kademlia=True)  # it turned server and pushed identify
    assert not book.held("a", NOT_A_SERVER_MEMORY, advertises_kademlia=False)


def test_each_memory_is_bounded():
    book = RequestHolds(max_remembered=3)
    for i in range(10):
        book.failed(f"p{i}", 0.0)
        book.said_not_server(f"q{i}", 0.0)
        assert len(book._failures) <= 3 and len(book._not_servers) <= 3


class HoldsMachine(RuleBasedStateMachine):
    """Random failures, answers, "unsupported" answers and time; ``held`` always equals the model's."""

    def __init__(self) -> None:
        super().__init__()
        self.book, self.now = RequestHolds(), 0.0
        self.series: dict[str, tuple[float, int]] = {}
        self.clients: dict[str, float] = {}

    @rule(peer=PEERS)
    def fail(self, peer):
        self.book.failed(peer, self.now)
        self.series[peer] = (self.now, self.series.get(peer, (0.0, 0))[1] + 1)

    @rule(peer=PEERS)
    def answer(self, peer):
        self.book.answered(peer)
        self.series.pop(peer, None)

    @rule(peer=PEERS)
    def unsupported(self, peer):
        self.book.said_not_server(peer, self.now)
        self.clients[peer] = self.now

    @rule(dt=st.floats(0, 2 * holds.MAX_FAILURE_HOLD))
    def wait(self, dt):
        self.now += dt

    @invariant()
    def held_is_the_models(self):
        for peer in "abc":
            for kademlia in (False, True):
                client = peer in self.clients and self.now - self.clients[peer] < NOT_A_SERVER_MEMORY and not kademlia
                at, n = self.series.get(peer, (0.0, 0))
                failing = n > 0 and self.now - at < min(MAX_FAILURE_HOLD, FIRST_FAILURE_HOLD * 2 ** (n - 1))
                assert self.book.held(peer, self.now, kademlia) == (client or failing)


TestHoldsMachine = HoldsMachine.TestCase
