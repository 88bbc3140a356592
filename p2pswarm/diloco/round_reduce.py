"""The butterfly all-reduce of one agreed DiLoCo group: the pure second half of an outer round.

Once the group G is agreed (``round.py``), the flat pseudo-gradient is cut into |G| shards
(``messages.shard_bounds``) and member i of sorted(G) owns shard i:

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

from p2pswarm.diloco.messages import MAX_MEMBERS, MAX_ROUND, Part, Reply, Result, group_digest, shard_bounds
from p2pswarm.diloco.round_actions import Action, CombineShard, Outcome, Rejected, SendPart, SendResult

ExpectedBytes = Callable[[str, int], int]


def reply_to(msg: Part | Result, accepted: bool, reason: str) -> Reply:
    """The Reply to ``msg`` (its round and shard, clamped so that the Reply is always valid)."""
    return Reply(min(max(msg.round, 0), MAX_ROUND), min(max(msg.shard, 0), MAX_MEMBERS - 1), accepted, reason)


class Reduction:
    """One member's side of the butterfly all-reduce for an agreed group (module docstring)."""

    def __init__(self, *, me: str, stage: int, round: int, numel: int, codec: str, group: tuple[str, ...],
                 now: float, reduce_s: float, expected_bytes: ExpectedBytes, counts: dict[str, int]) -> None:
        self.me, self.stage, self.round, self.codec, self.group = me, stage, round, codec, group
        self.digest = group_digest(stage, round, group)
        self.bounds = shard_bounds(numel, len(group))
        self.index = group.index(me)
        self.owner_deadline = now + reduce_s  # an owner combines what it has by then
        self.results_deadline = now + 2 * reduce_s  # a member stops waiting for results then
        self._expected_bytes, self.counts = expected_bytes, counts
        self.own: list[bytes] | None = None  # our encoded shards, once the driver provided them
        self.parts: dict[str, bytes] = {}  # contributions to our shard, ours included
        self.combined = False  # our shard's parts are closed (CombineShard was emitted): later ones are late
        self.combining: tuple[str, ...] | None = None  # the members whose parts the driver is combining
        self.results: dict[int, bytes] = {}
        self.contributors: dict[int, int] = {}
        self.gone: set[str] = set()  # members that cannot be reached: not waited for
        self.bad_parts: set[str] = set()  # members whose part we refused: their part is not waited for
        self.bad_owners: set[str] = set()  # owners whose result we refused: their shard is not waited for

    def _numel(self, shard: int) -> int:
        start, stop = self.bounds[shard]
        return stop - start

    def _shard_msg(self, cls: type, shard: int, *extra: int) -> Part | Result:
        return cls(self.stage, self.round, self.digest, shard, len(self.group), self.codec, self._numel(shard), *extra)

    # --- our data ------------------------------------------------------------------------

    def provide(self, shards: list[bytes], now: float) -> list[Action]:
        """Our encoded shards (one per bound): send each owner its part; ValueError on misuse."""
        if self.own is not None:
            raise ValueError("the shards were already provided")
        if len(shards) != len(self.bounds):
            raise ValueError(f"{len(shards)} shards provided for a group of {len(self.bounds)}")
        for shard, data in enumerate(shards):
            size = self._expected_bytes(self.codec, self._numel(shard))
            if type(data) is not bytes or len(data) != size:
                raise ValueError(f"shard {shard} must be {size} bytes of {self.codec}")
        self.own = list(shards)
        self.parts[self.me] = shards[self.index]
        actions: list[Action] = [
            SendPart(owner, self._shard_msg(Part, shard), shards[shard])
            for shard, owner in enumerate(self.group) if owner != self.me and owner not in self.gone
        ]
        return actions + self._maybe_combine(now)

    # --- judging what arrives ------------------------------------------------------------

    def _judge(self, peer: str, msg: Part | Result, data: bytes, shard: int) -> tuple[str, bool] | None:
        """None if ``msg`` is a valid message for shard ``shard`` of this group, else (reason, fault)."""
        if (msg.stage, msg.round, msg.group) != (self.stage, self.round, self.digest):
            return "another group", False
        if peer not in self.group:
            return "not a member of the group", True
        if msg.shards != len(self.group) or msg.shard != shard:
            return "wrong shard", True
        if msg.codec != self.codec:
            return "wrong codec", True
        if msg.numel != self._numel(shard) or len(data) != self._expected_bytes(self.codec, msg.numel):
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
        """A contribution to our shard: keep the first valid one per member (module docstring)."""
        verdict = self._judge(peer, part, data, self.index)
        if verdict is not None:
            reply, actions = self._refuse(peer, part, *verdict)
            return reply, actions + self._maybe_combine(now)  # perhaps it was the last one we waited for
        if peer in self.parts or peer in self.bad_parts:
            self.counts["duplicates"] += 1
            return reply_to(part, peer in self.parts, "duplicate"), []
        if self.combined:
            self.counts["late"] += 1
            return reply_to(part, False, "late"), []
        self.parts[peer] = data
        return reply_to(part, True, ""), self._maybe_combine(now)

    def on_result(self, peer: str, result: Result, data: bytes, now: float) -> tuple[Reply, list[Action]]:
        """An owner's aggregate of its shard: keep the first valid one."""
        shard = self.group.index(peer) if peer in self.group else -1
        verdict = self._judge(peer, result, data, shard)
        if verdict is None and (shard == self.index or not 1 <= result.contributors <= len(self.group)):
            verdict = "wrong shard" if shard == self.index else "wrong contributors", True
        if verdict is not None:
            return self._refuse(peer, result, *verdict)
        if shard in self.results or peer in self.bad_owners:
            self.counts["duplicates"] += 1
            return reply_to(result, shard in self.results, "duplicate"), []
        self.results[shard] = data
        self.contributors[shard] = result.contributors
        return reply_to(result, True, ""), []

    def peer_gone(self, peer: str, now: float) -> list[Action]:
        """``peer`` cannot be reached: stop waiting for its part and its result."""
        if peer in self.group and peer != self.me:
            self.gone.add(peer)
        return self._maybe_combine(now)

    def tick(self, now: float) -> list[Action]:
        return self._maybe_combine(now)

    # --- combining and finishing ---------------------------------------------------------

    def _maybe_combine(self, now: float) -> list[Action]:
        """Combine our shard once our data is in and every reachable member's part is, or at the deadline."""
        if self.combined or self.own is None:
            return []
        waiting = set(self.group) - self.gone - self.bad_parts - set(self.parts)
        if waiting and now < self.owner_deadline:
            return []
        return self._combine_now()

    def _combine_now(self) -> list[Action]:
        self.combined = True
        self.combining = tuple(sorted(self.parts))
        action = CombineShard(self.index, self._numel(self.index), dict(self.parts))
        self.parts.clear()  # the data went with the action; `combined` now refuses late parts
        return [action]

    def on_combined(self, result: bytes, rejected: dict[str, str]) -> list[Action]:
        """The driver's answer to ``CombineShard``: send our aggregate; ValueError on misuse."""
        if self.combining is None:
            raise ValueError("combined() without a CombineShard to answer")
        size = self._expected_bytes(self.codec, self._numel(self.index))
        if type(result) is not bytes or len(result) != size:
            raise ValueError(f"combine must return the {size} bytes of our shard, not {type(result).__name__}")
        if self.me in rejected:
            raise ValueError("combine rejected our own contribution")
        contributors, self.combining = self.combining, None
        used = [p for p in contributors if p not in rejected]
        self.results[self.index] = result
        self.contributors[self.index] = len(used)
        actions: list[Action] = []
        for peer in sorted(set(rejected) & set(contributors)):
            self.counts["rejected"] += 1
            actions.append(Rejected(peer, f"contribution refused: {rejected[peer]}"[:200]))
        msg = self._shard_msg(Result, self.index, len(used))
        actions += [SendResult(peer, msg, result) for peer in self.group if peer != self.me and peer not in self.gone]
        return actions

    def complete(self, now: float) -> bool:
        """Every shard's result is in, or its owner is gone, or the results deadline has passed;
        never while our own combine is out (it is local work, and its answer always comes)."""
        if self.combining is not None:
            return False
        if now >= self.results_deadline:
            return True
        return all(s in self.results or (s != self.index and owner in self.gone | self.bad_owners)
                   for s, owner in enumerate(self.group))

    def next_deadline(self) -> float:
        if not self.combined and self.own is not None:
            return self.owner_deadline
        return self.results_deadline

    def outcome(self) -> Outcome:
        missing = tuple(s for s in range(len(self.group)) if s not in self.results)
        return Outcome(self.group, dict(self.results), missing, dict(self.contributors), False)
