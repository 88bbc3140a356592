"""One DiLoCo outer round of one replica, as a pure state machine: gather, agree, reduce.

Replicas of a stage train alone for H inner steps, then meet with no coordinator. Phases:

- IDLE: still training. Hellos from others are answered "not ready" and remembered.
- GATHER (``start``): tell every expected peer we are ready; collect who else is (a ready
  Hello for our stage, round, numel and codec; the Hello's numel is the stage's, ``stage_numel``,
  while a Streaming DiLoCo round reduces one fragment of it, ``numel``). Close when every expected peer is ready, at
  ``gather_s``, or at once when a closed Hello invites us (someone closed and waits for us).
  Closing fixes our proposal V (``group.Membership``) and sends it to every peer of V.
- AGREE: wait for the proposals of V (or ``agree_s``); the group is the intersection of all
  of them with the proposers (``Membership.agreed``). Peers that proposed (or were proposed
  in) a group without us are dropped; if that leaves us alone we are LEFT_OUT (the round went
  on without us), alone otherwise we are DONE (the driver applies its own pseudo-gradient);
  else we ask the driver for our shards (``NeedShards``) and reduce.
  Parts and results that come while we agree are held (``round_early.EarlyBuffer``) and
  replayed once the group is known.
- REDUCE: the butterfly all-reduce of ``round_reduce.Reduction``, then DONE. The owner's
  combine is asked of the driver too (``CombineShard``, answered with ``combined``): the
  tensor work of a round is the driver's, done off its event loop.
- DONE / LEFT_OUT: ``Finished`` was emitted once; later messages get "round over".

Every Hello request is answered with ``status()`` and a Hello reply is processed exactly like
a request. A Hello for a later round means we are behind: ``CatchUp`` (and the round is
abandoned). A left-out replica answers ``closed`` and not ``ready``: it withdrew, so nobody
waits for it or counts it. The machine never raises on a peer's input; it refuses (a Reply,
a ``Rejected`` action, a count) and raises ValueError only for its driver's misuse. Pure: no
trio, no torch, no clock (``now`` is passed in), no randomness.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from p2pswarm.dht.records import MAX_STAGES
from p2pswarm.diloco.group import Membership
from p2pswarm.diloco.messages import (
    CODECS,
    MAX_MEMBERS,
    MAX_ROUND,
    MAX_STAGE_NUMEL,
    Hello,
    Part,
    Reply,
    Result,
    is_peer_id,
    shard_plan,
)
from p2pswarm.diloco.round_actions import (
    Action,
    CatchUp,
    CombineShard,
    Finished,
    NeedShards,
    Outcome,
    Rejected,
    SendHello,
    SendPart,
    SendResult,
)
from p2pswarm.diloco.round_early import EarlyBuffer
from p2pswarm.diloco.round_reduce import ExpectedBytes, Reduction, reply_to

__all__ = [
    "AGREE_S",
    "EARLY_BUFFER_MODELS",
    "EARLY_SLACK_BYTES",
    "GATHER_S",
    "REDUCE_S",
    "Action",
    "CatchUp",
    "CombineShard",
    "Finished",
    "NeedShards",
    "Outcome",
    "OuterRound",
    "Phase",
    "Rejected",
    "RoundTiming",
    "SendHello",
    "SendPart",
    "SendResult",
]

GATHER_S = 20.0  # a ready replica waits this long for the expected ones: stragglers of H inner steps
AGREE_S = 5.0  # after closing, proposals need one Hello round trip: seconds even over relays
REDUCE_S = 30.0  # an owner waits this long for parts: a shard of a big stage over a slow link
EARLY_BUFFER_MODELS = 2  # held parts and results before our group is known: honest ones are < 2 models...
EARLY_SLACK_BYTES = 16  # ...plus, per member, a shard's rounding: one element more and two int8 scales
COUNT_KEYS = ("duplicates", "late", "early", "rejected", "mismatched", "missing_shards", "overflow")


class Phase(enum.Enum):
    IDLE = "idle"  # training the inner steps; not ready to meet yet
    GATHER = "gather"  # ready: collecting the ready peers
    AGREE = "agree"  # closed: waiting for the proposals of our view
    REDUCE = "reduce"  # group agreed: exchanging parts and results
    DONE = "done"  # finished with a group that includes us
    LEFT_OUT = "left_out"  # finished without a group (left out, or behind: CatchUp)


_OVER = (Phase.DONE, Phase.LEFT_OUT)


@dataclass(frozen=True)
class RoundTiming:
    gather_s: float = GATHER_S  # how long a ready member waits for the expected replicas
    agree_s: float = AGREE_S  # how long it waits for the others' proposals after closing
    reduce_s: float = REDUCE_S  # an owner's wait for parts; results are awaited until 2 * reduce_s

    def __post_init__(self) -> None:
        timings = (self.gather_s, self.agree_s, self.reduce_s)
        if not all(type(t) in (int, float) and 0 < t < float("inf") for t in timings):
            raise ValueError(f"round timings must be positive and finite: {self}")


class OuterRound:
    """One replica's outer round ``round`` of ``stage`` (module docstring)."""

    def __init__(self, *, me: str, stage: int, round: int, numel: int, codec: str, expected: frozenset[str],
                 now: float, timing: RoundTiming = RoundTiming(), expected_bytes: ExpectedBytes,
                 piece_elements: int | None = None, stage_numel: int | None = None) -> None:
        if not is_peer_id(me) or not all(is_peer_id(p) for p in expected):
            raise ValueError("me and every expected peer must be valid peer ids")
        if not (0 <= stage < MAX_STAGES and 0 <= round <= MAX_ROUND and 1 <= numel <= MAX_STAGE_NUMEL
                and codec in CODECS):
            raise ValueError(f"invalid round: stage {stage}, round {round}, numel {numel}, codec {codec!r}")
        self.me, self.stage, self.round, self.numel, self.codec = me, stage, round, numel, codec
        self.stage_numel = numel if stage_numel is None else stage_numel  # what Hellos carry and compare
        if not numel <= self.stage_numel <= MAX_STAGE_NUMEL:
            raise ValueError(f"a round of {numel} elements of a stage of {self.stage_numel}")
        self.expected = frozenset(expected) - {me}
        self.timing, self.created = timing, now
        self._expected_bytes = expected_bytes
        self._piece_elements = piece_elements  # None: as many as fit a frame (tests lower it)
        self.phase = Phase.IDLE
        self.book = Membership(me)
        self.counts: dict[str, int] = dict.fromkeys(COUNT_KEYS, 0)
        self.group: tuple[str, ...] | None = None  # sorted, once agreed; left out: the peers that went on
        self.outcome: Outcome | None = None
        self._deadline: float | None = None  # end of GATHER or AGREE
        self._reduction: Reduction | None = None
        limit = {} if piece_elements is None else {"max_elements": piece_elements}
        # pieces of one shard in the smallest group that reduces (2): what one peer may send of a kind early
        self._early = EarlyBuffer(
            budget=EARLY_BUFFER_MODELS * expected_bytes(codec, numel, 1) + MAX_MEMBERS * EARLY_SLACK_BYTES,
            pieces=shard_plan(numel, 2, codec, size=expected_bytes, **limit).pieces, counts=self.counts)
        self._rejected_hellos: set[str] = set()
        self._caught_up = round  # the latest round a CatchUp was emitted for

    # --- status ----------------------------------------------------------------------------

    def status(self) -> Hello:
        """My status Hello for this round: what every Hello request is answered with."""
        members: Iterable[str]
        if self.phase is Phase.IDLE:
            ready, closed, members = False, False, self.book.gathered() - {self.me}
        elif self.phase is Phase.GATHER:
            ready, closed, members = True, False, self.book.gathered()
        elif self.phase is Phase.AGREE:
            assert self.book.view is not None, "closed on entering AGREE"
            ready, closed, members = True, True, self.book.view
        elif self.phase is Phase.LEFT_OUT:
            ready, closed, members = False, True, self.group or ()
        else:
            assert self.group is not None, "agreed on entering REDUCE, or finished with one"
            ready, closed, members = True, True, self.group
        members = tuple(sorted(members))[:MAX_MEMBERS]  # only a left-out list can be longer: it is informative
        return Hello(self.stage, self.round, self.stage_numel, self.codec, ready, closed, members)

    @property
    def digest(self) -> bytes | None:
        return self._reduction.digest if self._reduction is not None else None

    def next_deadline(self) -> float | None:
        """When ``tick`` has something to do next (None: nothing until a message arrives)."""
        if self.phase in (Phase.GATHER, Phase.AGREE):
            return self._deadline
        if self.phase is Phase.REDUCE:
            return _reducing(self._reduction).next_deadline()
        return None

    # --- driver events ---------------------------------------------------------------------

    def start(self, now: float) -> list[Action]:
        """We finished our inner steps and are ready: gather (a finished round returns [])."""
        if self.phase in _OVER:
            return []
        if self.phase is not Phase.IDLE:
            raise ValueError(f"start() in phase {self.phase.name}")
        self.phase, self._deadline = Phase.GATHER, now + self.timing.gather_s
        actions = self._advance(now)
        if self.phase is Phase.GATHER:
            hello = self.status()
            book = self.book
            peers = (self.expected | book.ready) - book.withdrawn - book.failed - book.shut_out
            actions = [SendHello(peer, hello) for peer in sorted(peers)] + actions
        return actions

    def provide_shards(self, shards: list[bytes], now: float) -> list[Action]:
        """Our encoded shards, one per ``NeedShards.bounds``: send the parts ([] if the round is over)."""
        if self.phase in _OVER:
            return []
        if self.phase is not Phase.REDUCE:
            raise ValueError(f"provide_shards() in phase {self.phase.name}, before NeedShards")
        return self._after_reduce(_reducing(self._reduction).provide(shards, now), now)

    def combined(self, result: bytes, rejected: dict[str, str], now: float, shard: int | None = None) -> list[Action]:
        """The driver's answer to ``CombineShard`` number ``shard`` (None: the only one out): that
        piece's aggregate (encoded, of the round's codec) and the contributors its verification
        refused (peer -> reason, never us); the Results go out ([] if the round is over).
        ValueError on misuse."""
        if self.phase in _OVER:
            return []
        if self.phase is not Phase.REDUCE:
            raise ValueError(f"combined() in phase {self.phase.name}, before CombineShard")
        return self._after_reduce(_reducing(self._reduction).on_combined(result, rejected, shard), now)

    def on_send_failed(self, peer: str, now: float) -> list[Action]:
        """The driver could not deliver to ``peer``: treat it as gone for this round."""
        if self.phase in _OVER or peer == self.me:
            return []
        if self.phase is Phase.REDUCE:
            return self._after_reduce(_reducing(self._reduction).peer_gone(peer, now), now)
        self.book.note_failed(peer)
        return self._advance(now)

    def tick(self, now: float) -> list[Action]:
        """Act on the deadlines that have passed by ``now``."""
        if self.phase is Phase.REDUCE:
            return self._after_reduce(_reducing(self._reduction).tick(now), now)
        if self.phase in (Phase.GATHER, Phase.AGREE):
            return self._advance(now)
        return []

    # --- Hellos ----------------------------------------------------------------------------

    def on_hello(self, peer: str, hello: Hello, now: float) -> tuple[Hello, list[Action]]:
        """A peer's status (request or reply): update, act; the reply is my status afterwards."""
        actions: list[Action] = []
        if peer == self.me or not is_peer_id(peer) or hello.stage != self.stage:
            self.counts["mismatched"] += 1
        elif (hello.numel, hello.codec) != (self.stage_numel, self.codec):
            reason = f"numel/codec {hello.numel}/{hello.codec}, not {self.stage_numel}/{self.codec}"
            actions = _reject_once(self._rejected_hellos, self.counts, peer, reason)
        elif hello.round > self.round:
            actions = self._later_round(peer, hello.round, now)
        elif hello.round == self.round and self.phase not in _OVER:
            actions = self._same_round(peer, hello, now)
        return self.status(), actions

    def _later_round(self, peer: str, their_round: int, now: float) -> list[Action]:
        """A later round: we are behind, unless we are reducing or done and it is just the next one."""
        allowed = self.round + (1 if self.phase in (Phase.REDUCE, Phase.DONE) else 0)
        if their_round <= max(allowed, self._caught_up):
            return []
        self._caught_up = their_round
        actions: list[Action] = [CatchUp(peer, their_round)]
        if self.phase not in _OVER:
            actions += self._finish(Outcome((), left_out=True))
        return actions

    def _same_round(self, peer: str, hello: Hello, now: float) -> list[Action]:
        if hello.closed and not hello.ready:
            self.book.note_withdrawn(peer)
            if self.phase is Phase.REDUCE:
                return self._after_reduce(_reducing(self._reduction).peer_gone(peer, now), now)
        elif hello.ready and self.phase is not Phase.REDUCE:
            if hello.closed:
                if peer not in hello.members:
                    return _reject_once(self._rejected_hellos, self.counts, peer, "a proposal without its sender")
                self.book.note_proposal(peer, hello.members)
            else:
                self.book.note_ready(peer)
        return self._advance(now)

    # --- gather and agree ------------------------------------------------------------------

    def _advance(self, now: float) -> list[Action]:
        """Move on as far as what we know allows: left out, close, agree."""
        self.counts["overflow"] = self.book.overflow
        if self.phase is Phase.GATHER:
            inviter = self.book.invited_by()
            if inviter is not None or self.book.complete(self.expected) or _passed(self._deadline, now):
                return self._close(inviter, now)
        if self.phase is Phase.AGREE and (self.book.settled() or _passed(self._deadline, now)):
            return self._agree(now)
        return []

    def _close(self, inviter: str | None, now: float) -> list[Action]:
        view = self.book.close(inviter)
        self.phase, self._deadline = Phase.AGREE, now + self.timing.agree_s
        hello = self.status()
        actions: list[Action] = [SendHello(peer, hello) for peer in sorted(view - {self.me})]
        return actions + self._advance(now)

    def _agree(self, now: float) -> list[Action]:
        group = self.book.agreed()
        if group == {self.me} and self.book.shut_out:  # the others went on without us
            return self._finish(Outcome(tuple(sorted(self.book.shut_out)), left_out=True))
        self.group = tuple(sorted(group))
        if len(group) == 1:  # nobody else was ready: alone, not left out
            return self._finish(Outcome(self.group))
        self.phase = Phase.REDUCE
        self._reduction = Reduction(
            me=self.me, stage=self.stage, round=self.round, numel=self.numel, codec=self.codec, group=self.group,
            now=now, reduce_s=self.timing.reduce_s, expected_bytes=self._expected_bytes, counts=self.counts,
            piece_elements=self._piece_elements)
        actions: list[Action] = [NeedShards(self.group, tuple(self._reduction.bounds))]
        for peer in sorted(self.book.withdrawn | self.book.failed):
            actions += self._reduction.peer_gone(peer, now)  # they will not send, and need not be sent to
        for kind, peer, msg, data in self._early.drain():  # judge what came early (its replies were sent)
            actions += _judge(self._reduction, kind, peer, msg, data, now)[1]
        return self._after_reduce(actions, now)

    def _finish(self, outcome: Outcome) -> list[Action]:
        """DONE with ``outcome``'s group, or LEFT_OUT: ``outcome.group`` = the peers we know went on without us."""
        self.group = outcome.group
        self.phase = Phase.LEFT_OUT if outcome.left_out else Phase.DONE
        self.outcome, self._deadline = outcome, None
        self.counts["missing_shards"] += len(outcome.missing)
        self._early.clear()
        if self._reduction is not None:
            for held in self._reduction.parts.values():
                held.clear()
        return [Finished(outcome)]

    # --- reduce ----------------------------------------------------------------------------

    def _after_reduce(self, actions: list[Action], now: float) -> list[Action]:
        if self.phase is Phase.REDUCE and _reducing(self._reduction).complete(now):
            actions = actions + self._finish(_reducing(self._reduction).outcome())
        return actions

    def on_part(self, peer: str, part: Part, data: bytes, now: float) -> tuple[Reply, list[Action]]:
        """A member's contribution to our shard (see ``round_reduce``); early ones are held."""
        return self._on_shard_msg("part", peer, part, data, now)

    def on_result(self, peer: str, result: Result, data: bytes, now: float) -> tuple[Reply, list[Action]]:
        """An owner's aggregate of its shard (see ``round_reduce``); early ones are held."""
        return self._on_shard_msg("result", peer, result, data, now)

    def _on_shard_msg(self, kind: str, peer: str, msg: Part | Result, data: bytes,
                      now: float) -> tuple[Reply, list[Action]]:
        if self.phase in _OVER:
            self.counts["late"] += 1
            return reply_to(msg, False, "round over"), []
        if (msg.stage, msg.round) != (self.stage, self.round):
            self.counts["mismatched"] += 1
            return reply_to(msg, False, "another round"), []
        if self.phase is Phase.REDUCE:
            reply, actions = _judge(_reducing(self._reduction), kind, peer, msg, data, now)
            return reply, self._after_reduce(actions, now)
        accepting = self.phase is Phase.AGREE and peer in (self.book.view or ())
        return self._early.hold(kind, peer, msg, data, accepting=accepting), []


def _reject_once(rejected: set[str], counts: dict[str, int], peer: str, reason: str) -> list[Action]:
    """Refuse ``peer``'s Hello: counted each time, penalised (``Rejected``) once per peer and round,
    ``rejected`` being the peers already penalised: its config or code is wrong."""
    counts["rejected"] += 1
    if peer in rejected:
        return []
    rejected.add(peer)
    return [Rejected(peer, reason)]


def _reducing(reduction: Reduction | None) -> Reduction:
    """``OuterRound._reduction``, from phase REDUCE on."""
    assert reduction is not None, "set when the group agrees, on entering REDUCE"
    return reduction


def _passed(deadline: float | None, now: float) -> bool:
    """Whether ``OuterRound._deadline`` passed by ``now``."""
    assert deadline is not None, "set on entering GATHER and AGREE, the phases that have one"
    return now >= deadline


def _judge(reduction: Reduction, kind: str, peer: str, msg: Part | Result, data: bytes,
           now: float) -> tuple[Reply, list[Action]]:
    """``reduction``'s judgement of ``msg``: a Part if ``kind`` is "part", else a Result."""
    if kind == "part":
        assert isinstance(msg, Part), kind
        return reduction.on_part(peer, msg, data, now)
    assert isinstance(msg, Result), kind
    return reduction.on_result(peer, msg, data, now)
