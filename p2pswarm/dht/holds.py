"""Which peers a node leaves out of its stage-record requests for a while, and for how long.

Two kinds of evidence keep a peer out of a lookup's or an announcement's closest peers:

- **A request to it failed** (no connection, a stream cut, a timeout). It is left out for a hold
  that starts at FIRST_FAILURE_HOLD and doubles with each further failure in a row, up to
  MAX_FAILURE_HOLD; any answer from it ends the series. A peer that is truly unreachable (behind a
  symmetric NAT, offered by another server's answer) is soon asked only once a MAX_FAILURE_HOLD,
  so lookups do not keep waiting out its timeout; but one failure of a live peer (a connection
  closed under load, seen as a swarm's whole start-up on 2 loaded cores) costs seconds, where a
  flat minute once hid a small swarm's stores from each other and left replicas idle.
- **It answered "unsupported"** (a DHT client holds no records). It is left out for
  NOT_A_SERVER_MEMORY, unless it advertises Kademlia again: a peer that turns server once its
  reachability is known pushes identify with the protocol, and is asked at once.

Bounded: each memory holds at most MAX_REMEMBERED peers and is emptied when full (forgetting costs
one more request). Pure: ``now`` is passed in.
"""

from __future__ import annotations

from collections.abc import Hashable

FIRST_FAILURE_HOLD = 5.0  # seconds a peer is left out after one failed request: above a lookup's 3 s timeout
MAX_FAILURE_HOLD = 60.0  # seconds, at most: an unreachable peer costs a lookup's timeout once a minute
NOT_A_SERVER_MEMORY = 600.0  # a DHT client stays one until it advertises Kademlia (identify/push)
MAX_REMEMBERED = 4096  # bound on each memory


class RequestHolds:
    """Failed requests (a doubling hold per series) and "unsupported" answers, by peer."""

    def __init__(self, max_remembered: int = MAX_REMEMBERED) -> None:
        self._max = max_remembered
        self._failures: dict[Hashable, tuple[float, int]] = {}  # peer -> (last failure, failures in a row)
        self._not_servers: dict[Hashable, float] = {}  # peer -> when it answered "unsupported"

    def failed(self, peer: Hashable, now: float) -> None:
        """A request to ``peer`` failed at ``now``: its hold starts again, twice as long as the last."""
        _, in_a_row = self._failures.get(peer, (now, 0))
        if peer not in self._failures and len(self._failures) >= self._max:
            self._failures.clear()
        self._failures[peer] = (now, in_a_row + 1)

    def answered(self, peer: Hashable) -> None:
        """``peer`` answered a request: it is reachable, its series of failures ends."""
        self._failures.pop(peer, None)

    def said_not_server(self, peer: Hashable, now: float) -> None:
        """``peer`` answered "unsupported": a DHT client, holding no records."""
        if peer not in self._not_servers and len(self._not_servers) >= self._max:
            self._not_servers.clear()
        self._not_servers[peer] = now

    def hold_of(self, peer: Hashable) -> float:
        """How long ``peer``'s last failure keeps it out (0: no failure remembered)."""
        failure = self._failures.get(peer)
        if failure is None:
            return 0.0
        return min(MAX_FAILURE_HOLD, FIRST_FAILURE_HOLD * 2.0 ** (failure[1] - 1))

    def held(self, peer: Hashable, now: float, advertises_kademlia: bool) -> bool:
        """Whether ``peer`` is left out of requests at ``now``; ``advertises_kademlia``: its identify lists
        the Kademlia protocol now (a client that said "unsupported" and then turned server)."""
        said_at = self._not_servers.get(peer)
        if said_at is not None and now - said_at < NOT_A_SERVER_MEMORY and not advertises_kademlia:
            return True
        failure = self._failures.get(peer)
        return failure is not None and now - failure[0] < self.hold_of(peer)
