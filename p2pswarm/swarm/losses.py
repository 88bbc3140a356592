"""The last stage's figures: the training loss's running average and the held-out rounds.

Only the last stage computes a loss. A training micro-batch's loss moves the published average
(``LOSS_EMA``; a NaN or inf loss from a peer's bad activations is left out and counted); an
evaluation micro-batch's loss goes into its held-out round (``evaluation.EvalBook``), over the
bytes of text its target tokens stand for, with the outer rounds and the chain of peers that
made it. A completed round is logged.
"""

from __future__ import annotations

import logging
import math
import time

log = logging.getLogger(__name__)

LOSS_EMA = 0.05  # weight of a new micro-batch in the training-loss average


def train_loss(average: float | None, loss_nats: float, tokens: int) -> float | None:
    """The training-loss average (bits per byte) after one more micro-batch; None if its loss is not finite."""
    bpb = loss_nats / tokens / math.log(2)
    if not math.isfinite(bpb):
        return None
    return bpb if average is None else average + LOSS_EMA * (bpb - average)


def record_heldout(evals, tokenizer, job, out, me: str) -> None:
    """One evaluation micro-batch's loss into its round (``evals``); the round logged once complete."""
    work = job.work
    nbytes = None if tokenizer.is_bytes else tokenizer.count_bytes(work.targets.cpu().numpy())
    done = evals.record(work.key[0], work.step, out.loss_nats, out.tokens, time.time(), nbytes,
                        (*work.rounds, out.round), (*job.path, me))
    if done:
        per_token = "" if done.bits_per_token is None else f", {done.bits_per_token:.3f} bits/token"
        weights = "live weights" if done.agreed_round is None else f"outer round {done.agreed_round}"
        log.debug("held-out loss %.3f bits/byte%s (%s of stage 0 peer %s, %d tokens, %d bytes)",
                 done.bits_per_byte, per_token, weights, (done.chain or ("?",))[0][-8:], done.tokens,
                 done.bytes or done.tokens)
