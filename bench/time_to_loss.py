"""The score of a stage-boundary codec on a line: wall time until the swarm's agreed weights reach a target loss.

Bytes are not the score (Pluralis' NanoGPT: 6.4x fewer bytes bought 1.62x in time, because reaching the
target took 3.1x more steps); time to a target loss is. First one process trains a plain (not subspace)
tiny-lm/2 with the demo's optimizer and micro-batches (bench/common.one_process) for ``--budget`` tokens;
its held-out loss at the end is the **target**, the same for every arm
(bits/byte on the first ``--eval-batches`` held-out micro-batches, the set the swarm evaluates too). Then
each arm, one after the other, is the demo's 2 x 2 swarm in the link lab (``testing/linkswarm.link_swarm``:
every join on its own line of the profile, with its latency), with a run file of the demo's DiLoCo values,
the arm's ``[wire]`` both ways and as many held-out micro-batches; it runs until an outer round's agreed
weights, evaluated by the swarm on the held-out set, reach the target, or ``--limit`` seconds of training.

Printed per arm: bytes per token each way, whether and when the target was reached (wall seconds from the
first trained token; start-up apart), the swarm's tokens and a stage-0 replica's inner steps by then,
the steady step time, and the ratio of its time to the dense arm's on the same line and to the unshaped
dense arm's. The swarm evaluates only every few outer rounds (a tenth of its time, ``EVAL_SHARE``): the
time to target is known to within one evaluation period, said with each line.

    python bench/time_to_loss.py [--links unshaped,gpu-ratio] [--boundary dense,q8,q4,s16q4] [--budget 100000]
        [--limit 600] [--eval-batches 2]
"""

from __future__ import annotations

import argparse
import itertools
import signal
import sys
import tempfile
import time
from pathlib import Path

POLL = 2.0  # seconds between looks at the swarm (each look starts one small python per peer)
EVAL_EVERY = 10  # baseline steps between held-out figures


def baseline(budget: int, eval_batches: int) -> dict:
    """One process, ``budget`` tokens: its held-out curve, the target (the last figure) and its step time."""
    import torch
    from common import one_process

    from p2pswarm.swarm.engine import ids_tensor

    torch.manual_seed(0)
    setup = one_process("tiny-lm/2", eval_batches)
    tokens_per_step = setup.config.rows * setup.spec.context
    steps = max(1, budget // tokens_per_step)
    curve, compute = [(0, setup.evaluate())], 0.0
    for step in range(1, steps + 1):
        began = time.monotonic()
        ids = ids_tensor(next(setup.batches).rows)
        loss = setup.stages[1].loss(setup.stages[1](setup.stages[0](ids[:, :-1])), ids[:, 1:])
        setup.opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(setup.params, setup.config.grad_clip)
        setup.opt.step()
        compute += time.monotonic() - began
        if step % EVAL_EVERY == 0 or step == steps:
            curve.append((step, setup.evaluate()))
    return {"steps": steps, "tokens": steps * tokens_per_step, "target": curve[-1][1], "curve": curve,
            "s_per_step": compute / steps}


def best_agreed(docs: dict) -> tuple[float, int] | None:
    """The lowest held-out loss of any agreed outer round the last stage's peers evaluated, and its round."""
    rounds = [(r["bpb"], r["outer_round"]) for d in docs.values() for r in d.get("heldout_by_round") or []
              if r.get("bpb") is not None and r.get("outer_round") is not None]
    return min(rounds) if rounds else None


def arm(link: str, boundary: str, target: float, limit: float, eval_batches: int) -> dict:
    """The 2 x 2 swarm on ``link`` lines with ``boundary`` until its agreed weights reach ``target``."""
    from p2pswarm.model.catalog import get_model
    from p2pswarm.swarm.service import BATCH_ROWS
    from p2pswarm.testing.linkswarm import (
        MODEL,
        TRAIN_TIMEOUT,
        boundary_bytes,
        check_alive,
        link_swarm,
        log_figures,
        snapshot,
    )

    forward, backward = boundary_bytes(get_model(MODEL), boundary)
    tokens_per_batch = BATCH_ROWS * get_model(MODEL).context
    launched = time.monotonic()
    result: dict = {"link": link, "boundary": boundary, "reached": False,  # forward: the target bytes too
                    "b_per_token": (forward / tokens_per_batch, backward / tokens_per_batch)}
    with tempfile.TemporaryDirectory(prefix=f"time-to-loss-{link}-{boundary}-") as workdir, \
            link_swarm(link, Path(workdir), boundary, lifetime=TRAIN_TIMEOUT + limit + 120,
                       eval_batches=eval_batches) as (swarm, stages, get_doc):
        first = [n for n, s in stages.items() if s == 0]
        last = [n for n, s in stages.items() if s == max(stages.values())]
        started = None
        while time.monotonic() - launched < TRAIN_TIMEOUT + limit:
            check_alive(swarm)
            _, docs = snapshot(stages, get_doc)
            tokens = sum(docs[n].get("tokens", 0) for n in first if n in docs)
            if started is None and tokens > 0:
                started = time.monotonic()
                result["startup_s"] = round(started - launched, 1)
            steps = max((docs[n].get("step", 0) for n in first if n in docs), default=0)
            best = best_agreed({n: docs[n] for n in last if n in docs})
            result.update(tokens=tokens, steps=steps, best=best)
            if best is not None and best[0] <= target:
                result.update(reached=True, wall_s=round(time.monotonic() - started, 1) if started else None)
                break
            if started is not None and time.monotonic() - started > limit:
                break
            time.sleep(POLL)
        result.update(log_figures(swarm, list(stages)))
        trained_s = time.monotonic() - started if started else 0.0
        result["s_per_step"] = trained_s / result["steps"] if result.get("steps") else None
        result["trained_s"] = round(trained_s, 1)
    return result


def line(r: dict, dense: dict | None, unshaped: dict | None, target: float) -> str:
    return _reach(r, dense, unshaped, target) + (
        f"; stage health reported degraded or down {r.get('degraded_reports', '-')} times, backups taken "
        f"{r.get('backups_held', '-')} ({r.get('backup_fetches_cut', '-')} fetches cut)")


def _reach(r: dict, dense: dict | None, unshaped: dict | None, target: float) -> str:
    fwd, back = r["b_per_token"]
    best = "none evaluated" if not r.get("best") else f"best agreed {r['best'][0]:.3f} at outer round {r['best'][1]}"
    head = f"{r['link']} {r['boundary']}: {fwd:.0f} / {back:.0f} B per token forward / back"
    if not r["reached"]:
        return (f"{head}: target {target:.3f} NOT reached in {r['trained_s']:.0f} s of training ({best}); "
                f"{r.get('tokens', 0)} tokens, {r.get('steps', 0)} steps, start-up {r.get('startup_s', '-')} s")
    ratios = [f"{r['wall_s'] / other['wall_s']:.2f}x the time of {name}" for name, other in
              (("dense on this line", dense), ("unshaped dense", unshaped))
              if other is not None and other is not r and other.get("reached")]
    step = f"{r['s_per_step'] * 1000:.0f} ms a step" if r.get("s_per_step") else "-"
    return (f"{head}: target {target:.3f} reached {r['wall_s']:.0f} s after the first token ({best}; "
            f"{r['tokens']} tokens, {r['steps']} steps, {step}, start-up {r['startup_s']} s)"
            + (f"; {', '.join(ratios)}" if ratios else ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", default="unshaped,gpu-ratio", help="link profiles (testing/linklab.PROFILES)")
    parser.add_argument("--boundary", default="dense,q8,q4", help="stage-boundary encodings ([wire]): dense, q8, q4, "
                        "or sK, sKq8, sKq4 (a subspace of K)")
    parser.add_argument("--budget", type=int, default=100_000, help="tokens the one-process baseline trains")
    parser.add_argument("--limit", type=float, default=600.0, help="seconds of training an arm gets at most")
    parser.add_argument("--eval-batches", type=int, default=2, help="held-out micro-batches (32 rows) a round")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so a lab is torn down
    base = baseline(args.budget, args.eval_batches)
    print(f"one process: held-out {base['target']:.3f} bits/byte after {base['tokens']} tokens ({base['steps']} steps, "
          f"{base['s_per_step'] * 1000:.0f} ms a step): the target; curve "
          + " ".join(f"{s}:{loss:.3f}" for s, loss in base["curve"]), flush=True)
    links = sorted({x.strip() for x in args.links.split(",") if x.strip()}, key=lambda n: n != "unshaped")
    boundaries = sorted({x.strip() for x in args.boundary.split(",") if x.strip()}, key=lambda b: b != "dense")
    results: dict[tuple[str, str], dict] = {}
    for link, boundary in itertools.product(links, boundaries):
        try:
            results[link, boundary] = r = arm(link, boundary, base["target"], args.limit, args.eval_batches)
        except Exception as exc:
            print(f"{link} {boundary}: failed: {exc}", flush=True)
            continue
        print(line(r, results.get((link, "dense")), results.get(("unshaped", "dense")), base["target"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
