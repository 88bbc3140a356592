"""Who is in an outer round's group: the pure gather-and-agree book of one replica.

A DiLoCo outer round has no coordinator, so each replica decides the group from what it has
heard, and the rule must make replicas that heard the same things decide the same group:

- gather: a peer is *ready* once it sent a ready Hello for this round; the replica's view
  R = {me} + the ready peers, minus those gone, withdrawn or shut out (below);
- close: the replica stops gathering and fixes its proposal V (``close``): R, joined with the
  proposal of the peer whose closed Hello invited it (so a replica invited before it heard
  from everyone does not shrink the group by its own partial view);
- agree: once every peer of V proposed (or withdrew, or is gone or shut out), or at a
  deadline, the group is {me} + the peers of V that proposed, intersected with V and with
  every one of their proposals (``agreed``). Intersection makes the rule order-independent:
  a proposal only ever shrinks the group.

A proposal that leaves me out *shuts out* its sender and everyone it names: they will all
intersect with it (each gets it, as a request or as the reply to its own Hello), so none of
them can end in a group with me. They are dropped from my view instead of dragging me out, so
the replicas that remain can still form a group; a replica that is left with nobody because
others went on without it is *left out* (``round.py``), and one that was simply alone is not.

Every set here only grows (ready, withdrawn, failed, shut out) or only shrinks (a proposal is
intersected with any later one from the same peer), so reordered or repeated Hellos cannot
undo a decision. Pure and small: ``round.OuterRound`` drives it and turns it into messages.
"""

from __future__ import annotations

from collections.abc import Iterable

from p2pswarm.diloco.messages import MAX_MEMBERS


class Membership:
    """The gather-and-agree book of one replica for one round (module docstring)."""

    def __init__(self, me: str) -> None:
        self.me = me
        self.ready: set[str] = set()  # peers that said they are ready for this round (never me)
        self.withdrawn: set[str] = set()  # peers that said they are out of this round
        self.failed: set[str] = set()  # peers our driver could not reach
        self.shut_out: set[str] = set()  # peers that proposed, or were proposed in, a group without me
        self.proposals: dict[str, frozenset[str]] = {}  # peer -> its proposal (intersection of all it sent)
        self.view: frozenset[str] | None = None  # V, my proposal, once closed
        self.overflow = 0  # ready peers turned away because the book was full

    def note_ready(self, peer: str) -> bool:
        """``peer`` is ready; False if it is not (or can no longer be) part of the book."""
        if peer == self.me or peer in self.withdrawn:
            return False
        if peer not in self.ready:
            if len(self.ready) >= 2 * MAX_MEMBERS:  # bounds the book; a group is capped at close
                self.overflow += 1
                return False
            self.ready.add(peer)
        return True

    def note_proposal(self, peer: str, members: Iterable[str]) -> None:
        """``peer`` closed with ``members`` (which include it): keep the intersection of all it proposed.

        Once we closed, only the proposals of our view count: a peer outside it is not in our group
        anyway, and the peers it names may never hear of it.
        """
        if not self.note_ready(peer) or (self.view is not None and peer not in self.view):
            return
        new = frozenset(members)
        old = self.proposals.get(peer)
        merged = new if old is None else old & new
        self.proposals[peer] = merged
        if self.me not in merged:  # that group goes on without me: none of it can join mine
            self.shut_out |= (merged | {peer}) - {self.me}

    def note_withdrawn(self, peer: str) -> None:
        """``peer`` is out of this round: never wait for it, never count it in the group."""
        if peer != self.me:
            self.withdrawn.add(peer)
            self.ready.discard(peer)
            self.proposals.pop(peer, None)

    def note_failed(self, peer: str) -> None:
        """Our driver could not reach ``peer``: do not wait for it (a proposal it made still counts)."""
        if peer != self.me:
            self.failed.add(peer)

    def _out(self) -> set[str]:
        return self.withdrawn | self.shut_out

    def gathered(self) -> frozenset[str]:
        """R: me and the ready peers that are not gone, withdrawn or shut out (at most MAX_MEMBERS)."""
        peers = sorted(self.ready - self.failed - self._out())[: MAX_MEMBERS - 1]
        return frozenset({self.me, *peers})

    def complete(self, expected: Iterable[str]) -> bool:
        """Every expected peer that is not known gone, withdrawn or shut out is ready."""
        waiting = set(expected) - {self.me} - self.failed - self._out()
        return waiting <= self.ready

    def invited_by(self) -> str | None:
        """A peer (not shut out) whose proposal includes me, the first in sort order, if any."""
        return next((p for p in sorted(self.proposals) if self.me in self.proposals[p] and p not in self.shut_out),
                    None)

    def close(self, inviter: str | None) -> frozenset[str]:
        """Stop gathering: fix and return V, my proposal (see the module docstring)."""
        view = set(self.gathered())
        if inviter is not None:
            view |= self.proposals[inviter] - self._out()
            if len(view) > MAX_MEMBERS:  # the group lies within the inviter's proposal anyway
                view = (set(self.proposals[inviter]) - self._out()) | {self.me}
        self.view = frozenset(view)
        return self.view

    def settled(self) -> bool:
        """Closed, and every other peer of V proposed, withdrew, is unreachable or shut out."""
        if self.view is None:
            return False
        heard = set(self.proposals) | self.failed | self._out()
        return self.view - {self.me} <= heard

    def agreed(self) -> frozenset[str]:
        """The group: me and V's proposers still in, intersected with V and every proposal of theirs."""
        if self.view is None:
            raise ValueError("agreed() before close()")
        proposers = [p for p in sorted(self.view) if p in self.proposals and p not in self._out()]
        group = frozenset({self.me, *proposers}) & self.view
        for peer in proposers:
            group &= self.proposals[peer]
        return group
