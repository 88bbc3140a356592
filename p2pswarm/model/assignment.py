"""Which stage a peer serves as the swarm changes: the seed's replica rule, as a pure function.

``--layers auto`` puts a joining peer on the stage with the fewest live replicas. Peers then die
and join, and a stage can lose its last replica while another holds many; nothing trains until
that gap is filled. The rule: aim for at least ``TARGET_REPLICAS`` live replicas per stage; a peer
whose stage has at least ``MOVE_FROM_REPLICAS`` moves to a stage with no live replica, but only
once that gap has lasted ``GAP_GRACE`` (hysteresis: a restarting peer's record comes back first)
plus a random jitter drawn anew at each check, so that the crowded stage's peers do not all move
at once (the first mover's record closes the gap for the others).

Pure: it takes the replica counts, ``now`` and an injected ``random.Random``; no trio, no torch.
``GapClock`` is the little state a caller keeps to know since when the current gap has lasted.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

TARGET_REPLICAS = 2  # the seed's floor: one replica may die without leaving its stage empty
MOVE_FROM_REPLICAS = TARGET_REPLICAS + 1  # a mover leaves its stage at the target, never below
GAP_GRACE = 30.0  # seconds: twice the 15 s staleness, so a restarted peer re-announces first
GAP_JITTER = 30.0  # seconds: spreads movers over six 5 s announce periods, so one move is seen


def _validate(replicas: Sequence[int], mine: int) -> None:
    if not replicas:
        raise ValueError("replica counts for at least one stage are needed")
    if any(type(n) is not int or n < 0 for n in replicas):
        raise ValueError(f"replica counts must be non-negative ints, not {list(replicas)!r}")
    if type(mine) is not int or not 0 <= mine < len(replicas):
        raise ValueError(f"stage {mine!r} is not one of the {len(replicas)} stages")
    if replicas[mine] < 1:
        raise ValueError(f"the counts must include this peer: stage {mine} has {replicas[mine]}")


def gaps(replicas: Sequence[int]) -> tuple[int, ...]:
    """The stages with no live replica."""
    return tuple(stage for stage, count in enumerate(replicas) if count == 0)


def choose_stage(replicas: Sequence[int], mine: int, gap_age: float, now: float,
                 rng: random.Random) -> int:
    """The stage this peer should serve: ``mine``, or a stage with no live replica.

    ``replicas[s]`` is the number of live replicas of stage ``s``, this peer included;
    ``gap_age`` is how many seconds some stage has had no live replica without a break (see
    ``GapClock``). The peer moves only if its stage has at least ``MOVE_FROM_REPLICAS``,
    a stage has none, and ``gap_age`` is past ``GAP_GRACE`` plus a jitter drawn from ``rng``
    in [0, ``GAP_JITTER``). The target is drawn from ``rng`` among the empty stages. ``now``
    is the caller's clock, accepted for symmetry with the other pure cores and for logging.
    """
    _validate(replicas, mine)
    empty = gaps(replicas)
    if replicas[mine] < MOVE_FROM_REPLICAS or not empty or not gap_age >= GAP_GRACE:
        return mine
    if gap_age < GAP_GRACE + rng.uniform(0.0, GAP_JITTER):
        return mine
    return rng.choice(empty)


@dataclass(frozen=True)
class GapClock:
    """Since when some stage has had no live replica, without a break (None: no gap now)."""

    since: float | None = None

    def observe(self, replicas: Sequence[int], now: float) -> GapClock:
        """The clock after seeing ``replicas`` at ``now``: started, kept, or reset."""
        if not gaps(replicas):
            return GapClock(None)
        return self if self.since is not None else GapClock(now)

    def age(self, now: float) -> float:
        """Seconds the current gap has lasted (0 when there is none)."""
        return 0.0 if self.since is None else max(0.0, now - self.since)
