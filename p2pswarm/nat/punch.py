"""Who starts a hole punch, when to try again, and how the punches went: the pure part of DCUtR.

The DCUtR spec has exactly one initiator: the peer that *received* the relayed connection. It
learns the dialer's addresses from identify, tries a plain direct dial first (the dialer may be
public), then runs the CONNECT/SYNC exchange that times a simultaneous TCP open from both ends.
py-libp2p's service drives punches from both ends (defect 12), so two exchanges cross on one
relayed connection. ``initiates`` is the rule; ``PunchBook`` keeps the per-peer attempt budget
and backoff and the figures shown in /api/stats. No trio here: ``nat/holepunch.py`` drives it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from p2pswarm.net.dialplan import SAMPLE_WINDOW, percentile

MAX_PUNCH_ATTEMPTS = 3  # spec: the initiator retries twice before giving up on a connection
PUNCH_BACKOFF = 10.0  # seconds between attempts on one peer: NAT state and timing change little faster
UNILATERAL = "unilateral"  # the dialer turned out to be directly reachable: no punch was needed
PUNCHED = "punched"  # simultaneous open through both NATs
FAILED = "failed"  # no direct connection; the relayed one stays in use


def initiates(*, inbound_relayed: bool, outbound_relayed: bool, direct: bool, our_id: str, their_id: str) -> bool:
    """Whether we start the DCUtR exchange with a peer, given our connections to it.

    Only the receiving side of a relayed connection initiates. If each side dialed the other
    through a relay at once, both received one: the smaller peer id initiates, so still one does.
    """
    if direct or not inbound_relayed:
        return False
    return not outbound_relayed or our_id < their_id


@dataclass
class PunchBook:
    """Attempt budget, backoff and outcomes of the punches we initiate."""

    max_attempts: int = MAX_PUNCH_ATTEMPTS
    backoff: float = PUNCH_BACKOFF
    tries: dict[str, int] = field(default_factory=dict)
    next_try: dict[str, float] = field(default_factory=dict)
    running: set[str] = field(default_factory=set)
    outcomes: dict[str, int] = field(default_factory=lambda: {UNILATERAL: 0, PUNCHED: 0, FAILED: 0})
    punched: set[str] = field(default_factory=set)  # peers a punch of ours reached directly (path_kinds)
    refused: int = 0  # DCUtR streams from a peer that should not have initiated
    seconds: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLE_WINDOW))

    def due(self, peer: str, now: float) -> bool:
        return (peer not in self.running and self.tries.get(peer, 0) < self.max_attempts
                and now >= self.next_try.get(peer, 0.0))

    def started(self, peer: str, now: float) -> None:
        self.running.add(peer)
        self.tries[peer] = self.tries.get(peer, 0) + 1
        self.next_try[peer] = now + self.backoff

    def finished(self, peer: str, now: float, outcome: str, seconds: float) -> None:
        self.running.discard(peer)
        self.outcomes[outcome] += 1
        if outcome != FAILED:
            self.seconds.append(seconds)
        if outcome == PUNCHED:
            self.punched.add(peer)
        self.next_try[peer] = now + self.backoff

    def gone(self, peer: str) -> None:
        """The peer has no connection left: forgotten, and no longer reached by a punch of ours."""
        self.punched.discard(peer)
        self.forget(peer)

    def forget(self, peer: str) -> None:
        """A fresh budget for the peer (it left, or a new relayed connection came from it)."""
        if peer not in self.running:
            self.tries.pop(peer, None)
            self.next_try.pop(peer, None)

    def known(self) -> list[str]:
        return sorted(set(self.tries) | self.running)

    def summary(self) -> dict[str, Any]:
        attempts = sum(self.outcomes.values())
        p50, p95 = percentile(self.seconds, 0.5), percentile(self.seconds, 0.95)
        return {"attempts": attempts, **self.outcomes, "refused_second_initiator": self.refused,
                "running": len(self.running),
                "upgrade_p50_ms": None if p50 is None else round(1000 * p50, 1),
                "upgrade_p95_ms": None if p95 is None else round(1000 * p95, 1)}
