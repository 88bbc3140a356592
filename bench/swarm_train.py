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

With ``--links unshaped,home,...`` (names of ``p2pswarm.testing.linklab.PROFILES``, or ``relayed``)
the same 2 x 2 swarm then runs in a shaped-link lab (root; network namespaces and ``tc tbf``), one
arm per name after the arms above (``--links-only``: instead of them): every join on its own line
of that profile, or, for ``relayed``, stage 0 and stage 1 behind symmetric NATs talking through a
relay. Each prints tokens/s against the unshaped arm of the same run and against the link-bound
limit (what the links alone could carry), ack latency, timeouts per 100 sends, duplicates, lost
micro-batches and compute-busy per peer.

    python bench/swarm_train.py [--seconds 120] [--links unshaped,home [--links-only]]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
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


def main_arms(seconds: float) -> None:
    """The three arms above: baseline, swarm, swarm with 50 ms links."""
    base_rate, curve = baseline(seconds)
    print(f"baseline: one process, {base_rate:.0f} tok/s, held-out {curve[0][1]:.3f} -> {curve[-1][1]:.3f} "
          f"bits/byte after {curve[-1][0]} tokens", flush=True)
    result = swarm(seconds)
    equal = at_tokens(curve, result["tokens"])
    print(f"swarm 2x2: {result['tok_s']} tok/s over the run ({result['steady_tok_s']:.0f} steady), "
          f"{result['tokens']} tokens, held-out {result['heldout']} bits/byte; baseline at equal tokens "
          f"{equal:.3f}", flush=True)
    print(f"  ratio tokens/s (steady) {result['steady_tok_s'] / base_rate:.2f}x; held-out at equal tokens "
          f"{result['heldout'] / equal:.3f}x the baseline's; compute-busy {result['busy']}", flush=True)
    slow = swarm(seconds, delay_ms=50)
    print(f"swarm 2x2, 50 ms links: {slow['tok_s']} tok/s, held-out {slow['heldout']}, compute-busy per peer "
          f"{slow['busy']} (mean {slow['busy_mean']})", flush=True)


def link_arms(names: list[str], seconds: float) -> None:
    """One lab arm per name, one after the other (unshaped first, for the ratios); a line each."""
    from p2pswarm.testing.linkswarm import run_link_arm, run_relayed_arm

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so a lab is torn down
    unshaped = None
    for name in sorted(names, key=lambda n: n != "unshaped"):
        with tempfile.TemporaryDirectory(prefix=f"swarm-train-{name}-") as workdir:
            began = time.monotonic()
            try:
                result = (run_relayed_arm(seconds, Path(workdir)) if name == "relayed"
                          else run_link_arm(name, seconds, Path(workdir)))
            except Exception as exc:  # noqa: BLE001 - one broken arm must not hide the others
                print(f"link arm {name}: failed after {time.monotonic() - began:.0f} s: {exc}", flush=True)
                continue
        if name == "unshaped":
            unshaped = result["tokens_per_s"]
        print(link_line(result, unshaped), flush=True)


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
    return (f"link {result['arm']} ({line}): {rate:.0f} tok/s ({ratio}), {limit}, {ack}, timeouts {timeouts} "
            f"per 100 sends ({sent:.0f} sent), duplicates {duplicates}, lost {_total(delivery, 'lost'):.0f}, "
            f"compute-busy since start {busy}; {result['tokens']} tokens in {result['seconds']:.0f} s after "
            f"{result['wait_s']:.0f} s of start-up, arm {result['total_s']:.0f} s{started}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--links", default="", metavar="NAMES",
                        help="comma list of link profiles (unshaped, dc100, home, weak) or relayed: one lab arm each")
    parser.add_argument("--links-only", action="store_true", help="run only the --links arms")
    args = parser.parse_args()
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
    if not args.links_only:
        main_arms(args.seconds)
    if links:
        link_arms(links, args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
