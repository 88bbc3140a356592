"""The simulation behind ``bench/diloco_convergence.py``: workers, sync data parallel, DiLoCo rounds.

Everything runs in one process, one worker after the other, with deterministic seeds. The model
is a small byte-level transformer cut as ONE stage (embedding, blocks and head on one module), so
a "worker" is a model, its inner AdamW (the engine's settings) and its own shard of the corpus.

The DiLoCo outer round is simulated faithfully to the protocol (``p2pswarm/diloco/service.py``
and ``round_reduce.py``), only without the network: each replica's pseudo-gradient plus its
error-feedback residual is cut into ``shard_bounds`` shards and encoded with the codec; the owner
of shard i decodes the 4 parts of its shard, ``aggregation.combine``s them (verifying them when
asked) and encodes the result; every replica decodes every result (its own shard's too), checks
it against its own shard when verification is on (refused: it keeps its own), and applies
``OuterOptimizer.outer_step``. Bytes are the lengths of the encoded parts and results a replica
sends and receives. Replica ``BYZANTINE`` can lie in its parts and in the result it owns.
With ``fragments`` F (Streaming DiLoCo, ``OuterOptimizer.fragment``) a round every H / F steps
covers one fragment of the stage; with ``delay`` D the pseudo-gradient is taken D inner steps
before the outer step is applied, as a node's round overlaps its training (``outer.outer_step``
keeps the D steps' progress and counts it in the next round).
Not part of p2pswarm: imported by the bench (``python bench/NAME.py`` puts bench/ on sys.path).
"""

from __future__ import annotations

import copy
import functools
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from p2pswarm.diloco import aggregation
from p2pswarm.diloco import codec as codecs
from p2pswarm.diloco.messages import shard_bounds
from p2pswarm.diloco.offload import refuse_result
from p2pswarm.diloco.outer import OuterConfig, OuterOptimizer, flatten, shift_flat
from p2pswarm.diloco.service import STRIKES, result_check
from p2pswarm.model.catalog import ModelSpec
from p2pswarm.model.corpus import Corpus, batches, heldout_batches
from p2pswarm.model.transformer import build_stage
from p2pswarm.run.spec import DEFAULT_BETAS as BETAS
from p2pswarm.run.spec import DEFAULT_GRAD_CLIP as GRAD_CLIP
from p2pswarm.run.spec import DEFAULT_LR as LEARNING_RATE
from p2pswarm.run.spec import DEFAULT_WEIGHT_DECAY as WEIGHT_DECAY
from p2pswarm.swarm.engine import ids_tensor

SPEC = ModelSpec("bench-lm", n_layers=2, stage_size=2, width=64, heads=2, ffn=256,
                 context=64)  # 137k parameters: ~8 ms a step on one core
N_WORKERS = 4  # replicas of the stage, the brief's group size
BATCH = 8  # rows of SPEC.context bytes per worker micro-batch: 512 tokens a step
MODEL_SEED = 0  # initial weights
WARM_SEED = 7  # the warm start's data order (one stream over the whole corpus)
WARM_FROM = 0.5  # the warm start reads from the middle of the corpus: disjoint from the arms' first MBs
DATA_SEED = 1  # the arms' data order: worker w reads shard w of N_WORKERS
HELDOUT_ROWS = 1024  # held-out windows evaluated: 66 KB of text, the same every time
EVAL_ROWS = 128  # rows per evaluation forward: bounds memory, not the result
ATTACK_SEED = 1234  # the noise attack's generator
BYZANTINE = 3  # the index of the lying replica in the Byzantine arms
NAMES = tuple(f"r{i}" for i in range(N_WORKERS))  # replica ids; sorted order = shard ownership
DIVERGED_MARGIN = 1.0  # bits/byte above the warm start's (train or held-out) at which we stop an arm
PROGRESS_PARTS = 4  # progress lines per arm


def log(message: str) -> None:
    """A progress line on stderr (stdout carries the tables)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- model, data, evaluation ----------------------------------------------------------------


def new_model() -> torch.nn.Module:
    model = build_stage(SPEC, 0, MODEL_SEED)
    if not (model.is_first and model.is_last):
        raise RuntimeError("the bench model must be one stage holding embedding, blocks and head")
    return model


def new_optimizer(model: torch.nn.Module, lr: float = LEARNING_RATE) -> torch.optim.AdamW:
    """The engine's inner AdamW (lr, betas, weight decay)."""
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    """One AdamW step on one micro-batch, clipped as the engine clips; the loss in nats/byte."""
    loss = model.loss(model(ids[:, :-1]), ids[:, 1:])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    opt.step()
    return loss.item()


def evaluate(model: torch.nn.Module, heldout: list[torch.Tensor]) -> float:
    """Held-out bits per byte: summed cross-entropy over every target byte, / ln 2."""
    nats, count = 0.0, 0
    with torch.no_grad():
        for ids in heldout:
            logits = model(ids[:, :-1])
            nats += float(torch.nn.functional.cross_entropy(
                logits.reshape(-1, SPEC.vocab), ids[:, 1:].reshape(-1), reduction="sum"))
            count += ids[:, 1:].numel()
    return nats / count / math.log(2)


def load_heldout(corpus: Corpus) -> list[torch.Tensor]:
    return [ids_tensor(b.rows) for b in heldout_batches(corpus, SPEC.context, EVAL_ROWS, HELDOUT_ROWS)]


def load_streams(corpus: Corpus, steps: int) -> list[list[torch.Tensor]]:
    """``steps`` micro-batches per worker from its own shard: the same bytes for every arm."""
    streams = []
    for w in range(N_WORKERS):
        it = batches(corpus, w, N_WORKERS, SPEC.context, BATCH, seed=DATA_SEED)
        streams.append([ids_tensor(next(it).rows) for _ in range(steps)])
    return streams


@dataclass
class Warm:
    """The shared checkpoint both arms start from: weights, AdamW state, held-out bpb."""

    model_state: dict
    opt_state: dict
    bpb: float
    train_bits: float  # mean training loss of the last 50 warm steps, bits/byte


def warm_start(corpus: Corpus, steps: int, heldout: list[torch.Tensor]) -> Warm:
    model = new_model()
    opt = new_optimizer(model)
    offset = int(len(corpus.train) * WARM_FROM)
    it = batches(corpus, 0, 1, SPEC.context, BATCH, seed=WARM_SEED, offset=offset)
    losses = [train_step(model, opt, ids_tensor(next(it).rows)) for _ in range(steps)]
    tail = losses[-50:] or [math.nan]
    return Warm(copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()),
                evaluate(model, heldout), sum(tail) / len(tail) / math.log(2))


def from_warm(warm: Warm, lr: float = LEARNING_RATE) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    """A model and an AdamW holding the warm weights and the warm optimizer state (copies)."""
    model = new_model()
    model.load_state_dict(warm.model_state)
    opt = new_optimizer(model, lr)
    opt.load_state_dict(copy.deepcopy(warm.opt_state))
    for group in opt.param_groups:
        group["lr"] = lr  # load_state_dict restores the warm lr; the arm's lr wins
    return model, opt


# --- synchronous data parallel -------------------------------------------------------------


def run_sync(warm: Warm, streams: list[list[torch.Tensor]], heldout: list[torch.Tensor],
             lr: float) -> dict:
    """Every step: each worker's gradient on its own micro-batch, averaged, one clipped AdamW step."""
    model, opt = from_warm(warm, lr)
    steps = len(streams[0])
    started, losses = time.monotonic(), []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for stream in streams:
            ids = stream[step]
            loss = model.loss(model(ids[:, :-1]), ids[:, 1:]) / N_WORKERS  # sum of the 4 = their mean
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        opt.step()
        losses.append(total)
        if (step + 1) % max(1, steps // PROGRESS_PARTS) == 0:
            log(f"  sync lr {lr:g}: step {step + 1}/{steps}, train {_bits(losses[-50:]):.3f} bits/byte")
    numel = sum(p.numel() for p in model.parameters())
    per_step = 2 * (N_WORKERS - 1) / N_WORKERS * numel * 4  # ring all-reduce of the fp32 gradient
    return {"steps": steps, "bpb": evaluate(model, heldout), "bytes_per_worker": per_step * steps,
            "seconds": time.monotonic() - started, "diverged": False}


def _bits(nats: list[float]) -> float:
    return sum(nats) / max(1, len(nats)) / math.log(2)


# --- DiLoCo ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arm:
    """One DiLoCo run: inner steps, codec, outer optimizer, aggregation, and an optional attack."""

    inner_steps: int
    codec: str
    outer_lr: float
    momentum: float
    method: str = "mean"
    verify: bool = False  # combine verifies parts, members verify results
    attack: str | None = None  # None, "negate" (-10x its honest shards) or "noise" (Gaussian, same norm)
    owner_attack: bool = True  # the attacker also lies in the result of the shard it owns
    ef_decay: float = 1.0  # the residual's weight in the next round (SparseLoCo's beta; 1: plain error feedback)
    fragments: int = 1  # Streaming DiLoCo: a round every H / F steps over one of F fragments
    delay: int = 0  # inner steps between taking the pseudo-gradient and applying the outer step (overlap)


@dataclass
class Replica:
    model: torch.nn.Module
    opt: torch.optim.AdamW
    params: dict
    outer: OuterOptimizer
    residual: torch.Tensor | None = None  # error feedback of a lossy codec


@dataclass
class Stats:
    strikes: list = field(default_factory=list)  # rounds in which the honest replicas refused the liar
    bytes_sent: list = field(default_factory=lambda: [0] * N_WORKERS)  # parts out
    bytes_received: list = field(default_factory=lambda: [0] * N_WORKERS)  # results in
    rejected_byzantine: int = 0  # the attacker's parts an honest owner refused
    rejected_honest: int = 0  # an honest replica's parts refused (false positives)
    refused_results: int = 0  # results an honest member refused (kept its own shard)
    rounds: int = 0


def make_replicas(warm: Warm, arm: Arm) -> list[Replica]:
    config = OuterConfig(inner_steps=arm.inner_steps, lr=arm.outer_lr, momentum=arm.momentum, nesterov=True,
                         fragments=arm.fragments)
    replicas = []
    for _ in range(N_WORKERS):
        model, opt = from_warm(warm)
        params = dict(model.named_parameters())
        replicas.append(Replica(model, opt, params, OuterOptimizer(params, config, step=0)))
    return replicas


SPARSE_CODECS = ("sparse", "sparse-recut")  # issue 27's codec (diloco/sparse.py): an owner sends its aggregate with
#   room for every member's entries (the protocol's, ``diloco/codec.py``), or ("-recut") cut again to the top 64


def encode(vector: torch.Tensor, codec: str, result: bool = False) -> bytes:
    """A part (or with ``result``, an owner's aggregate) under ``codec``: the protocol's, or the re-cut sparse one."""
    return codecs.encode(vector, _wire(codec), width=_width(codec, result))


def decode(data: bytes, codec: str, numel: int, result: bool = False) -> torch.Tensor:
    return codecs.decode(data, _wire(codec), numel, width=_width(codec, result))


def encoded_size(codec: str, numel: int, result: bool = False) -> int:
    return codecs.encoded_size(_wire(codec), numel, _width(codec, result))


def _wire(codec: str) -> str:
    return "sparse" if codec in SPARSE_CODECS else codec


def _width(codec: str, result: bool) -> int:
    return N_WORKERS if result and codec == "sparse" else 1


NEGATE_FACTOR = 10.0  # attack A: the attacker sends -10x its honest pseudo-gradient


def attacked(honest: torch.Tensor, kind: str, gen: torch.Generator) -> torch.Tensor:
    """What the attacker sends instead of ``honest`` (one shard)."""
    if kind == "negate":
        return honest * -NEGATE_FACTOR
    noise = torch.randn(honest.numel(), generator=gen)
    norm = float(torch.linalg.vector_norm(noise))
    return noise * (float(torch.linalg.vector_norm(honest)) / norm) if norm > 0 else noise


def encode_parts(replica: Replica, bounds: list, codec: str,
                 ef_decay: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, list[bytes]]:
    """As ``service._provide_shards``: the flat weights, pseudo-gradient + residual, its encoded shards (of the
    round's fragment: ``bounds`` cut it; the residual is stage-sized)."""
    fa, fb = replica.outer.fragment()
    at = flatten(replica.params, bounds=(fa, fb))
    pseudo = replica.outer.pseudo_gradient(at)
    if replica.residual is not None:
        pseudo = pseudo + ef_decay * replica.residual[fa:fb]
    shards = [encode(pseudo[a:b], codec) for a, b in bounds]
    if codec != "float32":
        sent = torch.cat([decode(s, codec, b - a) for s, (a, b) in zip(shards, bounds)])
        if replica.residual is None:
            replica.residual = torch.zeros(replica.outer.numel)
        replica.residual[fa:fb] = pseudo - sent
    return at, pseudo, shards


def combine_shard(index: int, parts: list[list[bytes]], bounds: list, arm: Arm, stats: Stats) -> bytes:
    """Owner ``index``: decode the parts of its shard, combine (verifying if asked), encode the result."""
    a, b = bounds[index]
    contributions = {NAMES[r]: decode(parts[r][index], arm.codec, b - a) for r in range(len(parts))}
    check = aggregation.VerifyConfig() if arm.verify else None
    combined = aggregation.combine(contributions, NAMES[index], arm.method, check)
    for name in combined.rejected:
        if arm.attack is not None and name == NAMES[BYZANTINE]:
            stats.rejected_byzantine += 1
        else:
            stats.rejected_honest += 1
    return encode(combined.result, arm.codec, result=True)


def assemble(replica: Replica, pseudo: torch.Tensor, results: list[bytes], bounds: list, arm: Arm,
             me: int) -> tuple[torch.Tensor, int]:
    """As ``service._assemble``: every result decoded; where a verifying member refuses another
    owner's aggregate (judged by its length and direction, ``service.result_check``) it applies
    nothing and carries its own part to the next round in its residual (``service._carry``)."""
    shards, refused = [], 0
    check = result_check(len(bounds))
    fa, fb = replica.outer.fragment()
    for index, (data, (a, b)) in enumerate(zip(results, bounds)):
        result = decode(data, arm.codec, b - a, result=True)
        residual = replica.residual[fa:fb] if replica.residual is not None else None
        sent = pseudo[a:b] - residual[a:b] if _wire(arm.codec) == "sparse" and residual is not None \
            else None  # our part as sent: a sparse aggregate must hold its direction (offload.refuse_result)
        if arm.verify and index != me and refuse_result(result, pseudo[a:b], check, sent, N_WORKERS) is not None:
            refused += 1
            if replica.residual is None:
                replica.residual = torch.zeros(replica.outer.numel)
            replica.residual[fa + a:fa + b] = pseudo[a:b]
            shards.append(torch.zeros(b - a))
            continue
        shards.append(result)
    return torch.cat(shards), refused


def fragment_numel(replica: Replica) -> int:
    a, b = replica.outer.fragment()
    return b - a


def honest_round(replicas: list[Replica], arm: Arm, stats: Stats, step: int,
                 meanwhile: Callable[[], None] = lambda: None) -> None:
    """A round of the honest replicas alone (the liar is barred: service.STRIKES); the liar steps alone."""
    honest, liar = replicas[:BYZANTINE], replicas[BYZANTINE]
    bounds = shard_bounds(fragment_numel(honest[0]), len(honest))
    prepared = [encode_parts(replica, bounds, arm.codec, arm.ef_decay) for replica in honest]
    liar_at, liar_pseudo, _ = encode_parts(liar, [(0, fragment_numel(liar))], arm.codec)
    meanwhile()
    parts = [shards for _, _, shards in prepared]
    results = [combine_shard(i, parts, bounds, arm, stats) for i in range(len(honest))]
    for r, (replica, (at, pseudo, _)) in enumerate(zip(honest, prepared)):
        aggregated, refused = assemble(replica, pseudo, results, bounds, arm, r)
        stats.refused_results += refused
        replica.outer.outer_step(aggregated, at, replica.params, step)
        stats.bytes_sent[r] += sum(len(p) for i, p in enumerate(parts[r]) if i != r)
        stats.bytes_sent[r] += (len(honest) - 1) * len(results[r])
    liar.outer.outer_step(liar_pseudo, liar_at, liar.params, step)
    stats.rounds += 1


def outer_round(replicas: list[Replica], arm: Arm, stats: Stats, gen: torch.Generator, step: int,
                meanwhile: Callable[[], None] = lambda: None) -> None:
    """One butterfly round of every replica (module docstring); ValueError if something is not finite.
    ``meanwhile`` trains the inner steps that pass while the round runs (``Arm.delay``)."""
    bounds = shard_bounds(fragment_numel(replicas[0]), N_WORKERS)
    prepared = [encode_parts(replica, bounds, arm.codec, arm.ef_decay) for replica in replicas]
    meanwhile()
    parts = [shards for _, _, shards in prepared]
    liar = arm.attack is not None
    if liar:
        pseudo = prepared[BYZANTINE][1]
        parts[BYZANTINE] = [encode(attacked(pseudo[a:b], arm.attack, gen), arm.codec) for a, b in bounds]
    results = [combine_shard(i, parts, bounds, arm, stats) for i in range(N_WORKERS)]
    sent_results = list(results)
    if liar and arm.owner_attack:
        a, b = bounds[BYZANTINE]
        honest = decode(results[BYZANTINE], arm.codec, b - a, result=True)
        sent_results[BYZANTINE] = encode(attacked(honest, arm.attack, gen), arm.codec, result=True)
    for r, (replica, (at, pseudo, _)) in enumerate(zip(replicas, prepared)):
        mine = results if r == BYZANTINE else sent_results  # the attacker applies the honest aggregate
        aggregated, refused = assemble(replica, pseudo, mine, bounds, arm, r)
        if not (liar and r == BYZANTINE):
            stats.refused_results += refused
        replica.outer.outer_step(aggregated, at, replica.params, step)
        stats.bytes_sent[r] += sum(len(p) for i, p in enumerate(parts[r]) if i != r)
        stats.bytes_sent[r] += (N_WORKERS - 1) * len(sent_results[r])
    stats.rounds += 1


def inner_phase(replicas: list[Replica], streams: list[list[torch.Tensor]], start: int, steps: int) -> list[float]:
    """``steps`` AdamW steps of every replica on its own shard; each replica's mean loss in bits/byte."""
    means = []
    for replica, stream in zip(replicas, streams):
        losses = [train_step(replica.model, replica.opt, stream[t]) for t in range(start, start + steps)]
        means.append(_bits(losses))
    return means


def run_diloco(warm: Warm, streams: list[list[torch.Tensor]], heldout: list[torch.Tensor], arm: Arm,
               label: str) -> dict:
    """T inner steps per replica in rounds of H / F (module docstring), then held-out of honest replica 0."""
    replicas = make_replicas(warm, arm)
    stats = Stats()
    gen = torch.Generator().manual_seed(ATTACK_SEED)
    steps, every = len(streams[0]), replicas[0].outer.config.round_steps
    started, stopped, train = time.monotonic(), None, math.nan
    limit = max(warm.train_bits, warm.bpb) + DIVERGED_MARGIN  # far beyond the data's own variation
    delay = min(arm.delay, every)
    for k in range(steps // every):
        train = inner_phase(replicas, streams, k * every, every - delay)[0]
        if not train <= limit:  # also true for NaN
            stopped = f"training loss {train:.2f} bits/byte after round {k}"
            break
        meanwhile = functools.partial(inner_phase, replicas, streams, (k + 1) * every - delay, delay) if delay \
            else (lambda: None)
        try:
            if arm.verify and arm.attack is not None and len(stats.strikes) >= STRIKES:
                honest_round(replicas, arm, stats, (k + 1) * every, meanwhile)
            else:
                before = (stats.rejected_byzantine, stats.refused_results)
                outer_round(replicas, arm, stats, gen, (k + 1) * every, meanwhile)
                if (stats.rejected_byzantine, stats.refused_results) != before:
                    stats.strikes.append(k)  # honest replicas refused the liar this round
        except ValueError as exc:
            stopped = f"round {k + 1}: {exc}"
            break
        if (k + 1) % max(1, steps // every // PROGRESS_PARTS) == 0:
            log(f"  {label}: outer step {k + 1}/{steps // every}, replica 0 train {train:.3f} bits/byte")
    if stopped:
        log(f"  {label}: stopped, {stopped}")
    return _diloco_result(replicas, heldout, warm, stats, arm, stopped, time.monotonic() - started)


def _diloco_result(replicas: list[Replica], heldout: list[torch.Tensor], warm: Warm, stats: Stats, arm: Arm,
                   stopped: str | None, seconds: float) -> dict:
    honest = [r for i, r in enumerate(replicas) if arm.attack is None or i != BYZANTINE]
    first = flatten(honest[0].params)
    diff = max((float((flatten(r.params) - first).abs().max()) for r in honest[1:]), default=0.0)
    start_diff = max((float((r.outer.start - honest[0].outer.start).abs().max()) for r in honest[1:]), default=0.0)
    bpb = evaluate(honest[0].model, heldout)
    agreed = copy.deepcopy(honest[0].model)  # the start weights, what a node evaluates (``engine.agree``): with a
    params = dict(agreed.named_parameters())  # delay, the live ones also hold the last round's D local steps
    shift_flat(params, flatten(params), honest[0].outer.start)
    averaged = copy.deepcopy(honest[0].model)  # the honest replicas' live weights averaged: a last all-reduce of
    params = dict(averaged.named_parameters())  # everything, which no fragment schedule has at its end
    shift_flat(params, flatten(params), torch.stack([flatten(r.params) for r in honest]).mean(0))
    numel = honest[0].outer.numel
    return {"outer_steps": stats.rounds, "bpb": bpb, "bpb_agreed": evaluate(agreed, heldout),
            "bpb_averaged": evaluate(averaged, heldout),
            "bytes_per_worker": sum(stats.bytes_sent) / N_WORKERS,
            "formula_bytes_per_round": (N_WORKERS - 1) / N_WORKERS * (encoded_size(arm.codec, numel)
                                                                     + encoded_size(arm.codec, numel, result=True)),
            "rejected_byzantine": stats.rejected_byzantine, "rejected_honest": stats.rejected_honest,
            "refused_results": stats.refused_results, "max_param_diff": diff, "max_start_diff": start_diff,
            "diverged": bool(stopped) or not bpb <= warm.bpb, "stopped": stopped, "seconds": seconds}
