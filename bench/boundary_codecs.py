"""Stage-boundary encodings at equal steps, in one process: what quantizing a boundary costs in loss.

tiny-lm/2 trains in one process with the demo's run (AdamW lr 3e-3, 8 x 128-byte micro-batches of the
stdlib corpus, the same initial weights and batches for every arm), its two stages joined as the swarm
joins them: stage 0's hidden states go through ``codec.to_wire`` and ``codec.from_wire`` in the arm's
encoding, and so does the gradient coming back. An ``sK`` arm (``sKq8``, ``sKq4``) is the model
constrained to a subspace of K directions (``model/subspace.py``): its coordinates cross the boundary in
that encoding, and its forward also carries the token ids (``rows x (seq + 1)`` bytes, counted). The
``dense`` arm (float32, a plain model) is the baseline of the same run and seed. Printed per arm and seed:
bytes per token each way, the held-out loss (bits/byte, the swarm's held-out set) every ``--eval-every``
steps and at the end, the held-out ratio to dense at equal steps, the steps it took to reach dense's
final held-out loss (interpolated; none: never), and compute seconds per step (the encoding's own cost
included); with several ``--seeds`` (initial weights and batches both), the mean ratio per arm too. No
link here: ``bench/swarm_train.py --links ... --boundary ...`` measures tokens/s through shaped lines.

    python bench/boundary_codecs.py [--steps 600] [--eval-every 100] [--encodings dense,q8,q4,s16q4] [--seeds 0]
"""

from __future__ import annotations

import argparse
import itertools
import time


def train_arm(boundary: str, steps: int, eval_every: int, seed: int = 0) -> dict:
    import torch
    from common import one_process

    from p2pswarm.swarm import codec
    from p2pswarm.swarm.engine import ids_tensor
    from p2pswarm.testing.linkswarm import parse_boundary

    rank, encoding = parse_boundary(boundary)
    torch.manual_seed(seed)
    setup = one_process("tiny-lm/2", rank=rank, seed=seed)
    config, spec, stages, params, opt, evaluate = (setup.config, setup.spec, setup.stages, setup.params, setup.opt,
                                                   setup.evaluate)
    curve, sent, compute = [(0, evaluate())], [0, 0], 0.0
    it = setup.batches
    for step in range(1, steps + 1):
        t0 = time.monotonic()
        ids = ids_tensor(next(it).rows)
        hidden = stages[0](ids[:, :-1])
        dtype, shape, data = codec.to_wire(hidden, encoding)
        received = codec.from_wire(dtype, shape, data, "float32").requires_grad_()
        loss = stages[1].loss(stages[1](received, ids=ids[:, :-1]), ids[:, 1:])
        opt.zero_grad()
        loss.backward()
        dtype, shape, back = codec.to_wire(received.grad, encoding)
        hidden.backward(codec.from_wire(dtype, shape, back, "float32"))
        torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
        opt.step()
        compute += time.monotonic() - t0
        sent[0] += len(data) + (ids.numel() if rank else 0)  # a subspace forward's ids window (byte tokens)
        sent[1] += len(back)
        if step % eval_every == 0 or step == steps:
            curve.append((step, evaluate()))
    tokens = steps * config.rows * spec.context
    return {"encoding": boundary, "seed": seed, "curve": curve, "forward_b_per_token": sent[0] / tokens,
            "backward_b_per_token": sent[1] / tokens, "s_per_step": compute / steps}


def steps_to(curve: list[tuple[int, float]], target: float) -> float | None:
    """The first step the held-out curve reaches ``target`` (interpolated), None if it never does."""
    for (s0, l0), (s1, l1) in itertools.pairwise(curve):
        if l1 <= target:
            return s1 if l0 == l1 else s0 + (s1 - s0) * (l0 - target) / (l0 - l1)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--encodings", default="dense,q8,q4", help="dense, q8, q4, sK, sKq8, sKq4 (a subspace of K)")
    parser.add_argument("--seeds", default="0", help="comma list of seeds: initial weights and batches")
    args = parser.parse_args()
    encodings = [e.strip() for e in args.encodings.split(",") if e.strip()]
    if encodings[0] != "dense":
        encodings.insert(0, "dense")  # the baseline of the same run
    ratios: dict[str, list[float]] = {e: [] for e in encodings}
    for seed in [int(x) for x in args.seeds.split(",") if x.strip()]:
        results = [train_arm(e, args.steps, args.eval_every, seed) for e in encodings]
        dense = results[0]
        target = dense["curve"][-1][1]
        for r in results:
            final, reached = r["curve"][-1][1], steps_to(r["curve"], target)
            ratios[r["encoding"]].append(final / target)
            curve = " ".join(f"{s}:{loss:.3f}" for s, loss in r["curve"])
            print(f"seed {seed} {r['encoding']:>5}: {r['forward_b_per_token']:.0f} / {r['backward_b_per_token']:.0f} "
                  f"B per token forward / back ({dense['forward_b_per_token'] / r['forward_b_per_token']:.2f}x "
                  f"fewer than dense float32), held-out {final:.3f} bits/byte after {args.steps} steps "
                  f"({final / target:.3f}x dense), dense's final {target:.3f} reached at step "
                  f"{'never' if reached is None else f'{reached:.0f}'}, {r['s_per_step'] * 1000:.0f} ms a step; "
                  f"curve {curve}", flush=True)
    if len(next(iter(ratios.values()))) > 1:
        for encoding, values in ratios.items():
            print(f"{encoding:>5}: held-out {sum(values) / len(values):.3f}x dense on the mean of {len(values)} "
                  f"seeds (worst {max(values):.3f}x)", flush=True)


if __name__ == "__main__":
    main()
