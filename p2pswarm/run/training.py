"""One training peer's run, as one frozen value: built once from the command line, passed whole.

``Training`` holds what the swarm agrees on (the ``RunSpec``: model, tokenizer, optimizer and
schedule, micro-batch, wire dtype, agreed DiLoCo values) with what this peer chooses for itself
(DiLoCo's local knobs merged with the run's agreed ones, once; where it computes; the benches'
``Tunables``). ``TrainConfig`` is how a stage's engine trains: a pure value read off the run, never
a dict of keyword arguments.

Pure: no torch, no trio.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from p2pswarm.model.catalog import ModelSpec
from p2pswarm.run.diloco import DilocoSettings
from p2pswarm.run.placement import Placement
from p2pswarm.run.spec import (
    DEFAULT_ACCUMULATE,
    DEFAULT_BETAS,
    DEFAULT_DECAY,
    DEFAULT_DTYPE,
    DEFAULT_EPS,
    DEFAULT_EVAL_BATCHES,
    DEFAULT_GRAD_CLIP,
    DEFAULT_LR,
    DEFAULT_MIN_LR_RATIO,
    DEFAULT_ROWS,
    DEFAULT_SEED,
    DEFAULT_WARMUP,
    DEFAULT_WEIGHT_DECAY,
    RunSpec,
)
from p2pswarm.run.tunables import Tunables

PREDICT_WEIGHTS = True  # weight prediction against pipeline staleness (docs/benchmarks.md: the 2x1 arm)


@dataclass(frozen=True)
class TrainConfig:
    """How a stage trains; the defaults are the default run's (``run.spec``) on a plain model with dense
    boundaries (the run's ``[wire]`` compresses them). ``train_config(run)`` fills every field from a
    run, so that all peers of a swarm agree on them."""

    lr: float = DEFAULT_LR  # peak AdamW learning rate
    weight_decay: float = DEFAULT_WEIGHT_DECAY  # on matrices only (embeddings, norms and biases get none)
    accumulate: int = DEFAULT_ACCUMULATE  # micro-batches per optimizer step
    grad_clip: float = DEFAULT_GRAD_CLIP  # global norm of a stage's gradient before a step
    seed: int = DEFAULT_SEED  # initial weights are a pure function of (model, seed)
    betas: tuple[float, float] = DEFAULT_BETAS
    eps: float = DEFAULT_EPS
    warmup_steps: int = DEFAULT_WARMUP  # linear warm-up from 0 to lr over this many optimizer steps
    decay_steps: int = DEFAULT_DECAY  # cosine decay from lr to min_lr_ratio x lr after warm-up; 0: constant lr
    min_lr_ratio: float = DEFAULT_MIN_LR_RATIO  # the floor of the cosine decay, as a fraction of lr
    rows: int = DEFAULT_ROWS  # sequences per training micro-batch
    seq: int | None = None  # tokens per sequence; None: the model's context
    activation_dtype: str = DEFAULT_DTYPE  # what hidden states and their gradients travel as
    activation_codec: str = "dense"  # how hidden states cross a boundary: dense (activation_dtype), q8, q4
    gradient_codec: str = "dense"  # and their gradients (run file [wire])
    subspace: int = 0  # directions of a subspace-constrained model (run file [wire], model/subspace.py); 0: off
    eval_batches: int = DEFAULT_EVAL_BATCHES  # held-out micro-batches per evaluation round (the run's held-out set)
    predict_weights: bool = PREDICT_WEIGHTS  # forwards run on the weights predicted for when their gradient lands


def train_config(run: RunSpec) -> TrainConfig:
    """How a stage of ``run`` trains."""
    return TrainConfig(lr=run.lr, weight_decay=run.weight_decay, accumulate=run.accumulate, grad_clip=run.grad_clip,
                       seed=run.seed, betas=run.betas, eps=run.eps, warmup_steps=run.warmup_steps,
                       decay_steps=run.decay_steps, min_lr_ratio=run.min_lr_ratio, rows=run.rows, seq=run.context,
                       activation_dtype=run.dtype, activation_codec=run.activations, gradient_codec=run.gradients,
                       subspace=run.subspace,
                       eval_batches=run.eval_batches)


@dataclass(frozen=True)
class Training:
    """What a training peer trains (``run``) and how it takes part (the rest): the one run object.

    ``diloco`` already carries the run's agreed values (``RunSpec.diloco``), so no service merges them again."""

    run: RunSpec
    diloco: DilocoSettings
    placement: Placement = Placement()
    tunables: Tunables = Tunables()

    def __post_init__(self) -> None:
        if self.diloco != self.run.diloco(self.diloco):
            raise ValueError("Training.diloco must carry the run's agreed DiLoCo values (RunSpec.diloco)")

    @classmethod
    def of(cls, run: RunSpec, local: DilocoSettings = DilocoSettings(), placement: Placement = Placement(),
           tunables: Tunables = Tunables()) -> Training:
        """The run with our local DiLoCo knobs (verify, gather, snapshot period) merged in, once."""
        return cls(run, run.diloco(local), placement, tunables)

    @functools.cached_property
    def model(self) -> ModelSpec:
        """The model as the run trains it (the catalog's, with the tokenizer's vocabulary)."""
        return self.run.spec()

    @functools.cached_property
    def train(self) -> TrainConfig:
        return train_config(self.run)
