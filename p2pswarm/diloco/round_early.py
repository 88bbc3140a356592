"""The parts and results that reach an outer round before its group is agreed.

A member that agreed sooner than us may already send its parts and results while we still
wait for proposals (``round.OuterRound`` in AGREE). Refusing them would cost a round trip;
keeping them all would let any peer fill our memory. ``EarlyBuffer`` keeps one message per
kind, sender and piece, from the peers of our view only, at most the pieces one shard of the
smallest group has per sender and kind, and within a byte budget (about two models). Once the
group is known the round replays them in a fixed order (their replies were already sent);
a round that ends first drops them. Pure: no trio, no torch, no clock.
"""

from __future__ import annotations

from p2pswarm.diloco.messages import Part, Reply, Result
from p2pswarm.diloco.round_reduce import reply_to

__all__ = ["EarlyBuffer"]


class EarlyBuffer:
    """Held parts and results of one round, by (kind, peer, shard, piece) (module docstring)."""

    def __init__(self, *, budget: int, pieces: int, counts: dict[str, int]) -> None:
        self._held: dict[tuple[str, str, int, int], tuple[Part | Result, bytes]] = {}
        self._budget = budget  # bytes we may still hold
        self._pieces = pieces  # messages one peer may have held per kind
        self.counts = counts  # the round's counters: "duplicates" and "early" are ours

    def hold(self, kind: str, peer: str, msg: Part | Result, data: bytes, *, accepting: bool) -> Reply:
        """Keep ``msg`` if ``accepting`` (we are agreeing and ``peer`` is in our view), within the limits."""
        key = (kind, peer, msg.shard, msg.piece)
        if key in self._held:
            self.counts["duplicates"] += 1
            return reply_to(msg, True, "duplicate")
        self.counts["early"] += 1
        held = sum(1 for k in self._held if k[:2] == (kind, peer))
        if not accepting or len(data) > self._budget or held >= self._pieces:
            return reply_to(msg, False, "too early")
        self._budget -= len(data)
        self._held[key] = (msg, data)
        return reply_to(msg, True, "early")

    def drain(self) -> list[tuple[str, str, Part | Result, bytes]]:
        """Every held (kind, peer, message, data), in key order; the buffer is empty afterwards."""
        items = [(kind, peer, msg, data) for (kind, peer, _, _), (msg, data) in sorted(self._held.items(),
                                                                                       key=lambda item: item[0])]
        self._held.clear()
        return items

    def clear(self) -> None:
        self._held.clear()
