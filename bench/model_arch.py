"""The Llama-style tiny-lm against the GPT-2-style one it replaced: tokens/s and held-out bits/byte.

Two arms in one process, one thread each (``torch.set_num_threads(1)``), taking turns of
``ROUND_STEPS`` steps so that both see the same machine load:

- **gpt2** (the baseline): the decoder tiny-lm had before issue 15, copied below from
  ``git show 6ae908d:p2pswarm/model/transformer.py`` (LayerNorm, learned positions, GELU MLP of
  4 x width, biases), width 128, 4 heads, 8 blocks, context 128;
- **llama**: ``p2pswarm.model.transformer`` on ``get_model("tiny-lm")`` (RMSNorm, RoPE,
  SwiGLU of 256, no biases), all 8 layers as one stage.

Both start from the same seed, train on the same micro-batches (8 x 128 bytes of the embedded
corpus, ``corpus.batches(seed=1)``, as bench/swarm_train.py's baseline) with the same AdamW
(lr 3e-3, betas (0.9, 0.95), weight decay 0.01, clip 1.0) for the same number of steps, and are
evaluated on the same held-out windows (the swarm's evaluation set: ``EVAL_BATCHES`` x
``EVAL_ROWS`` rows). Printed: tokens/s of each arm (its own compute time only), held-out
bits/byte at equal tokens along the way, and the ratios new/old. Speed is tokens per CPU second
of the training thread (``time.thread_time``): other processes on a shared machine then skew the
ratio far less than they skew wall-clock time, which is printed too.

    python bench/model_arch.py [--seconds 60] [--ffn 256]   # CPU seconds of training per arm; new arm's ffn
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F
from torch import nn

from p2pswarm.model.catalog import ModelSpec, get_model
from p2pswarm.model.corpus import batches, heldout_batches, stdlib_corpus
from p2pswarm.model.seeding import INIT_STD, part_generator
from p2pswarm.model.transformer import build_stage
from p2pswarm.swarm.evaluation import EVAL_BATCHES, EVAL_ROWS

ROUND_STEPS = 20  # steps an arm takes before the other's turn: short turns share the machine's noise
EVALS = 6  # held-out evaluations along the run (plus one at the start)
ROWS = 8  # micro-batch rows, as the demo and bench/swarm_train.py
LR, BETAS, WEIGHT_DECAY, CLIP = 3e-3, (0.9, 0.95), 0.01, 1.0  # the engine's AdamW settings
SEED = 0  # initial weights of both arms
DATA_SEED = 1  # the micro-batch order (bench/swarm_train.py's)
OLD_FFN = 512  # the GPT-2 tiny-lm's MLP: 4 x width


# ---- the baseline: the GPT-2-style decoder of 6ae908d, verbatim but for the one-stage wrapper ----

class Gpt2Block(nn.Module):
    """BASELINE (old architecture). One pre-norm block: causal self-attention, then a GELU MLP."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.heads = spec.heads
        self.ln1 = nn.LayerNorm(spec.width)
        self.qkv = nn.Linear(spec.width, 3 * spec.width)
        self.out = nn.Linear(spec.width, spec.width)
        self.ln2 = nn.LayerNorm(spec.width)
        self.up = nn.Linear(spec.width, spec.ffn)
        self.down = nn.Linear(spec.ffn, spec.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, seq, width))
        return x + self.down(F.gelu(self.up(self.ln2(x))))

    def reset_parameters(self, generator: torch.Generator, n_layers: int) -> None:
        with torch.no_grad():
            for norm in (self.ln1, self.ln2):
                norm.weight.fill_(1.0)
                norm.bias.zero_()
            residual_std = INIT_STD / math.sqrt(2 * n_layers)
            for linear, std in ((self.qkv, INIT_STD), (self.out, residual_std),
                                (self.up, INIT_STD), (self.down, residual_std)):
                linear.weight.normal_(0.0, std, generator=generator)
                linear.bias.zero_()


class Gpt2Model(nn.Module):
    """BASELINE (old architecture). The old StageModule as one stage: embeddings, blocks, LayerNorm, head."""

    def __init__(self, spec: ModelSpec, seed: int) -> None:
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab, spec.width)
        self.pos = nn.Embedding(spec.context, spec.width)
        self.blocks = nn.ModuleList(Gpt2Block(spec) for _ in range(spec.n_layers))
        self.norm = nn.LayerNorm(spec.width)
        self.head = nn.Linear(spec.width, spec.vocab, bias=False)
        with torch.no_grad():
            generator = part_generator(spec.family, seed, "embed")
            self.embed.weight.normal_(0.0, INIT_STD, generator=generator)
            self.pos.weight.normal_(0.0, INIT_STD, generator=generator)
            for layer, block in enumerate(self.blocks):
                block.reset_parameters(part_generator(spec.family, seed, f"block/{layer}"), spec.n_layers)
            self.norm.weight.fill_(1.0)
            self.norm.bias.zero_()
            self.head.weight.normal_(0.0, INIT_STD, generator=part_generator(spec.family, seed, "head"))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


# ---- the run ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class Arm:
    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    compute: float = 0.0  # CPU seconds of this thread in forward, backward and step
    wall: float = 0.0  # wall-clock seconds of the same
    tokens: int = 0

    def train(self, rows: list[torch.Tensor]) -> None:
        started, cpu_started = time.perf_counter(), time.thread_time()
        for ids in rows:
            logits = self.model(ids[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
            self.optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
            self.optimizer.step()
            self.tokens += ids[:, 1:].numel()
        self.compute += time.thread_time() - cpu_started
        self.wall += time.perf_counter() - started

    def bits_per_byte(self, held: list[torch.Tensor]) -> float:
        with torch.no_grad():
            nats = sum(F.cross_entropy(self.model(h[:, :-1]).reshape(-1, 256), h[:, 1:].reshape(-1),
                                       reduction="sum").item() for h in held)
        return nats / sum(h[:, 1:].numel() for h in held) / math.log(2)


def arm(name: str, model: nn.Module) -> Arm:
    params = sum(p.numel() for p in model.parameters())
    print(f"{name}: {params:,} parameters", flush=True)
    return Arm(name, model, torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY))


def as_ids(rows) -> torch.Tensor:
    return torch.tensor([list(r) for r in rows], dtype=torch.int64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="CPU seconds of training per arm (default 60)")
    parser.add_argument("--ffn", type=int, help="the new arm's SwiGLU size (default: tiny-lm's)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = get_model("tiny-lm")
    whole = dataclasses.replace(spec, stage_size=spec.n_layers)
    arms = [arm("gpt2 (old)", Gpt2Model(dataclasses.replace(whole, ffn=OLD_FFN), SEED)),
            arm("llama (new)", build_stage(dataclasses.replace(whole, ffn=args.ffn or spec.ffn), 0, SEED))]
    corpus = stdlib_corpus()
    held = [as_ids(b.rows) for b in heldout_batches(corpus, spec.context, EVAL_ROWS, EVAL_BATCHES * EVAL_ROWS)]
    stream = batches(corpus, 0, 1, spec.context, ROWS, seed=DATA_SEED)
    print(f"start: held-out bits/byte {' / '.join(f'{a.bits_per_byte(held):.3f}' for a in arms)}", flush=True)
    eval_every = args.seconds / EVALS
    next_eval = eval_every
    while min(a.compute for a in arms) < args.seconds:
        rows = [as_ids(next(stream).rows) for _ in range(ROUND_STEPS)]
        for a in arms:
            a.train(rows)
        if min(a.compute for a in arms) >= next_eval or min(a.compute for a in arms) >= args.seconds:
            next_eval += eval_every
            old, new = (a.bits_per_byte(held) for a in arms)
            print(f"after {arms[0].tokens:>8} tokens: held-out bits/byte old {old:.3f}, new {new:.3f} "
                  f"(new/old {new / old:.3f})", flush=True)
    rates, walls = [a.tokens / a.compute for a in arms], [a.tokens / a.wall for a in arms]
    print(f"tokens per CPU second (one thread): old {rates[0]:.0f}, new {rates[1]:.0f} "
          f"(new/old {rates[1] / rates[0]:.3f}); wall-clock tokens/s old {walls[0]:.0f}, new {walls[1]:.0f} "
          f"(new/old {walls[1] / walls[0]:.3f}); {arms[0].tokens} tokens each", flush=True)


if __name__ == "__main__":
    main()
