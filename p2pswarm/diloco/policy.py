"""The DiLoCo driver's pure decisions: no trio, no I/O, no clock but the ``now`` it is given.

- ``next_move``: what the driver does at a tick: load the state of a replica that is ahead
  (``CATCH_UP``), forget such a claim that our own round overtook, start a round, tick the open
  one, or wait;
- ``believed_ahead``: whether a replica's claim to be at a later round is believed (only from a
  replica we meet, and only as far as its signed record goes);
- ``diverged_from``: whether a replica at our round holds other agreed weights than ours, and whose
  state we then take (the smallest digest: every replica of a split stage picks the same one);
- ``load_sources``: where a peer that starts looks for its stage's state, in order;
- ``gather_seconds``: how long a ready replica waits for the others;
- ``Strikes``: whom we refused in which rounds, and whom we therefore stop meeting;
- ``result_check``: how far an owner's aggregate may stray from our own shard before we call it a lie;
- ``reduce_seconds`` and ``LinkRate``: how long an owner waits for parts, from the bytes a round moves and
  the rate our own rounds moved theirs at.

``service`` (the driver) and ``loading`` act on these answers.
"""

from __future__ import annotations

import enum
import logging
from collections import Counter
from collections.abc import Collection, Iterable

from p2pswarm.dht.records import StageRecord
from p2pswarm.diloco import aggregation
from p2pswarm.diloco.round import Phase

log = logging.getLogger(__name__)

STRIKES = 3  # a peer whose contributions we refused in this many of the last STRIKE_ROUNDS rounds...
STRIKE_ROUNDS = 10  # ...is left out of our groups (its Hellos get our status, nothing more)
RESULT_MIN_PROJECTION = -1.0  # an aggregate may not undo more than all of our own step (honest: >= -0.6)
RESULT_MAX_NORM_RATIO = aggregation.MAX_NORM_RATIO  # honest: <= 3 (a mean of shards within 3x of ours); -10x of 2: ~5
GATHER_ROUND_SHARE = 0.5  # a ready replica waits up to this share of its own last round (gather_seconds)
REDUCE_S = 30.0  # an owner's least wait for parts: a small round on a loaded line (results: twice it)
MAX_REDUCE_S = 1800.0  # ...and its longest: a round that needs more is left for the next one
REDUCE_SLACK = 3.0  # a round's bytes may take this many times their time at the measured rate
ASSUMED_RATE = 1e6  # bytes/s our rounds move before one was measured: a 10 Mbit/s uplink, most of it ours
RATE_WEIGHT = 0.5  # the newest round's weight in LinkRate's moving mean


class Move(enum.Enum):
    """What the driver does at one tick (``next_move``)."""

    CATCH_UP = "catch_up"  # load the state of the replica that said it is ahead (then forget the claim)
    FORGET = "forget"  # a replica was ahead, our own round has reached it meanwhile: forget the claim
    START = "start"  # a round is due and may start: start it
    TICK = "tick"  # a round is open: tick it (its deadlines)
    WAIT = "wait"  # nothing to do yet


def next_move(now: float, *, behind_round: int | None, phase: Phase | None, rounds: int, due: bool,
              retry_at: float) -> Move:
    """The driver's next move at ``now``. ``behind_round``: the later round a replica claimed (None:
    no claim); ``phase``: the open round's (None: none open); ``rounds``: our outer rounds so far;
    ``due``: enough inner steps for a round; ``retry_at``: no new round before it (after being left out).

    A claim is acted on only when no round is open or ours went on without us: a round that is DONE
    is still applying its outer step, and a state must not be loaded under it."""
    if behind_round is not None and (phase is None or phase is Phase.LEFT_OUT):
        return Move.CATCH_UP if behind_round > rounds else Move.FORGET
    if phase is None:
        return Move.START if due and now >= retry_at else Move.WAIT
    return Move.TICK


def believed_ahead(peer: str, their_round: int, *, our_round: int, met: frozenset[str],
                   record_round: int | None) -> bool:
    """Whether ``peer`` saying it is at ``their_round`` makes us load its state: only a replica we
    meet (``met``), with a signed record (``record_round``: the outer round it announced, None: no
    record), and only as far as that record goes plus the one round it may have finished since:
    a peer claiming round 10^18 must not make us load whatever it serves."""
    return our_round < their_round and peer in met and record_round is not None \
        and their_round <= record_round + 1


def diverged_from(ours: tuple[int, bytes] | None, records: Iterable[StageRecord],
                  met: Collection[str]) -> StageRecord | None:
    """The replica whose agreed state we take, or None: replicas of one stage at the same outer round
    hold the same agreed weights and momentum (the digest of their agreed backup), unless they split:
    both did a round alone at the same round number (they started together, or a partition), or a
    member refused an owner's result that another applied. Nothing makes them equal again by itself
    (each round moves both starts by the same step). So a replica we meet (``met``) whose signed record
    claims our round (``ours``: our agreed claim) with a smaller digest wins: we take its state. The
    one with the smallest digest among them: every replica of the split picks the same."""
    if ours is None:
        return None
    round_, digest = ours
    split = [r for r in records if r.peer_id in met and r.agreed is not None and r.agreed[0] == round_
             and r.agreed[1] < digest]
    return min(split, key=lambda r: r.agreed[1] if r.agreed is not None else b"", default=None)


class Source(enum.Enum):
    """Where a starting peer may find its stage's state (``load_sources``)."""

    NEIGHBOUR = "neighbour"  # a replica of our stage: its hot snapshot (the current state)
    BACKUP = "backup"  # no replica left: the freshest verified agreed backup a peer of another stage holds
    DISK = "disk"  # nobody has it: our own newest snapshot file


def load_sources(*, neighbours: bool, backups: bool, disk: bool, fresh: bool = False) -> tuple[Source, ...]:
    """The sources a starting peer tries, in order, until one loads: a neighbour first (the stage's
    live state), then a backup (newer than our file if the stage trained on without us), then our
    own file. None of them: we keep our initial weights (the first replica of a stage).

    ``fresh``: every neighbour announces outer round 0, so the stage's agreed weights are still the
    initial ones, which every peer makes alike from the run's seed (``model.seeding.part_seed``):
    loading them would only move megabytes over a starting swarm's lines (minutes on a thin one).
    A backup past round 0 (the loader fetches no other) and our own file may hold more: a record
    that lies about its round must not make a peer moving into a dead stage drop its backup. A live
    neighbour that lied is met at its first outer round and caught up with then (``should_catch_up``)."""
    present = {Source.NEIGHBOUR: neighbours and not fresh, Source.BACKUP: backups, Source.DISK: disk}
    return tuple(source for source in Source if present[source])


def neighbours_by_round(records: Iterable[StageRecord], me: str, working: Collection[str] = ()) -> list[str]:
    """The other replicas in ``records`` (stage-map records): those counted as ``working`` first (a claimed
    round is only a claim), then the one announcing the latest outer round first."""
    return [r.peer_id for r in sorted((r for r in records if r.peer_id != me),
                                      key=lambda r: (r.peer_id not in working, -r.capacity.outer_round))]


class Strikes:
    """The contributions we refused, per peer, and whom we therefore stop meeting: a peer refused in
    STRIKES of the last STRIKE_ROUNDS rounds is barred (strikes age out)."""

    def __init__(self, counts: Counter[str]) -> None:
        self.counts = counts  # the driver's counters: "rejected_contributions"
        self.penalties: Counter[str] = Counter()  # rejected contributions per peer, ever
        self._rounds: dict[str, list[int]] = {}  # peer -> the rounds in which we refused it

    def refuse(self, peer: str, round_: int, reason: str) -> None:
        """We refused a contribution of ``peer`` in outer round ``round_``."""
        self.counts["rejected_contributions"] += 1
        self.penalties[peer] += 1
        rounds = self._rounds.setdefault(peer, [])
        if round_ not in rounds:
            rounds.append(round_)
        log.warning("outer round %d: refused %s: %s (left out of the round; nothing to do here)", round_, peer, reason)

    def refused_in(self, peer: str, round_: int) -> bool:
        """Whether we refused a contribution of ``peer`` in outer round ``round_``."""
        return round_ in self._rounds.get(peer, ())

    def barred(self, peer: str, round_: int) -> bool:
        """Refused in STRIKES of the last STRIKE_ROUNDS rounds before ``round_``: left out of our groups."""
        recent = [r for r in self._rounds.get(peer, ()) if r > round_ - STRIKE_ROUNDS]
        self._rounds[peer] = recent
        return len(recent) >= STRIKES


def result_check(members: int) -> aggregation.VerifyConfig:
    """How far an owner's aggregate m may be from our own shard a before we call it a lie. Only
    what would harm us is refused: m longer than RESULT_MAX_NORM_RATIO times a, or pulling back
    along a by more than a itself (m.a / a.a < RESULT_MIN_PROJECTION), which a -10x aggregate
    does. No cosine bar and no lower bound on length: honest pseudo-gradients may be orthogonal
    or opposed (pairwise cosine down to -0.2 early on, norms 3x apart), and then their aggregate
    can be short and point anywhere but far back (m.a / a.a >= (1 - 0.6 (n - 1)) / n for the mean
    of n within 3x and at cosine >= -0.2); the old bar 0.5/sqrt(n) refused such an honest owner
    (2 members, cosine 0, norms 2.7x apart: cosine 1/sqrt(10) < 0.354). A short aggregate does
    little harm, and with 2 members nothing tells an honest owner from one that sends noise."""
    ratio = RESULT_MAX_NORM_RATIO  # (whatever the group's size: an aggregate is no longer than its longest part)
    return aggregation.VerifyConfig(min_cosine=-1.0, max_norm_ratio=ratio, max_var_ratio=ratio * ratio,
                                    min_projection=RESULT_MIN_PROJECTION, refuse_short=False)


def gather_seconds(configured: float, last_round_s: float | None) -> float:
    """How long a ready replica waits for the others: ``configured``, or GATHER_ROUND_SHARE of its own last
    round (from ready to ready; the first from the start of training) where that is longer. Replicas
    drift apart by a share of a round, not by fixed seconds: on a 0.2 Mbit/s line, where 40 inner steps
    took over a minute, the replicas were ready 13 to 29 s apart, a 10 s gather left one out of a round,
    and each time it loaded a state that its replica's uplink could not carry in time. A ready replica
    keeps training while it waits, so waiting longer costs only staleness."""
    return configured if last_round_s is None else max(configured, GATHER_ROUND_SHARE * last_round_s)


def reduce_seconds(nbytes: int, rate: float | None) -> float:
    """An owner's wait for parts (a member's for results: twice it) in a round where we send ``nbytes``:
    REDUCE_SLACK times their time at ``rate`` (bytes/s, ours measured; ASSUMED_RATE before one was),
    within [REDUCE_S, MAX_REDUCE_S]. A fixed 30 s cut an xl stage's int8 round (~266 MB a replica) on a
    20 Mbit/s line; a sparse round of a few MB never needs more than the floor."""
    usable = rate if rate is not None and rate > 0 else ASSUMED_RATE
    return min(MAX_REDUCE_S, max(REDUCE_S, REDUCE_SLACK * max(nbytes, 0) / usable))


class LinkRate:
    """The rate our rounds moved their bytes at: a moving mean of bytes sent over each reduce's seconds
    (from the group's agreement to the last result: waiting for others counts, so it errs low, on the
    side of a longer deadline)."""

    def __init__(self) -> None:
        self.rate: float | None = None

    def observe(self, nbytes: int, seconds: float) -> None:
        """A round sent ``nbytes`` in ``seconds``; a round that sent nothing (a group of one) says nothing."""
        if nbytes <= 0 or not seconds > 0:
            return
        sample = nbytes / seconds
        self.rate = sample if self.rate is None else RATE_WEIGHT * sample + (1 - RATE_WEIGHT) * self.rate
