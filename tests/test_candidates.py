"""Only peers that answered us are offered to a router: the pure book, then real nodes."""

from __future__ import annotations

import time

import trio
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from p2pswarm.dht.candidates import ANSWER_FRESH, CHECK_PERIOD, RETRY_AFTER, CandidateBook, asks_first
from p2pswarm.dht.protocol import StoreRecord
from p2pswarm.dht.record_codec import sign_record
from p2pswarm.dht.records import Capacity, StageRecord
from p2pswarm.identity import generate_identity
from p2pswarm.net.control import ControlService
from p2pswarm.net.host import connect, open_host, peer_info_from_multiaddr
from tests.test_discovery import LOOPBACK, RUN, start_swarm

PEERS = ["a", "b", "c", "d"]


def record(peer: str) -> StageRecord:
    return StageRecord(peer, (), "m", 0, 0, 1, Capacity(0, 0), 0.0, 60.0)


class BookMachine(RuleBasedStateMachine):
    """Against a model: a peer is a candidate exactly while its last answer is fresh."""

    def __init__(self) -> None:
        super().__init__()
        self.book, self.now = CandidateBook(), 1000.0
        self.last_answer: dict[str, float] = {}
        self.last_ask: dict[str, float] = {}

    @rule(peer=st.sampled_from(PEERS))
    def ask(self, peer):
        self.book.asked(peer, self.now)
        self.last_ask[peer] = self.now

    @rule(peer=st.sampled_from(PEERS))
    def answer(self, peer):
        self.book.answered(peer, self.now)
        self.last_answer[peer] = self.now
        self.last_ask.setdefault(peer, self.now)

    @rule(seconds=st.sampled_from([0.5, 1.0, 5.0, 10.0, 29.0, 30.0, 31.0]))
    def wait(self, seconds):
        self.now += seconds

    @invariant()
    def offers_exactly_the_peers_with_a_fresh_answer(self):
        offered = {r.peer_id for r in self.book.candidates(map(record, PEERS), self.now)}
        assert offered == {p for p, t in self.last_answer.items() if self.now - t < ANSWER_FRESH}

    @invariant()
    def asks_only_when_due(self):
        due = set(self.book.to_ask(PEERS, self.now))
        for peer in PEERS:
            if peer not in self.last_ask:
                assert peer in due  # never asked: ask now
            else:
                wait = CHECK_PERIOD if peer in self.last_answer else RETRY_AFTER
                assert (peer in due) == (self.now - self.last_ask[peer] >= wait)


TestBookMachine = BookMachine.TestCase


@given(st.lists(st.sampled_from(PEERS)), st.floats(0, 100))
def test_a_peer_that_never_answered_is_never_offered(asked, later):
    book = CandidateBook()
    for peer in asked:
        book.asked(peer, 0.0)
    assert book.candidates(map(record, PEERS), later) == []


@given(st.text(min_size=1), st.text(min_size=1))
def test_exactly_one_of_two_different_peers_asks_first(a, b):
    if a != b:
        assert asks_first(a, b) != asks_first(b, a)


def test_memory_is_bounded():
    book = CandidateBook(max_tracked=3)
    for i in range(10):
        book.asked(f"p{i}", float(i))
    assert len(book._seen) == 3


def test_a_record_author_that_answers_nothing_is_no_candidate():
    """A peer that stores its own, valid record but does not answer our round trips (gone, or an
    attacker's identity) is in the stage map but never among the candidates; a live peer is."""

    async def main():
        async with trio.open_nursery() as nursery:
            boot, (first, second) = await start_swarm(nursery, [(0, 2), (2, 4)])
            ghost = generate_identity()
            async with open_host(ghost, LOOPBACK) as host, trio.open_nursery() as inner:
                control = ControlService(host, inner)  # answers no Ping: it has no handler for it
                await connect(host, peer_info_from_multiaddr(boot.addrs()[0]))
                ghost_record = StageRecord(ghost.peer_id_text, tuple(str(a) for a in host.get_addrs()), "tiny-lm",
                                           1, 2, 4, Capacity(10_000, 0), time.time(), 60.0, RUN)
                reply = await control.request(boot.host.get_id(), StoreRecord(record=sign_record(ghost_record, ghost)))
                assert reply.accepted
                live, ghost_id = second.identity.peer_id_text, ghost.peer_id_text
                with trio.fail_after(30):
                    # whichever of the two asks, both end up counting the other as answered
                    while [r.peer_id for r in first.stage_map.candidates(1)] != [live]:
                        await trio.sleep(0.2)
                    while [r.peer_id for r in second.stage_map.candidates(0)] != [first.identity.peer_id_text]:
                        await trio.sleep(0.2)
                    while ghost_id not in {r.peer_id for r in first.stage_map.stages.get(1, [])}:
                        await trio.sleep(0.2)
                    if asks_first(first.identity.peer_id_text, ghost_id):  # else the ghost would have to ask us
                        while not first.stage_map.book._seen.get(ghost_id):
                            await trio.sleep(0.2)
                assert ghost_id not in {r.peer_id for r in first.stage_map.candidates(1)}
                doc = first.stage_map.doc()["stages"]["1"]["peers"]
                assert {p["peer_id"]: p["answered"] for p in doc} == {live: True, ghost_id: False}
                inner.cancel_scope.cancel()
            nursery.cancel_scope.cancel()

    trio.run(main)
