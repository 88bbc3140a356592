"""Stage 0's own work: training micro-batches cut from the corpus, and the held-out rounds.

A stage-0 peer reads the corpus (``--data`` or the stdlib; tokenized into shards unless tokens
are bytes) and runs two tasks beside the service's others:

- **feed** cuts micro-batches from its own offset of the corpus (a hash of its peer id), while no
  stage is down (``SwarmService.blocked``), some live peer serves the next stage and has room in
  its window, and fewer than ``max_in_flight`` of ours are queued or wait for their gradient
  (``MIN_IN_FLIGHT`` at least: more is more staleness, see the engine's weight prediction);
- **evaluate** sends the fixed held-out set through the swarm after each DiLoCo outer round (every
  ``EVAL_PERIOD`` without DiLoCo; later where a round takes over 1/``eval_share`` of the time to
  compute and send), to be evaluated on that round's agreed weights at every stage. Its micro-batches
  go one at a time (the next once the last was acked): on a thin line a round's frames queued at once
  held training back for minutes; one at a time they share the line with training.

Both put their jobs into the stage core (``StageCore.cut``) and wait on the service's wakeups.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time

import trio

from p2pswarm.errors import ConfigError
from p2pswarm.model import corpus as corpora
from p2pswarm.model import token_shards
from p2pswarm.run import plan
from p2pswarm.swarm import engine as eng
from p2pswarm.swarm.activation import NO_ROUND, SESSION_BYTES
from p2pswarm.swarm.buffers import Priority
from p2pswarm.swarm.evaluation import EVAL_ROWS
from p2pswarm.swarm.stage_core import Job
from p2pswarm.swarm.upkeep import UPKEEP_PERIOD

log = logging.getLogger(__name__)

EVAL_PERIOD = 10.0  # seconds between held-out evaluation rounds sent by a stage-0 peer (without outer rounds)


class Feeder:
    """Stage 0's two tasks (module docstring), for ``service``."""

    def __init__(self, service, data: str | None, eval_share: int) -> None:
        self.service, self.data, self.eval_share = service, data, eval_share

    async def start(self, nursery: trio.Nursery) -> None:
        """Read the corpus (in a worker thread), then start feeding and evaluating."""
        corpus = await trio.to_thread.run_sync(self.load_corpus)
        log.info("stage 0 reads %s", corpus.describe())
        nursery.start_soon(self.feed, corpus)
        nursery.start_soon(self.evaluate, corpus)

    def load_corpus(self):
        """Worker thread: the corpus (--data or the stdlib), tokenized into shards unless tokens are bytes."""
        spec, tokenizer = self.service.spec, self.service.tokenizer
        if tokenizer.vocab_size > spec.vocab:
            raise ConfigError(f"tokenizer {tokenizer.name} has {tokenizer.vocab_size} tokens, more than "
                              f"the {spec.vocab} of model {spec.name}")
        if tokenizer.vocab_size != spec.vocab:
            log.warning("model %s has %d tokens, tokenizer %s %d: ids above %d are never fed", spec.name,
                        spec.vocab, tokenizer.name, tokenizer.vocab_size, tokenizer.vocab_size - 1)
        corpus = corpora.load_corpus(self.data)
        return corpus if tokenizer.is_bytes else token_shards.tokenize_corpus(corpus, tokenizer)

    # --- training micro-batches ---------------------------------------------------------------------

    async def feed(self, corpus) -> None:
        svc = self.service
        offset = int.from_bytes(hashlib.sha256(svc.me.encode()).digest()[:8], "big")
        batches = corpora.batches(corpus, 0, 1, svc.config.seq or svc.spec.context, svc.config.rows, seed=offset,
                                  offset=offset)
        micro_batch = 0
        while True:
            await self._wait_to_cut()
            try:
                batch = await trio.to_thread.run_sync(next, batches)
            except ConfigError as exc:  # the corpus vanished under us: stop cutting, keep serving
                log.error("stage 0 stops cutting micro-batches: %s", exc)
                return
            ids = eng.ids_tensor(batch.rows)
            work = eng.Work("forward", (svc.session, micro_batch), ids[:, :-1], ids[:, 1:].contiguous())
            micro_batch += 1
            effects = svc.core.cut(Job(work, None), Priority.TRAINING_FORWARD, trio.current_time())
            if effects is None:
                await trio.sleep(UPKEEP_PERIOD)
            else:
                svc.apply(effects)

    async def _wait_to_cut(self) -> None:
        """Until a micro-batch cut now can complete, the next stage absorbs it, and the bound allows it."""
        svc = self.service
        while svc.blocked is not None:
            await trio.sleep(UPKEEP_PERIOD)  # a stage is down: a micro-batch cut now could not complete
        await self._wait_for_next_stage()
        while not svc.is_last and not svc.router.has_room(svc.stage + 1, time.time()):
            await svc.deliverer.wait_for_room()  # paced: cut only what the next stage absorbs
        while not svc.core.can_cut():
            await svc.progress.wait()

    async def _wait_for_next_stage(self) -> None:
        svc = self.service
        while not svc.is_last and not svc.router.choose(svc.stage + 1, time.time()):
            await trio.sleep(UPKEEP_PERIOD)  # no live peer serves the next stage: nothing to compute for

    # --- held-out rounds ------------------------------------------------------------------------------

    def held_out_set(self, corpus) -> list:
        """The held-out micro-batches of every round: the run's ``eval_batches``, each within one frame."""
        seq = self.service.config.seq or self.service.spec.context
        rows = self._eval_rows(seq)
        return list(corpora.heldout_batches(corpus, seq, rows, self.service.config.eval_batches * rows))

    async def evaluate(self, corpus) -> None:
        svc = self.service
        held = await trio.to_thread.run_sync(self.held_out_set, corpus)
        if not held:
            log.warning("the corpus has no held-out part: no evaluation (give --data more text: a part is held out)")
            return
        session, micro_batch, evaluated = os.urandom(SESSION_BYTES), 0, None
        await self._wait_for_next_stage()  # round 0 measures the untrained model: wait until it can go through
        while True:
            round_ = await self._next_eval_round(evaluated)
            began = trio.current_time()
            for batch in held:  # one at a time: an evaluation frame never queues ahead of many training ones
                ids = eng.ids_tensor(batch.rows)
                work = eng.Work("eval", (session, micro_batch), ids[:, :-1], ids[:, 1:].contiguous(), round_)
                micro_batch += 1
                effects = svc.core.cut(Job(work, None), Priority.INFERENCE, trio.current_time())
                if effects is not None:
                    svc.apply(effects)
                while svc.core.evals_pending:  # computed and acked downstream (or lost): the next may go
                    await svc.progress.wait()
            evaluated = round_
            # a round on a slow machine or line takes its share at most: 1 / eval_share of the time
            spent = trio.current_time() - began
            await trio.sleep(max((self.eval_share - 1) * spent,
                                 EVAL_PERIOD - spent if svc.engine.agreed_round == NO_ROUND else 0.0))

    async def _next_eval_round(self, evaluated: int | None) -> int:
        """What the next held-out round evaluates. With outer rounds: the agreed weights of our newest
        one, once it is newer than the last evaluated (every stage evaluates the same round: the
        figure of one model, the same through every chain). Without: our live weights, and the next
        number."""
        engine = self.service.engine
        if engine.agreed_round == NO_ROUND:
            return 0 if evaluated is None else evaluated + 1
        while evaluated is not None and engine.agreed_round <= evaluated:
            await trio.sleep(UPKEEP_PERIOD)
        return engine.agreed_round

    def _eval_rows(self, seq: int) -> int:
        """Rows per held-out micro-batch: EVAL_ROWS, or fewer where those would not fit one frame."""
        svc = self.service
        return plan.fitting_rows(svc.spec, EVAL_ROWS, seq, svc.config.activation_dtype)
