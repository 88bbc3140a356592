"""Our stage record in the DHT: announced every ANNOUNCE_PERIOD, sooner when the stage map has news,
and longer-lived after an announcement that a slow line cut (``discovery.announce_ttl``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import trio

from p2pswarm.dht import discovery
from p2pswarm.dht.discovery import ANNOUNCE_PERIOD, StageIndex
from p2pswarm.dht.records import StageRecord
from p2pswarm.dht.stagemap import StageMap

log = logging.getLogger(__name__)

ANNOUNCE_MIN_GAP = 1.0  # seconds between two announcements' starts when news comes sooner than the period


async def serve_announcements(index: StageIndex, signed_record: Callable[[float, float], tuple[StageRecord, bytes]],
                              stage_map: StageMap | None = None) -> None:
    """Announce our stage record every ANNOUNCE_PERIOD, start to start, well before its TTL runs out;
    and sooner (ANNOUNCE_MIN_GAP after the last start at the earliest) when ``stage_map`` has news: a peer
    started working in our book, which our record attests and its replicas are waiting to read.

    A slow announcement (lookups of up to LOOKUP_TIMEOUT each on a loaded machine) never stretches the
    period: it is cut at ANNOUNCE_PERIOD, and the next one starts on time with a fresh timestamp. Were the
    period measured from an announcement's end, two slow ones could leave the stores with no fresh record
    of a live peer (5 s + 6 s + 5 s + 6 s > RECORD_TTL) and the peer would drop out of every stage map
    (and after one that no store took, cut or not, the next record lives longer: ``announce_ttl``)."""
    level, ttl = logging.INFO, discovery.RECORD_TTL  # the first announcement is news (later: the debug log)
    while True:
        started = trio.current_time()
        next_at = started + ANNOUNCE_PERIOD
        if stage_map is not None:
            stage_map.news = trio.Event()  # what happens from now on is in a later announcement
        record, signed = signed_record(time.time(), ttl)
        if stage_map is not None:
            stage_map.own(record)  # we count ourselves, whether or not a store takes it
        accepted = 0
        with trio.move_on_after(ANNOUNCE_PERIOD) as scope:
            try:
                accepted = await index.announce(record, signed)
            except Exception:  # one failed round must not stop the node; the next one retries
                log.exception("announcing stage %d failed; retrying in %.0f s", record.stage, ANNOUNCE_PERIOD)
            else:
                log.log(level, "announced stage %d (layers [%d, %d)) of %s: %d store(s) accepted",
                        record.stage, record.start, record.end, record.model, accepted)
                level = logging.DEBUG
        ttl = discovery.announce_ttl(ttl, cut=not accepted)  # cut, failed, or no store took it: live longer
        if scope.cancelled_caught:
            log.warning("announcing stage %d took over %.0f s; again now, the record for %.0f s (a loaded machine or a "
                        "slow line: peers may miss us for a while)", record.stage,
                        ANNOUNCE_PERIOD, ttl)
        with trio.move_on_at(next_at):
            if stage_map is not None:
                await stage_map.news.wait()
                await trio.sleep_until(started + ANNOUNCE_MIN_GAP)
                continue
        await trio.sleep_until(next_at)
