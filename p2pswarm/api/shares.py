"""Fair shares of a node's generations among the API's clients: one client cannot take them all.

A node's ``/v1/completions`` requests each hold a generation session on every stage's replica, and
a replica gives one peer at most ``swarm.sessions.MAX_SESSIONS_PER_PEER`` of them: every HTTP client
of a node shares that one peer's share. So the API holds at most MAX_COMPLETIONS generations at
once, one client (one source address: what a client cannot change without a new address) at most
MAX_PER_CLIENT of them, half; a request past either is refused at once with 429 (``Overloaded``),
before any work, and its client may retry. A flooding client therefore leaves at least half of the
generations to the others. Pure bookkeeping: no I/O, no clock.
"""

from __future__ import annotations

from collections import Counter

from p2pswarm.swarm.sessions import MAX_SESSIONS_PER_PEER

MAX_COMPLETIONS = MAX_SESSIONS_PER_PEER  # generations a node's API runs at once: its share of each replica
MAX_PER_CLIENT = MAX_COMPLETIONS // 2  # one client's share: a flood leaves the other half to the rest


class ClientShares:
    """How many generations each client holds; ``take`` refuses past the client's or the node's share."""

    def __init__(self, total: int = MAX_COMPLETIONS, per_client: int = MAX_PER_CLIENT) -> None:
        if not 1 <= per_client <= total:
            raise ValueError(f"shares must satisfy 1 <= per client ({per_client}) <= total ({total})")
        self.total, self.per_client = total, per_client
        self.held: Counter[str] = Counter()
        self.refused = 0  # requests refused since start (/api/stats)

    def take(self, client: str) -> str | None:
        """Hold one generation for ``client``; None when granted, else why it is refused."""
        if self.held[client] >= self.per_client:
            self.refused += 1
            return f"this client already runs {self.held[client]} generations, its share of {self.total}"
        if sum(self.held.values()) >= self.total:
            self.refused += 1
            return f"this node runs {self.total} generations, all it may; try again shortly"
        self.held[client] += 1
        return None

    def give_back(self, client: str) -> None:
        """``client``'s generation ended (done, failed or abandoned)."""
        if self.held[client] <= 1:
            del self.held[client]
        else:
            self.held[client] -= 1

    def doc(self) -> dict:
        return {"running": sum(self.held.values()), "clients": len(self.held), "limit": self.total,
                "per_client": self.per_client, "refused": self.refused}
