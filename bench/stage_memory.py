"""Peak memory of one training stage against the catalog's estimate (issue 15's memory target).

For each (model, stage) asked, a fresh Python process:

1. imports torch and the engine and trains two micro-batches through a stage of a toy model
   (width 16, one layer, 1 x 8 tokens) in the same position (first, middle or last): its peak
   RSS then is the *runtime's fixed cost* (interpreter, torch's libraries, the autograd engine,
   attention and optimizer kernels and their pools), measured, not guessed;
2. builds the stage's ``StageEngine`` on the CPU and trains ``--steps`` micro-batches of the
   run's shape through it (stage 0: a forward, then a backward with a random output gradient;
   a middle stage the same from random hidden states; the last stage: forward, loss and backward
   at once), as the swarm would, one micro-batch at a time;
3. reports its peak RSS (``ru_maxrss``) minus the fixed cost, against
   ``catalog.stage_memory(spec, stage, rows, seq, "fp32")`` — weights, gradients, AdamW states,
   one stashed weight version and one micro-batch's activations.

The target: peak − fixed ≤ 1.5 × estimate. On a GPU the same holds for peak device memory
(``torch.cuda.max_memory_allocated``); this bench runs on the CPU only.

    python bench/stage_memory.py [--runs tiny-lm,nano] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TARGET_RATIO = 1.5  # the allowance over the estimate
MB = 1e6


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def _train(engine, rows: int, seq: int, steps: int) -> None:
    """``steps`` micro-batches through ``engine`` as the swarm sends them, one at a time."""
    import torch

    from p2pswarm.swarm import engine as eng

    spec = engine.spec
    generator = torch.Generator().manual_seed(0)
    for step in range(steps):
        key = (b"m" * 16, step)
        ids = torch.randint(0, spec.vocab, (rows, seq), generator=generator)
        x = ids if engine.is_first else torch.randn(rows, seq, spec.width, generator=generator)
        out = engine.compute(eng.Work("forward", key, x, ids if engine.is_last else None))
        if not engine.is_last:
            engine.compute(eng.Work("backward", key, torch.randn_like(out.forward), None))


def measure(run_name: str, stage: int, steps: int) -> dict:
    """In this process: the fixed cost, then one stage's training peak (see the module docstring)."""
    import dataclasses

    import torch

    from p2pswarm.model.catalog import stage_memory
    from p2pswarm.run.spec import load_run
    from p2pswarm.run.training import train_config
    from p2pswarm.swarm import engine as eng

    torch.set_num_threads(1)
    run = load_run(run_name)
    spec, config = run.spec(), train_config(run)
    toy = dataclasses.replace(spec, name="toy", n_layers=3, stage_size=1, width=16, heads=2, kv_heads=2, ffn=32,
                              context=8)
    position = 0 if stage == 0 else 2 if stage == spec.last_stage else 1
    _train(eng.StageEngine(toy, position, dataclasses.replace(config, rows=1, seq=8)), 1, 8, 2)
    fixed = _peak_bytes()
    rows, seq = config.rows, config.seq or spec.context
    engine = eng.StageEngine(spec, stage, config)
    _train(engine, rows, seq, steps)
    estimate = stage_memory(spec, stage, rows, seq, "fp32")
    used = _peak_bytes() - fixed
    return {"run": run_name, "model": spec.name, "stage": stage, "rows": rows, "seq": seq,
            "params": engine.module.param_count(), "fixed_mb": fixed / MB, "used_mb": used / MB,
            "estimate_mb": estimate.total / MB, "ratio": used / estimate.total}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="tiny-lm,nano", help="packaged runs to measure, comma-separated")
    parser.add_argument("--steps", type=int, default=6, help="micro-batches trained per stage")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # RUN:STAGE, in the child process
    args = parser.parse_args()
    if args.one:
        run_name, stage = args.one.rsplit(":", 1)
        print(json.dumps(measure(run_name, int(stage), args.steps)))
        return 0
    from p2pswarm.run.spec import load_run

    print(f"{'run':<8} {'model':<10} {'stage':>5} {'params':>11} {'fixed MB':>9} {'peak-fixed MB':>14} "
          f"{'estimate MB':>12} {'ratio':>6}  target <= {TARGET_RATIO}")
    for run_name in args.runs.split(","):
        spec = load_run(run_name).spec()
        for stage in sorted({0, spec.last_stage // 2, spec.last_stage}):
            child = subprocess.run([sys.executable, __file__, "--one", f"{run_name}:{stage}", "--steps",
                                    str(args.steps)], capture_output=True, text=True, check=True)
            doc = json.loads(child.stdout.strip().splitlines()[-1])
            print(f"{doc['run']:<8} {doc['model']:<10} {doc['stage']:>5} {doc['params']:>11,} "
                  f"{doc['fixed_mb']:>9.0f} {doc['used_mb']:>14.1f} {doc['estimate_mb']:>12.1f} "
                  f"{doc['ratio']:>6.2f}  {'met' if doc['ratio'] <= TARGET_RATIO else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
