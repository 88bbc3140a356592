"""What an outer round asks its driver to do: the actions of ``round.OuterRound`` and its outcome.

The round is a pure state machine (``round.py``): it never sends, never reads a clock and
never touches a tensor. Each of its methods returns a list of these frozen actions, and the
driver carries them out in order. They live in their own module so that the round's two
halves (``round.py`` for the group, ``round_reduce.py`` for the butterfly) share them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from p2pswarm.diloco.messages import Hello, Part, Result


@dataclass(frozen=True)
class SendHello:
    """Send ``hello`` to ``peer`` as a request; feed its reply (a Hello) back to ``on_hello``."""

    peer: str
    hello: Hello


@dataclass(frozen=True)
class NeedShards:
    """The group is agreed: take the pseudo-gradient now, encode one shard per bound, call ``provide_shards``."""

    group: tuple[str, ...]  # the sorted group; member i owns bounds[i]
    bounds: tuple[tuple[int, int], ...]  # (start, stop) of each piece of each shard (``messages.shard_plan``)


@dataclass(frozen=True)
class CombineShard:
    """One piece of our shard has its parts in (or its owner deadline passed): combine and verify
    ``parts`` (member -> encoded part of ``numel`` elements, ours included) and call ``combined``
    with the aggregate's bytes, the refused contributors and ``shard``. The work is O(piece): the
    driver does it off its event loop, and the round waits for the answer (no later deadline ends
    it before)."""

    shard: int  # the piece's position in ``NeedShards.bounds`` (our member index when a shard is one piece)
    numel: int
    parts: dict[str, bytes]


@dataclass(frozen=True)
class SendPart:
    """Send our contribution ``data`` to shard ``part.shard``'s owner ``peer``; it answers with a Reply."""

    peer: str
    part: Part
    data: bytes


@dataclass(frozen=True)
class SendResult:
    """Send our shard's aggregate ``data`` to the member ``peer``; it answers with a Reply."""

    peer: str
    result: Result
    data: bytes


@dataclass(frozen=True)
class Rejected:
    """We refused ``peer``'s part, result or Hello (wrong size, codec, shard; failed verification): lower its score."""

    peer: str
    reason: str


@dataclass(frozen=True)
class CatchUp:
    """``peer`` is at outer round ``round``, later than ours: load its state (this round is abandoned)."""

    peer: str
    round: int


@dataclass(frozen=True)
class Outcome:
    """How an outer round ended, for the driver's outer step.

    ``left_out``: the group went on without us (or we abandoned the round): apply nothing from
    it. A group of one (``group == (me,)``, no results): apply our own pseudo-gradient. Otherwise
    ``results[i]`` is the encoded aggregate of piece i (``NeedShards.bounds[i]``), ours included;
    for the pieces in ``missing`` no aggregate came: apply nothing there (the driver carries its
    own data to the next round). ``owner(i)`` is the member that sent piece i's aggregate.
    """

    group: tuple[str, ...]
    results: dict[int, bytes] = field(default_factory=dict)
    missing: tuple[int, ...] = ()
    contributors: dict[int, int] = field(default_factory=dict)  # shard -> parts its owner combined
    left_out: bool = False
    pieces: int = 1  # pieces a shard (``messages.ShardPlan.pieces``): piece i belongs to shard i // pieces

    def owner(self, index: int) -> str:
        """The member that owns piece ``index``."""
        return self.group[index // self.pieces]


@dataclass(frozen=True)
class Finished:
    """The round is over (emitted exactly once); later messages of this round are answered 'round over'."""

    outcome: Outcome


Action = SendHello | NeedShards | CombineShard | SendPart | SendResult | Rejected | CatchUp | Finished
