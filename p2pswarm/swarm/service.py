"""A peer's training: its stage's compute engine fed by the activation protocol, and SWARM routing.

``SwarmService`` is what ``p2pswarm join`` runs once the node has its stage. It is the trio
driver of the stage's pure core (``swarm/stage_core.py``: buffers, in-flight book, hand-on,
counts), which it feeds events and whose ``Effects`` it carries out:

- **inbound**: ``/p2pswarm/activation/1.0.0`` frames are checked (``admission``: a request for our
  stage with a fitting priority; ``codec``: right shape and dtype, targets where the last stage
  needs them; a peer that sends anything else has its stream reset and is refused for
  ``BAN_PERIOD``), queued in the bounded priority buffer and acked with our queue depth, or
  refused with ``Busy`` when the buffer is full;
- **compute**: one worker takes the most urgent micro-batch and runs it (``engine.StageEngine``) on
  the engine's one long-lived thread (``compute_thread``), so the trio loop never waits on torch;
  ``codec.encode_outputs`` turns the results into frames on that thread; when the outbound queue
  is full the step counts as local-only and the worker goes on;
- **inference**: ``/p2pswarm/infer/1.0.0`` steps of generation sessions (``swarm/inference.py``) run
  on the inference thread beside training (agreed weights), never in the training buffers;
- **outbound**: ``SENDERS`` tasks deliver forwards to the next stage with failover and
  gradients back to the peer each micro-batch came from (``swarm/sender.py``);
- **stage 0** cuts micro-batches and sends the held-out rounds (``swarm/feeding.py``); the last
  stage keeps the loss average and the held-out figures (``swarm/losses.py``);
- **upkeep**: candidates, warm streams, dead paths, stage health (``swarm/upkeep.py``).

Node-local knobs come in as ``tunables`` (``run/tunables.py``), never from the environment.
``doc()`` is ``GET /api/swarm`` (``swarm/status.py``). ``node.py`` imports this module (and so
torch) only for a training peer.
"""

from __future__ import annotations

import logging
import os
import random
import time

import trio

from p2pswarm import wire
from p2pswarm.dht.health import BlockWatch
from p2pswarm.errors import RemoteProtocolError
from p2pswarm.model.catalog import ModelSpec
from p2pswarm.model.tokenizer import ByteTokenizer
from p2pswarm.run.placement import Placement
from p2pswarm.run.training import TrainConfig
from p2pswarm.run.tunables import Tunables
from p2pswarm.swarm import admission, codec, losses, status
from p2pswarm.swarm import engine as eng
from p2pswarm.swarm.activation import (
    PROTOCOL_ID,
    SESSION_BYTES,
    UNNAMED_RUN,
    Ack,
    Backward,
    Forward,
)
from p2pswarm.swarm.buffers import Priority
from p2pswarm.swarm.compute_thread import ComputeThread, open_compute_thread
from p2pswarm.swarm.evaluation import EvalBook
from p2pswarm.swarm.feeding import Feeder
from p2pswarm.swarm.inference import PROTOCOL_ID as INFER_PROTOCOL
from p2pswarm.swarm.inference import InferenceServer, max_step_bytes
from p2pswarm.swarm.router import Router
from p2pswarm.swarm.sender import Deliverer
from p2pswarm.swarm.stage_core import Count, Effects, Job, Send, StageCore
from p2pswarm.swarm.upkeep import Upkeep
from p2pswarm.swarm.wakeup import Wakeup

log = logging.getLogger(__name__)

BATCH_ROWS = 8  # sequences per training micro-batch: 8 x 128 bytes, ~1 MiB of activations
SENDERS = 4  # concurrent deliveries: a slow peer never holds up the others


class SwarmService:
    """The training of one stage by one peer (module docstring)."""

    def __init__(self, *, spec: ModelSpec, stage: int, me: str, pool, stage_map, host,
                 config: TrainConfig = TrainConfig(), data: str | None = None,
                 threads: int | None = None, rng: random.Random | None = None, extensions=(),
                 placement: Placement = Placement(), run=None, tokenizer=None,
                 tunables: Tunables = Tunables(), moved_from: frozenset[int] = frozenset()) -> None:
        self.spec, self.stage, self.me, self.tunables = spec, stage, me, tunables
        self.moved_from = moved_from  # stages this node served before a move: their tensors are answered "moved"
        self.tokenizer = tokenizer or ByteTokenizer()  # the run's (model/tokenizer.py): what stage 0 feeds
        self.training_run = run  # the RunSpec we train (p2pswarm.run.spec); None: unnamed (tests)
        self.run_id = run.run_bytes if run is not None else UNNAMED_RUN  # every frame we send carries it
        self._other_runs: set[str] = set()  # peers of another run, logged once each
        self._pool, self._stage_map, self._host = pool, stage_map, host
        self.config, self._threads = config, threads
        self.placement = placement  # the engine's device and precision (swarm/device.py)
        self.compute: ComputeThread | None = None  # the engine's one thread, while run() runs
        self.rng = rng or random.Random()
        self.is_first, self.is_last = stage == 0, stage == spec.last_stage
        self.layout = codec.Layout.of(spec, stage, config, self.run_id, me)
        self.max_in_flight = tunables.in_flight_bound(spec.n_stages)  # stage 0's bound
        self.core = StageCore(is_first=self.is_first, is_last=self.is_last, max_in_flight=self.max_in_flight,
                              now=trio.current_time())
        core = self.core  # its parts, as the API, DiLoCo and tests read them:
        self.inbound, self.outbound = core.inbound, core.outbound
        self.ledger, self.inflight = core.ledger, core.inflight
        self.counts = core.counts
        self.bans = admission.Bans()
        self._banned = self.bans.until  # peer -> until when it is refused
        self.router = Router(self.rng)
        self.evals = EvalBook(config.eval_batches)  # the run's held-out micro-batches per round
        self.engine: eng.StageEngine | None = None
        self.inference: InferenceServer | None = None  # inference sessions (swarm/inference.py), once running
        self.engine_lock = trio.Lock()  # one user of the engine's tensors at a time: the worker, or DiLoCo
        self.extensions = list(extensions)  # e.g. DiLoCo: prepare(service) before training, run(service) beside it
        self.deliverer: Deliverer | None = None
        self.train_loss_bpb: float | None = None
        self.work_ready, self.sends_ready, self.progress = Wakeup(), Wakeup(), Wakeup()  # progress: stage 0's feeders
        self.session = os.urandom(SESSION_BYTES)
        self.blocks = BlockWatch(serving=stage)  # stage 0: which down stages keep us from training
        self.upkeep = Upkeep(self, affinity=tunables.affinity)
        self.feeder = Feeder(self, data, tunables.eval_share)
        # the parts' entry points under the names tests call them by
        self._feed, self._load_corpus = self.feeder.feed, self.feeder.load_corpus
        self._check_blocked, self._note_slow_links = self.upkeep.check_blocked, self.upkeep.note_slow_links

    # --- running --------------------------------------------------------------------------------

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with open_compute_thread(f"p2pswarm-stage{self.stage}") as self.compute:
            await self._train(task_status)

    async def _train(self, task_status) -> None:
        assert self.compute is not None  # run() opened it
        eng.set_threads(self._threads)
        self.engine = await self.compute.run(eng.StageEngine, self.spec, self.stage, self.config, self.placement)
        for extension in self.extensions:
            await extension.prepare(self)  # e.g. load our stage's current weights from a neighbour
        log.info("training stage %d of %s: %d parameters, lr %g, on %s in %s", self.stage, self.spec.name,
                 self.engine.module.param_count(), self.config.lr, self.placement.device, self.placement.precision)
        async with trio.open_nursery() as nursery:
            for extension in self.extensions:
                nursery.start_soon(extension.run, self)
            self.deliverer = Deliverer(self._pool, self.router, tunables=self.tunables,
                                       on_acked=lambda key, peer: self.apply(self.core.acked(key, peer)),
                                       on_lost=lambda send, why: self.apply(self.core.lost(send)),
                                       on_peer_error=lambda peer: self.apply(self.core.peer_failed(peer)))
            max_payload = codec.max_payload(self.spec, self.config.activation_dtype)
            self._pool.serve(PROTOCOL_ID, self._on_frame, max_payload=max_payload)
            self.inference = InferenceServer(self)  # generation's sessions, on their own thread
            self._pool.serve(INFER_PROTOCOL, self.inference.on_frame, max_payload=max_step_bytes(self.spec))
            nursery.start_soon(self._compute_worker)
            nursery.start_soon(self.upkeep.release_held)
            for _ in range(SENDERS):
                nursery.start_soon(self._sender)
            nursery.start_soon(self.upkeep.run)
            task_status.started(self)
            if self.is_first:
                await self.feeder.start(nursery)

    def apply(self, effects: Effects) -> None:
        """Carry out what the core asked for: forget graphs, blame peers, wake waiters."""
        for key in effects.forget:
            if self.engine is not None:
                self.engine.forget(key)
        for peer in effects.blame:
            self.router.observe_failure(peer, time.time())
        for peer, offset in effects.worked:
            if self._stage_map is not None:  # work we saw: counts the peer as serving its stage (dht.work)
                self._stage_map.saw(peer, self.stage + offset)
        if effects.work:
            self.work_ready.notify()
        if effects.sends:
            self.sends_ready.notify()
        if effects.progress:
            self.progress.notify()

    # --- inbound ----------------------------------------------------------------------------------

    async def _on_frame(self, peer: str, message, payload: bytes):
        if self.bans.barred(peer, trio.current_time()):
            raise RemoteProtocolError(f"{peer} is refused for sending garbage")
        if isinstance(message, (Forward, Backward)) and message.run != self.run_id:
            return self._refuse_other_run(peer, message.run)
        if isinstance(message, (Forward, Backward)) and message.stage != self.stage:  # no garbage: no ban
            return self._refuse_wrong_stage(peer, message.stage)
        try:
            job, priority = self._job_from(peer, message, payload)
        except RemoteProtocolError as exc:
            self.counts[Count.GARBAGE_FRAMES] += 1
            self.bans.bar(peer, trio.current_time())
            log.warning("dropping %s: %s", peer, exc)
            raise
        if job is None:  # a gradient for a micro-batch given up already
            return Ack(message.micro_batch, len(self.inbound))
        reply, effects = self.core.admit(job, priority, trio.current_time())
        self.apply(effects)
        return reply

    def _refuse_other_run(self, peer: str, run: bytes) -> wire.ErrorReply:
        """A tensor of another run: never computed, answered with a refusal (not a ban: it is no garbage,
        only not ours), and logged once per peer."""
        self.counts[Count.OTHER_RUN_FRAMES] += 1
        ours = f"run {self.run_id.hex()}" + (f" ({self.training_run.name})" if self.training_run is not None else "")
        if peer not in self._other_runs:
            self._other_runs.add(peer)
            log.warning("peer %s is training run %s, we train %s: refusing its tensors (peers must train the "
                        "same run: the same --run file, or the same model and DiLoCo flags)", peer, run.hex(), ours)
        return wire.ErrorReply("other-run", f"this peer trains {ours}, not run {run.hex()}")

    def _refuse_wrong_stage(self, peer: str, stage: int) -> wire.ErrorReply:
        """A tensor for a stage we do not serve: its sender's map still shows where we were before a move
        (records live RECORD_TTL). Refused, not barred: it is no garbage, and the sender routes elsewhere."""
        self.counts[Count.WRONG_STAGE_FRAMES] += 1
        log.debug("peer %s sent a tensor for stage %d; we serve stage %d", peer, stage, self.stage)
        if stage in self.moved_from:
            return wire.ErrorReply("moved", f"this peer moved from stage {stage} to stage {self.stage}")
        return wire.ErrorReply("wrong-stage", f"this peer serves stage {self.stage}, not stage {stage}")

    def _job_from(self, peer: str, message, payload: bytes) -> tuple[Job | None, Priority]:
        """The job a frame asks for (None: a late gradient); RemoteProtocolError for anything we would
        not compute."""
        admission.check_request(message)
        codec.check_header(message, self.layout)
        kind = admission.classify(message, stage=self.stage, is_last=self.is_last, waiting=self.inflight.awaiting(peer))
        if kind is None:
            self.counts[Count.LATE_GRADIENTS] += 1
            return None, Priority.TRAINING_BACKWARD
        work = codec.decode_work(kind, message, payload, self.layout)
        if kind == "eval":
            return Job(work, peer, message.path, trio.current_time()), Priority(message.priority)
        return Job(work, peer), Priority(message.priority)

    # --- compute --------------------------------------------------------------------------------

    async def _compute_worker(self) -> None:
        assert self.engine is not None and self.compute is not None  # _train made them first
        while True:
            job, effects = self.core.take(self.engine.agreed_round, trio.current_time())
            self.apply(effects)
            if job is None:
                await self.work_ready.wait()
                continue
            started = trio.current_time()
            try:
                async with self.engine_lock:
                    sends, out = await self.compute.run(self._compute, job)
            except Exception as exc:  # a bad tensor from a peer, or a bug: one micro-batch lost, never the node
                log.warning("micro-batch %d of %s failed on stage %d: %r (given up; training goes on)", job.work.key[1],
                            job.upstream or "us", self.stage, exc)
                self.apply(self.core.failed(job, trio.current_time()))
                continue
            if out.loss_nats is not None:
                self._record_loss(job, out)
            now = trio.current_time()
            self.apply(self.core.done(job, sends, now - started, now))

    async def with_engine(self, fn):
        """``fn(engine)`` on the engine's compute thread, between two jobs of the compute worker."""
        assert self.compute is not None  # run() opened it
        async with self.engine_lock:
            return await self.compute.run(fn, self.engine)

    def _compute(self, job: Job) -> tuple[list[Send], eng.Output]:
        """Compute thread: run the job, turn its output into frames (tensor bytes made off the loop).
        Only the engine is touched here; the service's own state changes on the trio side."""
        assert self.engine is not None  # _train made it first
        out = self.engine.compute(job.work)
        return codec.encode_outputs(job, out, self.layout, self.engine.step, self.engine.host_out), out

    def _record_loss(self, job: Job, out: eng.Output) -> None:
        """The last stage's loss of a micro-batch: into its held-out round, or into the training average."""
        if job.work.kind == "eval":
            return losses.record_heldout(self.evals, self.tokenizer, job, out, self.me)
        assert out.loss_nats is not None  # called for a loss only
        average = losses.train_loss(self.train_loss_bpb, out.loss_nats, out.tokens)
        if average is None:  # NaN or inf activations from a peer: the step is skipped, the average kept
            self.counts[Count.NON_FINITE_LOSSES] += 1
        else:
            self.train_loss_bpb = average

    # --- outbound -------------------------------------------------------------------------------

    async def _sender(self) -> None:
        assert self.deliverer is not None  # _train made it first
        while True:
            entry = self.outbound.take(trio.current_time())
            if entry is None:
                await self.sends_ready.wait()
                continue
            send: Send = entry.item
            if isinstance(send.message, Forward):
                await self.deliverer.forward(send)
            else:
                await self.deliverer.backward(send)

    # --- status -------------------------------------------------------------------------------------

    @property
    def blocked(self) -> str | None:
        """Why stage 0 does not train now (a stage is down), or None."""
        return self.blocks.reason if self.is_first else None

    @property
    def _local_queued(self) -> int:
        return self.core.local_queued

    def throughput(self) -> float:
        """Tokens/s whose gradients reached our weights, over the last ``upkeep.RATE_WINDOW``."""
        return self.upkeep.throughput()

    def queue_depth(self) -> int:
        return len(self.inbound)

    def doc(self) -> dict:
        return status.swarm_doc(self)

    async def doc_json(self, params: dict) -> dict:
        return self.doc()

    def routes(self) -> dict:
        return {"/api/swarm": self.doc_json}
