"""Who did the work: the peers a node counts as serving a stage, from evidence, not claims.

A stage record is a signed claim; a claim costs nothing, and 16 identities claiming a stage made
an honest joiner take another one and the swarm train nothing (issue 25). So stage choice, health,
rebalancing and DiLoCo's invitations count a peer only once it did verifiable work:

* **first-hand** (``WorkBook.saw``): a downstream peer sent back the gradient of a micro-batch we
  sent *it*; an upstream peer's forward was computed here; a replica's contribution was taken into
  a finished outer round. Each event adds 1 to the peer's score, which halves every WORK_HALF_LIFE
  seconds; a peer works while its score is at least MIN_WORK (one event counts for two half-lives).
* **attested**: our record carries the MAX_ATTESTED peers we saw work first-hand (``attested``),
  signed with it. A reader takes a record's attestations only from a *trusted* author: itself, a
  root (the bootstrap peers its operator named), or a peer it already counts as working, up to
  MAX_TRUST_HOPS attestations away from what it saw itself. A peer counted only through
  attestations counts a few per address in each stage (``ranking.spread``); one counted first-hand is
  never capped: a CGNAT's honest peers that work are all counted. The cap is per stage: honest peers
  of other stages behind one address must not crowd a stage's last worker out of the count, and make
  it look down (a peer would move out of a served stage).

Identities that only store records, or only answer pings, are never counted, whatever they claim or
attest of each other: no honest peer attests them. Pure: time is ``now``; no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from p2pswarm.dht.ranking import spread
from p2pswarm.dht.records import StageRecord, newest_per_peer

WORK_HALF_LIFE = 60.0  # seconds in which a peer's evidence halves: a peer that stopped working drops out in minutes
MIN_WORK = 0.25  # score a working peer has: one event counts for two half-lives, a busy peer for many more
MAX_WORKERS = 1024  # peers remembered; the lowest scores go first beyond this
MAX_ATTESTED = 8  # peers our record attests: our best-scored first-hand workers (the record's size stays small)
MAX_TRUST_HOPS = 3  # attestations followed from what we saw ourselves: a few stages away
CONTRIBUTION_WEIGHT = 8.0  # a contribution taken into an outer round: many micro-batches' worth of work


@dataclass(frozen=True)
class _Score:
    stage: int
    value: float  # at ``at``
    at: float

    def now(self, now: float) -> float:
        return self.value * 0.5 ** (max(0.0, now - self.at) / WORK_HALF_LIFE)


class WorkBook:
    """The work we saw peers do, first-hand, decayed over time (module docstring)."""

    def __init__(self, max_workers: int = MAX_WORKERS) -> None:
        self._scores: dict[str, _Score] = {}
        self._max = max_workers

    def saw(self, peer: str, stage: int, now: float, weight: float = 1.0) -> bool:
        """``peer`` did ``weight`` units of work for ``stage`` (a peer that moved starts again there);
        True when that is news: the peer was not counted as working for ``stage`` before."""
        held = self._scores.get(peer)
        before = held.now(now) if held is not None and held.stage == stage else 0.0
        self._scores[peer] = _Score(stage, before + weight, max(now, held.at if held else now))
        self._bound(peer, now)
        return before < MIN_WORK

    def keep(self, peer: str, stage: int, now: float) -> None:
        """``peer`` was just counted working for ``stage`` on others' word: remember it for two half-lives
        (a score of 1, never more), so that it still counts while the peers that attest it are briefly gone."""
        held = self._scores.get(peer)
        if held is None or held.stage != stage or held.now(now) < 1.0:
            self._scores[peer] = _Score(stage, 1.0, now)
            self._bound(peer, now)

    def _bound(self, peer: str, now: float) -> None:
        """Past ``max_workers``, forget the peer with the least work left, never ``peer`` (just written)."""
        if len(self._scores) > self._max:
            others = (p for p in self._scores if p != peer)
            del self._scores[min(others, key=lambda p: (self._scores[p].now(now), p))]

    def score(self, peer: str, now: float) -> float:
        held = self._scores.get(peer)
        return 0.0 if held is None else held.now(now)

    def working(self, now: float) -> dict[str, int]:
        """Every peer working now, with the stage it worked for."""
        return {peer: s.stage for peer, s in self._scores.items() if s.now(now) >= MIN_WORK}

    def active(self, now: float, within: float) -> dict[str, int]:
        """Every peer whose last event was at most ``within`` seconds before ``now``, with its stage:
        alive a moment ago, whatever its record says (``StageMap._fresh``)."""
        return {peer: s.stage for peer, s in self._scores.items() if now - s.at <= within}

    def attested(self, now: float, limit: int = MAX_ATTESTED) -> tuple[tuple[str, int], ...]:
        """What our record attests: up to ``limit`` working peers, the best scores first."""
        best = sorted(self.working(now).items(), key=lambda item: (-self.score(item[0], now), item[0]))
        return tuple(best[:limit])


def _per_stage(network: Callable[[StageRecord], tuple[str, str] | None]
               ) -> Callable[[StageRecord], tuple[str, str] | None]:
    """``network``'s groups, one set per stage: the per-address cap of attested peers counts in each stage."""
    def grouped(record: StageRecord) -> tuple[str, str] | None:
        group = network(record)
        return None if group is None else (f"{record.stage}/{group[0]}", f"{record.stage}/{group[1]}")
    return grouped


def workers(records: Mapping[int, Sequence[StageRecord]], first_hand: Mapping[str, int], *, me: str,
            roots: Iterable[str], network: Callable[[StageRecord], tuple[str, str] | None],
            remembered: Mapping[str, int] | None = None) -> dict[int, set[str]]:
    """Per stage, the peers of ``records`` (fresh records, per stage) counted as working: our own
    record's peer, peers seen first-hand, peers attested by trusted authors (module docstring), and
    ``remembered`` ones (attested a little while ago: ``WorkBook.keep``; they attest nobody). A peer
    counts once, in the stage of its newest record, whichever stage its work was for: a worker that
    moved is one (its replicas-to-be count it at once, so that two peers do not move into one dead
    stage). ``network`` groups records for the per-address cap of attested peers, in each stage."""
    newest = newest_per_peer(r for stage_records in records.values() for r in stage_records)
    working = {peer: newest[peer].stage for peer in first_hand if peer in newest}  # a worker that moved stays one
    if me in newest:
        working[me] = newest[me].stage
    frontier = set(working) | set(roots) | {me}  # the authors we take attestations from, hop by hop
    kept = sorted((newest[p] for p in (remembered or {}) if p not in working and p in newest), key=lambda r: r.peer_id)
    network = _per_stage(network)
    counted = [r for r, crowded in zip(kept, spread(kept, network)) if not crowded]  # attested ones that count
    for _ in range(MAX_TRUST_HOPS):
        known = set(working) | {r.peer_id for r in counted}
        found = {peer: newest[peer] for author in frontier if author in newest
                 for peer, _ in newest[author].worked if peer not in known and peer in newest}
        fresh = sorted(found.values(), key=lambda r: r.peer_id)
        crowded = spread([*counted, *fresh], network)[len(counted):]
        frontier = {r.peer_id for r, full in zip(fresh, crowded) if not full}
        counted += [r for r in fresh if r.peer_id in frontier]
        if not frontier:
            break
    result: dict[int, set[str]] = {}
    for peer, stage in [*working.items(), *((r.peer_id, r.stage) for r in counted)]:
        result.setdefault(stage, set()).add(peer)
    return result
