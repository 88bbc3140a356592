"""Outer rounds over a shaped line, int8 against the sparse codec: compute-busy during rounds (issue 27).

Why: a replica keeps training while its outer round runs (the outer step lands a few inner steps
late, ``outer.outer_step``); on a line where a round moves megabytes, does compute still wait for
it? The demo's 2 x 2 swarm (tiny-lm/2, the demo's H = 40, the packaged s16q4 boundary) runs on
one of the link lab's lines (``--line``, default ``home``: 20/100 Mbit/s, 30 ms) with the
packaged int8 codec (trimmed mean, verification), then with the sparse one (chunk-clipped mean,
verification), the baseline first in the same run. During a window of ``--seconds`` every peer's
``/api/diloco`` is read every ``POLL`` s: an interval that began in an outer round (phase not
"training") counts as in-round, the others as training; compute-busy is the share of an
interval's wall time its engine computed (``computing_s``). Printed per codec: compute-busy in
rounds and between them (their ratio: 1.0 means rounds cost compute nothing),
rounds completed, seconds and MB sent per round (p50). ``--arms`` adds ``int8-f4`` and ``sparse-f4``: the
same with Streaming DiLoCo's 4 fragments (a round every H / 4 steps over a quarter of the stage).

    PYTHONPATH=. python bench/diloco_line.py [--line home] [--seconds 120] [--arms int8,sparse,int8-f4,sparse-f4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2pswarm.testing.linkswarm import PROFILES, link_swarm, measure

CODECS = {"int8": 'codec = "int8"\naggregator = "trimmed_mean"',  # [diloco] lines: the packaged codec first
          "sparse": 'codec = "sparse"\naggregator = "chunk_clip"'}
CODECS |= {f"{name}-f4": lines + "\nfragments = 4" for name, lines in CODECS.items()}  # Streaming DiLoCo, F = 4
POLL = 0.5  # seconds between reads of every peer's /api/diloco
BOUNDARY = "s16q4"  # the packaged boundary


def sample(swarm, names: list[str]) -> dict[str, dict]:
    return {name: swarm.get(name, "/api/diloco", timeout=5.0) or {} for name in names}


def watch(swarm, names: list[str], seconds: float) -> dict:
    """Read every peer's /api/diloco each POLL s for ``seconds``: busy seconds and wall seconds in and out of rounds."""
    sums = {"round": [0.0, 0.0], "training": [0.0, 0.0]}  # [computed s, wall s]
    before, t0 = sample(swarm, names), time.monotonic()
    last = t0
    while last - t0 < seconds:
        time.sleep(POLL)
        now, after = time.monotonic(), sample(swarm, names)
        for name in names:
            a, b = before.get(name, {}), after.get(name, {})
            if "computing_s" not in a or "computing_s" not in b:
                continue
            kind = "training" if a.get("phase") == "training" else "round"
            sums[kind][0] += b["computing_s"] - a["computing_s"]
            sums[kind][1] += now - last
        before, last = after, now
    rounds = [r for d in before.values() for r in d.get("rounds", [])]
    return {"busy_in_rounds": sums["round"][0] / sums["round"][1] if sums["round"][1] else None,
            "busy_training": sums["training"][0] / sums["training"][1] if sums["training"][1] else None,
            "round_wall_share": sums["round"][1] / max(1e-9, sums["round"][1] + sums["training"][1]),
            "round_s_p50": statistics.median(r["seconds"] for r in rounds) if rounds else None,
            "round_mb_p50": statistics.median(r["bytes_sent"] for r in rounds) / 1e6 if rounds else None,
            "rounds": sum(1 for d in before.values() for _ in d.get("rounds", []))}


def run(line: str, codec: str, seconds: float, workdir: Path) -> dict:
    with link_swarm(line, workdir / codec, BOUNDARY, lifetime=seconds + 600, outer=CODECS[codec]) as (swarm, stages,
                                                                                                         get):
        started = measure(swarm, stages, get, 1.0)  # waits until stage 0 trains
        figures = watch(swarm, list(stages), seconds)
    return {"codec": codec, "training_started": started["training_started"], **figures}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--line", default="home", choices=sorted(PROFILES))
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--arms", default="int8,sparse", help=f"comma-separated, of {','.join(CODECS)} (the first is "
                        "the baseline)")
    args = parser.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    if not arms or set(arms) - set(CODECS):
        parser.error(f"--arms takes {','.join(CODECS)}")
    with tempfile.TemporaryDirectory(prefix="diloco-line-") as tmp:
        results = [run(args.line, codec, args.seconds, Path(tmp)) for codec in arms]
    print(f"\n| {args.line}, {args.seconds:.0f} s | compute-busy in rounds | between rounds | ratio | share of time in "
          "rounds | rounds | s a round (p50) | MB sent a round (p50) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        ratio = r["busy_in_rounds"] / r["busy_training"] if r["busy_in_rounds"] and r["busy_training"] else None
        print(f"| {r['codec']} | {r['busy_in_rounds']:.3f} | {r['busy_training']:.3f} | "
              f"{ratio:.3f} | {r['round_wall_share']:.2f} | {r['rounds']} | {r['round_s_p50']:.2f} | "
              f"{r['round_mb_p50']:.3f} |" if ratio is not None else f"| {r['codec']} | {r} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
