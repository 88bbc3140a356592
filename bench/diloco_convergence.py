"""DiLoCo against synchronous data parallel at equal tokens, and DiLoCo with one Byzantine replica of 4.

Why: p2pswarm's stage replicas train with DiLoCo (H local AdamW steps, then an outer round that
moves int8 pseudo-gradient shards through a butterfly all-reduce, combined robustly and verified).
That trades bytes for convergence and trusts peers we do not control; this bench measures both
costs in one process, with the real ``p2pswarm.diloco`` code (``bench/_diloco_sim.py``):

1. **warm start** — one model trains ``--warm`` AdamW steps; every arm starts from its weights and
   its AdamW state (DiLoCo's regime is a warm model; a cold start exaggerates the gap);
2. **sync** — 4 workers, each step the 4 gradients averaged, one AdamW step (the engine's lr, and
   twice that: the batch is 4x); bytes = a ring all-reduce of the fp32 gradient per step;
3. **sweep** — outer lr x momentum (Nesterov) at H=50 int8: with few outer steps the paper's
   0.7 / 0.9 can overshoot, so the best one here is used for every other DiLoCo arm;
4. **diloco** — H in {10, 50, 100} x codec in {float32, int8}, plain mean, plus H=50 int8 with the
   default trimmed mean + verification and nobody attacking; bytes = the encoded parts and results
   a replica sends; equal tokens: ``--steps`` inner steps per replica = ``--steps`` sync steps;
5. **byzantine** — H=50 int8, replica 3 sends -10x its pseudo-gradient, or Gaussian noise of the
   same norm, as its parts and as the result of the shard it owns, against each defence.

Held-out figure: bits per byte of a fixed held-out set of the embedded stdlib corpus, of replica 0
(honest) after the last outer step; ratios are to the best sync arm, or to the honest DiLoCo run.

    python bench/diloco_convergence.py [--steps T] [--warm W] [--only sync,diloco,sweep,byzantine] [--h H,...] [--json]
                                       [--codecs float32,int8,sparse,sparse-recut] [--outer LR,MOMENTUM]
                                       [--ef-decay BETA] [--fragments F,...] [--delay D]

``--fragments`` runs the diloco part's arms with each F (Streaming DiLoCo: a round every H / F steps over
one of F fragments); ``--delay`` takes each pseudo-gradient D inner steps before its outer step, as a
node's round overlaps its training.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _diloco_sim as sim
import torch
from common import print_table

from p2pswarm.model.corpus import load_corpus
from p2pswarm.run.spec import DEFAULT_LR as LEARNING_RATE

DEFAULT_STEPS = 800  # inner steps per replica = sync steps: every part in ~11 minutes on one core
DEFAULT_WARM = 500  # warm-start steps: past the fast initial drop, as DiLoCo assumes
PARTS = ("sync", "sweep", "diloco", "byzantine")
SYNC_LR_FACTORS = (1, 2)  # the engine's inner lr, and twice it for sync's 4x larger batch
INNER_STEPS = (10, 50, 100)  # H: from chatty to rare rounds
CODECS = ("float32", "int8")  # exact, and the protocol's default (4x fewer bytes); --codecs adds the sparse ones
SWEEP_LRS = (0.7, 1.0)  # outer lr: the paper's, and plain averaging's step size
SWEEP_MOMENTA = (0.0, 0.5, 0.9)  # none (averaging), half, the paper's Nesterov 0.9
FALLBACK_OUTER = (0.7, 0.5)  # outer lr, momentum when --only leaves the sweep out: the full run's pick
FOCUS_H, FOCUS_CODEC = 50, "int8"  # the sweep's and the Byzantine part's setting
ATTACKS = ("negate", "noise")
DEFENCES = (  # label, aggregation, verification, attacker lies as owner too
    ("plain mean", "mean", False, True),
    ("trimmed mean", "trimmed_mean", False, True),
    ("centered clip", "centered_clip", False, True),
    ("verify + mean", "mean", True, True),
    ("verify + trimmed mean", "trimmed_mean", True, True),
    ("trimmed mean, honest owner", "trimmed_mean", False, False),  # the attacker lies in its parts only
    ("chunk-clipped mean", "chunk_clip", False, True),  # issue 27's, for sparse contributions
    ("verify + chunk-clipped mean", "chunk_clip", True, True),  # the sparse codec's packaged defence
)
ATTACK_LABELS = {"negate": "A: -10x pseudo-gradient", "noise": "B: Gaussian noise, same norm"}


class Bench:
    """The shared data, the warm checkpoint, and every arm's result (each arm runs at most once)."""

    def __init__(self, steps: int, warm: int) -> None:
        corpus = load_corpus(None)
        self.heldout = sim.load_heldout(corpus)
        self.streams = sim.load_streams(corpus, steps)
        sim.log(f"warm start: {warm} steps")
        self.warm = sim.warm_start(corpus, warm, self.heldout)
        sim.log(f"warm start: held-out {self.warm.bpb:.4f} bits/byte, train {self.warm.train_bits:.3f}")
        self.steps = steps
        self.sync: dict[float, dict] = {}
        self.arms: dict[sim.Arm, dict] = {}

    def run_sync(self, lr: float) -> dict:
        if lr not in self.sync:
            sim.log(f"sync DP, lr {lr:g}")
            self.sync[lr] = sim.run_sync(self.warm, self.streams, self.heldout, lr)
            sim.log(f"sync DP, lr {lr:g}: held-out {self.sync[lr]['bpb']:.4f} ({self.sync[lr]['seconds']:.0f} s)")
        return self.sync[lr]

    def run_arm(self, arm: sim.Arm) -> dict:
        if arm not in self.arms:
            label = arm_label(arm)
            sim.log(f"DiLoCo {label}")
            result = sim.run_diloco(self.warm, self.streams, self.heldout, arm, label)
            sim.log(f"DiLoCo {label}: held-out {result['bpb']:.4f} (agreed weights {result['bpb_agreed']:.4f}, "
                    f"replicas averaged {result['bpb_averaged']:.4f}) after "
                    f"{result['outer_steps']} outer steps "
                    f"({result['seconds']:.0f} s)")
            self.arms[arm] = result
        return self.arms[arm]

    def best_sync(self) -> float | None:
        return min((r["bpb"] for r in self.sync.values()), default=None)

    def sync_bytes(self) -> float | None:
        return next((r["bytes_per_worker"] for r in self.sync.values()), None)


def arm_label(arm: sim.Arm) -> str:
    text = f"H={arm.inner_steps} {arm.codec} {arm.method}{' +verify' if arm.verify else ''} " \
           f"outer {arm.outer_lr:g}/{arm.momentum:g}" + (f" EF decay {arm.ef_decay:g}" if arm.ef_decay != 1 else "") \
        + (f" F={arm.fragments}" if arm.fragments > 1 else "") + (f" delay {arm.delay}" if arm.delay else "")
    if arm.attack:
        text += f" attack {arm.attack}{'' if arm.owner_attack else ' (parts only)'}"
    return text


def focus_arm(lr: float, momentum: float, **kwargs) -> sim.Arm:
    return sim.Arm(FOCUS_H, FOCUS_CODEC, lr, momentum, **kwargs)


PACKAGED_DEFENCE = {"int8": "verify + trimmed mean", "sparse": "verify + chunk-clipped mean"}  # a node's, per codec


# --- the parts --------------------------------------------------------------------------------


def part_sync(bench: Bench) -> list[dict]:
    return [dict(bench.run_sync(LEARNING_RATE * f), lr=LEARNING_RATE * f) for f in SYNC_LR_FACTORS]


def part_sweep(bench: Bench) -> tuple[list[dict], tuple[float, float]]:
    rows = []
    for lr in SWEEP_LRS:
        for momentum in SWEEP_MOMENTA:
            rows.append(dict(bench.run_arm(focus_arm(lr, momentum)), outer_lr=lr, momentum=momentum))
    finite = [r for r in rows if math.isfinite(r["bpb"])] or rows
    best = min(finite, key=lambda r: r["bpb"])
    sim.log(f"sweep: best outer lr {best['outer_lr']:g}, momentum {best['momentum']:g}")
    return rows, (best["outer_lr"], best["momentum"])


def diloco_arms(lr: float, momentum: float, codecs: tuple[str, ...] = CODECS, ef_decay: float = 1.0,
                fragments: tuple[int, ...] = (1,), delay: int = 0) -> list[sim.Arm]:
    """Each codec at each H and F with the plain mean, but the sparse ones as a node runs them (chunk-clipped mean
    and verification: the plain mean has no defence); then the packaged int8 defence at FOCUS_H, if int8 is run
    (and F = 1 is)."""
    arms = [sim.Arm(h, codec, lr, momentum, ef_decay=ef_decay, fragments=f, delay=delay,
                    **({"method": "chunk_clip", "verify": True} if codec in sim.SPARSE_CODECS else {}))
            for h in INNER_STEPS for f in fragments for codec in codecs]
    packaged = FOCUS_CODEC == "int8" and "int8" in codecs and FOCUS_H in INNER_STEPS and 1 in fragments
    return [*arms, *([focus_arm(lr, momentum, method="trimmed_mean", verify=True, delay=delay)] if packaged else [])]


def part_diloco(bench: Bench, outer: tuple[float, float], codecs: tuple[str, ...], ef_decay: float,
                fragments: tuple[int, ...] = (1,), delay: int = 0) -> list[dict]:
    return [dict(bench.run_arm(arm), label=arm_label(arm), arm=arm)
            for arm in diloco_arms(*outer, codecs, ef_decay, fragments, delay)]


def part_byzantine(bench: Bench, outer: tuple[float, float], fragments: int = 1, packaged_only: bool = False,
                   delay: int = 0) -> tuple[dict, list[dict]]:
    """Each attack against each defence (``packaged_only``: the focus codec's packaged one), at F ``fragments``."""
    honest = bench.run_arm(focus_arm(*outer, fragments=fragments, delay=delay))
    rows = []
    for attack in ATTACKS:
        for label, method, verify, owner in DEFENCES:
            if packaged_only and label != PACKAGED_DEFENCE.get(FOCUS_CODEC):
                continue
            arm = focus_arm(*outer, method=method, verify=verify, attack=attack, owner_attack=owner,
                            fragments=fragments, delay=delay)
            rows.append(dict(bench.run_arm(arm), attack=attack, defence=label))
    return honest, rows


# --- output -----------------------------------------------------------------------------------


def mb(value: float) -> str:
    return f"{value / 1e6:,.2f} MB"


def ratio(value: float, reference: float | None) -> str:
    return f"{value / reference:.4f}" if reference and math.isfinite(value) else "—"


def bytes_ratio(value: float, sync_bytes: float | None) -> str:
    return f"1/{sync_bytes / value:,.0f}" if sync_bytes and value else "—"


def bpb(value: float) -> str:
    return f"{value:.4f}" if math.isfinite(value) else "NaN"


def diverged(result: dict) -> str:
    if not result["diverged"]:
        return "no"
    steps = result["outer_steps"]
    return f"yes (stopped after {steps} outer step{'' if steps == 1 else 's'})" if result["stopped"] else "yes"


def table_sync(rows: list[dict]) -> None:
    best = min(r["bpb"] for r in rows)
    print_table("Sync data parallel (4 workers, gradients averaged every step)",
                ["arm", "steps", "held-out bpb", "ratio to best sync", "bytes per worker", "bytes vs sync DP"],
                [[f"sync DP, AdamW lr {r['lr']:g}", r["steps"], bpb(r["bpb"]), ratio(r["bpb"], best),
                  mb(r["bytes_per_worker"]), "1"] for r in rows])


def table_sweep(rows: list[dict], sync: float | None, chosen: tuple[float, float]) -> None:
    print_table(f"Outer lr x momentum sweep (Nesterov), H={FOCUS_H} {FOCUS_CODEC}, plain mean; "
                f"chosen: lr {chosen[0]:g}, momentum {chosen[1]:g}",
                ["outer lr", "momentum", "outer steps", "held-out bpb", "ratio to sync DP", "diverged"],
                [[f"{r['outer_lr']:g}", f"{r['momentum']:g}", r["outer_steps"], bpb(r["bpb"]),
                  ratio(r["bpb"], sync), diverged(r)] for r in rows])


def table_diloco(rows: list[dict], sync: float | None, sync_bytes: float | None, outer: tuple) -> None:
    body = [[r["label"], r["outer_steps"], bpb(r["bpb"]), bpb(r["bpb_agreed"]), bpb(r["bpb_averaged"]),
             ratio(r["bpb"], sync),
             mb(r["bytes_per_worker"]),
             bytes_ratio(r["bytes_per_worker"], sync_bytes), r["rejected_honest"] + r["rejected_byzantine"],
             r["refused_results"], f"{r['max_param_diff']:.1e} / {r['max_start_diff']:.0e}"] for r in rows]
    print_table(f"DiLoCo, 4 replicas, equal tokens, outer lr {outer[0]:g} momentum {outer[1]:g}",
                ["arm", "outer steps", "held-out bpb", "of the agreed weights", "of the replicas averaged",
                 "ratio to sync DP", "bytes per worker",
                 "bytes vs sync DP",
                 "rejected contributions", "refused results", "max replica diff (live / start)"], body)


def table_byzantine(honest: dict, rows: list[dict], sync_bytes: float | None) -> None:
    ref = honest["bpb"]
    body = [["none (honest run)", "plain mean", honest["outer_steps"], bpb(ref), "1.0000",
             mb(honest["bytes_per_worker"]), bytes_ratio(honest["bytes_per_worker"], sync_bytes), "0 / 0", 0,
             f"{honest['max_param_diff']:.1e}", diverged(honest)]]
    for r in rows:
        body.append([ATTACK_LABELS[r["attack"]], r["defence"], r["outer_steps"], bpb(r["bpb"]), ratio(r["bpb"], ref),
                     mb(r["bytes_per_worker"]), bytes_ratio(r["bytes_per_worker"], sync_bytes),
                     f"{r['rejected_byzantine']} / {r['rejected_honest']}", r["refused_results"],
                     f"{r['max_param_diff']:.1e}", diverged(r)])
    print_table(f"Byzantine: replica 3 of 4 lies, H={FOCUS_H} {FOCUS_CODEC}; held-out of honest replica 0",
                ["attack", "defence", "outer steps", "held-out bpb", "ratio to honest run", "bytes per worker",
                 "bytes vs sync DP", "rejected contributions (attacker / honest)", "refused results",
                 "max honest-replica diff", "diverged"],
                body)


def plain(result: dict) -> dict:
    """A result without the Arm object, for --json."""
    return {k: (vars(v) if isinstance(v, sim.Arm) else v) for k, v in result.items()}


# --- main -------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    global FOCUS_CODEC, FOCUS_H, INNER_STEPS  # --focus and --h set them
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="inner steps per replica = sync steps")
    parser.add_argument("--warm", type=int, default=DEFAULT_WARM, help="warm-start AdamW steps")
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of the tables")
    parser.add_argument("--codecs", default=",".join(CODECS),
                        help=f"diloco part's codecs, of float32,float16,bfloat16,int8,{','.join(sim.SPARSE_CODECS)}")
    parser.add_argument("--outer", default=None, metavar="LR,MOMENTUM",
                        help=f"the outer lr and momentum when the sweep is left out (default {FALLBACK_OUTER})")
    parser.add_argument("--focus", default=None, metavar="CODEC,H",
                        help=f"the sweep's and the Byzantine part's codec and H (default {FOCUS_CODEC},{FOCUS_H})")
    parser.add_argument("--h", default=None, metavar="H,...",
                        help=f"the diloco part's H values (default {INNER_STEPS})")
    parser.add_argument("--ef-decay", type=float, default=1.0,
                        help="the diloco part's error-feedback decay (SparseLoCo's beta; default 1: none)")
    parser.add_argument("--fragments", default="1", metavar="F,...",
                        help="the diloco part's fragment counts (Streaming DiLoCo; default 1: none)")
    parser.add_argument("--delay", type=int, default=0, metavar="D",
                        help="inner steps between taking a pseudo-gradient and its outer step (default 0)")
    parser.add_argument("--packaged-defence", action="store_true",
                        help="the byzantine part runs only the focus codec's packaged defence, at the last --fragments")
    args = parser.parse_args()
    if not all(f.isdigit() and int(f) > 0 for f in args.fragments.split(",")):
        parser.error("--fragments takes positive counts, e.g. 1,5")
    args.fragments = tuple(int(f) for f in args.fragments.split(","))
    if args.delay < 0:
        parser.error("--delay must be non-negative")
    args.codecs = tuple(c for c in args.codecs.split(",") if c)
    if set(args.codecs) - {"float32", "float16", "bfloat16", "int8", *sim.SPARSE_CODECS}:
        parser.error("--codecs takes float32, float16, bfloat16, int8, " + ", ".join(sim.SPARSE_CODECS))
    try:
        args.outer = FALLBACK_OUTER if args.outer is None else tuple(float(v) for v in args.outer.split(","))
    except ValueError:
        parser.error("--outer takes LR,MOMENTUM, e.g. 0.7,0.5")
    if len(args.outer) != 2:
        parser.error("--outer takes LR,MOMENTUM, e.g. 0.7,0.5")
    if args.h is not None:
        if not all(h.isdigit() and int(h) > 0 for h in args.h.split(",")):
            parser.error("--h takes positive H values, e.g. 50,500")
        INNER_STEPS = tuple(int(h) for h in args.h.split(","))
    if any(h % f for h in INNER_STEPS for f in args.fragments):
        parser.error("every H must be a multiple of every --fragments count")
    if args.focus is not None:
        codec, _, h = args.focus.partition(",")
        if codec not in {"float32", "float16", "bfloat16", "int8", *sim.SPARSE_CODECS} or not h.isdigit() \
                or int(h) not in INNER_STEPS:
            parser.error(f"--focus takes CODEC,H with H one of {INNER_STEPS}, e.g. sparse,50")
        FOCUS_CODEC, FOCUS_H = codec, int(h)
    args.parts = [p for p in args.only.split(",") if p]
    if set(args.parts) - set(PARTS):
        parser.error(f"--only takes parts of {','.join(PARTS)}")
    lcm = math.lcm(*INNER_STEPS)
    if args.steps < lcm or args.steps % lcm:
        parser.error(f"--steps must be a positive multiple of {lcm} (every H)")
    if args.warm < 0:
        parser.error("--warm must be non-negative")
    return args


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


def header(args: argparse.Namespace) -> dict:
    numel = sim.new_model().param_count()
    info = {"command": "python " + " ".join([sys.argv[0], *sys.argv[1:]]), "loadavg_start": loadavg(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "cores": os.cpu_count(),
            "model": f"{sim.SPEC.n_layers} blocks, width {sim.SPEC.width}, ffn {sim.SPEC.ffn}, "
                     f"context {sim.SPEC.context}, {numel:,} parameters, one stage",
            "batch": f"{sim.N_WORKERS} workers x {sim.BATCH} rows x {sim.SPEC.context} bytes per step",
            "steps": args.steps, "warm": args.warm,
            "tokens": sim.N_WORKERS * args.steps * sim.BATCH * sim.SPEC.context}
    out = sys.stderr if args.json else sys.stdout
    print(f"# {info['command']}", file=out)
    for key in ("loadavg_start", "torch", "threads", "cores", "model", "batch", "steps", "warm", "tokens"):
        print(f"# {key}: {info[key]}", file=out)
    out.flush()
    return info


def run_parts(bench: Bench, parts: list[str], outer: tuple[float, float], codecs: tuple[str, ...],
              ef_decay: float = 1.0, fragments: tuple[int, ...] = (1,), delay: int = 0,
              packaged_only: bool = False) -> dict:
    out: dict = {"outer": outer}
    if "sync" in parts:
        out["sync"] = part_sync(bench)
    if "sweep" in parts:
        out["sweep"], out["outer"] = part_sweep(bench)
    if "diloco" in parts:
        out["diloco"] = part_diloco(bench, out["outer"], codecs, ef_decay, fragments, delay)
    if "byzantine" in parts:
        out["honest"], out["byzantine"] = part_byzantine(bench, out["outer"], fragments[-1], packaged_only, delay)
    return out


def report(bench: Bench, out: dict) -> None:
    sync, sync_bytes = bench.best_sync(), bench.sync_bytes()
    print(f"\nwarm start: {bench.warm.bpb:.4f} bits/byte held-out (the divergence threshold)")
    if "sync" in out:
        table_sync(out["sync"])
    if "sweep" in out:
        table_sweep(out["sweep"], sync, out["outer"])
    if "diloco" in out:
        table_diloco(out["diloco"], sync, sync_bytes, out["outer"])
    if "byzantine" in out:
        table_byzantine(out["honest"], out["byzantine"], sync_bytes)


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)  # 2 shared cores: one for us
    started = time.monotonic()
    info = header(args)
    bench = Bench(args.steps, args.warm)
    out = run_parts(bench, args.parts, args.outer, args.codecs, args.ef_decay, args.fragments, args.delay,
                    args.packaged_defence)
    info.update(loadavg_end=loadavg(), wall_seconds=round(time.monotonic() - started, 1))
    if args.json:
        out = {k: ([plain(r) for r in v] if isinstance(v, list) else v) for k, v in out.items()}
        print(json.dumps(dict(info, warm_bpb=bench.warm.bpb, **out), default=str, indent=1))
        return 0
    report(bench, out)
    print(f"\n# loadavg at end: {info['loadavg_end']}; wall time {info['wall_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
