"""DiLoCo for a training peer: the thin trio driver of its outer rounds with the other replicas of its stage.

``DilocoService`` is an extension of ``swarm.service.SwarmService`` (``prepare`` before training, ``run`` beside
it). Before training its ``loading.StageLoader`` loads our stage's current state. Every H / F inner steps it
runs one outer round of the stage's current fragment (``outer``: all of it when F = 1; ``round.OuterRound``:
gather, agree on the group, butterfly reduce) over ``/p2pswarm/diloco/1.0.0``: the pseudo-gradient is taken
when the group is agreed and encoded with error feedback (``contribution``), each shard combined robustly by
its owner (``aggregation``), and the outer Nesterov step applied (``outer``). Training never pauses for a
round. Every step that walks a vector runs in a worker thread (``offload``) or on the engine's compute thread
(``SwarmService.with_engine``), never on the trio loop that also answers the activation protocol's acks; the
residual is written only under ``state_lock``. What to do at a tick (catch up with a replica that is ahead,
start or tick a round), whom to believe ahead and whom to stop meeting are ``policy``'s decisions. ``doc()``
is ``GET /api/diloco`` (``status``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch
import trio

from p2pswarm import wire
from p2pswarm.dht.ranking import Standing
from p2pswarm.dht.records import UNNAMED_RUN_BYTES
from p2pswarm.dht.stagemap import neighbour_stages
from p2pswarm.dht.work import CONTRIBUTION_WEIGHT
from p2pswarm.diloco import checkpoint, contribution, offload, policy, snapshots, status
from p2pswarm.diloco import messages as msgs
from p2pswarm.diloco import round as rnd
from p2pswarm.diloco.aggregation import judged
from p2pswarm.diloco.loading import StageLoader, outer_config
from p2pswarm.diloco.outer import OuterOptimizer
from p2pswarm.diloco.policy import STRIKES, Move, result_check  # noqa: F401 (STRIKES: bench/_diloco_sim.py)
from p2pswarm.diloco.round import OuterRound, Phase, RoundTiming
from p2pswarm.errors import DialError, ProtocolError, RemoteProtocolError
from p2pswarm.run.diloco import DilocoSettings
from p2pswarm.run.tunables import Tunables

log = logging.getLogger(__name__)

TICK = 0.25  # seconds between checks for a due round and the round's deadlines
HELLO_TIMEOUT = 5.0  # a replica answers a Hello at once: longer means gone
REDUCE_S = policy.REDUCE_S  # the least wait for parts (policy.reduce_seconds: the bytes and the measured rate)
AGREE_S = 5.0  # the wait for the others' proposals once we closed
LEFT_OUT_BACKOFF = 5.0  # after a round that went on without us, and no replica to load from: wait, then retry
HISTORY = 20  # outer rounds kept for /api/diloco


class DilocoService:
    """Outer rounds of one training peer (module docstring); loads and snapshots are its ``loader``'s."""

    def __init__(self, *, settings: DilocoSettings, spec, stage: int, me: str, pool, stage_map,
                 snapshot_dir: Path | None = None, run=None, backups=None, serve_snapshots=None,
                 tunables: Tunables = Tunables()) -> None:
        self.settings, self.spec, self.stage, self.me = settings, spec, stage, me
        self.run_id = run.run_bytes if run is not None else UNNAMED_RUN_BYTES  # in every Hello and snapshot.get
        self._other_runs: set[str] = set()  # replicas of another run, logged once each
        self._pool, self._stage_map = pool, stage_map
        self._alone_adopts = tunables.alone_adopts  # benches: a lone round's ablation
        self.swarm: Any = None  # the SwarmService (prepare): these four are what the loader shares (loading.Replica)
        self.outer: OuterOptimizer | None = None
        self.residual: torch.Tensor | None = None  # error feedback: what compression left out, carried on
        self.state_lock = trio.Lock()  # the residual, written by _assemble's thread and loads: snapshots wait for it
        self.counts: Counter = Counter()
        self.strikes = policy.Strikes(self.counts)  # whom we refused, and whom we stop meeting
        self.penalties = self.strikes.penalties  # rejected contributions per peer, ever
        self.loader = StageLoader(self, settings=settings, spec=spec, stage=stage, me=me, run_id=self.run_id,
                                  pool=pool, stage_map=stage_map, backups=backups, counts=self.counts,
                                  store=checkpoint.SnapshotStore(snapshot_dir) if snapshot_dir else None)
        self.server = self.loader.server  # our stage's snapshot server
        self._serve_snapshots = serve_snapshots  # None: we register our snapshot server on the pool ourselves
        self.round: OuterRound | None = None
        self.history: collections.deque = collections.deque(maxlen=HISTORY)
        self.bytes_sent, self.bytes_received, self.comm_s = 0, 0, 0.0  # comm_s: in rounds, readiness to outer step
        self.link = policy.LinkRate()  # the rate our rounds sent their bytes at: the reduce's deadline follows it
        self.loaded_from: dict | None = None  # where our state came from, if it was loaded
        self._nursery: trio.Nursery | None = None
        self._wake = trio.Event()  # set: step the rounds now (a replica is ahead), not at the next TICK
        self._behind: tuple[str, int] | None = None  # (a replica, its later round): load its state
        self._retry_at = 0.0  # no new round before this (after being left out)
        self._pending: dict | None = None  # the open round's own data: weights at the close, pseudo-gradient
        self._buffers: contribution.Buffers | None = None  # what _pending's tensors live in
        self._started_at, self._sent_before, self._received_before = 0.0, 0, 0  # the open round's start
        self._ready_at: float | None = None  # when we were last ready for a round (or began): its length (gather)
        self._bulk_locks: dict[str, trio.Lock] = {}  # one Part or Result at a time to a peer (_send_bulk)

    # --- life cycle ------------------------------------------------------------------------------

    async def prepare(self, swarm) -> None:
        """Before training: the outer optimizer, the protocols, and our stage's current state."""
        self.swarm = swarm

        def start(engine):
            outer = OuterOptimizer(engine.params, outer_config(self.settings), step=engine.step)
            engine.agree(outer.rounds, outer.start.clone())  # round 0: the initial weights, the same everywhere
            return outer

        self.outer = outer = await swarm.with_engine(start)
        if self._serve_snapshots is not None:
            self._serve_snapshots(self.server)  # the node's one snapshot handler serves our stage through it
        else:
            self._pool.serve(snapshots.PROTOCOL_ID, self.server.on_frame)
        largest = max(msgs.expected_bytes("float32", outer.numel),  # a piece fits a frame (a tiny stage's
                      msgs.expected_bytes(self.settings.codec, outer.numel, msgs.MAX_MEMBERS))  # sparse Result may
        max_payload = min(wire.MAX_PAYLOAD_BYTES, largest)  # be longer than its float32 elements)
        self._pool.serve(msgs.PROTOCOL_ID, self._on_frame, max_payload=max_payload)
        self.loaded_from = await self.loader.load_at_start()

    async def run(self, swarm) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self.loader.run_snapshots)
            self._ready_at = trio.current_time()  # training starts: the first round's length counts from here
            while True:
                await self._step_rounds()
                with trio.move_on_after(TICK):
                    await self._wake.wait()
                self._wake = trio.Event()

    async def _step_rounds(self) -> None:
        """One tick: catch up with a replica that is ahead, start a due round, or tick the open one."""
        outer, now = self.outer, trio.current_time()
        assert outer is not None  # prepare() made it
        move = policy.next_move(now, behind_round=self._behind[1] if self._behind else None,
                                phase=self.round.phase if self.round else None, rounds=outer.rounds,
                                due=outer.due(self.swarm.engine.step), retry_at=self._retry_at)
        if move in (Move.CATCH_UP, Move.FORGET):
            assert self._behind is not None  # what these moves answer
            (peer, _), self._behind = self._behind, None
            if move is Move.CATCH_UP:  # not caught up meanwhile by our own round
                self.loaded_from = await self.loader.rejoin(peer) or self.loaded_from
        elif move is Move.TICK:
            assert self.round is not None  # a round is open
            self._do(self.round, self.round.tick(now))
        elif move is Move.START:
            with trio.move_on_after(HELLO_TIMEOUT):  # the records of our stage and its neighbours as they are
                await self._stage_map.refresh_stages(neighbour_stages(self.spec, self.stage))  # now: the
                #   neighbours' records attest which of our replicas work (a replica that just joined included)
            split = await self.loader.settle_split(self._replicas())  # (records as fresh as the round's start)
            if split is not None:  # we took a replica's agreed state: the round is due again after H / F steps
                self.loaded_from = split
                return
            now, expected = trio.current_time(), self._replicas()
            last = now - self._ready_at if self._ready_at is not None else None
            a, b = outer.fragment()  # (the whole stage, but with Streaming DiLoCo's fragments)
            nbytes = msgs.bytes_sent(b - a, max(2, len(expected) + 1), self.settings.codec)
            timing = RoundTiming(gather_s=policy.gather_seconds(self.settings.gather_s, last), agree_s=AGREE_S,
                                 reduce_s=policy.reduce_seconds(nbytes, self.link.rate))
            self._ready_at = now
            self.round = OuterRound(me=self.me, stage=self.stage, round=outer.rounds, numel=b - a,
                                    codec=self.settings.codec, expected=expected, now=now, timing=timing,
                                    expected_bytes=msgs.expected_bytes, stage_numel=outer.numel)
            self._started_at, self._sent_before, self._received_before = now, self.bytes_sent, self.bytes_received
            log.debug("outer round %d: ready after %d inner steps, gathering with %d known replica(s) for up to %.0f s "
                     "(then %.2f MB to send, within %.0f s)", outer.rounds,
                     outer.inner_steps_done(self.swarm.engine.step), len(expected), timing.gather_s, nbytes / 1e6,
                     timing.reduce_s)
            self._do(self.round, self.round.start(now))

    def _replicas(self) -> frozenset[str]:
        """The other replicas of our stage we meet, but those we refuse to meet: those counted as working
        (``StageMap.workers``: seen, or attested by peers we trust). A replica's neighbours see its work: its own
        partners every micro-batch, other chains' peers when a micro-batch explores (``swarm.router``), and a
        contribution taken into a round counts too (``_finish``). Only a run of one stage, where no micro-batch
        crosses a boundary, meets on probation the replicas that answered us, a few per address (the vouched
        peers of the stage's top; ``dht.ranking``)."""
        assert self.outer is not None  # prepare() made it
        rounds = self.outer.rounds
        met = set(self._stage_map.workers().get(self.stage, set()))
        if self.spec.n_stages == 1:
            standing = self._stage_map.standings()
            met |= {r.peer_id for r in self._stage_map.stages.get(self.stage, [])
                    if standing(r.peer_id) is Standing.VOUCHED}
        return frozenset(peer for peer in met if peer != self.me and not self.strikes.barred(peer, rounds))

    # --- rounds --------------------------------------------------------------------------------------

    def _do(self, round_: OuterRound, actions) -> None:
        for action in actions:
            if isinstance(action, rnd.SendHello):
                self._spawn(self._send_hello, round_, action.peer, action.hello)
            elif isinstance(action, rnd.SendPart):
                self._spawn(self._send_bulk, round_, action.peer, action.part, action.data)
            elif isinstance(action, rnd.SendResult):
                self._spawn(self._send_bulk, round_, action.peer, action.result, action.data)
            elif isinstance(action, rnd.NeedShards):
                self._spawn(self._provide_shards, round_, action.bounds)
            elif isinstance(action, rnd.CombineShard):
                self._spawn(self._combine_shard, round_, action)
            elif isinstance(action, rnd.Rejected):
                assert self.outer is not None  # prepare() made it
                self.strikes.refuse(action.peer, self.outer.rounds, action.reason)
            elif isinstance(action, rnd.CatchUp):
                self._note_ahead(action.peer, action.round)
            elif isinstance(action, rnd.Finished):
                self._spawn(self._finish, round_, action.outcome)

    def _spawn(self, task: Callable[..., Awaitable[object]], *args: object) -> None:
        assert self._nursery is not None  # run() set it: rounds run inside it
        self._nursery.start_soon(task, *args)

    def _note_ahead(self, peer: str, their_round: int) -> None:
        """A replica says it is at a later round: load its state after our round, if believed (``policy``)."""
        record = next((r for r in self._stage_map.stages.get(self.stage, []) if r.peer_id == peer), None)
        assert self.outer is not None  # prepare() made it
        if policy.believed_ahead(peer, their_round, our_round=self.outer.rounds, met=self._replicas(),
                                 record_round=record.capacity.outer_round if record is not None else None):
            self._behind = (peer, their_round)
            self._wake.set()

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
                    self._pool.lease(peer, msgs.PROTOCOL_ID, timeout=REDUCE_S) as stream:  # (a thin line: slow)
                await stream.write_frame(message, data)
                self.bytes_sent += len(data)
                reply, _ = await stream.read_frame(max_payload=0, timeout=REDUCE_S)
        except (DialError, ProtocolError) as exc:
            log.debug("outer round %d: %s to %s failed: %r", message.round, message.TYPE, peer, exc)
            self._do(round_, round_.on_send_failed(peer, trio.current_time()))
            return
        if isinstance(reply, msgs.Reply) and not reply.accepted:
            self.counts["refused_by_peer"] += 1
            log.info("outer round %d: %s refused our %s: %s", message.round, peer, message.TYPE, reply.reason)

    async def _provide_shards(self, round_: OuterRound, bounds) -> None:
        """The group is agreed: our pseudo-gradient now (on the engine's compute thread: only the flatten and
        the subtraction hold training), plus the residual carried on, encoded piece by piece in a worker
        thread (``contribution.encode_contribution``: a sparse top-k of a stage held training for its whole
        encoding, compute-busy 0.91 of its level between rounds on the lab's home line), under ``state_lock``."""
        codec, outer = self.settings.codec, self.outer
        assert outer is not None  # prepare() made it
        buffers = self._buffers = contribution.round_buffers(self._buffers, outer)
        self.residual = torch.zeros(outer.numel) if self.residual is None and codec != "float32" else self.residual
        residual = contribution.fragment_residual(self.residual, outer.fragment())  # (a view: written in place)
        began = trio.current_time()
        async with self.state_lock:  # (a snapshot reads the residual the encoding writes)
            at, pseudo = await self.swarm.with_engine(functools.partial(contribution.take_pseudo_gradient,
                                                                        outer=outer, buffers=buffers))
            shards = await trio.to_thread.run_sync(contribution.encode_with_residual, pseudo, bounds, codec, residual)
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
            log.info("outer round %d went on without us; we load a replica's state once it is done", round_.round)
            self.round, self._pending = None, None  # its group is mid-round: a Hello of the next round
            self._retry_at = trio.current_time() + LEFT_OUT_BACKOFF  # will tell us whom to load from
            return
        outer, swarm = self.outer, self.swarm
        assert outer is not None  # prepare() made it
        buffers = self._buffers = contribution.round_buffers(self._buffers, outer)
        own = functools.partial(contribution.take_alone, outer=outer, buffers=buffers)  # a group of one
        pending = self._pending or await swarm.with_engine(own)
        finished = trio.current_time()
        done = await self._assemble(outcome, pending)
        assembled = trio.current_time()
        alone = len(outcome.group) == 1 and self._alone_adopts

        def apply(engine):
            if alone:  # nothing to agree with: our weights at the close are the round's start
                outer.adopt(pending["at"], engine.step)
            else:
                outer.outer_step(done.aggregated, pending["at"], engine.params, engine.step)
            engine.weights_changed()
            engine.agree(outer.rounds, outer.start.clone())  # the same on every member: evaluated

        await swarm.with_engine(apply)
        times = status.RoundTimes(self._started_at, pending.get("agreed_s", 0.0), pending.get("take_s", 0.0),
                                  finished, assembled, trio.current_time())
        self.comm_s += times.now - times.started
        sent, received = self.bytes_sent - self._sent_before, self.bytes_received - self._received_before
        self.link.observe(sent, times.finished - times.started - times.agreed_s)  # the reduce: from the agreement
        self.history.append(status.round_record(round_.round, outcome.group, times, sent, received, done,
                                                step=swarm.engine.step, tokens=swarm.engine.tokens))
        self.counts["rounds"] += 1
        for peer in outcome.group if judged(len(outcome.group)) else ():  # taken into a judged round: work
            if peer != self.me and not self.strikes.refused_in(peer, round_.round):
                self._stage_map.saw(peer, self.stage, CONTRIBUTION_WEIGHT)
        log.debug("outer round %d done: %d member(s), %.1f s, %.2f MB sent, %d shard(s) missing", round_.round,
                 len(outcome.group), times.now - times.started, sent / 1e6, len(done.missing))
        self.round, self._pending = None, None
        await self.loader.refresh_agreed()

    async def _assemble(self, outcome, pending) -> offload.Assembled:
        """The group's pseudo-gradient from the owners' results (``offload.assemble``, in a worker
        thread, under ``state_lock``: it writes the residual a snapshot reads); then, on the loop,
        a strike for each owner whose result we refused."""
        assert self.outer is not None  # prepare() made it
        verify = result_check(len(outcome.group)) if self.settings.verify else None
        fragment = self.outer.fragment()  # (the round's: the outer step that moves on is applied after this)
        assemble = functools.partial(offload.assemble, outcome, pending["pseudo"], pending["bounds"], me=self.me,
                                     codec=self.settings.codec, verify=verify,
                                     residual=contribution.fragment_residual(self.residual, fragment))
        async with self.state_lock:
            done = await trio.to_thread.run_sync(assemble)
            self.residual = contribution.stage_residual(self.residual, done.residual, fragment, self.outer.numel)
        for index, reason in done.refused.items():  # an owner's aggregate far from our own: a lying owner
            self.strikes.refuse(outcome.owner(index), self.outer.rounds,
                                f"aggregate of piece {index}: {reason}")
        return done

    # --- inbound -----------------------------------------------------------------------------------

    async def _on_frame(self, peer: str, message, payload: bytes):
        round_, outer, now = self.round, self.outer, trio.current_time()
        assert outer is not None  # prepare() made it before it served this protocol
        if isinstance(message, msgs.Hello):
            ours = msgs.Hello(self.stage, outer.rounds, outer.numel, self.settings.codec, False, False, (),
                              self.run_id)  # our status: not in a round with it
            if not self._our_run(peer, message):
                return ours  # its run's replicas are not ours: we never meet it
            if peer not in self._replicas():  # not announced for our stage, or it sent us poison too often:
                return ours  # we do not meet it (a stranger cannot join our groups)
            if round_ is not None and message.round == round_.round and message.stage == self.stage:
                reply, actions = round_.on_hello(peer, message, now)
                self._do(round_, actions)
                return dataclasses.replace(reply, run=self.run_id) if isinstance(reply, msgs.Hello) else reply
            if message.stage == self.stage and message.ready:
                self._note_ahead(peer, message.round)
            return ours
        self.bytes_received += len(payload)
        if not isinstance(message, (msgs.Part, msgs.Result)):
            raise RemoteProtocolError(f"{message.TYPE} is not a DiLoCo request")
        if round_ is None or message.round != round_.round:
            self.counts["late_messages"] += 1
            return msgs.Reply(message.round, message.shard, False, "not in that round")
        if isinstance(message, msgs.Part):
            answer, actions = round_.on_part(peer, message, payload, now)
        else:
            answer, actions = round_.on_result(peer, message, payload, now)
        self._do(round_, actions)
        return answer

    def _our_run(self, peer: str, hello: msgs.Hello) -> bool:
        """Whether ``hello`` comes from a replica of our run; another run's is logged once per peer."""
        if hello.run == self.run_id:
            return True
        self.counts["other_run_hellos"] += 1
        if peer not in self._other_runs:
            self._other_runs.add(peer)
            log.warning("peer %s is training run %s, we train run %s: refusing its outer rounds (replicas must "
                        "train the same run: the same --run file, or the same model and DiLoCo flags)", peer,
                        hello.run.hex(), self.run_id.hex())
        return False

    # --- status --------------------------------------------------------------------------------------

    def outer_round(self) -> int:
        return self.outer.rounds if self.outer else 0

    def doc(self) -> dict:
        engine = self.swarm.engine if self.swarm else None
        ledger = self.swarm.ledger.stats(trio.current_time()) if self.swarm else None
        return status.diloco_doc(self, step=engine.step if engine else 0,
                                 compute_s=ledger.busy_fraction * ledger.elapsed if ledger else 0.0)

    def routes(self) -> dict:
        async def doc_json(params: dict) -> dict:
            return self.doc()

        return {"/api/diloco": doc_json}
