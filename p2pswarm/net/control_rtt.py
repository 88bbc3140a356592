"""How long a control request to one peer may wait for its reply: the caller's bound, or the round trip
measured to that peer when that is longer. The pure core of ``control.ControlService.request``.

A control request (a DHT store or fetch, a candidate check, a ping) had a fixed bound of 3-5 s. On a
0.2 Mbit/s uplink full of training frames its round trip waits behind up to ~3 s of the lab router's
queue on each side (`docs/benchmarks.md` §25): announcements and lookups overran, records expired, and
2-3 of 14 pings failed. So each peer's answered requests are timed, smoothed as TCP smooths its round
trip (RFC 6298: ``srtt``, ``rttvar``, gains 1/8 and 1/4), and a request waits
``max(bound, srtt + RTT_K x rttvar)``, times a backoff that each unanswered request doubles (up to
MAX_BACKOFF) and an answer resets, at most MAX_REQUEST_TIMEOUT (unless the caller's bound is longer).
On a fast line the caller's bound is the longer: nothing changes there. Only answers teach it: a peer
that never answers keeps the caller's bound, doubled at most MAX_BACKOFF times. Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace

RTT_ALPHA = 1 / 8  # RFC 6298: gain of the smoothed round trip
RTT_BETA = 1 / 4  # RFC 6298: gain of its variation
RTT_K = 4  # RFC 6298: srtt + 4 rttvar
MAX_BACKOFF = 4.0  # an unanswered request doubles the next one's wait, up to this factor
MAX_REQUEST_TIMEOUT = 30.0  # s: what a measured round trip may stretch a request's wait to
MAX_PEERS = 4096  # peers whose round trip is remembered; the least recently used forgotten first


@dataclass(frozen=True)
class PeerRtt:
    """What we measured of control round trips to one peer."""

    srtt: float | None = None  # smoothed seconds from request to reply; None before an answer
    rttvar: float = 0.0
    backoff: float = 1.0

    def timeout(self, bound: float) -> float:
        """Seconds a request whose caller allows ``bound`` waits for this peer's reply."""
        measured = bound if self.srtt is None else max(bound, self.srtt + RTT_K * self.rttvar)
        return min(max(bound, MAX_REQUEST_TIMEOUT), measured * self.backoff)

    def answered(self, seconds: float) -> PeerRtt:
        seconds = max(0.0, seconds)
        if self.srtt is None:
            return PeerRtt(seconds, seconds / 2, 1.0)
        rttvar = (1 - RTT_BETA) * self.rttvar + RTT_BETA * abs(self.srtt - seconds)
        return PeerRtt((1 - RTT_ALPHA) * self.srtt + RTT_ALPHA * seconds, rttvar, 1.0)

    def unanswered(self) -> PeerRtt:
        return replace(self, backoff=min(MAX_BACKOFF, 2 * self.backoff))


class RttBook:
    """Each peer's ``PeerRtt``, at most MAX_PEERS of them."""

    def __init__(self) -> None:
        self._peers: OrderedDict[str, PeerRtt] = OrderedDict()

    def get(self, peer: str) -> PeerRtt:
        return self._peers.get(peer, PeerRtt())

    def answered(self, peer: str, seconds: float) -> None:
        self._put(peer, self.get(peer).answered(seconds))

    def unanswered(self, peer: str) -> None:
        self._put(peer, self.get(peer).unanswered())

    def _put(self, peer: str, rtt: PeerRtt) -> None:
        self._peers[peer] = rtt
        self._peers.move_to_end(peer)
        while len(self._peers) > MAX_PEERS:
            self._peers.popitem(last=False)

    def __len__(self) -> int:
        return len(self._peers)
