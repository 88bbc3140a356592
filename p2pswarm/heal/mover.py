"""The rebalancing driver: every MOVE_CHECK_S it feeds the stage map to the pure rule and moves when told.

``Mover.run`` reads the stage map, turns it into members per stage (each peer counted once, in its
newest record; our own stage as the node has it, not as our last announcement said), and asks
``heal.rebalance.Rebalancer``. On a ``Move`` it waits the rule's jitter, looks the two stages up
again (a loaded peer's lookup may miss a live stage's records) and moves only if the rule still
says so: it logs one line and awaits the node's ``move`` callback,
which rebuilds our stage's services for the new stage (``node._serve_stages``). ``doc()`` is the
``rebalance`` part of ``/api/stats``: moves done, the last one, the last decision.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

import trio

from p2pswarm.dht.ranking import Standing
from p2pswarm.dht.records import FLAG_PINNED, StageRecord, newest_per_peer
from p2pswarm.heal.rebalance import Move, Rebalancer

log = logging.getLogger(__name__)

MOVE_CHECK_S = 5.0  # seconds between checks: one announce period, so each check sees a fresh map
MAP_WAIT = 3.0  # seconds a check waits for a map rebuild before it uses the map it has


def _counted(stages: Mapping[int, Sequence[StageRecord]], working: Mapping[int, set[str]], mine: int | None,
             standing) -> dict[int, list[StageRecord]]:
    """The records a move is decided on. A stage nobody is seen working in is down, whatever records claim it
    (``dht.work``): fakes must not keep it served. Another stage with a worker counts its records as every
    peer's map shows them: the election needs the same counts on every peer, and which peers of a far stage
    one saw work differs from peer to peer. Our own stage counts only the peers we know (working, or that
    answered us): fakes claiming it must not make it look over-served and send us away again."""
    return {s: [] if not working.get(s) else
            [r for r in records if s != mine or standing(r.peer_id) is not Standing.STRANGER]
            for s, records in stages.items()}


def members_of(stages: Mapping[int, Sequence[StageRecord]], me: str,
               my_stage: int | None) -> tuple[dict[int, list[str]], set[str]]:
    """Per stage its peers, each in its newest record only (a peer that moved is fresh in two stages for a
    while), with us in ``my_stage``; and the peers that are not pinned."""
    newest = newest_per_peer(r for records in stages.values() for r in records)
    members: dict[int, list[str]] = {}
    movable = set()
    for peer, record in sorted(newest.items()):
        if peer == me:
            continue
        members.setdefault(record.stage, []).append(peer)
        if not record.capacity.flags & FLAG_PINNED:
            movable.add(peer)
    if my_stage is not None:
        members.setdefault(my_stage, []).append(me)
        movable.add(me)  # the mover runs only when we rebalance: we are not pinned
    return members, movable


class Mover:
    """Runs the rule for one node; ``move(to_stage)`` is the node's callback (returns once the new stage serves)."""

    def __init__(self, *, stage_map, me: str, core: Rebalancer, stage: Callable[[], int | None],
                 move: Callable[[int], Awaitable[None]], clock: Callable[[], float] = time.time) -> None:
        self._stage_map, self._core, self._stage, self._move = stage_map, core, stage, move
        self._clock = clock  # unix time; tests pass trio's virtual clock
        self.me = me
        self.moves: list[dict] = []  # the moves done, oldest first

    async def run(self) -> None:
        """Check every MOVE_CHECK_S; never returns."""
        while True:
            move = await self._check()
            if move is not None:
                await trio.sleep(self._core.delay())  # the jitter: another's move may show meanwhile
                await self._stage_map.refresh_stages([move.to_stage, move.from_stage])  # a lookup of their own:
                move = await self._check()  # a lookup that missed a busy stage's records must not move us
            if move is not None:
                await self._do(move)
            await trio.sleep(MOVE_CHECK_S)

    async def _check(self) -> Move | None:
        stages = await self._stage_map.current(wait=MAP_WAIT)
        stage = self._stage()
        stages = _counted(stages, self._stage_map.workers(), stage, self._stage_map.standings())
        members, movable = members_of(stages, self.me, stage)
        move = self._core.observe(members, movable, self._clock())
        return move if move is not None and move.from_stage == stage else None

    async def _do(self, move: Move) -> None:
        log.info("moving from stage %d to stage %d: %s", move.from_stage, move.to_stage, move.reason)
        began = self._clock()
        self._core.moved(move.from_stage, move.to_stage, began)
        await self._move(move.to_stage)
        seconds = self._clock() - began
        self.moves.append({"from": move.from_stage, "to": move.to_stage, "reason": move.reason, "at": began,
                           "seconds": round(seconds, 1)})
        log.info("serving stage %d, %.1f s after leaving stage %d", move.to_stage, seconds, move.from_stage)

    def doc(self) -> dict:
        return {"moves": len(self.moves), "last_move": self.moves[-1] if self.moves else None,
                "last_decision": self._core.last}
