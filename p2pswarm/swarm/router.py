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
until the backoff expires; the ack timeout adapts per peer like TCP's RTO (RFC 6298).
"""

from __future__ import annotations

import random
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field, replace
from enum import Enum

from p2pswarm.dht.records import FLAG_DRAINING, FLAG_RELAYED, StageRecord
from p2pswarm.errors import LocalProtocolError, NoCandidates

STALE_AFTER = 15.0  # seconds without news before a peer is stale (seed Task 1.2: 3 missed 5 s beats)
K_CANDIDATES = 3  # candidates per choice, kept warm by the driver (seed Task 1.1 K_CANDIDATES)
LATENCY_WEIGHT = 0.4  # seed Task 1.1 score weight of latency
QUEUE_WEIGHT = 0.6  # seed Task 1.1 score weight of queue depth: a long queue costs more than a slow link
LATENCY_SCALE = 0.5  # seconds; seed Task 1.1 normalises latency over 0..500 ms
QUEUE_SCALE = 100  # seed Task 1.1 normalises queue depth over 0..100
UNMEASURED_LATENCY = 0.1  # seconds assumed before the first ack: half the ceiling, neither favoured nor shunned
ACK_TIMEOUT_CEILING = 0.2  # seconds; the seed's fixed 200 ms ack timeout is the adaptive one's upper bound
ACK_TIMEOUT_FLOOR = 0.03  # seconds; below this a GC pause or a busy 2-core loop would fail over healthy peers
RTT_ALPHA = 1 / 8  # RFC 6298 gain of the smoothed round trip (also the latency EMA of the score)
RTT_BETA = 1 / 4  # RFC 6298 gain of the round-trip variation
RTT_K = 4  # RFC 6298: timeout = srtt + 4 * rttvar
BACKOFF_BASE = 1.0  # seconds of backoff after a first failure: long enough to skip a peer that just died
BACKOFF_CAP = 30.0  # seconds at most: twice STALE_AFTER, by then a dead peer is stale anyway
BACKOFF_JITTER = 0.5  # a backoff is drawn from [1 - this, 1] x its nominal length, so peers do not retry in step
FORGET_AFTER = 4 * STALE_AFTER  # seconds without news before a peer's statistics are dropped (bounded memory)


class Failure(Enum):
    """Why a send to a peer did not end in an ack."""

    TIMEOUT = "timeout"  # no ack within the ack timeout
    ERROR = "error"  # the stream or connection failed, or the peer sent garbage


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
    timeout_floor: float = ACK_TIMEOUT_FLOOR
    timeout_ceiling: float = ACK_TIMEOUT_CEILING
    backoff_base: float = BACKOFF_BASE
    backoff_cap: float = BACKOFF_CAP

    def __post_init__(self) -> None:
        if self.k < 1 or not 0 < self.timeout_floor <= self.timeout_ceiling or self.backoff_base <= 0:
            raise LocalProtocolError(f"router config out of range: {self}")


@dataclass(frozen=True)
class PeerState:
    """What the router knows of one peer."""

    candidate: Candidate
    srtt: float | None = None  # smoothed ack latency (the latency EMA); None before the first ack
    rttvar: float = 0.0  # smoothed variation of the ack latency
    failures: int = 0  # consecutive failures since the last ack
    backoff_until: float = float("-inf")  # not routed to before this time

    @property
    def latency(self) -> float:
        return UNMEASURED_LATENCY if self.srtt is None else self.srtt


def score(latency: float, queue_depth: int, config: RouterConfig = RouterConfig()) -> float:
    """Seed Task 1.1: weighted normalised latency and queue depth; lower is better."""
    latency_norm = min(1.0, max(0.0, latency) / LATENCY_SCALE)
    queue_norm = min(1.0, max(0, queue_depth) / QUEUE_SCALE)
    return config.latency_weight * latency_norm + config.queue_weight * queue_norm


def rto(srtt: float | None, rttvar: float, config: RouterConfig = RouterConfig()) -> float:
    """The ack timeout: srtt + 4 * rttvar within [floor, ceiling]; the ceiling before any sample."""
    if srtt is None:
        return config.timeout_ceiling
    return min(config.timeout_ceiling, max(config.timeout_floor, srtt + RTT_K * rttvar))


def backoff_delay(failures: int, rng: random.Random, config: RouterConfig = RouterConfig()) -> float:
    """Exponential in the consecutive failures, capped, with jitter drawn from ``rng``."""
    nominal = min(config.backoff_cap, config.backoff_base * 2.0 ** min(max(failures, 1) - 1, 64))
    return nominal * rng.uniform(1.0 - BACKOFF_JITTER, 1.0)


@dataclass
class Router:
    """The routing state of one node across all stages it sends to."""

    rng: random.Random
    config: RouterConfig = RouterConfig()
    peers: dict[str, PeerState] = field(default_factory=dict)
    failovers: int = 0  # failures observed, a statistic for /api/swarm

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

    def observe_capacity(self, peer: str, queue_depth: int, now: float, flags: int | None = None) -> None:
        """A capacity update (heartbeat or ack) from a known peer: it is alive now."""
        state = self.peers.get(peer)
        if state is None:
            return
        old = state.candidate
        candidate = replace(old, queue_depth=queue_depth, heard_at=max(now, old.heard_at),
                            flags=old.flags if flags is None else flags)
        self.peers[peer] = replace(state, candidate=candidate)

    def observe_ack(self, peer: str, latency: float, now: float, queue_depth: int | None = None) -> None:
        """An ack after ``latency`` seconds: update srtt/rttvar (RFC 6298), end any backoff."""
        state = self.peers.get(peer)
        if state is None:
            return
        latency = max(0.0, latency)
        if state.srtt is None:
            srtt, rttvar = latency, latency / 2
        else:
            rttvar = (1 - RTT_BETA) * state.rttvar + RTT_BETA * abs(state.srtt - latency)
            srtt = (1 - RTT_ALPHA) * state.srtt + RTT_ALPHA * latency
        self.peers[peer] = replace(state, srtt=srtt, rttvar=rttvar, failures=0, backoff_until=float("-inf"))
        self.observe_capacity(peer, state.candidate.queue_depth if queue_depth is None else queue_depth, now)

    def observe_failure(self, peer: str, now: float, kind: Failure = Failure.TIMEOUT) -> float:
        """A timeout or error: back the peer off; returns the time the backoff ends."""
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

    def ack_timeout(self, peer: str) -> float:
        """How long to wait for this peer's ack before failing over."""
        state = self.peers.get(peer)
        return self.config.timeout_ceiling if state is None else rto(state.srtt, state.rttvar, self.config)

    def ranked(self, stage: int, now: float) -> list[str]:
        """Every live peer of ``stage``, best first: direct before relayed, then by score."""
        live = [s for p, s in self.peers.items() if s.candidate.stage == stage and self.is_live(p, now)]
        return [s.candidate.peer for s in sorted(live, key=self._rank)]

    def choose(self, stage: int, now: float) -> list[str]:
        """The K best live peers of ``stage``, best first (empty when there is none)."""
        return self.ranked(stage, now)[: self.config.k]

    def next_after(self, stage: int, tried: Collection[str], now: float) -> str:
        """The best live peer of ``stage`` not yet tried for this micro-batch; NoCandidates when none."""
        for peer in self.ranked(stage, now):
            if peer not in tried:
                return peer
        raise NoCandidates(f"no live peer of stage {stage} left to try ({len(tried)} tried)")

    def stats(self, now: float) -> dict:
        """Per-peer routing statistics for /api/swarm."""
        return {"failovers": self.failovers, "peers": {
            p: {"stage": s.candidate.stage, "live": self.is_live(p, now), "queue_depth": s.candidate.queue_depth,
                "latency_ms": None if s.srtt is None else s.srtt * 1000, "timeout_ms": self.ack_timeout(p) * 1000,
                "failures": s.failures, "relayed": s.candidate.relayed} for p, s in sorted(self.peers.items())}}

    def _rank(self, state: PeerState) -> tuple:
        c = state.candidate
        # after the score, raw latency and queue keep the order beyond the score's saturation
        return (c.relayed, score(state.latency, c.queue_depth, self.config), state.latency, c.queue_depth, c.peer)
