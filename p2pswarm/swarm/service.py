"""A peer's training: its stage's compute engine fed by the activation protocol, and SWARM routing.

``SwarmService`` is what ``p2pswarm join`` runs once the node has its stage:

- **inbound**: ``/p2pswarm/activation/1.0.0`` frames are checked (right stage, right shape and
  dtype, targets where the last stage needs them; a peer that sends anything else has its stream
  reset and is refused for ``BAN_PERIOD``), queued in the bounded priority buffer and acked with
  our queue depth, or refused with ``Busy`` when the buffer is full;
- **compute**: one worker takes the most urgent micro-batch and runs it (``engine.StageEngine``) on
  the engine's one long-lived thread (``compute_thread``), so the trio loop never waits on torch;
  results go to the outbound queue, and when that is full the step counts as local-only and the
  worker goes on;
- **inference**: ``/p2pswarm/infer/1.0.0`` steps of generation sessions (``swarm/inference.py``) run
  on the inference thread beside training (agreed weights), never in the training buffers;
- **outbound**: ``SENDERS`` tasks deliver forwards to the next stage with failover and
  gradients back to the peer each micro-batch came from (``swarm/sender.py``);
- **stage 0** cuts micro-batches from its own offset of the corpus, keeps one in flight per stage
  (``MIN_IN_FLIGHT`` at least: more is more staleness, see the engine's weight prediction), and after each DiLoCo outer round (every ``EVAL_PERIOD`` without DiLoCo; later
  where a round takes over 1/EVAL_SHARE of the time to compute and send) sends the fixed held-out
  set through the swarm, to be evaluated on that round's agreed weights at every stage (a stage
  not there yet holds it, ``EVAL_HOLD`` at most); the last stage turns those into held-out bits
  per byte per chain (``swarm/evaluation.py``);
- **upkeep**: candidates of the next stage from the stage map into the router, our partner among
  them (``router.partner_for``: fixed chains of replicas), streams to the best of them kept warm,
  micro-batches whose path died given up (``swarm/inflight.py``); stage 0 also reads every stage's
  health from the stage map and, while a stage is down (``heal.health.BlockWatch``), cuts no
  micro-batches and says why, once, in its log and in ``/api/swarm`` ``blocked``.

``doc()`` is ``GET /api/swarm``. This module and the engine are the only networking-side code
that imports torch; ``node.py`` imports this module only for a training peer.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import math
import os
import random
import time
from collections import Counter
from dataclasses import dataclass


import trio

from p2pswarm.errors import ConfigError, RemoteProtocolError
from p2pswarm.dht.health import BLOCK_CHECK_S, BlockWatch
from p2pswarm.model import corpus as corpora
from p2pswarm.model import token_shards
from p2pswarm.model.tokenizer import ByteTokenizer
from p2pswarm.model.catalog import ModelSpec
from p2pswarm.swarm import engine as eng
from p2pswarm import wire
from p2pswarm.swarm.activation import (MAX_RETRY_AFTER_MS, NO_ROUND, PROTOCOL_ID, SESSION_BYTES, UNNAMED_RUN, Ack,
                                       Backward, Busy, Forward)
from p2pswarm.swarm.compute_thread import ComputeThread, open_compute_thread
from p2pswarm.swarm.device import Placement
from p2pswarm.swarm.buffers import EngineLedger, Outcome, Priority, hand_on, inbound_buffer, outbound_queue
from p2pswarm.swarm.evaluation import EVAL_BATCHES, EVAL_ROWS, EvalBook, agreement
from p2pswarm.swarm.inference import PROTOCOL_ID as INFER_PROTOCOL
from p2pswarm.swarm.inference import InferenceServer, max_step_bytes
from p2pswarm.swarm.inflight import InFlight, RecentKeys
from p2pswarm.swarm.router import Candidate, Router, partner_for
from p2pswarm.swarm.sender import Deliverer, Send

log = logging.getLogger(__name__)

BATCH_ROWS = 8  # sequences per training micro-batch: 8 x 128 bytes, ~1 MiB of activations
MAX_ROWS = 256  # rows a peer may send us in one micro-batch
IN_FLIGHT_ENV = "P2PSWARM_MAX_IN_FLIGHT"  # benches only: stage 0's in-flight bound (the staleness ablation)
MIN_IN_FLIGHT = 2  # stage-0 micro-batches between being cut and their gradient coming back: one per stage (1F1B),
#                 two at least. Each one more is one optimizer step of staleness: 5 cost 18 % per token (bench)
SENDERS = 4  # concurrent deliveries: a slow peer never holds up the others
EVAL_PERIOD = 10.0  # seconds between held-out evaluation rounds sent by a stage-0 peer
EVAL_SHARE = 10  # a round that takes t seconds to compute and send waits (EVAL_SHARE - 1) x t before the next:
#                 8 x 32 rows are 16.8 MB of activations, 6.7 s of a 20 Mbit/s uplink every 10 s otherwise; on
#                 tiny-lm a round costs about a quarter of 40 training steps (bench: 5 cost 0.57x one process's tok/s)
EVAL_SHARE_ENV = "P2PSWARM_EVAL_SHARE"  # tests only: "1" evaluates every outer round (export's round trip needs the
#                 figure of the round it exported)
UPKEEP_PERIOD = 0.5  # seconds between candidate refreshes, stream warming and in-flight checks
WARM_STREAMS = 2  # idle streams kept open to each of the router's best candidates
BAN_PERIOD = 60.0  # seconds a peer that sent us garbage is refused
RATE_WINDOW = 20.0  # seconds over which throughput (tokens/s) is measured
SLOW_LINK_FACTOR = 4.0  # a link whose transfer of a micro-batch takes this many compute times bounds training
LOSS_EMA = 0.05  # weight of a new micro-batch in the training-loss average
AFFINITY_ENV = "P2PSWARM_AFFINITY"  # benches only: "0" turns stage-to-stage affinity off (the ablation)
EVAL_HOLD = 30.0  # seconds an evaluation waits for our outer round to reach stage 0's (a round's gather + reduce)
MAX_HELD_EVALS = 4 * EVAL_BATCHES  # evaluations held at once: a few rounds' worth, never unbounded


@dataclass(frozen=True)
class Job:
    """A unit of work in the inbound buffer, with the peer it came from (None: cut here)."""

    work: eng.Work
    upstream: str | None
    path: tuple[str, ...] = ()  # an evaluation's chain so far: the peers of the stages before us
    arrived: float = 0.0  # trio time it came in: an evaluation waits for our outer round EVAL_HOLD at most


class SwarmService:
    """The training of one stage by one peer (module docstring)."""

    def __init__(self, *, spec: ModelSpec, stage: int, me: str, pool, stage_map, host,
                 config: eng.TrainConfig = eng.TrainConfig(), data: str | None = None,
                 threads: int | None = None, rng: random.Random | None = None, extensions=(),
                 placement: Placement = Placement(), run=None, tokenizer=None) -> None:
        self.spec, self.stage, self.me = spec, stage, me
        self.tokenizer = tokenizer or ByteTokenizer()  # the run's (model/tokenizer.py): what stage 0 feeds
        self.training_run = run  # the RunSpec we train (p2pswarm.run.spec); None: unnamed (tests)
        self.run_id = run.run_bytes if run is not None else UNNAMED_RUN  # every frame we send carries it
        self._other_runs: set[str] = set()  # peers of another run, logged once each
        self._pool, self._stage_map, self._host = pool, stage_map, host
        self.config, self._data, self._threads = config, data, threads
        self.placement = placement  # the engine's device and precision (swarm/device.py)
        self.compute: ComputeThread | None = None  # the engine's one thread, while run() runs
        self.rng = rng or random.Random()
        self.is_first, self.is_last = stage == 0, stage == spec.last_stage
        now = trio.current_time()
        self.inbound, self.outbound = inbound_buffer(now), outbound_queue(now)
        self.ledger = EngineLedger(now)
        self.inflight = InFlight()
        self.taken = RecentKeys()  # micro-batches taken from peers: copies are duplicates
        self.router = Router(self.rng)
        self.affinity = os.environ.get(AFFINITY_ENV, "1") != "0"  # prefer one partner of the next stage
        self.evals = EvalBook()
        self.engine: eng.StageEngine | None = None
        self.inference: InferenceServer | None = None  # inference sessions (swarm/inference.py), once running
        self.engine_lock = trio.Lock()  # one user of the engine's tensors at a time: the worker, or DiLoCo
        self.extensions = list(extensions)  # e.g. DiLoCo: prepare(service) before training, run(service) beside it
        self.deliverer: Deliverer | None = None
        self.counts: Counter = Counter()
        self.train_loss_bpb: float | None = None
        self._banned: dict[str, float] = {}
        self._slow: dict[str, str] = {}  # next-stage peer -> why its link bounds training
        self._slow_logged: set[str] = set()  # peers whose slowness was logged already
        self._work_ready = trio.Event()
        self._sends_ready = trio.Event()
        self._progress = trio.Event()
        self._local_queued = 0
        self._evals_queued = 0  # held-out batches cut here and not yet computed
        self._eval_sends: set = set()  # held-out batches computed here and not yet acked downstream
        self._held_evals: list[Job] = []  # evaluations waiting for our outer round to reach theirs
        self._compute_s = 0.05  # EMA of one job's compute time: the basis of Busy's retry-after
        self._rate: collections.deque = collections.deque()
        self.session = os.urandom(SESSION_BYTES)
        self.max_in_flight = int(os.environ.get(IN_FLIGHT_ENV) or max(MIN_IN_FLIGHT, spec.n_stages))
        self.eval_share = max(1, int(os.environ.get(EVAL_SHARE_ENV) or EVAL_SHARE))  # read once, like the in-flight bound
        self.blocks = BlockWatch(serving=stage)  # stage 0: which down stages keep us from training
        self._blocks_checked = -math.inf

    # --- running --------------------------------------------------------------------------------

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with open_compute_thread(f"p2pswarm-stage{self.stage}") as self.compute:
            await self._train(task_status)

    async def _train(self, task_status) -> None:
        eng.set_threads(self._threads)
        self.engine = await self.compute.run(eng.StageEngine, self.spec, self.stage, self.config, self.placement)
        for extension in self.extensions:
            await extension.prepare(self)  # e.g. load our stage's current weights from a neighbour
        log.info("training stage %d of %s: %d parameters, lr %g, on %s in %s", self.stage, self.spec.name,
                 self.engine.module.param_count(), self.config.lr, self.placement.device, self.placement.precision)
        async with trio.open_nursery() as nursery:
            for extension in self.extensions:
                nursery.start_soon(extension.run, self)
            self.deliverer = Deliverer(self._pool, self.router, on_acked=self._sent,
                                       on_lost=self._send_lost, on_peer_error=self._downstream_failed)
            self._pool.serve(PROTOCOL_ID, self._on_frame, max_payload=self._max_payload())
            self.inference = InferenceServer(self)  # generation's sessions, on their own thread
            self._pool.serve(INFER_PROTOCOL, self.inference.on_frame, max_payload=max_step_bytes(self.spec))
            nursery.start_soon(self._compute_worker)
            nursery.start_soon(self._release_held_evals)
            for _ in range(SENDERS):
                nursery.start_soon(self._sender)
            nursery.start_soon(self._upkeep)
            task_status.started(self)
            if self.is_first:
                corpus = await trio.to_thread.run_sync(self._load_corpus)
                log.info("stage 0 reads %s", corpus.describe())
                nursery.start_soon(self._feed, corpus)
                nursery.start_soon(self._evaluate, corpus)

    def _max_payload(self) -> int:
        """The largest micro-batch a peer may send us: MAX_ROWS x context in the run's activation
        dtype with its targets, within one frame (``model.plan``)."""
        from p2pswarm.run import plan  # sizes only (pure): imported here, where the bound is made

        return plan.max_message_bytes(self.spec, MAX_ROWS, self.spec.context, self.config.activation_dtype)

    def _eval_rows(self, seq: int) -> int:
        """Rows per held-out micro-batch: EVAL_ROWS, or fewer where those would not fit one frame."""
        from p2pswarm.run import plan

        return plan.fitting_rows(self.spec, EVAL_ROWS, seq, self.config.activation_dtype)

    # --- inbound ----------------------------------------------------------------------------------

    async def _on_frame(self, peer: str, message, payload: bytes):
        if self._banned.get(peer, float("-inf")) > trio.current_time():
            raise RemoteProtocolError(f"{peer} is refused for sending garbage")
        if isinstance(message, (Forward, Backward)) and message.run != self.run_id:
            return self._refuse_other_run(peer, message.run)
        try:
            job, priority = self._job_from(peer, message, payload)
        except RemoteProtocolError as exc:
            self.counts["garbage_frames"] += 1
            self._banned[peer] = trio.current_time() + BAN_PERIOD
            log.warning("dropping %s: %s", peer, exc)
            raise
        if job is None:  # a gradient for a micro-batch given up already
            return Ack(message.micro_batch, len(self.inbound))
        taken = (job.work.kind, job.work.key)
        if not self.taken.add(taken):  # a re-send of what we hold or did: never computed twice
            self.counts["duplicates_dropped"] += 1
            return Ack(message.micro_batch, len(self.inbound), duplicate=True)
        if not self.inbound.offer(job, priority, trio.current_time()).accepted:
            self.taken.discard(taken)
            self.counts["busy_replies"] += 1
            retry_ms = min(MAX_RETRY_AFTER_MS, int(1000 * self._compute_s * max(1, len(self.inbound))))
            return Busy(message.micro_batch, len(self.inbound), retry_ms)
        self._work_ready.set()
        return Ack(message.micro_batch, len(self.inbound))

    def _refuse_other_run(self, peer: str, run: bytes) -> wire.ErrorReply:
        """A tensor of another run: never computed, answered with a refusal (not a ban: it is no garbage,
        only not ours), and logged once per peer."""
        self.counts["other_run_frames"] += 1
        ours = f"run {self.run_id.hex()}" + (f" ({self.training_run.name})" if self.training_run is not None else "")
        if peer not in self._other_runs:
            self._other_runs.add(peer)
            log.warning("peer %s is training run %s, we train %s: refusing its tensors", peer, run.hex(), ours)
        return wire.ErrorReply("other-run", f"this peer trains {ours}, not run {run.hex()}")

    def _job_from(self, peer: str, message, payload: bytes) -> tuple[Job | None, Priority]:
        """The job a frame asks for; RemoteProtocolError for anything we would not compute."""
        if not isinstance(message, (Forward, Backward)):
            raise RemoteProtocolError(f"{message.TYPE} is not a request")
        if message.stage != self.stage:
            raise RemoteProtocolError(f"a {message.TYPE} for stage {message.stage}; we serve {self.stage}")
        tensor_bytes, target_bytes = message.split(payload)
        shape = message.shape
        if message.dtype != self.config.activation_dtype or len(shape) != 3 or shape[2] != self.spec.width \
                or not 0 < shape[0] <= MAX_ROWS or not 0 < shape[1] <= self.spec.context:
            raise RemoteProtocolError(f"{message.dtype} {shape} is not a [rows, seq, {self.spec.width}] "
                                      f"{self.config.activation_dtype} micro-batch")
        key = (message.session, message.micro_batch)
        if isinstance(message, Backward):
            if message.priority != Priority.TRAINING_BACKWARD:
                raise RemoteProtocolError(f"a gradient with priority {message.priority}")
            if key not in self.inflight:
                self.counts["late_gradients"] += 1
                return None, Priority.TRAINING_BACKWARD
            work = eng.Work("backward", key, eng.from_wire(message.dtype, shape, tensor_bytes), None)
            return Job(work, peer), Priority.TRAINING_BACKWARD
        if self.is_first or message.priority == Priority.TRAINING_BACKWARD:
            raise RemoteProtocolError(f"a forward with priority {message.priority} for stage {self.stage}")
        if self.is_last and not target_bytes:
            raise RemoteProtocolError("a forward for the last stage without its targets")
        targets = eng.targets_from_bytes(target_bytes, shape[0], shape[1], self.spec.vocab) if target_bytes else None
        if message.priority == Priority.TRAINING_FORWARD:
            work = eng.Work("forward", key, eng.from_wire(message.dtype, shape, tensor_bytes), targets, message.step)
            return Job(work, peer), Priority(message.priority)
        if len(message.rounds) != self.stage:
            raise RemoteProtocolError(f"an evaluation for stage {self.stage} with {len(message.rounds)} rounds")
        work = eng.Work("eval", key, eng.from_wire(message.dtype, shape, tensor_bytes), targets, message.step,
                        message.rounds)
        return Job(work, peer, message.path, trio.current_time()), Priority(message.priority)

    # --- compute --------------------------------------------------------------------------------

    async def _compute_worker(self) -> None:
        while True:
            entry = self.inbound.take(trio.current_time())
            if entry is None:
                self._work_ready = trio.Event()
                await self._work_ready.wait()
                continue
            job: Job = entry.item
            if self._hold_eval(job):
                continue
            if job.upstream is None and job.work.kind == "forward":
                self._local_queued -= 1
            if job.upstream is None and job.work.kind == "eval":
                self._evals_queued -= 1
                self._progress.set()
            self.ledger.begin(trio.current_time())
            started = trio.current_time()
            try:
                async with self.engine_lock:
                    sends, out = await self.compute.run(self._compute, job)
            except Exception as exc:  # a bad tensor from a peer, or a bug: one micro-batch lost, never the node
                log.warning("micro-batch %d of %s failed on stage %d: %r", job.work.key[1],
                            job.upstream or "us", self.stage, exc)
                self.ledger.finish(trio.current_time(), Outcome.DROPPED)
                self._give_up(job.work.key)
                continue
            self._compute_s += 0.1 * (trio.current_time() - started - self._compute_s)
            if job.upstream is not None and job.work.kind == "forward":
                self.counts["forwards_trained"] += 1  # at most once per micro-batch: ``taken``
            if out.loss_nats is not None:
                self._record_loss(job, out)
            self.ledger.finish(trio.current_time(), self._hand_on(job, sends))
            self._progress.set()

    def _hold_eval(self, job: Job) -> bool:
        """An evaluation that asks for an outer round we have not agreed yet (stage 0 finished it
        before us) waits for it, EVAL_HOLD at most, beside the buffer; True if it was held."""
        work, now = job.work, trio.current_time()
        if work.kind != "eval" or not work.rounds or self.engine.agreed_round == NO_ROUND \
                or work.rounds[0] <= self.engine.agreed_round or now - job.arrived > EVAL_HOLD \
                or len(self._held_evals) >= MAX_HELD_EVALS:
            return False
        self._held_evals.append(job)
        return True

    async def _release_held_evals(self) -> None:
        """Back into the buffer: held evaluations whose round we reached, or that waited long enough."""
        while True:
            await trio.sleep(UPKEEP_PERIOD)
            now, agreed = trio.current_time(), self.engine.agreed_round
            ready = [j for j in self._held_evals if j.work.rounds[0] <= agreed or now - j.arrived > EVAL_HOLD]
            for job in ready:
                self._held_evals.remove(job)
                if self.inbound.offer(job, Priority.INFERENCE, now).accepted:
                    self._work_ready.set()

    async def with_engine(self, fn):
        """``fn(engine)`` on the engine's compute thread, between two jobs of the compute worker."""
        async with self.engine_lock:
            return await self.compute.run(fn, self.engine)

    def _compute(self, job: Job) -> tuple[list[Send], eng.Output]:
        """Compute thread: run the job, turn its output into frames (tensor bytes made off the loop).
        Only the engine is touched here; the service's own state changes on the trio side."""
        work, engine = job.work, self.engine
        out = engine.compute(work)
        sends = []
        if out.forward is not None:
            priority = Priority.TRAINING_FORWARD if work.kind == "forward" else Priority.INFERENCE
            dtype, shape, data = engine.wire_out(out.forward)
            targets = eng.targets_to_bytes(work.targets, self.spec.vocab)
            if work.kind == "eval":  # the chain and the outer rounds it was evaluated on so far
                message = Forward(work.key[0], work.key[1], self.stage + 1, int(priority), work.step, dtype, shape,
                                  len(targets), self.run_id, work.rounds + (out.round,), job.path + (self.me,))
            else:
                message = Forward(work.key[0], work.key[1], self.stage + 1, int(priority), engine.step, dtype,
                                  shape, len(targets), self.run_id)
            sends.append(Send(message, data + targets, work.key))
        if out.backward is not None:
            dtype, shape, data = engine.wire_out(out.backward)
            message = Backward(work.key[0], work.key[1], self.stage - 1, int(Priority.TRAINING_BACKWARD),
                               engine.step, dtype, shape, 0, self.run_id)
            sends.append(Send(message, data, work.key, to=job.upstream))  # a backward job: set in _hand_on
        return sends, out

    def _record_loss(self, job: Job, out: eng.Output) -> None:
        work = job.work
        if work.kind == "eval":
            nbytes = None if self.tokenizer.is_bytes else self.tokenizer.count_bytes(work.targets.cpu().numpy())
            done = self.evals.record(work.key[0], work.step, out.loss_nats, out.tokens, time.time(), nbytes,
                                     work.rounds + (out.round,), job.path + (self.me,))
            if done:
                per_token = "" if done.bits_per_token is None else f", {done.bits_per_token:.3f} bits/token"
                weights = "live weights" if done.agreed_round is None else f"outer round {done.agreed_round}"
                log.info("held-out loss %.3f bits/byte%s (%s of stage 0 peer %s, %d tokens, %d bytes)",
                         done.bits_per_byte, per_token, weights, (done.chain or ("?",))[0][-8:], done.tokens,
                         done.bytes or done.tokens)
            return
        bpb = out.loss_nats / out.tokens / math.log(2)
        if not math.isfinite(bpb):  # NaN or inf activations from a peer: the step is skipped, the average kept
            self.counts["non_finite_losses"] += 1
            return
        self.train_loss_bpb = bpb if self.train_loss_bpb is None else \
            self.train_loss_bpb + LOSS_EMA * (bpb - self.train_loss_bpb)

    def _hand_on(self, job: Job, sends: list[Send]) -> Outcome:
        work, now = job.work, trio.current_time()
        if work.kind == "backward":
            entry = self.inflight.finish(work.key)
            if entry is None:  # given up while it was computed: its gradient goes nowhere
                sends = []
            else:
                sends = [dataclasses.replace(s, to=entry.upstream) for s in sends]
                self.counts["micro_batches_done" if self.is_first else "gradients_passed"] += 1
        if work.kind == "forward" and not self.is_last:
            self.inflight.add(work.key, job.upstream, now)
        outcome = Outcome.SENT
        if work.kind == "eval" and self.is_first and sends:
            self._eval_sends.add(work.key)  # on its way until acked or lost
        for send in sends:
            priority = Priority(send.message.priority)
            if hand_on(self.outbound, send, priority, now, len(send.payload)) is Outcome.LOCAL_ONLY:
                outcome = Outcome.LOCAL_ONLY
                self._send_lost(send, "the outbound queue was full")
            else:
                self._sends_ready.set()
        return outcome

    # --- outbound -------------------------------------------------------------------------------

    async def _sender(self) -> None:
        while True:
            entry = self.outbound.take(trio.current_time())
            if entry is None:
                self._sends_ready = trio.Event() if self._sends_ready.is_set() else self._sends_ready
                await self._sends_ready.wait()
                continue
            send: Send = entry.item
            if isinstance(send.message, Forward):
                await self.deliverer.forward(send)
            else:
                await self.deliverer.backward(send)

    def _sent(self, key, peer: str) -> None:
        """The next stage (or the upstream peer) acked ``key``."""
        self.inflight.sent_to(key, peer)
        self._eval_sends.discard(key)
        self._progress.set()

    def _send_lost(self, send: Send, why: str) -> None:
        self.counts["lost_" + send.message.TYPE.split(".")[-1]] += 1
        self._eval_sends.discard(send.key)
        if isinstance(send.message, Forward) and send.message.priority == Priority.TRAINING_FORWARD:
            self._give_up(send.key)

    def _give_up(self, key) -> None:
        if self.inflight.give_up(key) is not None:
            self.counts["given_up"] += 1
        self.engine.forget(key)
        self._progress.set()

    def _downstream_failed(self, peer: str) -> None:
        for key in self.inflight.peer_failed(peer):
            self.engine.forget(key)
            self.counts["given_up"] += 1
        self._progress.set()

    # --- stage 0: data and evaluation ---------------------------------------------------------------

    async def _feed(self, corpus) -> None:
        offset = int.from_bytes(hashlib.sha256(self.me.encode()).digest()[:8], "big")
        batches = corpora.batches(corpus, 0, 1, self.config.seq or self.spec.context, self.config.rows, seed=offset,
                                  offset=offset)
        micro_batch = 0
        while True:
            while self.blocked is not None:
                await trio.sleep(UPKEEP_PERIOD)  # a stage is down: a micro-batch cut now could not complete
            while not self.is_last and not self.router.choose(self.stage + 1, time.time()):
                await trio.sleep(UPKEEP_PERIOD)  # no live peer serves the next stage: nothing to compute for
            while not self.is_last and not self.router.has_room(self.stage + 1, time.time()):
                await self.deliverer.wait_for_room()  # paced: cut only what the next stage absorbs
            while self._local_queued + self.inflight.waiting_from(None) >= self.max_in_flight:
                await self._next_progress()
            try:
                batch = await trio.to_thread.run_sync(next, batches)
            except ConfigError as exc:  # the corpus vanished under us: stop cutting, keep serving
                log.error("stage 0 stops cutting micro-batches: %s", exc)
                return
            ids = eng.ids_tensor(batch.rows)
            work = eng.Work("forward", (self.session, micro_batch), ids[:, :-1], ids[:, 1:].contiguous())
            micro_batch += 1
            if self.inbound.offer(Job(work, None), Priority.TRAINING_FORWARD, trio.current_time()).accepted:
                self._local_queued += 1
                self._work_ready.set()
            else:
                await trio.sleep(UPKEEP_PERIOD)

    async def _next_progress(self) -> None:
        """Until the next progress (a job done, a micro-batch given up); any number of waiters."""
        if self._progress.is_set():
            self._progress = trio.Event()
        await self._progress.wait()

    def _load_corpus(self):
        """Worker thread: the corpus (--data or the stdlib), tokenized into shards unless tokens are bytes."""
        if self.tokenizer.vocab_size > self.spec.vocab:
            raise ConfigError(f"tokenizer {self.tokenizer.name} has {self.tokenizer.vocab_size} tokens, more than "
                              f"the {self.spec.vocab} of model {self.spec.name}")
        if self.tokenizer.vocab_size != self.spec.vocab:
            log.warning("model %s has %d tokens, tokenizer %s %d: ids above %d are never fed", self.spec.name,
                        self.spec.vocab, self.tokenizer.name, self.tokenizer.vocab_size, self.tokenizer.vocab_size - 1)
        corpus = corpora.load_corpus(self._data)
        return corpus if self.tokenizer.is_bytes else token_shards.tokenize_corpus(corpus, self.tokenizer)

    async def _evaluate(self, corpus) -> None:
        seq = self.config.seq or self.spec.context
        rows = self._eval_rows(seq)  # EVAL_BATCHES micro-batches a round, each within one frame
        held = await trio.to_thread.run_sync(
            lambda: list(corpora.heldout_batches(corpus, seq, rows, EVAL_BATCHES * rows)))
        if not held:
            log.warning("the corpus has no held-out part: no evaluation")
            return
        session, micro_batch, evaluated = os.urandom(SESSION_BYTES), 0, None
        while not self.is_last and not self.router.choose(self.stage + 1, time.time()):
            await trio.sleep(UPKEEP_PERIOD)  # round 0 measures the untrained model: wait until it can go through
        while True:
            round_ = await self._next_eval_round(evaluated)
            for batch in held:
                ids = eng.ids_tensor(batch.rows)
                work = eng.Work("eval", (session, micro_batch), ids[:, :-1], ids[:, 1:].contiguous(), round_)
                micro_batch += 1
                if self.inbound.offer(Job(work, None), Priority.INFERENCE, trio.current_time()).accepted:
                    self._evals_queued += 1
                    self._work_ready.set()
            evaluated, began = round_, trio.current_time()
            while self._evals_queued or self._eval_sends:  # never stack rounds that starve training
                await self._next_progress()
            # a round on a slow machine or line takes its share at most: 1 / EVAL_SHARE of the time
            spent = trio.current_time() - began
            await trio.sleep(max((self.eval_share - 1) * spent,
                                 EVAL_PERIOD - spent if self.engine.agreed_round == NO_ROUND else 0.0))

    async def _next_eval_round(self, evaluated: int | None) -> int:
        """What the next held-out round evaluates. With outer rounds: the agreed weights of our newest
        one, once it is newer than the last evaluated (every stage evaluates the same round: the
        figure of one model, the same through every chain). Without: our live weights, and the next
        number."""
        if self.engine.agreed_round == NO_ROUND:
            return 0 if evaluated is None else evaluated + 1
        while evaluated is not None and self.engine.agreed_round <= evaluated:
            await trio.sleep(UPKEEP_PERIOD)
        return self.engine.agreed_round

    # --- upkeep and status ------------------------------------------------------------------------

    async def _upkeep(self) -> None:
        warming: set[str] = set()
        async with trio.open_nursery() as nursery:
            while True:
                now = time.time()
                if not self.is_last:
                    candidates = self._stage_map.candidates(self.stage + 1)
                    self.router.offer([Candidate.from_record(r) for r in candidates], now)
                    self._choose_partner()
                    for peer in self.router.choose(self.stage + 1, now):
                        if peer not in warming:
                            warming.add(peer)
                            nursery.start_soon(self._warm, peer, warming)
                connected = {str(p) for p in self._host.get_connected_peers()}
                for peer in {e.sent_to for e in self.inflight.entries() if e.sent_to} - connected:
                    self._downstream_failed(peer)
                self._expire_in_flight()
                if self.inference is not None:
                    self.inference.expire(trio.current_time())  # idle sessions' KV caches freed
                self._note_slow_links()
                self._sample_rate()
                self._banned = {p: t for p, t in self._banned.items() if t > trio.current_time()}
                if self.is_first:
                    await self._check_blocked()
                await trio.sleep(UPKEEP_PERIOD)

    @property
    def blocked(self) -> str | None:
        """Why stage 0 does not train now (a stage is down), or None."""
        return self.blocks.reason if self.is_first else None

    async def _check_blocked(self) -> None:
        """Stage 0, every BLOCK_CHECK_S: is a stage down? Logged once when that starts and once when it ends.
        ``current(wait=0)`` starts a stale map's rebuild in the background (every stage's records fresh)."""
        now = time.time()
        if now - self._blocks_checked < BLOCK_CHECK_S:
            return
        self._blocks_checked = now
        await self._stage_map.current(wait=0)
        line = self.blocks.observe(self._stage_map.counts(), now)
        if line is not None:
            log.log(logging.WARNING if self.blocks.down else logging.INFO, line)

    def _choose_partner(self) -> None:
        """Our partner in the next stage (affinity, ``router.partner_for``); none when affinity is off.
        Both lists are the stage map's fresh records, which every replica reads alike, not the peers
        that answered *us* (on a loaded machine those flicker per observer, and two replicas that
        miss each other pick the same partner); the router still sends only to a live partner."""
        if not self.affinity:
            return self.router.set_partner(self.stage + 1, None)
        mine, nexts = ([r.peer_id for r in self._stage_map.pool(s)] for s in (self.stage, self.stage + 1))
        self.router.set_partner(self.stage + 1, partner_for(self.me, mine, nexts))

    def _note_slow_links(self) -> None:
        """Flag (and log, once per peer) a next-stage peer reachable only through a relay whose best
        measured rate, not compute, would bound training: a micro-batch's transfer at the fastest
        rate seen takes over SLOW_LINK_FACTOR x our compute time."""
        size = self.router.frame_size
        for peer, state in list(self.router.peers.items()):
            fastest = self.router.link(peer).fastest
            transfer = size / fastest if fastest else 0.0
            if not (state.candidate.relayed and transfer > SLOW_LINK_FACTOR * self._compute_s):
                self._slow.pop(peer, None)
                continue
            why = (f"its only path is a relay at {fastest * 8 / 1e6:.1f} Mbit/s at best: a {size / 1024:.0f} KiB "
                   f"micro-batch takes {transfer:.2f} s, {transfer / self._compute_s:.0f}x our compute time")
            if peer not in self._slow_logged:
                self._slow_logged.add(peer)
                log.warning("peer %s of stage %d is too slow for its stage: %s", peer, state.candidate.stage, why)
            self._slow[peer] = why

    def _expire_in_flight(self) -> None:
        """Give up micro-batches whose gradient is overdue; a peer that took one and never sent its
        gradient back is backed off (measured from our side: its acks alone prove nothing)."""
        for key, entry in self.inflight.expire(trio.current_time()):
            self.engine.forget(key)
            self.counts["given_up"] += 1
            if entry.sent_to is not None:
                self.counts["gradients_overdue"] += 1
                self.router.observe_failure(entry.sent_to, time.time())
            self._progress.set()

    async def _warm(self, peer: str, warming: set[str]) -> None:
        try:
            with trio.move_on_after(10):
                await self._pool.warm(peer, PROTOCOL_ID, WARM_STREAMS)
        except Exception as exc:  # a candidate we cannot reach: the sender will find out and back it off
            log.debug("could not warm streams to %s: %r", peer, exc)
        finally:
            warming.discard(peer)

    def _sample_rate(self) -> None:
        now = trio.current_time()
        self._rate.append((now, self.engine.tokens))
        while len(self._rate) > 2 and now - self._rate[0][0] > RATE_WINDOW:
            self._rate.popleft()

    def throughput(self) -> float:
        """Tokens/s whose gradients reached our weights, over the last RATE_WINDOW."""
        if len(self._rate) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self._rate[0], self._rate[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def queue_depth(self) -> int:
        return len(self.inbound)

    def doc(self) -> dict:
        now = trio.current_time()
        engine, ledger = self.engine, self.ledger.stats(now)
        latest = self.evals.latest()
        return {
            "stage": self.stage, "first": self.is_first, "last": self.is_last, "blocked": self.blocked,
            "step": engine.step if engine else 0, "tokens": engine.tokens if engine else 0,
            "micro_batches": engine.micro_batches if engine else 0,
            "tokens_per_s": round(self.throughput(), 1),
            "train_loss_bpb": self.train_loss_bpb,
            "heldout_bpb": latest.bits_per_byte if latest else None,
            "heldout": [{"source": r.session.hex()[:8], "round": r.round, "bpb": round(r.bits_per_byte, 4),
                         "tokens": r.tokens, "at": r.at, "outer_round": r.agreed_round,
                         "rounds": None if r.rounds is None else list(r.rounds),
                         "chain": None if r.chain is None else list(r.chain), "complete": r.complete}
                        for r in self.evals.history],  # source: the stage-0 peer's evaluation session
            "heldout_by_round": [{"outer_round": a.round, "bpb": round(a.bits_per_byte, 4),
                                  "spread": round(a.spread, 4), "chains": len(a.chains)}
                                 for a in agreement(self.evals.history)],  # the chains this last stage saw
            "engine": {"steps": ledger.steps, "local_only": ledger.local_only, "drops": ledger.drops,
                       "local_only_rate": ledger.local_only_rate, "busy_fraction": round(ledger.busy_fraction, 4),
                       "busy_since_first": round(ledger.busy_since_first, 4),
                       "kept_graphs": engine.kept if engine else 0},
            "in_flight": len(self.inflight), "counts": dict(self.counts),
            "inbound": _fill_doc(self.inbound.stats(now)), "outbound": _fill_doc(self.outbound.stats(now)),
            "router": self._router_doc(),
            "delivery": self.deliverer.stats() if self.deliverer else {},
            "inference": self.inference.doc() if self.inference else {},
        }

    def _router_doc(self) -> dict:
        doc = self.router.stats(time.time())
        for peer, entry in doc["peers"].items():
            entry["slow"] = self._slow.get(peer)
        doc["partner"] = self.router.partners.get(self.stage + 1)  # None: last stage, affinity off, or no peer
        return doc

    async def doc_json(self, params: dict) -> dict:
        return self.doc()

    def routes(self) -> dict:
        return {"/api/swarm": self.doc_json}


def _fill_doc(stats) -> dict:
    return {"items": stats.items, "capacity": stats.capacity_items, "peak": stats.peak_items,
            "mean_fill": round(stats.mean_fill, 4), "offered": stats.offered, "refused": stats.refused}

