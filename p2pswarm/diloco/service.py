"""DiLoCo for a training peer: outer rounds with the other replicas of its stage, and hot snapshots.

``DilocoService`` is an extension of ``swarm.service.SwarmService`` (``prepare`` before training,
``run`` beside it). It is the thin trio driver of the pure pieces:

- **before training** it loads the current state of its stage from a neighbour replica over
  ``/p2pswarm/snapshot/1.0.0`` (``snapshots.py``), else its own newest snapshot on disk, else it
  keeps the initial weights (the first replica of a stage);
- **every H inner steps** it runs one outer round (``round.OuterRound``: gather, agree on the
  group, butterfly reduce) over ``/p2pswarm/diloco/1.0.0``; the pseudo-gradient is taken when the
  group is agreed, compressed with error feedback (``compression``), each shard combined robustly
  by its owner (``aggregation``), and the outer Nesterov step applied (``outer``). Training never
  pauses for a round: the engine keeps stepping and the local progress made meanwhile is kept.
  Every step of a round that walks a vector runs in a worker thread (``offload``), never on the
  trio loop that also answers the activation protocol's acks;
- **a peer that fell behind** (left out of a round, or meeting a replica at a later round) loads
  that replica's snapshot;
- **every** ``snapshot_period`` it writes its state atomically to ``--data-dir`` (last 5 kept);
- **after every outer round and every load** it encodes the stage's *agreed backup* (start,
  momentum, round: ``heal.backups``), served by digest and announced in our record
  (``agreed_claim``); a peer whose stage has no replica left loads the freshest verified backup
  that peers of other stages hold (``backups.fetch_freshest``, ``heal.backup_service``).

Only this module, ``offload``, ``compression``, ``aggregation`` and ``outer`` touch torch; the
engine's tensors are touched only through ``SwarmService.with_engine`` (between two compute jobs,
on the engine's compute thread), and the error-feedback residual only under ``_state_lock`` or the
engine's lock (a snapshot holds both while it copies). The outer state, the residual and the
snapshots live on the host even when the engine is on a GPU: a snapshot is made of host copies
(``StageEngine.host_state_dict``) and encoded in a worker thread, and a loaded one is moved to the
engine's device by ``StageEngine.load_state_dict``. ``doc()`` is ``GET /api/diloco``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
from collections import Counter
from pathlib import Path

import torch
import trio

from p2pswarm import wire

from p2pswarm.diloco import checkpoint
from p2pswarm.diloco import aggregation, compression, messages as msgs, offload, snapshots
from p2pswarm.diloco.outer import OuterConfig, OuterOptimizer, flatten, shift_flat
from p2pswarm.diloco.round import OuterRound, Phase, RoundTiming
from p2pswarm.diloco import round as rnd
from p2pswarm.run.diloco import DilocoSettings
from p2pswarm.dht.records import UNNAMED_RUN_BYTES
from p2pswarm.diloco import backups as backup_core
from p2pswarm.run import plan
from p2pswarm.errors import DialError, ProtocolError, RemoteProtocolError

log = logging.getLogger(__name__)

TICK = 0.25  # seconds between checks for a due round and the round's deadlines
HELLO_TIMEOUT = 5.0  # a replica answers a Hello at once: longer means gone
REDUCE_S = 30.0  # the owner's wait for parts; 64 MB over a 3 MiB/s relay takes ~20 s
AGREE_S = 5.0  # the wait for the others' proposals once we closed
LEFT_OUT_BACKOFF = 5.0  # after a round that went on without us, and no replica to load from: wait, then retry
CATCH_UP_WAIT = 30.0  # how long a peer that fell behind looks for a replica to load from
HISTORY = 20  # outer rounds kept for /api/diloco
STRIKES = 3  # a peer whose contributions we refused in this many of the last STRIKE_ROUNDS rounds...
STRIKE_ROUNDS = 10  # ...is left out of our groups (its Hellos get our status, nothing more)
STATE_FORMAT = 1  # the layout of a snapshot's state tree
ALONE_ENV = "P2PSWARM_DILOCO_ALONE"  # benches only: "adopt" makes a round of one take its weights as they are
ATTACK_VARIABLE = "P2PSWARM_DILOCO_ATTACK"  # tests and benches only: "negate10" or "noise" poisons what we send


class DilocoService:
    """Outer rounds and snapshots of one training peer (module docstring)."""

    def __init__(self, *, settings: DilocoSettings, spec, stage: int, me: str, pool, stage_map,
                 snapshot_dir: Path | None = None, run=None, backups=None, serve_snapshots=None) -> None:
        self.settings, self.spec, self.stage, self.me = settings, spec, stage, me
        self.run_id = run.run_bytes if run is not None else UNNAMED_RUN_BYTES  # in every Hello and snapshot.get
        self._other_runs: set[str] = set()  # replicas of another run, logged once each
        self._pool, self._stage_map = pool, stage_map
        self.store = checkpoint.SnapshotStore(snapshot_dir) if snapshot_dir else None
        self.swarm = None
        self._alone_adopts = os.environ.get(ALONE_ENV, "step") == "adopt"  # benches: a lone round's ablation
        self.outer: OuterOptimizer | None = None
        self.residual: torch.Tensor | None = None  # error feedback: what compression left out, carried on
        self.round: OuterRound | None = None
        self.server = snapshots.SnapshotServer(spec.name, stage, self._make_snapshot, run=self.run_id)
        self.history: collections.deque = collections.deque(maxlen=HISTORY)
        self.counts: Counter = Counter()
        self.penalties: Counter = Counter()  # rejected contributions per peer, ever
        self._strikes: dict[str, list[int]] = {}  # peer -> the rounds in which we refused it
        self.bytes_sent = self.bytes_received = 0
        self.comm_s = 0.0  # seconds spent in outer rounds, from readiness to the outer step
        self.loaded_from: dict | None = None
        self.last_snapshot: dict | None = None
        self._backups = backups  # heal.backup_service.BackupService, or None: no backups to load from
        self._serve_snapshots = serve_snapshots  # None: we register our snapshot server on the pool ourselves
        self.agreed_backup: snapshots.Snapshot | None = None  # our stage's agreed backup (heal.backups)
        self._nursery: trio.Nursery | None = None
        self._wake = trio.Event()
        self._behind: tuple[str, int] | None = None  # (a replica, its later round): load its state
        self._retry_at = 0.0  # no new round before this (after being left out)
        self._pending: dict | None = None  # the open round's own data: weights at the close, pseudo-gradient
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # what _pending's tensors live in
        self._state_lock = trio.Lock()  # the residual, written by _finish's thread: snapshots wait for it
        self._bulk_locks: dict[str, trio.Lock] = {}  # one Part or Result at a time to a peer (below)

    # --- life cycle ------------------------------------------------------------------------------

    async def prepare(self, swarm) -> None:
        """Before training: the outer optimizer, the protocols, and our stage's current state."""
        self.swarm = swarm
        def start(engine):
            outer = OuterOptimizer(engine.params, self._outer_config(), step=engine.step)
            engine.agree(outer.rounds, outer.start.clone())  # round 0: the initial weights, the same everywhere
            return outer

        self.outer = await swarm.with_engine(start)
        if self._serve_snapshots is not None:
            self._serve_snapshots(self.server)  # the node's one snapshot handler serves our stage through it
        else:
            self._pool.serve(snapshots.PROTOCOL_ID, self.server.on_frame)
        self._pool.serve(msgs.PROTOCOL_ID, self._on_frame, max_payload=self._max_payload())
        if not (await self._load_from_neighbour() or await self._load_from_backup() or await self._load_from_disk()):
            log.info("stage %d starts from its initial weights (no replica, backup or snapshot to load)", self.stage)
            await self._refresh_agreed()

    def _outer_config(self) -> OuterConfig:
        s = self.settings
        return OuterConfig(inner_steps=s.inner_steps, lr=s.outer_lr, momentum=s.momentum, nesterov=s.momentum > 0)

    def _max_payload(self) -> int:
        return min(wire.MAX_PAYLOAD_BYTES, msgs.expected_bytes("float32", self.outer.numel))  # a piece fits a frame

    async def run(self, swarm) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._snapshot_loop)
            while True:
                await self._step_rounds()
                with trio.move_on_after(TICK):
                    await self._wake.wait()
                self._wake = trio.Event()

    async def _step_rounds(self) -> None:
        now = trio.current_time()
        if self._behind is not None and (self.round is None or self.round.phase is Phase.LEFT_OUT):
            # (a round that is DONE is still applying its outer step: load only after it, not under it)
            (peer, their_round), self._behind = self._behind, None
            if their_round > self.outer.rounds:  # not caught up meanwhile by our own round
                await self._catch_up([peer], rebase=True)
            return
        if self.round is None and self.outer.due(self.swarm.engine.step) and now >= self._retry_at:
            if not self._replicas():  # none known yet (a swarm starting up): look again before going alone
                with trio.move_on_after(HELLO_TIMEOUT):
                    await self._stage_map.refresh_stages([self.stage])
            self._start_round(trio.current_time())
        elif self.round is not None:
            self._do(self.round, self.round.tick(now))

    # --- rounds --------------------------------------------------------------------------------------

    def _start_round(self, now: float) -> None:
        expected = self._replicas()
        timing = RoundTiming(gather_s=self.settings.gather_s, agree_s=AGREE_S, reduce_s=REDUCE_S)
        self.round = OuterRound(me=self.me, stage=self.stage, round=self.outer.rounds, numel=self.outer.numel,
                                codec=self.settings.codec, expected=expected, now=now, timing=timing,
                                expected_bytes=msgs.expected_bytes)
        self._started_at = now
        self._sent_before, self._received_before = self.bytes_sent, self.bytes_received
        log.info("outer round %d: ready after %d inner steps, gathering with %d known replica(s)",
                 self.outer.rounds, self.outer.inner_steps_done(self.swarm.engine.step), len(expected))
        self._do(self.round, self.round.start(now))

    def _replicas(self) -> frozenset[str]:
        """The other replicas of our stage in the stage map, but those we refuse to meet."""
        return frozenset(r.peer_id for r in self._stage_map.stages.get(self.stage, [])
                         if r.peer_id != self.me and not self._barred(r.peer_id))

    def _do(self, round_: OuterRound, actions) -> None:
        for action in actions:
            if isinstance(action, rnd.SendHello):
                self._nursery.start_soon(self._send_hello, round_, action.peer, action.hello)
            elif isinstance(action, rnd.SendPart):
                self._nursery.start_soon(self._send_bulk, round_, action.peer, action.part, action.data)
            elif isinstance(action, rnd.SendResult):
                self._nursery.start_soon(self._send_bulk, round_, action.peer, action.result, action.data)
            elif isinstance(action, rnd.NeedShards):
                self._nursery.start_soon(self._provide_shards, round_, action.bounds)
            elif isinstance(action, rnd.CombineShard):
                self._nursery.start_soon(self._combine_shard, round_, action)
            elif isinstance(action, rnd.Rejected):
                self._rejected(action.peer, action.reason)
            elif isinstance(action, rnd.CatchUp):
                self._note_ahead(action.peer, action.round)
            elif isinstance(action, rnd.Finished):
                self._nursery.start_soon(self._finish, round_, action.outcome)

    def _note_ahead(self, peer: str, their_round: int) -> None:
        """A replica says it is at a later round: load its state once our round is over. Only a
        replica of our stage map that we still meet is believed, and only as far as its signed
        record goes (plus the one round it may have finished since it was announced): a peer
        claiming round 10^18 must not make us load whatever it serves."""
        record = next((r for r in self._stage_map.stages.get(self.stage, []) if r.peer_id == peer), None)
        if their_round <= self.outer.rounds or peer not in self._replicas() or record is None \
                or their_round > record.capacity.outer_round + 1:
            return
        self._behind = (peer, their_round)
        self._wake.set()

    def _rejected(self, peer: str, reason: str) -> None:
        self.counts["rejected_contributions"] += 1
        self.penalties[peer] += 1
        rounds = self._strikes.setdefault(peer, [])
        if self.outer.rounds not in rounds:
            rounds.append(self.outer.rounds)
        log.warning("outer round %d: refused %s: %s", self.outer.rounds, peer, reason)

    def _barred(self, peer: str) -> bool:
        """Refused in STRIKES of the last STRIKE_ROUNDS rounds: left out of our groups."""
        recent = [r for r in self._strikes.get(peer, ()) if r > self.outer.rounds - STRIKE_ROUNDS]
        self._strikes[peer] = recent
        return len(recent) >= STRIKES

    async def _send_hello(self, round_: OuterRound, peer: str, hello) -> None:
        try:
            with trio.fail_after(HELLO_TIMEOUT):
                async with self._pool.lease(peer, msgs.PROTOCOL_ID, timeout=HELLO_TIMEOUT) as stream:
                    await stream.write_frame(dataclasses.replace(hello, run=self.run_id))
                    reply, _ = await stream.read_frame(max_payload=0, timeout=HELLO_TIMEOUT)
        except (DialError, ProtocolError, trio.TooSlowError) as exc:
            if round_.phase is Phase.REDUCE:  # a proposal that failed after the group was agreed without
                log.debug("hello to %s failed after the group was agreed: %r", peer, exc)  # needing it: the
                return  # parts and results say whether the peer is reachable (else it would be taken for gone)
            log.debug("hello to %s failed: %r", peer, exc)
            self._do(round_, round_.on_send_failed(peer, trio.current_time()))
            return
        if isinstance(reply, msgs.Hello) and self._our_run(peer, reply):
            self._do(round_, round_.on_hello(peer, reply, trio.current_time())[1])

    async def _send_bulk(self, round_: OuterRound, peer: str, message, data: bytes) -> None:
        """One Part or Result, after the ones before it to the same peer: a peer's inbound share
        holds one frame of up to 64 MiB (a piece), so a second one sent beside it would wait
        there past the pool's budget wait and be refused (``net/budget.py``)."""
        try:
            async with self._bulk_locks.setdefault(peer, trio.Lock()), \
                    self._pool.lease(peer, msgs.PROTOCOL_ID) as stream:
                await stream.write_frame(message, data)
                self.bytes_sent += len(data)
                reply, _ = await stream.read_frame(max_payload=0, timeout=REDUCE_S)
        except (DialError, ProtocolError) as exc:
            log.info("outer round %d: %s to %s failed: %r", message.round, message.TYPE, peer, exc)
            self._do(round_, round_.on_send_failed(peer, trio.current_time()))
            return
        if isinstance(reply, msgs.Reply) and not reply.accepted:
            self.counts["refused_by_peer"] += 1
            log.info("outer round %d: %s refused our %s: %s", message.round, peer, message.TYPE, reply.reason)

    async def _provide_shards(self, round_: OuterRound, bounds) -> None:
        codec = self.settings.codec

        attack = os.environ.get(ATTACK_VARIABLE)

        def take(engine):
            at, pseudo = self._round_buffers()
            flatten(engine.params, out=at)
            self.outer.pseudo_gradient(at, out=pseudo)
            if self.residual is None and codec != "float32":
                self.residual = torch.zeros_like(pseudo)
            if self.residual is not None:
                pseudo.add_(self.residual)
            if attack:
                return at, pseudo, [compression.encode(_poisoned(pseudo[a:b], attack), codec) for a, b in bounds]
            # the residual becomes what the codec leaves out of each shard, carried to the next round
            residual = self.residual
            shards = [compression.encode(pseudo[a:b], codec, error_out=None if residual is None else residual[a:b])
                      for a, b in bounds]
            return at, pseudo, shards

        if attack:
            log.warning("%s=%s: this peer sends poisoned pseudo-gradients (a test of the others' defences)",
                        ATTACK_VARIABLE, attack)
        began = trio.current_time()
        at, pseudo, shards = await self.swarm.with_engine(take)
        self._pending = {"at": at, "pseudo": pseudo, "bounds": bounds, "agreed_s": began - self._started_at,
                         "take_s": trio.current_time() - began}
        self._do(round_, round_.provide_shards(shards, trio.current_time()))

    async def _combine_shard(self, round_: OuterRound, action: rnd.CombineShard) -> None:
        """Our shard's aggregate, made in a worker thread (decode, verify, combine, encode: ~95 ms for
        4M elements), then handed back to the round on the loop (which sends the Results)."""
        s = self.settings
        combine = functools.partial(offload.combine_shard, action.parts, self.me, action.numel, codec=s.codec,
                                    aggregator=s.aggregator, verify=s.verify)
        result, refused = await trio.to_thread.run_sync(combine)
        self._do(round_, round_.combined(result, refused, trio.current_time(), action.shard))

    async def _finish(self, round_: OuterRound, outcome) -> None:
        if outcome.left_out:
            self.counts["left_out"] += 1
            log.info("outer round %d went on without us; we load a replica's state once it is done",
                     round_.round)
            self.round, self._pending = None, None  # its group is mid-round: a Hello of the next round
            self._retry_at = trio.current_time() + LEFT_OUT_BACKOFF  # will tell us whom to load from
            return
        pending = self._pending or await self._alone()
        finished = trio.current_time()
        done = await self._assemble(outcome, pending)
        aggregated, missing, refused = done.aggregated, done.missing, list(done.refused)
        assembled = trio.current_time()

        alone = len(outcome.group) == 1 and self._alone_adopts

        def apply(engine):
            if alone:  # nothing to agree with: our weights at the close are the round's start
                self.outer.adopt(pending["at"], engine.step)
            else:
                self.outer.outer_step(aggregated, pending["at"], engine.params, engine.step)
            engine.weights_changed()
            engine.agree(self.outer.rounds, self.outer.start.clone())  # the same on every member: evaluated

        await self.swarm.with_engine(apply)
        now = trio.current_time()
        self.comm_s += now - self._started_at
        self.history.append({
            "round": round_.round, "members": list(outcome.group), "seconds": round(now - self._started_at, 2),
            "bytes_sent": self.bytes_sent - self._sent_before,
            "bytes_received": self.bytes_received - self._received_before,
            "missing_shards": missing, "refused_results": refused,
            "pseudo_gradient_norm": round(done.pseudo_norm, 4),
            "update_norm": round(done.update_norm, 4), "at_step": self.swarm.engine.step,
            "tokens": self.swarm.engine.tokens,  # ours, trained into our weights by the end of the round
            "phases_s": {"gather_agree": round(pending.get("agreed_s", 0.0), 3),
                         "take_pseudo_gradient": round(pending.get("take_s", 0.0), 3),
                         "exchange": round(finished - self._started_at - pending.get("agreed_s", 0.0)
                                           - pending.get("take_s", 0.0), 3),
                         "assemble": round(assembled - finished, 3), "outer_step": round(now - assembled, 3)}})
        self.counts["rounds"] += 1
        log.info("outer round %d done: %d member(s), %.1f s, %.2f MB sent, %d shard(s) missing",
                 round_.round, len(outcome.group), now - self._started_at,
                 (self.bytes_sent - self._sent_before) / 1e6, len(missing))
        self.round, self._pending = None, None
        await self._refresh_agreed()

    def _round_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Two stage-sized vectors a round fills (weights at the close, pseudo-gradient), kept
        from round to round: one round at a time uses them, and fresh ones would cost page faults."""
        if self._buffers is None or self._buffers[0].numel() != self.outer.numel:
            self._buffers = (torch.empty(self.outer.numel), torch.empty(self.outer.numel))
        return self._buffers

    async def _alone(self) -> dict:
        """A group of one: our own pseudo-gradient is the aggregate (DiLoCo with one worker)."""
        def take(engine):
            at, pseudo = self._round_buffers()
            flatten(engine.params, out=at)
            return {"at": at, "pseudo": self.outer.pseudo_gradient(at, out=pseudo), "bounds": ((0, self.outer.numel),)}

        return await self.swarm.with_engine(take)

    async def _assemble(self, outcome, pending) -> offload.Assembled:
        """The group's pseudo-gradient from the owners' results (``offload.assemble``, in a worker
        thread, under ``_state_lock``: it writes the residual a snapshot reads); then, on the loop,
        a strike for each owner whose result we refused."""
        verify = result_check(len(outcome.group)) if self.settings.verify else None
        assemble = functools.partial(offload.assemble, outcome, pending["pseudo"], pending["bounds"], me=self.me,
                                     codec=self.settings.codec, verify=verify, residual=self.residual)
        async with self._state_lock:
            done = await trio.to_thread.run_sync(assemble)
            self.residual = done.residual
        for index, reason in done.refused.items():  # an owner's aggregate far from our own: a lying owner
            self._rejected(outcome.owner(index), f"aggregate of piece {index}: {reason}")
        return done

    # --- inbound -----------------------------------------------------------------------------------

    async def _on_frame(self, peer: str, message, payload: bytes):
        round_ = self.round
        now = trio.current_time()
        if isinstance(message, msgs.Hello):
            if not self._our_run(peer, message):
                return self._status()  # its run's replicas are not ours: we never meet it
            if peer not in self._replicas():  # not announced for our stage, or it sent us poison too often:
                return self._status()  # we do not meet it (a stranger cannot join our groups)
            if round_ is not None and message.round == round_.round and message.stage == self.stage:
                reply, actions = round_.on_hello(peer, message, now)
                self._do(round_, actions)
                return dataclasses.replace(reply, run=self.run_id) if isinstance(reply, msgs.Hello) else reply
            if message.stage == self.stage and message.ready:
                self._note_ahead(peer, message.round)
            return self._status()
        self.bytes_received += len(payload)
        if not isinstance(message, (msgs.Part, msgs.Result)):
            raise RemoteProtocolError(f"{message.TYPE} is not a DiLoCo request")
        if round_ is None or message.round != round_.round:
            self.counts["late_messages"] += 1
            return msgs.Reply(message.round, message.shard, False, "not in that round")
        handle = round_.on_part if isinstance(message, msgs.Part) else round_.on_result
        reply, actions = handle(peer, message, payload, now)
        self._do(round_, actions)
        return reply

    def _status(self) -> msgs.Hello:
        return msgs.Hello(self.stage, self.outer.rounds, self.outer.numel, self.settings.codec, False, False, (),
                          self.run_id)

    def _our_run(self, peer: str, hello: msgs.Hello) -> bool:
        """Whether ``hello`` comes from a replica of our run; another run's is logged once per peer."""
        if hello.run == self.run_id:
            return True
        self.counts["other_run_hellos"] += 1
        if peer not in self._other_runs:
            self._other_runs.add(peer)
            log.warning("peer %s is training run %s, we train run %s: refusing its outer rounds", peer,
                        hello.run.hex(), self.run_id.hex())
        return False

    # --- catching up and snapshots -------------------------------------------------------------------

    async def _load_from_neighbour(self) -> bool:
        with trio.move_on_after(CATCH_UP_WAIT):
            await self._stage_map.refresh_stages([self.stage])
        records = sorted((r for r in self._stage_map.stages.get(self.stage, []) if r.peer_id != self.me),
                         key=lambda r: -r.capacity.outer_round)
        return await self._catch_up([r.peer_id for r in records]) if records else False

    async def _catch_up(self, peers: list[str], rebase: bool = False) -> bool:
        for peer in peers:
            try:
                fetched = await snapshots.fetch_snapshot(
                    self._pool, peer, self.spec.name, self.stage, run=self.run_id,
                    max_bytes=plan.snapshot_plan(self.spec, self.stage).total_bytes)
                state = await trio.to_thread.run_sync(checkpoint.decode_state, fetched.data)
                rebased = await self._load_state(state, ours=False, rebase=rebase)
            except (DialError, ProtocolError) as exc:
                log.warning("could not load stage %d from %s: %s", self.stage, peer, exc)
                continue
            self.counts["catch_ups"] += 1
            self.loaded_from = {"peer": peer, "round": fetched.round, "step": fetched.step,
                                "bytes": len(fetched.data), "seconds": round(fetched.seconds, 2), "rebased": rebased}
            log.info("loaded stage %d from %s: outer round %d, inner step %d, %.1f MB in %.1f s%s", self.stage, peer,
                     fetched.round, fetched.step, len(fetched.data) / 1e6, fetched.seconds,
                     "; our own progress since our last round kept on top (rebased)" if rebased else "")
            return True
        return False

    async def _load_from_disk(self) -> bool:
        if self.store is None:
            return False
        found = await trio.to_thread.run_sync(self.store.latest)
        if found is None:
            return False
        path, state = found
        try:
            await self._load_state(state, ours=True)
        except ProtocolError as exc:
            log.warning("snapshot %s does not fit stage %d: %s", path, self.stage, exc)
            return False
        self.loaded_from = {"file": str(path), "round": self.outer.rounds}
        log.info("loaded stage %d from %s (outer round %d)", self.stage, path, self.outer.rounds)
        return True

    async def _load_state(self, state: dict, ours: bool, rebase: bool = False) -> bool:
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
            and state["diloco"].get("rounds") == self.outer.rounds + 1

        def load(engine):
            mine = (engine.micro_batches, engine.tokens)
            try:
                if rebased:
                    return self._rebase(engine, state["diloco"])
                engine.load_state_dict(state["engine"])
                self.outer.load_state_dict(state["diloco"])
                self.outer.config = self._outer_config()  # our flags, not the neighbour's
                residual = state.get("feedback", {}).get("residual") if ours else None
                self.residual = residual if isinstance(residual, torch.Tensor) and \
                    residual.dtype == torch.float32 and residual.shape == (self.outer.numel,) else None
            except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
                raise RemoteProtocolError(f"the snapshot's state does not fit: {exc!r:.200}") from None
            engine.micro_batches, engine.tokens = mine  # our own work counters stay ours
            engine.weights_changed()
            engine.agree(self.outer.rounds, self.outer.start.clone())  # what held-out rounds evaluate

        async with self._state_lock:
            await self.swarm.with_engine(load)
        await self._refresh_agreed()
        return rebased

    async def _load_from_backup(self) -> bool:
        """No replica to load from: the freshest verified backup of our stage that a peer holds."""
        found = await self._backups.fetch_freshest(self.stage) if self._backups is not None else None
        if found is None:
            return False
        state, info = found
        try:
            await self._load_backup(state)
        except ProtocolError as exc:
            log.warning("the backup of stage %d held by %s does not fit: %s", self.stage, info["holder"], exc)
            return False
        self.counts["backup_loads"] += 1
        self.loaded_from = {"backup": info["holder"], "round": info["round"], "bytes": info["bytes"],
                            "seconds": round(info["seconds"], 2)}
        log.info("loaded stage %d from the backup held by %s: outer round %d (%.1f MB in %.1f s)", self.stage,
                 info["holder"], info["round"], info["bytes"] / 1e6, info["seconds"])
        return True

    async def _load_backup(self, state: dict) -> None:
        """Take a checked backup (``backup_core.check_backup``) as our state: the weights are its start
        (a fresh AdamW), the outer state its start, momentum and round; the engine's step goes to
        ``round x inner_steps``, so the LR schedule continues about where the stage was."""
        config = dataclasses.asdict(self._outer_config())

        def load(engine):
            backup_core.apply_backup(engine, self.outer, state, self.settings.inner_steps, config)
            self.residual = None  # what compression left out is per replica too

        async with self._state_lock:
            await self.swarm.with_engine(load)
        await self._refresh_agreed()

    async def _refresh_agreed(self) -> None:
        """Encode our stage's agreed backup (in a worker thread) and serve it by digest."""
        def take(engine):
            momentum = self.outer.momentum.clone() if self.outer.config.momentum > 0 else None  # 0: never acts
            return self.outer.rounds, self.outer.start.clone(), momentum

        round_, start, momentum = await self.swarm.with_engine(take)
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

    def _rebase(self, engine, outer_state: dict) -> None:
        """Compute thread: the outer state of the round we missed, with our live progress kept (``_load_state``)."""
        ours = self.outer.start
        self.outer.load_state_dict(outer_state)
        self.outer.config = self._outer_config()
        self.outer.round_started_step = engine.step  # our next round comes after H more of our steps
        shift_flat(engine.params, ours, self.outer.start)
        engine.weights_changed()
        engine.agree(self.outer.rounds, self.outer.start.clone())

    async def _make_snapshot(self) -> snapshots.Snapshot:
        def take(engine):  # on the compute thread: host copies (of device tensors on a GPU), nothing more
            residual = self.residual.clone() if self.residual is not None else None
            return engine.host_state_dict(), self.outer.state_dict(), residual

        async with self._state_lock:  # (not while _finish's thread writes the residual)
            engine_state, outer_state, residual = await self.swarm.with_engine(take)
        state = {"format": STATE_FORMAT, "model": self.spec.name, "stage": self.stage, "engine": engine_state,
                 "diloco": outer_state, "feedback": {"residual": residual} if residual is not None else {}}
        data = await trio.to_thread.run_sync(checkpoint.encode_state, state)  # O(snapshot), off the engine
        return snapshots.Snapshot(data, outer_state["rounds"], engine_state["step"], trio.current_time())

    async def _snapshot_loop(self) -> None:
        if self.store is None:
            log.info("no --data-dir: stage %d keeps no snapshots on disk (neighbours still serve it)", self.stage)
            return
        while True:
            await trio.sleep(self.settings.snapshot_period)
            snapshot = await self.server.newest()
            path = await trio.to_thread.run_sync(
                lambda: self.store.save(snapshot.data, round=snapshot.round, step=snapshot.step))
            self.last_snapshot = {"path": str(path), "round": snapshot.round, "step": snapshot.step,
                                  "bytes": len(snapshot.data)}
            self.counts["snapshots"] += 1
            log.info("snapshot of stage %d written: %s (%.1f MB)", self.stage, path, len(snapshot.data) / 1e6)

    # --- status --------------------------------------------------------------------------------------

    def outer_round(self) -> int:
        return self.outer.rounds if self.outer else 0

    def doc(self) -> dict:
        engine, outer, round_ = self.swarm.engine if self.swarm else None, self.outer, self.round
        step = engine.step if engine else 0
        ledger = self.swarm.ledger.stats(trio.current_time()) if self.swarm else None
        compute_s = ledger.busy_fraction * ledger.elapsed if ledger else 0.0
        return {
            "stage": self.stage, "inner_step": step, "outer_round": outer.rounds if outer else 0,
            "inner_steps_this_round": outer.inner_steps_done(step) if outer else 0,
            "inner_steps_per_round": self.settings.inner_steps,
            "settings": dataclasses.asdict(self.settings),
            "phase": round_.phase.name.lower() if round_ else "training",
            "last_round": self.history[-1] if self.history else None, "rounds": list(self.history),
            "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
            "rejected_contributions": dict(self.penalties), "counts": dict(self.counts),
            "communicating_s": round(self.comm_s, 2), "computing_s": round(compute_s, 2),
            "loaded_from": self.loaded_from, "last_snapshot": self.last_snapshot,
            "snapshots_served": {"requests": self.server.requests, "bytes": self.server.served},
            "agreed": {"round": self.agreed_backup.round, "digest": self.agreed_backup.digest.hex()}
            if self.agreed_backup is not None else None,
        }

    async def doc_json(self, params: dict) -> dict:
        return self.doc()

    def routes(self) -> dict:
        return {"/api/diloco": self.doc_json}


def _poisoned(shard: torch.Tensor, attack: str) -> torch.Tensor:
    """What a Byzantine replica sends instead of its shard: -10 times it, or noise of its norm."""
    if attack == "noise":
        noise = torch.randn_like(shard)
        return noise * (shard.norm() / noise.norm().clamp_min(1e-12))
    return -10.0 * shard


RESULT_MIN_PROJECTION = -1.0  # an aggregate may not undo more than all of our own step (honest: >= -0.6)
RESULT_MAX_NORM_RATIO = aggregation.MAX_NORM_RATIO  # honest: <= 3 (a mean of shards within 3x of ours); -10x of 2: ~5


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
