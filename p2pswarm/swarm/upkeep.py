"""A training peer's upkeep, every ``UPKEEP_PERIOD``: the next stage's candidates, links and health.

- candidates of the next stage from the stage map into the router, our partner among them
  (``router.partner_for``: fixed chains of replicas; none when affinity is off), streams to the
  best of them kept warm;
- micro-batches whose path died given up: a peer we sent one to is no longer connected, or its
  gradient is overdue (``StageCore.expire``; the peer is backed off);
- idle inference sessions expired, slow relayed links flagged, the token rate sampled, bans pruned;
- stage 0 also reads every stage's health from the stage map and, while a stage is down
  (``dht.health.BlockWatch``), cuts no micro-batches and says why, once, in its log and in
  ``/api/swarm`` ``blocked``;
- evaluations held for our outer round go back into the buffer once it is reached.
"""

from __future__ import annotations

import collections
import logging
import math
import time

import trio

from p2pswarm.dht.health import BLOCK_CHECK_S
from p2pswarm.swarm.activation import PROTOCOL_ID
from p2pswarm.swarm.router import Candidate, partner_for

log = logging.getLogger(__name__)

UPKEEP_PERIOD = 0.5  # seconds between candidate refreshes, stream warming and in-flight checks
WARM_STREAMS = 2  # idle streams kept open to each of the router's best candidates
RATE_WINDOW = 20.0  # seconds over which throughput (tokens/s) is measured
SLOW_LINK_FACTOR = 4.0  # a link whose transfer of a micro-batch takes this many compute times bounds training
WARM_TIMEOUT = 10.0  # seconds to open a candidate's warm streams before leaving it to the sender


class Upkeep:
    """The periodic upkeep of ``service`` (module docstring)."""

    def __init__(self, service, *, affinity: bool) -> None:
        self.service, self.affinity = service, affinity  # affinity: prefer one partner of the next stage
        self.slow: dict[str, str] = {}  # next-stage peer -> why its link bounds training
        self._slow_logged: set[str] = set()  # peers whose slowness was logged already
        self._rate: collections.deque = collections.deque()
        self._blocks_checked = -math.inf

    async def run(self) -> None:
        warming: set[str]
        svc, warming = self.service, set()
        async with trio.open_nursery() as nursery:
            while True:
                if not svc.is_last:
                    self._refresh_candidates(nursery, warming)
                connected = {str(p) for p in svc._host.get_connected_peers()}
                svc.apply(svc.core.disconnected(connected))
                svc.apply(svc.core.expire(trio.current_time()))
                if svc.inference is not None:
                    svc.inference.expire(trio.current_time())  # idle sessions' KV caches freed
                self.note_slow_links()
                self._sample_rate()
                svc.bans.prune(trio.current_time())
                if svc.is_first:
                    await self.check_blocked()
                await trio.sleep(UPKEEP_PERIOD)

    async def release_held(self) -> None:
        """Back into the buffer: held evaluations whose round we reached, or that waited long enough."""
        svc = self.service
        while True:
            await trio.sleep(UPKEEP_PERIOD)
            svc.apply(svc.core.release_held(svc.engine.agreed_round, trio.current_time()))

    def _refresh_candidates(self, nursery: trio.Nursery, warming: set[str]) -> None:
        svc, now = self.service, time.time()
        candidates = svc._stage_map.candidates(svc.stage + 1)
        svc.router.offer([Candidate.from_record(r) for r in candidates], now)
        self.choose_partner()
        for peer in svc.router.choose(svc.stage + 1, now):
            if peer not in warming:
                warming.add(peer)
                nursery.start_soon(self._warm, peer, warming)

    async def _warm(self, peer: str, warming: set[str]) -> None:
        try:
            with trio.move_on_after(WARM_TIMEOUT):
                await self.service._pool.warm(peer, PROTOCOL_ID, WARM_STREAMS)
        except Exception as exc:  # a candidate we cannot reach: the sender will find out and back it off
            log.debug("could not warm streams to %s: %r", peer, exc)
        finally:
            warming.discard(peer)

    async def check_blocked(self) -> None:
        """Stage 0, every BLOCK_CHECK_S: is a stage down? Logged once when that starts and once when it ends.
        ``current(wait=0)`` starts a stale map's rebuild in the background (every stage's records fresh)."""
        svc, now = self.service, time.time()
        if now - self._blocks_checked < BLOCK_CHECK_S:
            return
        self._blocks_checked = now
        await svc._stage_map.current(wait=0)
        line = svc.blocks.observe(svc._stage_map.counts(claimed=True), now)
        if line is not None:
            hint = " (a peer with --rebalance moves in; or start one: p2pswarm join --layers auto)"
            log.log(logging.WARNING if svc.blocks.down else logging.INFO, line + (hint if svc.blocks.down else ""))

    def choose_partner(self) -> None:
        """Our partner in the next stage (affinity, ``router.partner_for``); none when affinity is off.
        Both lists are the stage map's fresh records, which every replica reads alike, not the peers
        that answered *us* (on a loaded machine those flicker per observer, and two replicas that
        miss each other pick the same partner); the router still sends only to a live partner."""
        svc = self.service
        if not self.affinity:
            return svc.router.set_partner(svc.stage + 1, None)
        mine, nexts = ([r.peer_id for r in svc._stage_map.pool(s)] for s in (svc.stage, svc.stage + 1))
        svc.router.set_partner(svc.stage + 1, partner_for(svc.me, mine, nexts))

    def note_slow_links(self) -> None:
        """Flag (and log, once per peer) a next-stage peer reachable only through a relay whose best
        measured rate, not compute, would bound training: a micro-batch's transfer at the fastest
        rate seen takes over SLOW_LINK_FACTOR x our compute time."""
        router, compute_s = self.service.router, self.service.core.compute_s
        size = router.frame_size
        for peer, state in list(router.peers.items()):
            fastest = router.link(peer).fastest
            transfer = size / fastest if fastest else 0.0
            if not (state.candidate.relayed and transfer > SLOW_LINK_FACTOR * compute_s):
                self.slow.pop(peer, None)
                continue
            why = (f"its only path is a relay at {fastest * 8 / 1e6:.1f} Mbit/s at best: a {size / 1024:.0f} KiB "
                   f"micro-batch takes {transfer:.2f} s, {transfer / compute_s:.0f}x our compute time")
            if peer not in self._slow_logged:
                self._slow_logged.add(peer)
                log.warning("peer %s of stage %d is too slow for its stage: %s (we send it no work while another can "
                            "take it)", peer, state.candidate.stage, why)
            self.slow[peer] = why

    def _sample_rate(self) -> None:
        now = trio.current_time()
        self._rate.append((now, self.service.engine.tokens))
        while len(self._rate) > 2 and now - self._rate[0][0] > RATE_WINDOW:
            self._rate.popleft()

    def throughput(self) -> float:
        """Tokens/s whose gradients reached our weights, over the last RATE_WINDOW."""
        if len(self._rate) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self._rate[0], self._rate[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0
