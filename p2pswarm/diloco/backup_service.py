"""Stage backups, the driver: hold other stages' agreed backups, serve them, and hand the freshest
verified one to a peer that moves into a stage with no replica left.

Every BACKUP_CHECK_S the service reads the stage map, records the (round, digest) that each
stage's replicas announce (``AgreedLedger``), computes its duties (``backup_duties``: the stages
whose backup it holds, never its own), and for each duty whose announced round is
``every_rounds`` past the held one fetches that digest from a replica announcing it
(``snapshots.fetch_snapshot(digest=...)``: the bytes must hash to it; paced to BACKUP_SHARE of the
line's time and resumed where a cut try stopped, ``fetch_pace.py``; not again before ``refresh_due``),
decodes it, checks it
(``check_backup``: that stage, that round, vectors of the stage's size) and, if it fits the
budget, stores it (``directory``, atomically; memory only without one) and announces it
(``claims``, put in our record by the node). It keeps the newest copy of each stage (and, in
memory, serves the one it replaced until the next refresh, so a fetch in progress completes), and
keeps a stage's copy while the stage has no other replica even if the duty moved.

``register`` installs ONE ``/p2pswarm/snapshot/1.0.0`` handler for the node: a request for our
own stage goes to the attached ``SnapshotServer`` (DiLoCo's: hot snapshots and our agreed
backups), one for another stage is answered from the held backups, by digest only.
``fetch_freshest`` is what a mover calls: held copies in ``choose_backups`` order (our own copy
included; last if the ledger does not know it: we checked it when we took it), each fetched,
checked and decoded; the first that passes. ``doc`` is ``GET /api/backups``.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import trio

from p2pswarm import wire
from p2pswarm.dht.records import MAX_BACKUP_CLAIMS, BackupClaim
from p2pswarm.diloco import snapshots
from p2pswarm.diloco.backups import (
    BACKUP_COPIES,
    BACKUP_EVERY_ROUNDS,
    BACKUP_LINE_SHARE,
    BACKUP_SHARE,
    AgreedLedger,
    BackupBudget,
    backup_duties,
    backup_max_bytes,
    choose_backups,
    decode_backup,
    refresh_due,
)
from p2pswarm.errors import DialError, ProtocolError, RemoteProtocolError
from p2pswarm.files import write_atomic

log = logging.getLogger(__name__)

BACKUP_CHECK_S = 5.0  # the stage map's re-announce period: a new agreed round is seen within one
STAGE_MAP_WAIT = 5.0  # how long a check waits for a stage map rebuild before using the map as it is
RECENT_REFUSALS = 20  # refusals listed in /api/backups (the counts cover them all)
FILE_PATTERN = re.compile(r"stage(\d+)-round(\d+)\.backup")  # a held backup on disk


def _spread(me: str, peer: str) -> bytes:
    """The order in which ``me`` asks replicas: its own, so that the holders of a stage share the serving."""
    return hashlib.sha256(me.encode() + b"|" + peer.encode()).digest()


def backup_path(directory: Path, stage: int, round_: int) -> Path:
    """The file of our held backup of ``stage`` at outer round ``round_``."""
    return directory / f"stage{stage}-round{round_}.backup"


@dataclass(frozen=True)
class Held:
    """A backup we hold for another stage."""

    stage: int
    snapshot: snapshots.Snapshot  # round = the backup's outer round, digest computed
    fetched_at: float  # unix seconds
    source: str  # the peer it came from ("disk": read back at start)

    @property
    def claim(self) -> BackupClaim:
        return BackupClaim(self.stage, self.snapshot.round, self.snapshot.digest)


class BackupService:
    """Holds, checks, serves and hands out stage backups (module docstring)."""

    def __init__(self, *, pool, stage_map, model, run, me: str, directory: Path | None, budget_bytes: int,
                 copies: int = BACKUP_COPIES, every_rounds: int = BACKUP_EVERY_ROUNDS,
                 line_share: float = BACKUP_LINE_SHARE) -> None:
        self._pool, self._stage_map, self.model, self.run_spec, self.me = pool, stage_map, model, run, me
        self.directory = Path(directory) if directory is not None else None
        self.budget, self.copies, self.every_rounds = BackupBudget(budget_bytes), copies, every_rounds
        self.line_share = line_share  # of all the time a stage's refreshes may take (refresh_due)
        self.stage: int | None = None  # our own stage (the node sets it): never held as a backup
        self.ledger = AgreedLedger()
        self.duties: frozenset[int] = frozenset()
        self._held: dict[int, Held] = {}
        self._previous: dict[int, snapshots.Snapshot] = {}  # the copy each refresh replaced: served (memory only)
        #                                                   until the next, so a fetch in progress completes
        self._server: snapshots.SnapshotServer | None = None
        self._over_budget_logged: set[int] = set()
        self.partials = snapshots.PartialFetches()  # refreshes cut short: the next try at that digest resumes
        self._last_fetch: dict[int, tuple[float, float]] = {}  # stage -> (end, seconds) of its last refresh's fetch
        self.bytes_fetched = self.bytes_served = 0
        self.taken = 0  # backups taken (refreshes completed): /api/backups "taken"
        self.refused: Counter = Counter()  # why, counted
        self.recent_refusals: collections.deque = collections.deque(maxlen=RECENT_REFUSALS)

    # --- serving ---------------------------------------------------------------------------------

    def register(self) -> None:
        self._pool.serve(snapshots.PROTOCOL_ID, self.on_frame)

    def attach_server(self, server: snapshots.SnapshotServer | None) -> None:
        self._server = server

    def held_snapshot(self, stage: int, digest: bytes) -> snapshots.Snapshot | None:
        """The held copy of ``stage`` (or the one its last refresh replaced) whose digest is ``digest``."""
        if stage == self.stage:
            return None
        kept = [self._held[stage].snapshot] if stage in self._held else []
        kept += [self._previous[stage]] if stage in self._previous else []
        return next((snapshot for snapshot in kept if snapshot.digest == digest), None)

    async def on_frame(self, peer: str, message, payload: bytes):
        server = self._server
        if server is not None and isinstance(message, snapshots.Get) and message.stage == server.stage:
            return await server.on_frame(peer, message, payload)
        if not isinstance(message, snapshots.Get):
            raise RemoteProtocolError(f"{message.TYPE} is not a snapshot request")
        if message.run != self.run_spec.run_bytes:
            return wire.ErrorReply("other-run", f"this peer trains run {self.run_spec.run_bytes.hex()}")
        held = self.held_snapshot(message.stage, message.digest) if message.model == self.model.name else None
        if held is None:
            return wire.ErrorReply("wrong-stage", f"no backup of stage {message.stage} with that digest here")
        reply = snapshots.part_reply(self.model.name, message, held)
        if not isinstance(reply, wire.ErrorReply):
            self.bytes_served += len(reply[1])
        return reply

    def claims(self) -> tuple[BackupClaim, ...]:
        """What our record announces: the held backups (duties first, then the freshest)."""
        held = sorted((h for s, h in self._held.items() if s != self.stage),
                      key=lambda h: (h.stage not in self.duties, -h.snapshot.round, h.stage))
        return tuple(h.claim for h in held[:MAX_BACKUP_CLAIMS])

    # --- the loop --------------------------------------------------------------------------------

    async def run(self) -> None:
        if self.directory is not None:
            await trio.to_thread.run_sync(self._read_directory)
        while True:
            await self.check_once()
            await trio.sleep(BACKUP_CHECK_S)

    async def check_once(self) -> None:
        """Observe the stage map, recompute duties, refresh the backups that are due."""
        stages = await self._stage_map.current(wait=STAGE_MAP_WAIT)
        self._observe(stages)
        members = {stage: [r.peer_id for r in stages.get(stage, [])] for stage in range(self.model.n_stages)}
        self.duties = backup_duties(self.me, members, self.copies) - {self.stage}
        for stage in sorted(self.duties):
            await self._refresh(stage, stages.get(stage, []))
        for stage in [s for s in self._held if s not in self.duties and set(members.get(s, ())) - {self.me}]:
            self._drop(stage)  # others hold it now; a copy of a stage with no other replica is kept whatever
            #                    (a mover that just took it may still be loading from it)

    async def _refresh(self, stage: int, records) -> None:
        newest = self.ledger.newest(stage)
        held = self._held.get(stage)
        outvoted = held is not None and newest is not None and newest[0] == held.snapshot.round \
            and newest[1] != held.snapshot.digest  # we took a digest the stage's replicas outvoted: replace it
        if newest is None or (held is not None and newest[0] < held.snapshot.round + self.every_rounds
                              and not outvoted):
            return
        if not refresh_due(trio.current_time(), self._last_fetch.get(stage), self.line_share):
            return  # the last fetch of it took long: the line is left to training for a while (refresh_due)
        round_, digest = newest
        announcing = [r.peer_id for r in records if r.agreed == newest and r.peer_id != self.me]
        for peer in sorted(announcing, key=lambda peer: _spread(self.me, peer)):  # holders ask different replicas
            began = trio.current_time()
            try:
                data, _ = await self._fetch_checked(peer, stage, round_, digest, share=BACKUP_SHARE)
            except (DialError, ProtocolError) as exc:
                self._refuse(peer, stage, exc)
                continue
            finally:
                self._last_fetch[stage] = (trio.current_time(), trio.current_time() - began)
            await self._hold(stage, data, round_, peer)
            return

    async def _fetch_checked(self, peer: str, stage: int, round_: int, digest: bytes,
                             share: float = 1.0) -> tuple[bytes, dict]:
        """The bytes of ``stage``'s backup ``digest`` from ``peer`` and its decoded state, checked; ``share``:
        of the line's time the fetch may take (a refresh: BACKUP_SHARE; a mover's load: all of it)."""
        max_bytes = backup_max_bytes(self.model, stage)
        fetched = await snapshots.fetch_snapshot(self._pool, peer, self.model.name, stage,
                                                 run=self.run_spec.run_bytes, max_bytes=max_bytes, digest=digest,
                                                 partials=self.partials, share=share)
        self.bytes_fetched += len(fetched.data) - fetched.resumed_at
        data = bytes(fetched.data)
        state = await trio.to_thread.run_sync(self._decode_checked, data, stage, round_)
        return data, state

    def _decode_checked(self, data: bytes, stage: int, round_: int) -> dict:
        """Worker thread: decode a backup (total: RemoteProtocolError) and check it is what it claims."""
        return decode_backup(data, self.model, stage, self.run_spec.identity, round_)

    async def _hold(self, stage: int, data: bytes, round_: int, source: str) -> None:
        sizes = {s: len(h.snapshot.data) for s, h in self._held.items()}
        if not self.budget.fits(sizes, stage, len(data)):
            self.refused["over_budget"] += 1
            if stage not in self._over_budget_logged:
                self._over_budget_logged.add(stage)
                log.warning("the backup of stage %d (%.1f MB) does not fit the backup budget (%.1f MB): not held "
                            "(raise --backup-budget-mb to hold it)",
                            stage, len(data) / 1e6, self.budget.limit_bytes / 1e6)
            return
        snapshot = snapshots.Snapshot(data, round_, 0, trio.current_time())
        await trio.to_thread.run_sync(lambda: snapshot.digest)  # hashed once, off the loop
        old = self._held.get(stage)
        if self.directory is not None:
            try:
                await trio.to_thread.run_sync(self._write, stage, snapshot, old)
            except OSError as exc:  # a full or read-only disk: not held (we could not keep it across a restart)
                self.refused["disk"] += 1
                log.warning("could not store the backup of stage %d in %s: %s (check the free space and permissions "
                            "of --data-dir)", stage, self.directory, exc)
                return
        self._held[stage] = Held(stage, snapshot, time.time(), source)
        self.taken += 1
        if old is not None:
            self._previous[stage] = old.snapshot
        log.debug("holding the backup of stage %d: outer round %d from %s (%.1f MB)", stage, round_, source,
                 len(data) / 1e6)

    def _drop(self, stage: int) -> None:
        held = self._held.pop(stage)
        self._previous.pop(stage, None)
        if self.directory is not None:
            backup_path(self.directory, stage, held.snapshot.round).unlink(missing_ok=True)

    def _observe(self, stages) -> None:
        """The agreed digests of the working replicas' records (``StageMap.workers``): a peer that only
        claims a stage cannot make its digest trusted."""
        working = {peer for peers in self._stage_map.workers().values() for peer in peers}
        self.ledger.observe([r for records in stages.values() for r in records if r.peer_id in working], time.time())

    def _refuse(self, peer: str, stage: int, exc: Exception) -> None:
        why = "unreachable" if isinstance(exc, DialError) else "refused"
        self.refused[why] += 1
        self.recent_refusals.append({"peer": peer, "stage": stage, "why": why, "detail": str(exc)[:200],
                                     "at": round(time.time(), 1)})
        (log.debug if why == "unreachable" else log.warning)("backup of stage %d from %s %s: %s", stage, peer, why, exc)

    # --- disk --------------------------------------------------------------------------------------

    def _write(self, stage: int, snapshot: snapshots.Snapshot, old: Held | None) -> None:
        """Atomically (the bytes are small next to a stage's snapshot; the old copy removed after)."""
        assert self.directory is not None  # called only when backups are kept on disk
        self.directory.mkdir(parents=True, exist_ok=True)
        write_atomic(backup_path(self.directory, stage, snapshot.round), snapshot.data)
        if old is not None and old.snapshot.round != snapshot.round:
            backup_path(self.directory, stage, old.snapshot.round).unlink(missing_ok=True)

    def _read_directory(self) -> None:
        """Worker thread, at start: the newest backup of each stage in ``directory`` that still checks."""
        assert self.directory is not None  # called only when backups are kept on disk
        if not self.directory.is_dir():
            return
        found = sorted((int(m[1]), int(m[2]), p) for p in self.directory.iterdir()
                       if (m := FILE_PATTERN.fullmatch(p.name)))
        for stage, round_, path in found:  # ascending rounds: the newest of a stage is kept last
            try:
                data = path.read_bytes()
                self._decode_checked(data, stage, round_)
            except (OSError, ProtocolError) as exc:
                log.warning("backup %s is unusable: %s (left out; a fresh copy is fetched from a replica)", path, exc)
                continue
            snapshot = snapshots.Snapshot(data, round_, 0, 0.0)
            snapshot.digest  # noqa: B018 (hashed here, in the worker thread)
            self._held[stage] = Held(stage, snapshot, path.stat().st_mtime, "disk")

    # --- a mover's load ------------------------------------------------------------------------------

    async def fetch_freshest(self, stage: int, newer_than: int = -1) -> tuple[dict, dict] | None:
        """The freshest verified backup of ``stage`` past outer round ``newer_than`` and {"holder", "round",
        "bytes", "seconds"}; None if none."""
        stages = await self._stage_map.current(wait=STAGE_MAP_WAIT)
        self._observe(stages)
        claims = [(r.peer_id, c) for records in stages.values() for r in records for c in r.backups
                  if c.stage == stage and r.peer_id != self.me]
        own = [(self.me, self._held[stage].claim)] if stage in self._held else []
        chosen = choose_backups(stage, claims + own, self.ledger)
        chosen += [mine for mine in own if mine not in chosen]  # ours was checked when we took it: a last resort
        for holder, claim in (c for c in chosen if c[1].round > newer_than):
            started = trio.current_time()
            try:
                if holder == self.me:
                    data = self._held[stage].snapshot.data
                    state = await trio.to_thread.run_sync(self._decode_checked, data, stage, claim.round)
                else:
                    data, state = await self._fetch_checked(holder, stage, claim.round, claim.digest)
            except (DialError, ProtocolError) as exc:
                self._refuse(holder, stage, exc)
                continue
            return state, {"holder": holder, "round": claim.round, "bytes": len(data),
                           "seconds": trio.current_time() - started}
        return None

    # --- status --------------------------------------------------------------------------------------

    def doc(self) -> dict:
        now = time.time()
        held = [{"stage": h.stage, "round": h.snapshot.round, "digest": h.snapshot.digest.hex(),
                 "bytes": len(h.snapshot.data), "fetched_at": round(h.fetched_at, 1),
                 "age_s": round(now - h.fetched_at, 1), "from": h.source} for h in sorted(
                     self._held.values(), key=lambda h: h.stage)]
        return {"stage": self.stage, "held": held, "duties": sorted(self.duties),
                "budget_bytes": self.budget.limit_bytes, "held_bytes": sum(h["bytes"] for h in held),
                "bytes_fetched": self.bytes_fetched, "bytes_served": self.bytes_served, "taken": self.taken,
                "refused": dict(self.refused), "recent_refusals": list(self.recent_refusals),
                "claims": [{"stage": c.stage, "round": c.round} for c in self.claims()]}

    def routes(self) -> dict:
        async def doc_json(params: dict) -> dict:
            return self.doc()

        return {"/api/backups": doc_json}
