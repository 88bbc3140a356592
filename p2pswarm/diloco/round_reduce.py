"""The butterfly all-reduce of one agreed DiLoCo group: the pure second half of an outer round.

Once the group G is agreed (``round.py``), the flat pseudo-gradient is cut into |G| shards
(``messages.shard_bounds``) and member i of sorted(G) owns shard i. A shard too big for one frame
is cut into pieces (``messages.shard_plan``); everything below happens piece by piece, and a
small stage has one piece a shard:

- every member sends each other owner its own slice of that owner's shard (a ``Part``);
- an owner accepts one Part per member of G that names exactly this group, shard, size and
  codec; when it has them all (its own included), or at ``reduce_s`` after the reduce began,
  it asks its driver to combine them (``CombineShard``: O(shard) tensor work, which the driver
  does in a worker thread, never on its event loop) and, given the aggregate (``combined``;
  the contributions the driver's verification refused are reported as ``Rejected``), sends
  it (a ``Result``) to every other member;
- a member accepts a Result only from that shard's owner, and is done when it has every
  shard's, or at ``2 * reduce_s``, or as soon as the owners it still waits for are gone (the
  driver could not reach them) or sent an invalid result; never while its own combine is out.

A member that sent an invalid part (or owner an invalid result) is not waited for any more:
its first message settled what it owed, as a valid first one would have (later copies are
ignored either way).

A part or result for another group (another digest) is not the sender's fault, only a
disagreement about the group: it is refused and counted as *mismatched*, never used. Pure: no
trio, no torch; the shards are opaque bytes and their sizes come from ``expected_bytes``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from p2pswarm.diloco.messages import MAX_MEMBERS, MAX_ROUND, Part, Reply, Result, group_digest, shard_plan
from p2pswarm.diloco.round_actions import Action, CombineShard, Outcome, Rejected, SendPart, SendResult

ExpectedBytes = Callable[[str, int, int], int]  # (codec, elements, width): messages.expected_bytes
_ShardT = TypeVar("_ShardT", Part, Result)


def reply_to(msg: Part | Result, accepted: bool, reason: str) -> Reply:
    """The Reply to ``msg`` (its round and shard, clamped so that the Reply is always valid)."""
    return Reply(min(max(msg.round, 0), MAX_ROUND), min(max(msg.shard, 0), MAX_MEMBERS - 1), accepted, reason)


class Reduction:
    """One member's side of the butterfly all-reduce for an agreed group (module docstring)."""

    def __init__(self, *, me: str, stage: int, round: int, numel: int, codec: str, group: tuple[str, ...],
                 now: float, reduce_s: float, expected_bytes: ExpectedBytes, counts: dict[str, int],
                 piece_elements: int | None = None) -> None:
        self.me, self.stage, self.round, self.codec, self.group = me, stage, round, codec, group
        self.digest = group_digest(stage, round, group)
        limit = {} if piece_elements is None else {"max_elements": piece_elements}
        self.plan = shard_plan(numel, len(group), codec, size=expected_bytes, **limit)
        self.bounds = self.plan.bounds  # every piece of every shard, in order: what NeedShards asks for
        self.index = group.index(me)
        self.mine = range(self.plan.index(self.index, 0), self.plan.index(self.index + 1, 0))  # our pieces
        self.owner_deadline = now + reduce_s  # an owner combines what it has by then
        self.results_deadline = now + 2 * reduce_s  # a member stops waiting for results then
        self._expected_bytes, self.counts = expected_bytes, counts
        self.own: list[bytes] | None = None  # our encoded pieces, once the driver provided them
        self.parts: dict[int, dict[str, bytes]] = {i: {} for i in self.mine}  # contributions to our pieces
        self.combined: set[int] = set()  # our pieces whose parts are closed (CombineShard emitted)
        self.combining: dict[int, tuple[str, ...]] = {}  # our pieces out with the driver -> their members
        self.results: dict[int, bytes] = {}
        self.contributors: dict[int, int] = {}
        self.gone: set[str] = set()  # members that cannot be reached: not waited for
        self.bad_parts: set[str] = set()  # members whose part we refused: their parts are not waited for
        self.bad_owners: set[str] = set()  # owners whose result we refused: their shard is not waited for

    def _numel(self, index: int) -> int:
        start, stop = self.bounds[index]
        return stop - start

    def _shard_msg(self, cls: type[_ShardT], index: int, **extra: int) -> _ShardT:
        shard, piece = divmod(index, self.plan.pieces)
        return cls(self.stage, self.round, self.digest, shard, len(self.group), self.codec, self._numel(index),
                   piece=piece, **extra)

    # --- our data ------------------------------------------------------------------------

    def provide(self, shards: list[bytes], now: float) -> list[Action]:
        """Our encoded pieces (one per bound): send each owner its parts; ValueError on misuse."""
        if self.own is not None:
            raise ValueError("the shards were already provided")
        if len(shards) != len(self.bounds):
            raise ValueError(f"{len(shards)} shards provided for {len(self.bounds)} pieces")
        for index, data in enumerate(shards):
            size = self._expected_bytes(self.codec, self._numel(index), 1)
            if type(data) is not bytes or len(data) != size:
                raise ValueError(f"piece {index} must be {size} bytes of {self.codec}")
        self.own = list(shards)
        for index in self.mine:
            self.parts[index][self.me] = shards[index]
        actions: list[Action] = [
            SendPart(self.group[self.plan.owner(index)], self._shard_msg(Part, index), data)
            for index, data in enumerate(shards)
            if self.plan.owner(index) != self.index and self.group[self.plan.owner(index)] not in self.gone
        ]
        return actions + self._maybe_combine(now)

    # --- judging what arrives ------------------------------------------------------------

    def _judge(self, peer: str, msg: Part | Result, data: bytes, shard: int) -> tuple[str, bool] | None:
        """None if ``msg`` is a valid message for a piece of shard ``shard`` of this group, else (reason, fault)."""
        if (msg.stage, msg.round, msg.group) != (self.stage, self.round, self.digest):
            return "another group", False
        if peer not in self.group:
            return "not a member of the group", True
        if msg.shards != len(self.group) or msg.shard != shard or msg.piece >= self.plan.pieces:
            return "wrong shard", True
        if msg.codec != self.codec:
            return "wrong codec", True
        index = self.plan.index(shard, msg.piece)
        if msg.numel != self._numel(index) or len(data) != self._expected_bytes(self.codec, msg.numel, msg.width()):
            return "wrong size", True
        return None

    def _refuse(self, peer: str, msg: Part | Result, reason: str, fault: bool) -> tuple[Reply, list[Action]]:
        """Refuse ``msg``; a faulty one also settles what ``peer`` owed us: it is not waited for."""
        if not fault:
            self.counts["mismatched"] += 1
            return reply_to(msg, False, reason), []
        self.counts["rejected"] += 1
        if peer in self.group:
            (self.bad_parts if isinstance(msg, Part) else self.bad_owners).add(peer)
        return reply_to(msg, False, reason), [Rejected(peer, reason)]

    def on_part(self, peer: str, part: Part, data: bytes, now: float) -> tuple[Reply, list[Action]]:
        """A contribution to one of our pieces: keep the first valid one per member (module docstring)."""
        verdict = self._judge(peer, part, data, self.index)
        if verdict is not None:
            reply, actions = self._refuse(peer, part, *verdict)
            return reply, actions + self._maybe_combine(now)  # perhaps it was the last one we waited for
        index = self.plan.index(self.index, part.piece)
        if peer in self.parts[index] or peer in self.bad_parts:
            self.counts["duplicates"] += 1
            return reply_to(part, peer in self.parts[index], "duplicate"), []
        if index in self.combined:
            self.counts["late"] += 1
            return reply_to(part, False, "late"), []
        self.parts[index][peer] = data
        return reply_to(part, True, ""), self._maybe_combine(now)

    def on_result(self, peer: str, result: Result, data: bytes, now: float) -> tuple[Reply, list[Action]]:
        """An owner's aggregate of one piece of its shard: keep the first valid one."""
        shard = self.group.index(peer) if peer in self.group else -1
        verdict = self._judge(peer, result, data, shard)
        if verdict is None and (shard == self.index or not 1 <= result.contributors <= len(self.group)):
            verdict = "wrong shard" if shard == self.index else "wrong contributors", True
        if verdict is not None:
            return self._refuse(peer, result, *verdict)
        index = self.plan.index(shard, result.piece)
        if index in self.results or peer in self.bad_owners:
            self.counts["duplicates"] += 1
            return reply_to(result, index in self.results, "duplicate"), []
        self.results[index] = data
        self.contributors[index] = result.contributors
        return reply_to(result, True, ""), []

    def peer_gone(self, peer: str, now: float) -> list[Action]:
        """``peer`` cannot be reached: stop waiting for its parts and its results."""
        if peer in self.group and peer != self.me:
            self.gone.add(peer)
        return self._maybe_combine(now)

    def tick(self, now: float) -> list[Action]:
        return self._maybe_combine(now)

    # --- combining and finishing ---------------------------------------------------------

    def _maybe_combine(self, now: float) -> list[Action]:
        """Combine each of our pieces once our data is in and every reachable member's part is, or at the deadline."""
        if self.own is None:
            return []
        expected = set(self.group) - self.gone - self.bad_parts
        return [self._combine_now(index) for index in self.mine if index not in self.combined
                and (now >= self.owner_deadline or expected <= set(self.parts[index]))]

    def _combine_now(self, index: int) -> CombineShard:
        self.combined.add(index)
        self.combining[index] = tuple(sorted(self.parts[index]))
        action = CombineShard(index, self._numel(index), dict(self.parts[index]))
        self.parts[index].clear()  # the data went with the action; `combined` now refuses late parts
        return action

    def on_combined(self, result: bytes, rejected: dict[str, str], shard: int | None = None) -> list[Action]:
        """The driver's answer to ``CombineShard`` number ``shard`` (None: the only one out): send our
        aggregate of that piece; ValueError on misuse."""
        if shard is None and len(self.combining) == 1:
            shard = next(iter(self.combining))
        if shard not in self.combining:
            raise ValueError(f"combined() without a CombineShard {shard} to answer")
        if self.me in rejected:
            raise ValueError("combine rejected our own contribution")
        used = [p for p in self.combining[shard] if p not in rejected]
        size = self._expected_bytes(self.codec, self._numel(shard), len(used))
        if type(result) is not bytes or len(result) != size:
            raise ValueError(f"combine must return the {size} bytes of our piece, not {type(result).__name__}")
        contributors = self.combining.pop(shard)
        self.results[shard] = result
        self.contributors[shard] = len(used)
        actions: list[Action] = []
        for peer in sorted(set(rejected) & set(contributors)):
            self.counts["rejected"] += 1
            actions.append(Rejected(peer, f"contribution refused: {rejected[peer]}"[:200]))
        msg = self._shard_msg(Result, shard, contributors=len(used))
        actions += [SendResult(peer, msg, result) for peer in self.group if peer != self.me and peer not in self.gone]
        return actions

    def complete(self, now: float) -> bool:
        """Every piece's result is in, or its owner is gone, or the results deadline has passed;
        never while a combine of ours is out (it is local work, and its answer always comes)."""
        if self.combining:
            return False
        if now >= self.results_deadline:
            return True
        return all(i in self.results or (i not in self.mine and self.group[self.plan.owner(i)] in
                                         self.gone | self.bad_owners) for i in range(len(self.bounds)))

    def next_deadline(self) -> float:
        if len(self.combined) < len(self.mine) and self.own is not None:
            return self.owner_deadline
        return self.results_deadline

    def outcome(self) -> Outcome:
        missing = tuple(i for i in range(len(self.bounds)) if i not in self.results)
        return Outcome(self.group, dict(self.results), missing, dict(self.contributors), False, self.plan.pieces)
