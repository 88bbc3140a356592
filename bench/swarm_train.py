"""The swarm against one process at equal tokens: ablation arms, tokens/s, compute-busy with 50 ms links.

Arms, one after the other on this machine (never at once: 2 cores), each ``p2pswarm demo`` (real
processes on loopback) for ``--seconds`` with ``--summary``, named STAGESxREPLICAS:

- ``1x2``: one stage of all 8 blocks, 2 replicas — DiLoCo alone;
- ``2x1``: 2 stages, 1 replica each — the pipeline alone (each replica's outer rounds are alone);
- ``2x2``: both (the default demo);
- ``3x1``: 3 stages (3 + 3 + 2 blocks), 1 replica each — a middle stage forwarding and relaying;

then the **baseline**: one process trains tiny-lm (all 8 blocks, the same initial weights, micro-batches
of 8 x 128 bytes, AdamW with the run's settings) until it has seen as many tokens as the largest arm,
its held-out loss measured on the swarm's held-out set every ``EVAL_EVERY`` steps. Each arm's held-out
figure is that of the agreed weights after each DiLoCo outer round (the same through every chain, see
``swarm/evaluation.py``), at the tokens the stage-0 replicas had trained by then; it is compared with
the baseline at those tokens (interpolated). Printed per arm: tokens/s (steady, and against the
baseline's), the held-out ratio at the last round and over the rounds of the second half, the spread
between chains, compute-busy. Last, ``2x2`` with ``--tune link_delay_s=0.05`` (every frame waits 50 ms
before it is written), for compute-busy (``--no-delay-arm`` skips it).

``--tune KEY=VALUE`` (repeatable) reaches every peer of every arm: e.g. ``--tune affinity=0`` (no
stage-to-stage affinity) for an ablation of that.

With ``--links unshaped,home,...`` (names of ``p2pswarm.testing.linklab.PROFILES``, or ``relayed``)
the same 2 x 2 swarm then runs in a shaped-link lab (root; network namespaces and ``tc tbf``), one
arm per name after the arms above (``--links-only``: instead of them): every join on its own line
of that profile, or, for ``relayed``, stage 0 and stage 1 behind symmetric NATs talking through a
relay. Each prints tokens/s against the unshaped arm of the same run and against the link-bound
limit (what the links alone could carry), ack latency, timeouts per 100 sends, duplicates, lost
micro-batches and compute-busy per peer.

``--boundary dense,q8,q4`` runs each link arm once per stage-boundary encoding (a run file's ``[wire]``,
``swarm/quant.py``); the link-bound limit follows the encoding's bytes per token.

    python bench/swarm_train.py [--seconds 120] [--arms 1x2,2x1,2x2,3x1] [--links unshaped,home [--links-only]]
        [--boundary dense,q8,q4]
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

EVAL_EVERY = 50  # baseline steps between held-out evaluations
ARMS = ("1x2", "2x1", "2x2", "3x1")  # stages x replicas
BASELINE_CAP = 3.0  # the baseline trains at most this many times --seconds to match the largest arm's tokens


def baseline(tokens_wanted: int, seconds_cap: float) -> tuple[float, list[tuple[int, float]]]:
    """One process until ``tokens_wanted`` (or ``seconds_cap``): tokens per compute second, held-out curve."""
    import torch
    from common import one_process

    from p2pswarm.model.transformer import run_stages
    from p2pswarm.swarm.engine import ids_tensor, lr_at

    setup = one_process("tiny-lm")
    config, stages, params, opt, evaluate = setup.config, setup.stages, setup.params, setup.opt, setup.evaluate
    curve, tokens, step, compute = [(0, evaluate())], 0, 0, 0.0
    it = setup.batches
    started = time.monotonic()
    while tokens < tokens_wanted and time.monotonic() - started < seconds_cap:
        t0 = time.monotonic()
        ids = ids_tensor(next(it).rows)
        loss = stages[-1].loss(run_stages(stages, ids[:, :-1]), ids[:, 1:])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, config.lr, config.warmup_steps, config.decay_steps, config.min_lr_ratio)
        opt.step()
        compute += time.monotonic() - t0
        tokens, step = tokens + ids[:, 1:].numel(), step + 1
        if step % EVAL_EVERY == 0:
            curve.append((tokens, evaluate()))
    curve.append((tokens, evaluate()))
    return tokens / compute, curve


def at_tokens(curve: list[tuple[int, float]], tokens: int) -> float:
    """The baseline's held-out loss after ``tokens``, interpolated between evaluations."""
    for (t0, l0), (t1, l1) in itertools.pairwise(curve):
        if t0 <= tokens <= t1:
            return l0 + (l1 - l0) * (tokens - t0) / max(1, t1 - t0)
    return curve[-1][1]


TUNE: list[str] = []  # --tune KEY=VALUE flags for every arm's peers (main() fills it from the command line)


def swarm(seconds: float, stages: int = 2, replicas: int = 2, delay_ms: int = 0) -> dict:
    """One ``p2pswarm demo`` arm: its --summary document plus the steady tokens/s of its progress lines."""
    tune = [flag for pair in TUNE for flag in ("--tune", pair)] + ["--tune", f"link_delay_s={delay_ms / 1000}"]
    with tempfile.TemporaryDirectory(prefix="swarm-train-") as workdir:
        summary = Path(workdir) / "summary.json"
        out = subprocess.run([sys.executable, "-m", "p2pswarm", "demo", "--duration", str(seconds),
                              "--stages", str(stages), "--peers", str(stages * replicas), "--summary", str(summary),
                              "--dir", str(Path(workdir) / "demo"), *tune],
                             capture_output=True, text=True, timeout=seconds + 300).stdout
        if not summary.exists():
            raise RuntimeError(f"the demo wrote no summary; its output ended: {out[-800:]}")
        doc = json.loads(summary.read_text())
    rates = [float(x) for x in re.findall(r"bits/byte .*? (\d+) tok/s", out)]
    doc["steady_tok_s"] = sum(rates[2:]) / max(1, len(rates[2:]))
    return doc


def arm_line(name: str, result: dict, base_rate: float, curve: list[tuple[int, float]]) -> str:
    points = [p for p in result["curve"] if p["tokens"] is not None]
    if len(points) < 2:
        return f"arm {name}: {result['steady_tok_s']:.0f} tok/s, too few outer rounds evaluated ({len(points)})"
    ratios = [p["bpb"] / at_tokens(curve, p["tokens"]) for p in points[1:]]
    late = ratios[len(ratios) // 2:]
    last = points[-1]
    spreads = [p["spread"] for p in result["curve"] if p["chains"] > 1]
    spread = f"max spread between chains {max(spreads):.3f}" if spreads else "one chain per round"
    busy = result["busy"]
    return (f"arm {name}: {result['steady_tok_s']:.0f} tok/s steady ({result['steady_tok_s'] / base_rate:.2f}x one "
            f"process), {result['tokens']} tokens; held-out at round {last['round']} {last['bpb']:.3f} after "
            f"{last['tokens']} tokens vs one process {at_tokens(curve, last['tokens']):.3f}: {ratios[-1]:.3f}x "
            f"(rounds of the second half {sum(late) / len(late):.3f}x); curve "
            + " ".join(f"{p['tokens'] // 1000}k:{p['bpb']:.2f}" for p in points)
            + f"; {spread}; compute-busy mean {sum(busy) / max(1, len(busy)):.2f}")


def main_arms(seconds: float, arms: list[str], delay_arm: bool) -> None:
    """The ablation arms, then the baseline to as many tokens, then 2x2 with 50 ms links."""
    results = {}
    for name in arms:
        stages, replicas = (int(x) for x in name.split("x"))
        try:
            results[name] = swarm(seconds, stages, replicas)
        except Exception as exc:
            print(f"arm {name}: failed: {exc}", flush=True)
    wanted = max([r["tokens"] for r in results.values()] + [1])
    base_rate, curve = baseline(wanted, BASELINE_CAP * seconds)
    print(f"baseline: one process, {base_rate:.0f} tok/s, held-out {curve[0][1]:.3f} -> {curve[-1][1]:.3f} "
          f"bits/byte after {curve[-1][0]} tokens", flush=True)
    for name, result in results.items():
        print(arm_line(name, result, base_rate, curve), flush=True)
    if delay_arm:
        slow = swarm(seconds, delay_ms=50)
        busy = slow["busy"]
        print(f"arm 2x2, 50 ms links: {slow['steady_tok_s']:.0f} tok/s steady, compute-busy per peer "
              f"{', '.join(f'{b:.3f}' for b in busy)} (mean {sum(busy) / max(1, len(busy)):.3f})", flush=True)


def link_arms(names: list[str], seconds: float, boundaries: list[str]) -> None:
    """One lab arm per name and boundary encoding, one after the other (unshaped first, for the ratios);
    a line each. The ratio to unshaped is against the unshaped arm of the same encoding."""
    from p2pswarm.testing.linkswarm import run_link_arm, run_relayed_arm

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so a lab is torn down
    unshaped: dict[str, float] = {}
    for boundary, name in itertools.product(boundaries, sorted(names, key=lambda n: n != "unshaped")):
        if name == "relayed" and boundary != boundaries[0]:  # the demo's run: its packaged boundary, once
            continue
        with tempfile.TemporaryDirectory(prefix=f"swarm-train-{name}-") as workdir:
            began = time.monotonic()
            try:
                result = (run_relayed_arm(seconds, Path(workdir)) if name == "relayed"
                          else run_link_arm(name, seconds, Path(workdir), boundary))
            except Exception as exc:
                print(f"link arm {name} ({boundary}): failed after {time.monotonic() - began:.0f} s: {exc}", flush=True)
                continue
        if name == "unshaped":
            unshaped[boundary] = result["tokens_per_s"]
        print(link_line(result, unshaped.get(boundary)), flush=True)


def _total(section: dict, word: str) -> float:
    """The sum over stages of every key of SECTION (stage -> counters) containing WORD."""
    return sum(v for sums in section.values() for k, v in sums.items() if word in k and "_ms" not in k)


def _worst(section: dict, key: str) -> float | None:
    values = [sums[key] for sums in section.values() if sums.get(key) is not None]
    return max(values) if values else None


def link_line(result: dict, unshaped: float | None) -> str:
    rate, bound, delivery = result["tokens_per_s"], result["link_bound_tok_s"], result["delivery"]
    if result["arm"] == "relayed":
        line = "symmetric NATs, through a relay"
    elif result["up_mbit"] is None and result["down_mbit"] is None:
        line = "unshaped"
    else:
        line = f"{result['up_mbit'] or '-'} up / {result['down_mbit'] or '-'} down Mbit/s"
    ratio = ("no unshaped arm" if unshaped is None else "the unshaped arm trained nothing" if not unshaped
             else f"{rate / unshaped:.2f}x unshaped")
    limit = f"link-bound {bound:.0f} tok/s ({rate / bound:.2f}x)" if bound else "link-bound -"
    p50, p99 = _worst(delivery, "ack_ms_p50"), _worst(delivery, "ack_ms_p99")
    ack = f"ack p50/p99 {p50:.0f}/{p99:.0f} ms" if p50 is not None and p99 is not None else "ack p50/p99 -"
    sent = _total(delivery, "sent")
    timeouts = f"{100 * _total(delivery, 'timeouts') / sent:.1f}" if sent else "-"
    duplicates = f"{_total(result['counts'], 'duplicate'):.0f} dropped by receivers, " \
                 f"{_total(delivery, 'duplicate'):.0f} acked as such to senders"
    busy = " ".join(f"{b:.2f}" if b is not None else "-" for _, b in sorted(result["busy"].items()))
    started = "" if result["training_started"] else " (training never started)"
    if result["arm"] == "relayed" and not result.get("relay_reserved"):
        started += " (a peer never got a relay reservation)"
    boundary = result.get("boundary", "dense")
    return (f"link {result['arm']} ({line}, {boundary} boundary): {rate:.0f} tok/s ({ratio}), {limit}, {ack}, "
            f"timeouts {timeouts} "
            f"per 100 sends ({sent:.0f} sent), duplicates {duplicates}, lost {_total(delivery, 'lost'):.0f}, "
            f"control ping p50/max {result.get('control_rtt_ms_p50')}/{result.get('control_rtt_ms_max')} ms "
            f"({result.get('control_pings_failed', '-')} of {result.get('control_pings', '-')} failed), "
            f"stage health reported degraded or down {result.get('degraded_reports', '-')} times, backups taken "
            f"{result.get('backups_held', '-')} ({result.get('backup_fetches_cut', '-')} fetches cut), "
            f"compute-busy since start {busy}; {result['tokens']} tokens in {result['seconds']:.0f} s after "
            f"{result['wait_s']:.0f} s of start-up, arm {result['total_s']:.0f} s{started}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--links", default="", metavar="NAMES",
                        help="comma list of link profiles (unshaped, dc100, home, weak) or relayed: one lab arm each")
    parser.add_argument("--links-only", action="store_true", help="run only the --links arms")
    parser.add_argument("--boundary", default="dense", metavar="NAMES",
                        help="comma list of stage-boundary encodings for the --links arms: dense, q8, q4, "
                             "or sK, sKq8, sKq4 (a subspace of K; run file [wire]; one lab arm per link and "
                             "encoding)")
    parser.add_argument("--arms", default=",".join(ARMS), metavar="SxR,...",
                        help=f"ablation arms, stages x replicas (default {','.join(ARMS)})")
    parser.add_argument("--no-delay-arm", action="store_true", help="skip the 2x2 arm with 50 ms links")
    parser.add_argument("--tune", action="append", default=[], metavar="KEY=VALUE",
                        help="a knob for every peer of every arm (p2pswarm join --help), e.g. affinity=0")
    args = parser.parse_args()
    TUNE.extend(args.tune)
    links = [n.strip() for n in args.links.split(",") if n.strip()]
    if links:
        from p2pswarm.testing.linklab import PROFILES, link_lab_available
        from p2pswarm.testing.natlab import lab_available

        unknown = [n for n in links if n not in PROFILES and n != "relayed"]
        if unknown:
            parser.error(f"unknown link profile(s) {unknown}; known: {', '.join(PROFILES)}, relayed")
        if reason := link_lab_available() or ("relayed" in links and lab_available()):
            parser.error(reason)
    elif args.links_only:
        parser.error("--links-only needs --links")
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if any(not re.fullmatch(r"[1-9]x[1-9]", a) for a in arms):
        parser.error(f"--arms: each arm is STAGESxREPLICAS, e.g. 2x2, not {args.arms!r}")
    if not args.links_only:
        main_arms(args.seconds, arms, not args.no_delay_arm)
    boundaries = [b.strip() for b in args.boundary.split(",") if b.strip()]
    from p2pswarm.testing.linkswarm import parse_boundary

    for boundary in boundaries:
        try:
            parse_boundary(boundary)
        except ValueError as exc:
            parser.error(f"--boundary: {exc}")
    if links:
        link_arms(links, args.seconds, boundaries)
    return 0


if __name__ == "__main__":
    sys.exit(main())
