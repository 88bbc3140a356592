"""Which peers of the stage map have answered us: only those are ever offered to a router.

A stage record proves that its peer signed it and stored it itself, some seconds ago. It does
not prove that the peer answers *us* now: it may have died within its TTL, sit behind a NAT
we cannot cross, or be an attacker's identity that stores records and answers nothing else. So
a node asks each record's peer for a round trip (a ``Ping`` on the control channel) and offers
a router only the peers that answered one recently. Of two peers that check each other, only the
one with the smaller peer id asks (``asks_first``); the other counts the ping it receives and
answers as the same evidence. That halves the checks and never has both sides dial each other
at once (two crossed relayed connections would each start a hole punch). Pure bookkeeping;
``dht.stagemap`` drives it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from p2pswarm.dht.records import StageRecord

ANSWER_FRESH = 30.0  # an answer this old still vouches for a peer (re-checked every CHECK_PERIOD)
CHECK_PERIOD = 10.0  # how often a peer already heard from is asked again
RETRY_AFTER = 5.0  # a peer that did not answer is asked again after this long (not in a loop)
MAX_TRACKED = 4096  # peers remembered; the oldest are forgotten first beyond this


@dataclass(frozen=True)
class _Seen:
    answered_at: float | None  # last answer, None if it never answered
    asked_at: float  # last time we asked


def asks_first(me: str, peer: str) -> bool:
    """Whether we, not ``peer``, start the round trips between us (the smaller peer id does)."""
    return me < peer


class CandidateBook:
    """When each peer last answered us, and whom to ask next."""

    def __init__(self, max_tracked: int = MAX_TRACKED) -> None:
        self._seen: dict[str, _Seen] = {}
        self._max_tracked = max_tracked

    def asked(self, peer: str, now: float) -> None:
        held = self._seen.pop(peer, None)
        self._seen[peer] = _Seen(held.answered_at if held else None, now)
        if len(self._seen) > self._max_tracked:
            del self._seen[next(iter(self._seen))]  # dicts keep insertion order: the least recently asked

    def answered(self, peer: str, now: float) -> None:
        held = self._seen.pop(peer, None)
        self._seen[peer] = _Seen(now, held.asked_at if held else now)

    def has_answered(self, peer: str, now: float) -> bool:
        seen = self._seen.get(peer)
        return seen is not None and seen.answered_at is not None and now - seen.answered_at < ANSWER_FRESH

    def to_ask(self, peers: Iterable[str], now: float) -> list[str]:
        """The peers due a check: never asked, answered CHECK_PERIOD ago, or silent RETRY_AFTER ago."""
        due = []
        for peer in peers:
            seen = self._seen.get(peer)
            wait = RETRY_AFTER if seen is None or seen.answered_at is None else CHECK_PERIOD
            if seen is None or now - seen.asked_at >= wait:
                due.append(peer)
        return due

    def candidates(self, records: Iterable[StageRecord], now: float) -> list[StageRecord]:
        """The records whose peers answered us recently, in the order given."""
        return [r for r in records if self.has_answered(r.peer_id, now)]
