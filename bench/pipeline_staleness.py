"""What pipeline staleness costs per token: two stage engines chained by hand, gradients landing d steps late.

One process (no network) runs tiny-lm/2's two ``StageEngine``s the way a 2-stage swarm does —
stage 0's forward of micro-batch k, the last stage's forward and backward at once, stage 0's
backward of k after the forward of k + d (the engine's own weight stashing) — for ``--steps``
micro-batches of the run's data and optimizer, and prints the held-out loss (bits per byte, the
swarm's fixed held-out set) every 100 steps, then each variant's final figure as a ratio against
d = 0 (the gradient lands in step: exactly one process's training) measured in the same run.

Variants (``--variants``, comma list): ``dD`` (D steps late), ``dDp`` (D steps late, with the
engine's weight prediction), ``aA`` (in step, A micro-batches per optimizer step).

    python bench/pipeline_staleness.py [--steps 400] [--variants d0,d1,d1p,d5,d5p,a2]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import math
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

REPORT_EVERY = 100  # steps between held-out evaluations


def run(delay: int, predict: bool, accumulate: int, steps: int) -> float:
    import torch

    from p2pswarm.model.catalog import get_model
    from p2pswarm.model.corpus import batches, heldout_batches, stdlib_corpus
    from p2pswarm.run.spec import load_run
    from p2pswarm.run.training import train_config
    from p2pswarm.swarm.activation import NO_ROUND
    from p2pswarm.swarm.engine import StageEngine, Work, ids_tensor
    from p2pswarm.swarm.evaluation import EVAL_BATCHES, EVAL_ROWS

    spec = get_model("tiny-lm/2")
    config = dataclasses.replace(train_config(load_run("tiny-lm")), accumulate=accumulate,
                                 predict_weights=predict)
    first, last = StageEngine(spec, 0, config), StageEngine(spec, 1, config)
    corpus = stdlib_corpus()
    held = [ids_tensor(b.rows) for b in heldout_batches(corpus, spec.context, EVAL_ROWS, EVAL_BATCHES * EVAL_ROWS)]

    def evaluate() -> float:
        nats = tokens = 0
        for i, h in enumerate(held):
            out = first.compute(Work("eval", (b"e", i), h[:, :-1], h[:, 1:].contiguous(), NO_ROUND))
            res = last.compute(Work("eval", (b"e", i), out.forward, h[:, 1:].contiguous(), NO_ROUND, (NO_ROUND,)))
            nats, tokens = nats + res.loss_nats, tokens + res.tokens
        return nats / tokens / math.log(2)

    it, waiting, began, figure = batches(corpus, 0, 1, spec.context, config.rows, seed=1), collections.deque(), \
        time.monotonic(), float("nan")
    torch.manual_seed(0)
    for t in range(steps):
        ids = ids_tensor(next(it).rows)
        key = (b"s", t)
        out = first.compute(Work("forward", key, ids[:, :-1], ids[:, 1:].contiguous()))
        back = last.compute(Work("forward", key, out.forward, ids[:, 1:].contiguous()))
        waiting.append((key, back.backward))
        while len(waiting) > delay:
            k, grad = waiting.popleft()
            first.compute(Work("backward", k, grad, None))
        if (t + 1) % REPORT_EVERY == 0 or t + 1 == steps:
            figure = evaluate()
            print(f"  d={delay} predict={predict} accumulate={accumulate}: step {t + 1}, "
                  f"{(t + 1) * ids[:, 1:].numel()} "
                  f"tokens, held-out {figure:.3f} ({time.monotonic() - began:.0f} s)", flush=True)
    return figure


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--variants", default="d0,d1,d1p,d5,d5p,a2")
    args = parser.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if any(not re.fullmatch(r"d\d+p?|a\d+", v) for v in variants) or args.steps < 1:
        parser.error("variants are dD, dDp or aA (e.g. d0,d1p,a2); --steps at least 1")
    results = {}
    for v in ["d0"] + [v for v in variants if v != "d0"]:
        if v.startswith("a"):
            results[v] = run(0, True, int(v[1:]), args.steps)
        else:
            results[v] = run(int(v[1:].rstrip("p")), v.endswith("p"), 1, args.steps)
    for v, figure in results.items():
        print(f"{v}: held-out {figure:.3f} bits/byte, {figure / results['d0']:.3f}x in step", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
