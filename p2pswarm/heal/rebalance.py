"""Which peer moves to which stage at runtime, and when: the rebalancing rule, as a pure core.

Every peer sees the same stage map (give or take a lookup) and runs the same rule on it, so the
swarm agrees on at most one move per check without talking:

- counts ``c[s]``: live peers per stage, each peer counted once (in its newest record);
- the target ``b`` is the least served stage and the donor ``a`` the most served stage that has a
  movable peer (ties: the lowest stage); a move is wanted iff ``c[a] >= c[b] + 2``. A move then
  raises the sorted count vector (leximin) and lowers the sum of squares by at least 2: a potential
  that bounds the number of moves, so there is no oscillation; a balanced swarm (max - min <= 1)
  never moves, and a move never empties a stage (``c[a] >= 2``);
- grace: the same need ``(a, b)`` must have held without a break for ``DOWN_GRACE`` when the target
  is down (``c[b] == 0``: its records expired, which already outlasts a restart) and for
  ``IMBALANCE_GRACE`` otherwise;
- cooldowns: no move out of a stage within ``STAGE_COOLDOWN`` of the last move out of it that we
  saw (a peer id leaving that stage for another) unless the target is down, and none by a peer that
  has watched for less than that (it cannot know the last move); a peer that moved is not elected
  again within ``PEER_COOLDOWN``, unless a stage is down (that cooldown is local history: a peer
  that joined after the move never saw it, and two such views elected each other);
- a peer that has watched the map for less than ``JOIN_GRACE`` does not move: at start, a map with
  the swarm's records half in looks like down stages;
- one mover: among the donor's movable peers not in their cooldown, the one whose sha256(peer id)
  is lowest. Only it moves; the driver waits a jitter (``delay``) and asks again before it does.

The old rule (``model/assignment.py``, never called) moved only into an EMPTY stage and only from a
stage with 3 or more replicas: with 3 stages of 2 replicas and both middle replicas dead
(``[2, 0, 2]``) it never moved, and the swarm stopped. This one moves one peer there
(``[1, 1, 2]``), and also evens out ``[4, 1, 1]`` slowly (60 s grace, 5 min per stage).

Plain Python: ``now`` and a ``random.Random`` are injected; no trio, no torch.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

DOWN_GRACE = 5.0  # seconds a down stage waits: its records expired already (10-15 s after a death), restarts filtered
IMBALANCE_GRACE = 60.0  # seconds an uneven but live swarm waits: a churning peer comes back before anyone moves
STAGE_COOLDOWN = 300.0  # seconds between two moves out of one stage (unless the target is down): the 5-minute target
PEER_COOLDOWN = 300.0  # seconds before a peer that moved can be elected again: a move costs a reload
MOVE_JITTER = 5.0  # seconds of random wait before an elected mover acts: one announce period to see another's move
JOIN_GRACE = 30.0  # seconds we watch the map before any move: every live peer re-announced (5 s) twice per 15 s TTL
MOVE_GAP = 2  # a move is wanted when the donor has at least this many more peers than the target


@dataclass(frozen=True)
class Move:
    """A decision: leave ``from_stage`` for ``to_stage``, and why (one log line)."""

    from_stage: int
    to_stage: int
    reason: str


@dataclass(frozen=True)
class Need:
    """What the counts ask for: one peer of ``donor`` to ``target``; ``since`` when it first held."""

    donor: int
    target: int
    since: float


def counts(members: Mapping[int, Sequence[str]], n_stages: int) -> tuple[int, ...]:
    """Live peers per stage ``0 .. n_stages - 1`` (a stage missing from ``members`` has none)."""
    return tuple(len(set(members.get(stage, ()))) for stage in range(n_stages))


def wanted(count: Sequence[int], donors: Sequence[int]) -> tuple[int, int] | None:
    """``(donor, target)`` when a move is wanted: the target is the least served stage, the donor the
    most served of ``donors`` (stages with a movable peer), ties to the lowest stage; else None."""
    if not donors:
        return None
    target = min(range(len(count)), key=lambda s: (count[s], s))
    donor = min(donors, key=lambda s: (-count[s], s))
    return (donor, target) if count[donor] >= count[target] + MOVE_GAP else None


def rank(peer: str) -> bytes:
    """The election order: the lowest sha256(peer id) moves first (the same answer on every peer)."""
    return hashlib.sha256(peer.encode()).digest()


@dataclass
class Rebalancer:
    """One peer's view of the rule over time: feed it the map each check, act on the ``Move`` it returns."""

    me: str
    n_stages: int
    rng: random.Random = field(default_factory=random.Random)
    need: Need | None = None
    seen: dict[str, int] = field(default_factory=dict)  # peer -> the stage it was in at the last check
    left_at: dict[int, float] = field(default_factory=dict)  # stage -> when we last saw a peer leave it
    moved_at: dict[str, float] = field(default_factory=dict)  # peer -> when we last saw it move
    last: str = "no check yet"  # the last decision, for /api/stats
    since: float | None = None  # our first check: before STAGE_COOLDOWN of watching we do not know the last moves

    def observe(self, members: Mapping[int, Sequence[str]], movable: set[str], now: float) -> Move | None:
        """The move this peer should make now, if any. ``members[s]``: the peers of stage ``s`` (each
        peer in one stage only: its newest record); ``movable``: the peers not pinned."""
        self.since = now if self.since is None else self.since
        self._note_moves(members, now)
        count = counts(members, self.n_stages)
        # a down stage elects among every movable peer: the peer cooldown is local history (a peer that
        # joined after a move never saw it), and two views of it elected each other and nobody moved
        electable = self._electable(members, movable, now, cooldown=min(count) > 0)
        want = wanted(count, sorted(electable))
        self._keep_need(want, now)
        return self._decide(count, electable, now)

    def moved(self, from_stage: int, to_stage: int, now: float) -> None:
        """Our own move, done: the cooldowns start now, before the map shows it."""
        self.moved_at[self.me] = self.left_at[from_stage] = now
        self.seen[self.me] = to_stage
        self.need = None

    def delay(self) -> float:
        """The jitter an elected mover waits before it checks again and moves."""
        return self.rng.uniform(0.0, MOVE_JITTER)

    def _note_moves(self, members: Mapping[int, Sequence[str]], now: float) -> None:
        stage_of = {peer: stage for stage, peers in members.items() for peer in peers}
        for peer, stage in stage_of.items():
            before = self.seen.get(peer)
            if before is not None and before != stage:
                self.left_at[before] = self.moved_at[peer] = now
        self.seen.update(stage_of)
        if len(self.seen) > 4 * max(len(stage_of), 1):  # forget the long gone: bounded state
            self.seen = {peer: self.seen[peer] for peer in stage_of}

    def _electable(self, members: Mapping[int, Sequence[str]], movable: set[str], now: float,
                   cooldown: bool = True) -> dict[int, str]:
        """Per stage, the peer that would move out of it: movable, out of its cooldown (``cooldown``), lowest rank."""
        chosen: dict[int, str] = {}
        for stage, peers in members.items():
            free = [p for p in peers if p in movable
                    and (not cooldown or now - self.moved_at.get(p, -PEER_COOLDOWN) >= PEER_COOLDOWN)]
            if free and 0 <= stage < self.n_stages:
                chosen[stage] = min(free, key=rank)
        return chosen

    def _keep_need(self, want: tuple[int, int] | None, now: float) -> None:
        if want is None:
            self.need = None
        elif self.need is None or (self.need.donor, self.need.target) != want:
            self.need = Need(*want, since=now)

    def _decide(self, count: Sequence[int], electable: dict[int, str], now: float) -> Move | None:
        assert self.since is not None  # observe sets it before it decides
        need = self.need
        if need is None:
            self.last = f"balanced: {list(count)} live peers per stage"
            return None
        a, b = need.donor, need.target
        down = count[b] == 0
        grace = DOWN_GRACE if down else IMBALANCE_GRACE
        if now - self.since < JOIN_GRACE:
            self.last = f"watching the map for {JOIN_GRACE:.0f} s before any move ({list(count)})"
            return None
        if now - need.since < grace:
            self.last = f"stage {b} needs a peer of stage {a}: waiting {grace:.0f} s ({list(count)})"
            return None
        if not down and now - max(self.left_at.get(a, self.since), self.since) < STAGE_COOLDOWN:
            self.last = f"stage {a} gave a peer, or we joined, less than {STAGE_COOLDOWN:.0f} s ago ({list(count)})"
            return None
        if electable[a] != self.me:
            self.last = f"stage {b} needs a peer of stage {a}: {electable[a]} moves ({list(count)})"
            return None
        why = f"stage {b} is down (0 live replicas)" if down else f"stage {b} has {count[b]} live replicas"
        self.last = f"moving from stage {a} to stage {b}: {why}, stage {a} has {count[a]}"
        return Move(a, b, f"{why}, stage {a} has {count[a]}")
