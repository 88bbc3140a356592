"""The swarm against one process: tokens/s and held-out loss at equal tokens, then compute-busy with 50 ms links.

Three arms in one run, one after the other on this machine (never at once: 2 cores):

1. **baseline** — one process trains tiny-lm (all 8 blocks, the same initial weights, the same
   micro-batches of 8 x 128 bytes, AdamW with the engine's settings) for ``--seconds``; its
   held-out loss is measured on the swarm's held-out set every ``EVAL_EVERY`` steps;
2. **swarm** — ``p2pswarm demo`` (2 stages x 2 replicas of tiny-lm/2, real processes on
   loopback) for the same ``--seconds``; tokens/s and the final held-out loss from its summary,
   compared with the baseline's held-out loss when it had trained on as many tokens;
3. **swarm, 50 ms links** — the same with ``P2PSWARM_LINK_DELAY_MS=50`` (every frame waits 50 ms
   before it is written), for the compute-busy fraction.

    python bench/swarm_train.py [--seconds 120]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

EVAL_EVERY = 50  # baseline steps between held-out evaluations


def baseline(seconds: float) -> tuple[float, list[tuple[int, float]]]:
    import torch

    from p2pswarm.model.catalog import get_model
    from p2pswarm.model.corpus import batches, heldout_batches, stdlib_corpus
    from p2pswarm.model.transformer import build_model, run_stages
    from p2pswarm.swarm.engine import BETAS, GRAD_CLIP, LEARNING_RATE, WEIGHT_DECAY, ids_tensor
    from p2pswarm.swarm.evaluation import EVAL_BATCHES, EVAL_ROWS

    spec = get_model("tiny-lm")
    stages = build_model(spec, 0)
    params = [p for m in stages for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=LEARNING_RATE, betas=BETAS, weight_decay=WEIGHT_DECAY)
    corpus = stdlib_corpus()
    held = [ids_tensor(b.rows) for b in heldout_batches(corpus, spec.context, EVAL_ROWS, EVAL_BATCHES * EVAL_ROWS)]

    def evaluate() -> float:
        with torch.no_grad():
            nats = sum(torch.nn.functional.cross_entropy(run_stages(stages, h[:, :-1]).reshape(-1, 256),
                                                         h[:, 1:].reshape(-1), reduction="sum").item() for h in held)
        return nats / sum(h[:, 1:].numel() for h in held) / math.log(2)

    curve, tokens, step, compute = [(0, evaluate())], 0, 0, 0.0
    it = batches(corpus, 0, 1, spec.context, 8, seed=1)
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        t0 = time.monotonic()
        ids = ids_tensor(next(it).rows)
        loss = stages[-1].loss(run_stages(stages, ids[:, :-1]), ids[:, 1:])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
        opt.step()
        compute += time.monotonic() - t0
        tokens, step = tokens + ids[:, 1:].numel(), step + 1
        if step % EVAL_EVERY == 0:
            curve.append((tokens, evaluate()))
    curve.append((tokens, evaluate()))
    return tokens / compute, curve


def at_tokens(curve: list[tuple[int, float]], tokens: int) -> float:
    """The baseline's held-out loss after ``tokens``, interpolated between evaluations."""
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if t0 <= tokens <= t1:
            return l0 + (l1 - l0) * (tokens - t0) / max(1, t1 - t0)
    return curve[-1][1]


def swarm(seconds: float, delay_ms: int = 0) -> dict:
    env = dict(os.environ, P2PSWARM_LINK_DELAY_MS=str(delay_ms))
    out = subprocess.run([sys.executable, "-m", "p2pswarm", "demo", "--duration", str(seconds)],
                         capture_output=True, text=True, env=env, timeout=seconds + 200).stdout
    summary = re.search(r"summary: (\d+) tokens in (\d+) s \((\d+) tok/s\)", out)
    heldout = re.search(r"held-out loss ([\d.]+) -> ([\d.]+)", out)
    busy = re.search(r"compute-busy fraction per peer ([\d., ]+) \(mean ([\d.]+)\)", out)
    rates = [float(x) for x in re.findall(r"bits/byte .*? (\d+) tok/s", out)]
    return {"tokens": int(summary.group(1)), "tok_s": int(summary.group(3)),
            "steady_tok_s": sum(rates[2:]) / max(1, len(rates[2:])),
            "heldout": float(heldout.group(2)) if heldout else None,
            "busy": busy.group(1) if busy else None, "busy_mean": float(busy.group(2)) if busy else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0)
    args = parser.parse_args()
    base_rate, curve = baseline(args.seconds)
    print(f"baseline: one process, {base_rate:.0f} tok/s, held-out {curve[0][1]:.3f} -> {curve[-1][1]:.3f} "
          f"bits/byte after {curve[-1][0]} tokens", flush=True)
    result = swarm(args.seconds)
    equal = at_tokens(curve, result["tokens"])
    print(f"swarm 2x2: {result['tok_s']} tok/s over the run ({result['steady_tok_s']:.0f} steady), "
          f"{result['tokens']} tokens, held-out {result['heldout']} bits/byte; baseline at equal tokens "
          f"{equal:.3f}", flush=True)
    print(f"  ratio tokens/s (steady) {result['steady_tok_s'] / base_rate:.2f}x; held-out at equal tokens "
          f"{result['heldout'] / equal:.3f}x the baseline's; compute-busy {result['busy']}", flush=True)
    slow = swarm(args.seconds, delay_ms=50)
    print(f"swarm 2x2, 50 ms links: {slow['tok_s']} tok/s, held-out {slow['heldout']}, compute-busy per peer "
          f"{slow['busy']} (mean {slow['busy_mean']})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
