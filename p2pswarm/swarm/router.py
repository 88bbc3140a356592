"""Where a micro-batch goes next: the pure routing core of one node (no I/O, no trio, no torch).

SWARM parallelism sends each micro-batch of a stage to whichever replica of that stage is alive and
least loaded, and when no ack comes in time it sends the same micro-batch to the next one. This
module holds that decision and nothing else, so that it can be tested exhaustively without a
network: the driver feeds it the stage map's answered peers (``offer``), ack latencies
(``observe_ack``), failures (``observe_failure``) and capacity updates (``observe_capacity``), and
asks ``choose`` (the K best, to keep warm) and ``next_after`` (failover, one peer at a time).

Rules: a peer not heard from for STALE_AFTER is stale and never routed to, nor is a draining one;
the score is the seed's Task 1.1 weighted sum of normalised latency EMA and queue depth (lower is
better, monotone in both); directly reachable peers come before relayed ones; a failing peer is
backed off exponentially (capped, jittered by the injected ``random.Random``) and not routed to
until the backoff expires. Each peer's ``pacing.Link`` gives the deadline of a frame of a given
size (measured throughput plus RFC 6298 slack) and its in-flight window (AIMD): ``next_after``
offers only a peer with room in its window, and ``has_room`` tells stage 0 whether to cut.

Affinity: each replica prefers one fixed replica of the next stage, its *partner* (``partner_for``:
the i-th of our stage's sorted peer ids takes the (i mod n)-th of the next stage's), so that with
equal replica counts the swarm forms disjoint chains and a replica never mixes activations of
upstream replicas that drifted apart between outer rounds. A live partner ranks first; while it is
live and untried ``next_after`` offers it alone (None while its window is full: wait, never spill),
and ``has_room`` is its window. Once it is tried, backed off, stale or draining, the other peers
are offered as without a partner: failover is unchanged.

Exploration: a micro-batch the driver marks ``explore`` (every EXPLORE_EVERY-th) is first offered to
a live non-partner with room, each in turn by peer id, and fails over to the partner as usual.
Disjoint chains would otherwise never see each other work, and seen work is what lets replicas of
one stage count each other (``dht.work``) and so meet in DiLoCo rounds, which admit no stranger.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from p2pswarm.dht.records import FLAG_DRAINING, FLAG_RELAYED, StageRecord
from p2pswarm.errors import LocalProtocolError, NoCandidates
from p2pswarm.swarm.pacing import Link

STALE_AFTER = 15.0  # seconds without news before a peer is stale (seed Task 1.2: 3 missed 5 s beats)
K_CANDIDATES = 3  # candidates per choice, kept warm by the driver (seed Task 1.1 K_CANDIDATES)
LATENCY_WEIGHT = 0.4  # seed Task 1.1 score weight of latency
QUEUE_WEIGHT = 0.6  # seed Task 1.1 score weight of queue depth: a long queue costs more than a slow link
LATENCY_SCALE = 0.5  # seconds; seed Task 1.1 normalises latency over 0..500 ms
QUEUE_SCALE = 100  # seed Task 1.1 normalises queue depth over 0..100
UNMEASURED_LATENCY = 0.1  # seconds assumed before the first ack: neither favoured nor shunned
RTT_ALPHA = 1 / 8  # gain of the ack-latency EMA of the score (RFC 6298's srtt gain)
BACKOFF_BASE = 1.0  # seconds of backoff after a first failure: long enough to skip a peer that just died
BACKOFF_CAP = 30.0  # seconds at most: twice STALE_AFTER, by then a dead peer is stale anyway
BACKOFF_JITTER = 0.5  # a backoff is drawn from [1 - this, 1] x its nominal length, so peers do not retry in step
MAX_LINKS = 256  # peers whose link measurements are kept, at most
EXPLORE_EVERY = 16  # one micro-batch in this many tries a non-partner first: 1/16 mixed, chains linked
FORGET_AFTER = 4 * STALE_AFTER  # seconds without news before a peer's statistics are dropped (bounded memory)


class Failure(Enum):
    """Why a send to a peer did not end in an ack."""

    TIMEOUT = "timeout"  # no ack within the ack timeout
    ERROR = "error"  # the stream or connection failed, or the peer sent garbage
    CIRCUIT = "circuit"  # the relayed path could not carry the frame (refused before a byte): not the peer's fault


@dataclass(frozen=True)
class Candidate:
    """A peer serving a stage, as the stage map (or a capacity heartbeat) reports it."""

    peer: str
    stage: int
    queue_depth: int  # >= 0, requests waiting at the peer
    flags: int = 0  # FLAG_* bitfield of p2pswarm.dht.records
    heard_at: float = 0.0  # when the peer last showed it was alive (record timestamp, ack, heartbeat)

    @property
    def relayed(self) -> bool:
        return bool(self.flags & FLAG_RELAYED)

    @classmethod
    def from_record(cls, record: StageRecord) -> Candidate:
        cap = record.capacity
        return cls(record.peer_id, record.stage, cap.queue_depth, cap.flags, record.timestamp)


@dataclass(frozen=True)
class RouterConfig:
    """The router's knobs; the defaults are the named constants above."""

    k: int = K_CANDIDATES
    stale_after: float = STALE_AFTER
    latency_weight: float = LATENCY_WEIGHT
    queue_weight: float = QUEUE_WEIGHT
    backoff_base: float = BACKOFF_BASE
    backoff_cap: float = BACKOFF_CAP

    def __post_init__(self) -> None:
        if self.k < 1 or self.backoff_base <= 0:
            raise LocalProtocolError(f"router config out of range: {self}")


@dataclass(frozen=True)
class PeerState:
    """What the router knows of one peer."""

    candidate: Candidate
    srtt: float | None = None  # smoothed ack latency (the latency EMA); None before the first ack
    failures: int = 0  # consecutive failures since the last ack
    backoff_until: float = float("-inf")  # not routed to before this time
    acks: int = 0  # frames it acked, a statistic for /api/swarm (which replicas a chain used)

    @property
    def latency(self) -> float:
        return UNMEASURED_LATENCY if self.srtt is None else self.srtt


def score(latency: float, queue_depth: int, config: RouterConfig = RouterConfig()) -> float:
    """Seed Task 1.1: weighted normalised latency and queue depth; lower is better."""
    latency_norm = min(1.0, max(0.0, latency) / LATENCY_SCALE)
    queue_norm = min(1.0, max(0, queue_depth) / QUEUE_SCALE)
    return config.latency_weight * latency_norm + config.queue_weight * queue_norm


def backoff_delay(failures: int, rng: random.Random, config: RouterConfig = RouterConfig()) -> float:
    """Exponential in the consecutive failures, capped, with jitter drawn from ``rng``."""
    nominal = min(config.backoff_cap, config.backoff_base * 2.0 ** min(max(failures, 1) - 1, 64))
    return nominal * rng.uniform(1.0 - BACKOFF_JITTER, 1.0)


def rank_key(state: PeerState, config: RouterConfig = RouterConfig()) -> tuple[bool, float, float, int, str]:
    """A live peer's place in ``Router.ranked`` (smallest first, before the partner is put first):
    direct before relayed, then by score; after the score, raw latency and queue keep the order
    beyond the score's saturation, and the peer id breaks ties."""
    c = state.candidate
    return (c.relayed, score(state.latency, c.queue_depth, config), state.latency, c.queue_depth, c.peer)


def partner_for(me: str, my_stage_peers: Iterable[str], next_stage_peers: Iterable[str]) -> str | None:
    """Our partner in the next stage: the (i mod n)-th of its n sorted peer ids, where i is our index
    among our own stage's sorted peer ids (``me`` counted whether listed or not); None when the next
    stage has no peer, or more peers than ours (a partner each would leave some idle: then every one
    of them is used, as without affinity). Every replica computing this from the same lists gives
    each next-stage peer a share within one of the others, with no coordination."""
    nexts = sorted(set(next_stage_peers))
    mine = sorted(set(my_stage_peers) | {me})
    if not nexts or len(nexts) > len(mine):
        return None
    return nexts[mine.index(me) % len(nexts)]


@dataclass
class Router:
    """The routing state of one node across all stages it sends to."""

    rng: random.Random
    config: RouterConfig = RouterConfig()
    peers: dict[str, PeerState] = field(default_factory=dict)
    failovers: int = 0  # failures observed, a statistic for /api/swarm
    frame_size: int = 0  # bytes of the last frame sent: the size /api/swarm shows deadlines for
    links: dict[str, Link] = field(default_factory=dict)  # every peer we send to, gradients' too (pacing)
    partners: dict[int, str] = field(default_factory=dict)  # stage -> the peer of it we prefer (affinity)
    explored: int = 0  # micro-batches offered to a non-partner first: the next one takes the next in turn

    def offer(self, candidates: Iterable[Candidate], now: float) -> None:
        """Merge the stage map's answered peers; the newest news of a peer wins."""
        for candidate in candidates:
            state = self.peers.get(candidate.peer)
            if state is None:
                self.peers[candidate.peer] = PeerState(candidate)
            elif candidate.heard_at >= state.candidate.heard_at:
                self.peers[candidate.peer] = replace(state, candidate=candidate)
        for peer in [p for p, s in self.peers.items() if now - s.candidate.heard_at >= FORGET_AFTER]:
            del self.peers[peer]
        while len(self.links) > MAX_LINKS:  # oldest first: a gradient's upstream peer gone for good
            self.links.pop(next(iter(self.links)))

    def observe_capacity(self, peer: str, queue_depth: int, now: float, flags: int | None = None) -> None:
        """A capacity update (heartbeat or ack) from a known peer: it is alive now."""
        state = self.peers.get(peer)
        if state is None:
            return
        old = state.candidate
        candidate = replace(old, queue_depth=queue_depth, heard_at=max(now, old.heard_at),
                            flags=old.flags if flags is None else flags)
        self.peers[peer] = replace(state, candidate=candidate)

    def observe_sent(self, peer: str, size: int) -> None:
        """A ``size``-byte frame to ``peer`` is on the way: it takes a place in the peer's window."""
        self._set_link(peer, self.link(peer).sent())
        self.frame_size = size

    def observe_ack(self, peer: str, latency: float, now: float, queue_depth: int | None = None,
                    size: int = 0) -> None:
        """An ack ``latency`` seconds after the first byte of a ``size``-byte frame: the latency EMA,
        the link's throughput and slack (and its window) learn from it; any backoff ends."""
        self._set_link(peer, self.link(peer).acked(size, latency, now))
        state = self.peers.get(peer)
        if state is None:
            return
        latency = max(0.0, latency)
        srtt = latency if state.srtt is None else state.srtt + RTT_ALPHA * (latency - state.srtt)
        self.peers[peer] = replace(state, srtt=srtt, failures=0, backoff_until=float("-inf"), acks=state.acks + 1)
        self.observe_capacity(peer, state.candidate.queue_depth if queue_depth is None else queue_depth, now)

    def observe_busy(self, peer: str, queue_depth: int, now: float) -> None:
        """A ``Busy``: alive but full. Not a failure; its window halves."""
        self._set_link(peer, self.link(peer).busy())
        self.observe_capacity(peer, queue_depth, now)

    def observe_failure(self, peer: str, now: float, kind: Failure = Failure.TIMEOUT) -> float:
        """No progress within the deadline, or an error: back the peer off and halve its window;
        returns the time the backoff ends."""
        self._set_link(peer, self.link(peer).timed_out(late=kind is Failure.TIMEOUT))
        state = self.peers.get(peer)
        if state is None:
            return now
        failures = state.failures + 1
        until = now + backoff_delay(failures, self.rng, self.config)
        self.peers[peer] = replace(state, failures=failures, backoff_until=until)
        self.failovers += 1
        return until

    def forget(self, peer: str) -> None:
        self.peers.pop(peer, None)

    def is_live(self, peer: str, now: float) -> bool:
        """Fresh, not draining and not backed off: a peer the router may send to."""
        state = self.peers.get(peer)
        if state is None:
            return False
        c = state.candidate
        return (now - c.heard_at < self.config.stale_after and not c.flags & FLAG_DRAINING
                and now >= state.backoff_until)

    def score_of(self, peer: str) -> float:
        state = self.peers[peer]
        return score(state.latency, state.candidate.queue_depth, self.config)

    def _set_link(self, peer: str, link: Link) -> None:
        self.links.pop(peer, None)  # re-inserted last: ``offer`` prunes the least recently used
        self.links[peer] = link

    def queue_depth(self, peer: str) -> int:
        state = self.peers.get(peer)
        return 0 if state is None else state.candidate.queue_depth

    def link(self, peer: str) -> Link:
        """What we measured of the path to ``peer`` (a fresh Link before the first frame)."""
        return self.links.get(peer) or Link()

    def deadline(self, peer: str, size: int) -> float:
        """Seconds an attempt of ``size`` bytes to ``peer`` may go without progress (``pacing``)."""
        return self.link(peer).deadline(size)

    def set_partner(self, stage: int, peer: str | None) -> None:
        """Prefer ``peer`` among the peers of ``stage`` (module docstring); None: no preference."""
        if peer is None:
            self.partners.pop(stage, None)
        else:
            self.partners[stage] = peer

    def live_partner(self, stage: int, now: float) -> str | None:
        """Our partner in ``stage`` if it is a live peer of that stage, else None."""
        peer = self.partners.get(stage)
        if peer is None:
            return None
        state = self.peers.get(peer)
        return peer if state is not None and state.candidate.stage == stage and self.is_live(peer, now) else None

    def has_room(self, stage: int, now: float) -> bool:
        """Whether the live partner of ``stage`` (without one: some live peer of it) has room in its
        window: stage 0 cuts only then, at its partner's pace."""
        partner = self.live_partner(stage, now)
        if partner is not None:
            return self.link(partner).has_room
        return any(self.link(p).has_room for p in self.ranked(stage, now))

    def ranked(self, stage: int, now: float) -> list[str]:
        """Every live peer of ``stage``, best first: the live partner, then direct before relayed, then
        by score."""
        live = [s for p, s in self.peers.items() if s.candidate.stage == stage and self.is_live(p, now)]
        order = [s.candidate.peer for s in sorted(live, key=lambda s: rank_key(s, self.config))]
        partner = self.live_partner(stage, now)
        return order if partner is None else [partner, *(p for p in order if p != partner)]

    def choose(self, stage: int, now: float) -> list[str]:
        """The K best live peers of ``stage``, best first (empty when there is none)."""
        return self.ranked(stage, now)[: self.config.k]

    def next_after(self, stage: int, tried: Collection[str], now: float, explore: bool = False) -> str | None:
        """The best live peer of ``stage`` not yet tried for this micro-batch with room in its window;
        None when every such peer's window is full (wait for an answer); NoCandidates when none is left.
        A live untried partner is the only one offered (None while its window is full), but a first try
        marked ``explore`` goes to a live non-partner with room, each in turn (module docstring)."""
        untried = [peer for peer in self.ranked(stage, now) if peer not in tried]
        if not untried:
            raise NoCandidates(f"no live peer of stage {stage} left to try ({len(tried)} tried)")
        if untried[0] == self.live_partner(stage, now):
            others = sorted(p for p in untried[1:] if self.link(p).has_room) if explore and not tried else []
            if others:
                self.explored += 1
                return others[(self.explored - 1) % len(others)]
            return untried[0] if self.link(untried[0]).has_room else None
        return next((peer for peer in untried if self.link(peer).has_room), None)

    def stats(self, now: float) -> dict[str, Any]:
        """Per-peer routing statistics for /api/swarm."""
        return {"failovers": self.failovers, "peers": {
            p: {"stage": s.candidate.stage, "live": self.is_live(p, now), "queue_depth": s.candidate.queue_depth,
                "latency_ms": None if s.srtt is None else round(s.srtt * 1000, 1), **self.link(p).doc(self.frame_size),
                "failures": s.failures, "acks": s.acks, "relayed": s.candidate.relayed}
            for p, s in sorted(self.peers.items())}}
