"""Where a DiLoCo replica's state comes from and goes to: loads, catch-up, snapshots, agreed backups.

``StageLoader`` is the I/O half of ``service.DilocoService`` that is not an outer round:

- **before training** (``load_at_start``) it loads the current state of its stage from a
  neighbour replica over ``/p2pswarm/snapshot/1.0.0`` (``snapshots.py``), else the freshest
  verified agreed backup that peers of other stages hold (``backups.fetch_freshest``,
  ``backup_service``), else its own newest snapshot on disk, else it keeps the initial weights
  (the first replica of a stage); the order is ``policy.load_sources``;
- **a peer that fell behind** (left out of a round, or meeting a replica at a later round) loads
  that replica's snapshot (``catch_up``), rebased on its own progress when it missed one round;
  it takes the outer state of the replica's newest agreed backup instead when that is of a later
  round (``rejoin``: a third of the bytes, kept while in use, resumable), several rounds on too;
- **every** ``snapshot_period`` it writes its state atomically to ``--data-dir`` (last 5 kept:
  ``checkpoint.SnapshotStore``), and it makes the hot snapshots its ``SnapshotServer`` serves;
- **after every outer round and every load** it encodes the stage's *agreed backup* (start,
  momentum, round: ``backups``), served by digest and announced in our record (``agreed_claim``).

The loader reads and writes its driver only through ``Replica`` (the engine's service, the outer
optimizer, the residual and its lock). The engine's tensors are touched only through
``SwarmService.with_engine``, and the error-feedback residual only under ``Replica.state_lock``
(a snapshot holds it while it copies).
A snapshot is made of host copies (``StageEngine.host_state_dict``) and encoded in a worker
thread; a loaded one is moved to the engine's device by ``StageEngine.load_state_dict``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections import Counter
from typing import Any, Protocol

import torch
import trio

from p2pswarm.diloco import backups as backup_core
from p2pswarm.diloco import checkpoint, snapshots
from p2pswarm.diloco.outer import OuterConfig, OuterOptimizer, shift_flat
from p2pswarm.diloco.policy import Source, diverged_from, load_sources, neighbours_by_round
from p2pswarm.errors import DialError, ProtocolError, RemoteProtocolError
from p2pswarm.run import plan
from p2pswarm.run.diloco import DilocoSettings

log = logging.getLogger(__name__)

CATCH_UP_WAIT = 30.0  # how long a peer that starts looks for a replica to load from
STATE_FORMAT = 1  # the layout of a snapshot's state tree


class Replica(Protocol):
    """What the loader shares with its round driver (``service.DilocoService``): the engine's service
    (``with_engine``), the outer optimizer, the error-feedback residual (what compression left out,
    carried on), and the lock under which the residual is written (by a round's assembly, or a load)
    and read (by a snapshot)."""

    swarm: Any  # the SwarmService, from ``prepare``
    outer: OuterOptimizer | None
    residual: torch.Tensor | None
    state_lock: trio.Lock


def outer_config(settings: DilocoSettings) -> OuterConfig:
    """Our outer optimizer's flags, from our settings (never a neighbour's)."""
    return OuterConfig(inner_steps=settings.inner_steps, lr=settings.outer_lr, momentum=settings.momentum,
                       nesterov=settings.momentum > 0, fragments=settings.fragments)


class StageLoader:
    """Loads, snapshots and agreed backups of one stage (module docstring)."""

    def __init__(self, replica: Replica, *, settings: DilocoSettings, spec, stage: int, me: str, run_id: bytes,
                 pool, stage_map, store: checkpoint.SnapshotStore | None, backups, counts: Counter) -> None:
        self.replica, self.settings, self.spec, self.stage, self.me = replica, settings, spec, stage, me
        self.run_id, self._pool, self._stage_map, self.store = run_id, pool, stage_map, store
        self._backups = backups  # backup_service.BackupService, or None: no backups to load from
        self.counts = counts  # the driver's: "catch_ups", "backup_loads", "snapshots"
        self.server = snapshots.SnapshotServer(spec.name, stage, self.make_snapshot, run=run_id)
        self.last_snapshot: dict | None = None
        self.agreed_backup: snapshots.Snapshot | None = None  # our stage's agreed backup (backups.py)
        self.partials = snapshots.PartialFetches()  # loads cut short: a later one of that version resumes

    @property
    def _outer(self) -> OuterOptimizer:
        """The replica's outer optimizer: its ``prepare`` makes it before anything here runs."""
        assert self.replica.outer is not None
        return self.replica.outer

    # --- loading -------------------------------------------------------------------------------------

    async def load_at_start(self) -> dict | None:
        """Before training: our stage's current state from the first source that has it
        (``policy.load_sources``); where it came from (None: our initial weights are kept)."""
        with trio.move_on_after(CATCH_UP_WAIT):
            await self._stage_map.refresh_stages([self.stage])
        records = self._stage_map.stages.get(self.stage, [])
        neighbours = neighbours_by_round(records, self.me, self._stage_map.workers().get(self.stage, ()))
        fresh = all(r.capacity.outer_round == 0 for r in records if r.peer_id != self.me)
        for source in load_sources(neighbours=bool(neighbours), backups=self._backups is not None,
                                   disk=self.store is not None, fresh=fresh):
            if source is Source.NEIGHBOUR:
                loaded = await self.catch_up(neighbours)
            else:
                loaded = await (self._load_from_backup() if source is Source.BACKUP else self._load_from_disk())
            if loaded is not None:
                return loaded
        why = "its replicas are at outer round 0" if fresh and neighbours else "no replica, backup or snapshot to load"
        log.info("stage %d starts from its initial weights (%s)", self.stage, why)
        await self.refresh_agreed()
        return None

    async def catch_up(self, peers: list[str], rebase: bool = False) -> dict | None:
        """The state of the first of ``peers`` that serves one that fits; where it came from (None: none did)."""
        for peer in peers:
            try:
                fetched = await snapshots.fetch_snapshot(
                    self._pool, peer, self.spec.name, self.stage, run=self.run_id,
                    max_bytes=plan.snapshot_plan(self.spec, self.stage).total_bytes, partials=self.partials)
                state = await trio.to_thread.run_sync(checkpoint.decode_state, fetched.data)
                rebased = await self.load_state(state, ours=False, rebase=rebase)
            except (DialError, ProtocolError) as exc:
                log.warning("could not load stage %d from %s: %s (trying the next replica)", self.stage, peer, exc)
                continue
            self.counts["catch_ups"] += 1
            log.info("loaded stage %d from %s: outer round %d, inner step %d, %.1f MB in %.1f s%s", self.stage, peer,
                     fetched.round, fetched.step, len(fetched.data) / 1e6, fetched.seconds,
                     "; our own progress since our last round kept on top (rebased)" if rebased else "")
            return {"peer": peer, "round": fetched.round, "step": fetched.step, "bytes": len(fetched.data),
                    "seconds": round(fetched.seconds, 2), "rebased": rebased}
        return None

    async def rejoin(self, peer: str) -> dict | None:
        """``peer`` says it is ahead of us: if it announces the agreed backup of a later round than ours,
        fetch that by digest and rebase on it (``_rebase``: the round's start and momentum, a third of a
        hot snapshot's bytes; a backup in use stays served and a cut fetch resumes, where a hot
        snapshot's version is replaced within seconds); else its hot snapshot (``catch_up``). Our
        progress since our own last round goes on top even when we missed several rounds (on a thin
        line a fetch outlasts rounds; that progress then enters the next round late, as asynchronous
        DiLoCo takes a stale contribution). Where it came from; None: nothing loaded."""
        with trio.move_on_after(CATCH_UP_WAIT):
            await self._stage_map.refresh_stages([self.stage])
        record = next((r for r in self._stage_map.stages.get(self.stage, []) if r.peer_id == peer), None)
        agreed = record.agreed if record is not None else None
        if agreed is None or agreed[0] <= self._outer.rounds:
            return await self.catch_up([peer], rebase=True)
        return await self.rebase_on_agreed(peer, *agreed)

    async def settle_split(self, met: frozenset[str]) -> dict | None:
        """Where a replica we meet holds other agreed weights at our round (``policy.diverged_from``: the
        stage split), take its agreed state, our progress since our last round on top. The records are
        those of the round's start (``DilocoService`` refreshed them). Only the backup that hashes to the digest
        its signed record claims is taken, never its hot snapshot instead (whose content no claim binds): a
        fetch that fails leaves the split to the next round. Where it came from; None: nothing loaded."""
        record = diverged_from(self.agreed_claim(), self._stage_map.stages.get(self.stage, []), met)
        if record is None or record.agreed is None:
            return None
        self.counts["splits"] += 1
        log.warning("stage %d split: our agreed weights of outer round %d differ from %s's; we take its agreed "
                    "state", self.stage, record.agreed[0], record.peer_id)
        return await self.rebase_on_agreed(record.peer_id, *record.agreed, or_snapshot=False)

    async def rebase_on_agreed(self, peer: str, round_: int, digest: bytes, or_snapshot: bool = True) -> dict | None:
        """Fetch ``peer``'s agreed backup of ``round_`` by ``digest`` and rebase on it (``_rebase``); if that
        fails, its hot snapshot (``or_snapshot``) or nothing. Where it came from; None: nothing loaded."""
        try:
            fetched = await snapshots.fetch_snapshot(
                self._pool, peer, self.spec.name, self.stage, run=self.run_id, digest=digest,
                max_bytes=backup_core.backup_max_bytes(self.spec, self.stage), partials=self.partials)
            decode = functools.partial(backup_core.decode_backup, fetched.data, self.spec, self.stage,
                                       self.run_id.hex(), round_)
            state = await trio.to_thread.run_sync(decode)
        except (DialError, ProtocolError) as exc:
            log.warning("could not load the agreed backup of round %d from %s: %s%s", round_, peer, exc,
                        "; its snapshot instead" if or_snapshot else "; we try again at our next round")
            return await self.catch_up([peer], rebase=True) if or_snapshot else None
        # round_started_step 0: _rebase sets it to our engine's step
        outer_state = backup_core.outer_state(state, 0, dataclasses.asdict(outer_config(self.settings)))
        async with self.replica.state_lock:
            await self.replica.swarm.with_engine(lambda engine: self._rebase(engine, outer_state))
        await self.refresh_agreed()
        self.counts["catch_ups"] += 1
        log.info("rebased stage %d on the agreed backup of outer round %d from %s: %.1f MB in %.1f s", self.stage,
                 round_, peer, len(fetched.data) / 1e6, fetched.seconds)
        return {"peer": peer, "round": round_, "bytes": len(fetched.data), "seconds": round(fetched.seconds, 2),
                "rebased": True}

    async def _load_from_disk(self) -> dict | None:
        assert self.store is not None  # load_sources offers the disk only with a store
        found = await trio.to_thread.run_sync(self.store.latest)
        if found is None:
            return None
        path, state = found
        try:
            await self.load_state(state, ours=True)
        except ProtocolError as exc:
            log.warning("snapshot %s does not fit stage %d: %s (not loaded: a snapshot of another model or stage "
                        "in --data-dir? a replica's state is loaded instead)", path, self.stage, exc)
            return None
        log.info("loaded stage %d from %s (outer round %d)", self.stage, path, self._outer.rounds)
        return {"file": str(path), "round": self._outer.rounds}

    async def _load_from_backup(self) -> dict | None:
        """No replica to load from: the freshest verified backup of our stage that a peer holds."""
        found = await self._backups.fetch_freshest(self.stage, newer_than=0)  # round 0's: the seeded weights
        if found is None:
            return None
        state, info = found
        try:
            await self.load_backup(state)
        except ProtocolError as exc:
            log.warning("the backup of stage %d held by %s does not fit: %s (trying the next holder)", self.stage,
                        info["holder"], exc)
            return None
        self.counts["backup_loads"] += 1
        log.info("loaded stage %d from the backup held by %s: outer round %d (%.1f MB in %.1f s)", self.stage,
                 info["holder"], info["round"], info["bytes"] / 1e6, info["seconds"])
        return {"backup": info["holder"], "round": info["round"], "bytes": info["bytes"],
                "seconds": round(info["seconds"], 2)}

    async def load_state(self, state: dict, ours: bool, rebase: bool = False) -> bool:
        """Take a snapshot's state as ours (RemoteProtocolError if it is not a state of our stage); True if
        it was rebased.

        The error-feedback residual is taken only from our own snapshot: a neighbour's is what *it*
        still has to send (carried parts included), and sending it too would count it twice.

        **Rebase.** A replica left out of exactly one round (``rebase``, and the snapshot is one round
        ahead of us: it missed the gather by seconds) takes only the outer state, the round's new
        start and momentum, and keeps its own work: its live weights move by ``new start - our start``
        (``shift_flat``), its AdamW state and step stay, and its progress since our last round goes
        into its next pseudo-gradient. Replacing its weights with the replica's would throw away the
        tokens it trained in the round it missed."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT or \
                state.get("model") != self.spec.name or state.get("stage") != self.stage:
            raise RemoteProtocolError("the snapshot is not of our model and stage")
        rebased = rebase and isinstance(state.get("diloco"), dict) \
            and state["diloco"].get("rounds") == self._outer.rounds + 1

        def load(engine):
            outer, mine = self._outer, (engine.micro_batches, engine.tokens)
            try:
                if rebased:
                    return self._rebase(engine, state["diloco"])
                engine.load_state_dict(state["engine"])
                outer.load_state_dict(state["diloco"])
                outer.config = outer_config(self.settings)  # our flags, not the neighbour's
                residual = state.get("feedback", {}).get("residual") if ours else None
                self.replica.residual = residual if isinstance(residual, torch.Tensor) and \
                    residual.dtype == torch.float32 and residual.shape == (outer.numel,) else None
            except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
                raise RemoteProtocolError(f"the snapshot's state does not fit: {exc!r:.200}") from None
            engine.micro_batches, engine.tokens = mine  # our own work counters stay ours
            engine.weights_changed()
            engine.agree(outer.rounds, outer.start.clone())  # what held-out rounds evaluate

        async with self.replica.state_lock:
            await self.replica.swarm.with_engine(load)
        await self.refresh_agreed()
        return rebased

    def _rebase(self, engine, outer_state: dict) -> None:
        """Compute thread: the outer state of the round we missed, with our live progress kept (``load_state``)."""
        outer = self._outer
        ours = outer.start
        outer.load_state_dict(outer_state)
        outer.config = outer_config(self.settings)
        outer.round_started_step = engine.step  # our next round comes after H more of our steps
        shift_flat(engine.params, ours, outer.start)
        engine.weights_changed()
        engine.agree(outer.rounds, outer.start.clone())

    async def load_backup(self, state: dict) -> None:
        """Take a checked backup (``backups.check_backup``) as our state: the weights are its start
        (a fresh AdamW), the outer state its start, momentum and round; the engine's step goes to
        ``round x round_steps`` (H / F), so the LR schedule continues about where the stage was."""
        config = dataclasses.asdict(outer_config(self.settings))

        def load(engine):
            backup_core.apply_backup(engine, self._outer, state, outer_config(self.settings).round_steps, config)
            self.replica.residual = None  # what compression left out is per replica too

        async with self.replica.state_lock:
            await self.replica.swarm.with_engine(load)
        await self.refresh_agreed()

    # --- agreed backups and snapshots --------------------------------------------------------------

    async def refresh_agreed(self) -> None:
        """Encode our stage's agreed backup (in a worker thread) and serve it by digest."""
        def take(engine):
            outer = self._outer
            momentum = outer.momentum.clone() if outer.config.momentum > 0 else None  # 0: never acts
            return outer.rounds, outer.start.clone(), momentum

        round_, start, momentum = await self.replica.swarm.with_engine(take)
        encode = functools.partial(backup_core.encode_backup, self.spec.name, self.stage, self.run_id.hex(),
                                   round_, start, momentum)
        data = await trio.to_thread.run_sync(encode)
        backup = snapshots.Snapshot(data, round_, 0, trio.current_time())
        await trio.to_thread.run_sync(lambda: backup.digest)  # hashed once, off the loop
        if self.agreed_backup is None or round_ >= self.agreed_backup.round:
            self.agreed_backup = backup
            self.server.add_agreed(backup)

    def agreed_claim(self) -> tuple[int, bytes] | None:
        """(outer round, digest) of our stage's agreed backup, for our record; None before the first."""
        backup = self.agreed_backup
        return (backup.round, backup.digest) if backup is not None else None

    async def make_snapshot(self) -> snapshots.Snapshot:
        """Our stage's state now, encoded: what the snapshot server serves and the disk loop writes."""
        def take(engine):  # on the compute thread: host copies (of device tensors on a GPU), nothing more
            residual = self.replica.residual.clone() if self.replica.residual is not None else None
            return engine.host_state_dict(), self._outer.state_dict(), residual

        async with self.replica.state_lock:  # (not while a round's assembly writes the residual)
            engine_state, outer_state, residual = await self.replica.swarm.with_engine(take)
        state = {"format": STATE_FORMAT, "model": self.spec.name, "stage": self.stage, "engine": engine_state,
                 "diloco": outer_state, "feedback": {"residual": residual} if residual is not None else {}}
        data = await trio.to_thread.run_sync(checkpoint.encode_state, state)  # O(snapshot), off the engine
        return snapshots.Snapshot(data, outer_state["rounds"], engine_state["step"], trio.current_time())

    async def run_snapshots(self) -> None:
        """Every ``snapshot_period``: our newest snapshot written to disk (never returns; at once without a store)."""
        if self.store is None:
            log.info("no --data-dir: stage %d keeps no snapshots on disk (neighbours still serve it)", self.stage)
            return
        while True:
            await trio.sleep(self.settings.snapshot_period)
            snapshot = await self.server.newest()
            save = functools.partial(self.store.save, snapshot.data, round=snapshot.round, step=snapshot.step)
            path = await trio.to_thread.run_sync(save)
            self.last_snapshot = {"path": str(path), "round": snapshot.round, "step": snapshot.step,
                                  "bytes": len(snapshot.data)}
            self.counts["snapshots"] += 1
            log.debug("snapshot of stage %d written: %s (%.1f MB)", self.stage, path, len(snapshot.data) / 1e6)
