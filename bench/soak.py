"""A chaos soak: a local swarm for a set time while peers are killed, restarted and frozen; does it last?

Starts a bootstrap node and ``tiny-lm/3`` x ``--per-stage`` ``p2pswarm join`` peers (the demo's DiLoCo
values, rebalancing on, each with its own data dir), on loopback or, with ``--link PROFILE``, each join
on its own shaped line of the link lab (``p2pswarm.testing.linklab``; root). One peer of stage 0 and
one of the last stage, and the bootstrap node, are never touched: their memory is read over the whole
run. Every ``--every`` seconds (seeded, ``--seed``) one touchable peer is either SIGKILLed and started
again ``RESTART_S`` later on its own data dir (a crash and a restart), or SIGSTOPped for ``FREEZE_S``
(a hang). Once, at half time, every replica of a stage with no untouched peer is killed at once; they
are started again after ``WHOLE_STAGE_DOWN_S`` (the swarm heals meanwhile: a peer moves in).

Reports: processes that ended on their own (crashes), tracebacks in any log, micro-batches lost
(``delivery.lost`` summed over every life of every peer), outer rounds (the highest agreed round per
stage), restores (``loaded stage`` log lines), snapshots and backups on disk that do not decode at the end, the
longest stretch in which no stage-0 peer trained a token, and for each untouched process its RSS and
open fds over time with a least-squares slope after ``--warmup`` (MB per 10 minutes, fds per 10 min).

    python bench/soak.py --minutes 30 [--link home] [--per-stage 2] [--every 60] [--seed 0]

Targets (issue 28): 0 crashes, 0 tracebacks, 0 corrupted snapshots, stage 0 never stalled > 60 s,
RSS slope < 1 MB per 10 minutes after warm-up, fds flat.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import machine_line, print_table

from p2pswarm.demo import DEMO_GATHER_S, DEMO_INNER_STEPS, DEMO_OUTER_LR, DEMO_OUTER_MOMENTUM
from p2pswarm.diloco.checkpoint import decode_state
from p2pswarm.errors import RemoteProtocolError
from p2pswarm.model.catalog import get_model
from p2pswarm.testing.churn import ProcessUsage
from p2pswarm.testing.soakswarm import LabCluster, LoopbackCluster

MODEL = get_model("tiny-lm/3")
AGREED = ("--model", MODEL.name, "--outer-lr", str(DEMO_OUTER_LR), "--gather", str(DEMO_GATHER_S),
          "--inner-steps", str(DEMO_INNER_STEPS), "--outer-momentum", str(DEMO_OUTER_MOMENTUM), "--threads", "1")
RESTART_S = 5.0  # a killed peer comes back this long after
FREEZE_S = 20.0  # a SIGSTOPped peer is continued this long after
WHOLE_STAGE_DOWN_S = 60.0  # a killed stage's peers come back this long after
READY_TIMEOUT = 400.0  # a guard: every stage trained a token (7 processes on 2 cores start slowly)


class Soak:
    """The schedule, the watching and the tallies of one run."""

    def __init__(self, cluster, workdir: Path, per_stage: int, rng: random.Random) -> None:
        self.cluster, self.workdir, self.rng = cluster, workdir, rng
        self.lives: dict[str, int] = {}  # slot -> its current life (1 = first start)
        self.killed_by_us: set[str] = set()  # slots whose current process we ended
        self.crashes: list[str] = []
        self.frozen: dict[str, float] = {}  # slot -> when to continue it
        self.pending: dict[str, float] = {}  # slot -> when to start it again
        self.lost: dict[tuple[str, int], int] = {}  # (slot, life) -> its delivery.lost, last read
        self.rounds: dict[int, int] = {}  # stage -> highest agreed outer round seen
        self.tokens: dict[tuple[str, int], int] = {}  # (slot, life) -> stage-0 tokens, last read
        self.last_progress = self.longest_stall = 0.0
        self.usage: dict[str, list[tuple[float, float, int]]] = {}  # untouched -> (s, RSS MB, fds)
        self.events: list[str] = []
        self.stage_of: dict[str, int] = {}  # slot -> the stage its /api/swarm last named
        self.boot_addr = cluster.start("boot", ["bootstrap"], self.log("boot"), public=True)
        self.slots = {f"s{s}r{r}": s for s in range(MODEL.n_stages) for r in range(per_stage)}
        self.untouched = {"boot", "s0r0", f"s{MODEL.n_stages - 1}r0"}

    def log(self, slot: str) -> Path:
        return self.workdir / f"{slot}-{self.lives.get(slot, 0) + 1}.log"

    def join(self, slot: str) -> None:
        layers = ":".join(map(str, MODEL.stage_range(self.slots[slot])))
        self.cluster.start(slot, ["join", "--bootstrap", self.boot_addr, "--layers", layers, "--rebalance",
                                  *AGREED], self.log(slot))
        self.lives[slot] = self.lives.get(slot, 0) + 1
        self.killed_by_us.discard(slot)

    def kill(self, slot: str, back_in: float, now: float) -> None:
        os.kill(self.cluster.pid(slot), signal.SIGKILL)
        self.killed_by_us.add(slot)
        self.frozen.pop(slot, None)
        self.stage_of.pop(slot, None)
        self.cluster.procs[slot].wait()
        self.pending[slot] = now + back_in

    def freeze(self, slot: str, now: float) -> None:
        os.kill(self.cluster.pid(slot), signal.SIGSTOP)
        self.frozen[slot] = now + FREEZE_S

    def touchable(self) -> list[str]:
        return [s for s in self.slots if s not in self.untouched and s not in self.pending and s not in self.frozen]

    def chaos(self, now: float, t: float) -> None:
        choices = self.touchable()
        if not choices:
            return
        slot = self.rng.choice(choices)
        if self.rng.random() < 0.5:
            self.kill(slot, RESTART_S, now)
            self.events.append(f"{t:7.0f} s  SIGKILL {slot} (life {self.lives[slot]}), back in {RESTART_S:.0f} s")
        else:
            self.freeze(slot, now)
            self.events.append(f"{t:7.0f} s  SIGSTOP {slot} for {FREEZE_S:.0f} s")

    def kill_stage(self, now: float, t: float) -> None:
        """Every replica of a stage that no untouched peer serves (as each last said; frozen ones too)."""
        serving: dict[int, list[str]] = {}
        for slot, stage in self.stage_of.items():
            if slot not in self.pending:
                serving.setdefault(stage, []).append(slot)
        stages = [s for s, members in sorted(serving.items()) if not set(members) & self.untouched]
        if not stages:
            self.events.append(f"{t:7.0f} s  no stage without an untouched peer: whole-stage kill skipped")
            return
        victims = serving[stages[0]]
        for slot in victims:
            self.kill(slot, WHOLE_STAGE_DOWN_S, now)
        self.events.append(f"{t:7.0f} s  SIGKILL stage {stages[0]}: {', '.join(victims)}")

    def tend(self, now: float) -> None:
        """Continue frozen peers and start killed ones again when due; note processes that ended alone."""
        for slot, when in list(self.frozen.items()):
            if now >= when:
                os.kill(self.cluster.pid(slot), signal.SIGCONT)
                del self.frozen[slot]
        for slot, when in list(self.pending.items()):
            if now >= when:
                del self.pending[slot]
                self.join(slot)
        for slot in [*self.slots, "boot"]:
            if slot not in self.pending and slot not in self.killed_by_us and self.cluster.ended(slot) is not None:
                self.crashes.append(f"{slot} life {self.lives.get(slot, 1)}: exit {self.cluster.ended(slot)}")
                self.killed_by_us.add(slot)  # counted once; a peer is started again like a killed one
                if slot != "boot":
                    self.pending[slot] = now + RESTART_S

    def watch(self, now: float, t: float) -> None:
        live = [s for s in self.slots if s not in self.pending and s not in self.frozen]
        with ThreadPoolExecutor(len(live) or 1) as pool:
            docs = dict(zip(live, pool.map(self.cluster.get, live)))
        for slot, doc in docs.items():
            swarm, diloco, key = doc.get("/api/swarm") or {}, doc.get("/api/diloco") or {}, (slot, self.lives[slot])
            if swarm.get("stage") is not None:
                self.stage_of[slot] = swarm["stage"]
            self.lost[key] = max(self.lost.get(key, 0), (swarm.get("delivery") or {}).get("lost", 0))
            if swarm.get("stage") is not None and diloco.get("outer_round") is not None:
                self.rounds[swarm["stage"]] = max(self.rounds.get(swarm["stage"], 0), diloco["outer_round"])
            if swarm.get("first") and swarm.get("tokens", 0) > self.tokens.get(key, 0):
                self.tokens[key] = swarm["tokens"]
                self.last_progress = now
        if self.last_progress:
            self.longest_stall = max(self.longest_stall, now - self.last_progress)

    def sample_usage(self, t: float) -> None:
        for name in sorted(self.untouched):
            try:
                usage = ProcessUsage.of(self.cluster.pid(name))
            except (OSError, ValueError):
                continue
            self.usage.setdefault(name, []).append((t, usage.rss_mb, usage.fds))


def slope_per_10_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value), per 10 minutes."""
    if len(points) < 2:
        return float("nan")
    n = len(points)
    mx, my = sum(p[0] for p in points) / n, sum(p[1] for p in points) / n
    var = sum((p[0] - mx) ** 2 for p in points)
    return 600 * sum((p[0] - mx) * (p[1] - my) for p in points) / var if var else float("nan")


def floors(samples: list[tuple[float, float, int]], window: float = 300.0) -> list[tuple[float, float]]:
    """The lowest RSS of each ``window`` seconds, at the window's middle: a training peer's RSS swings by tens
    of MB as torch and the allocator take and give back memory; a leak lifts the floor."""
    by_window: dict[int, float] = {}
    for t, rss, _ in samples:
        by_window[int(t // window)] = min(rss, by_window.get(int(t // window), rss))
    return [((w + 0.5) * window, rss) for w, rss in sorted(by_window.items())]


def corrupt_snapshots(workdir: Path) -> tuple[int, int]:
    """(snapshots and held backups on disk, those that do not decode)."""
    paths = [*workdir.rglob("snapshot-*.p2ps"), *workdir.rglob("*.backup")]
    bad = 0
    for path in paths:
        try:
            decode_state(path.read_bytes())
        except (OSError, RemoteProtocolError):
            bad += 1
    return len(paths), bad


def run(args, workdir: Path) -> dict:
    seconds = args.minutes * 60
    cluster = (LabCluster(workdir, args.link, seconds + READY_TIMEOUT + 600) if args.link
               else LoopbackCluster(workdir))
    soak = Soak(cluster, workdir, args.per_stage, random.Random(args.seed))
    try:
        for slot in soak.slots:
            soak.join(slot)
        began = time.monotonic()
        while not soak.last_progress and time.monotonic() - began < READY_TIMEOUT:
            soak.watch(time.monotonic(), 0)
            time.sleep(args.poll)
        if not soak.last_progress:
            sys.exit(f"soak: stage 0 trained nothing within {READY_TIMEOUT:.0f} s; logs in {workdir}")
        start = time.monotonic()
        print(f"soak: training after {start - began:.0f} s; {args.minutes} minutes of chaos from now", flush=True)
        soak.last_progress, next_chaos, next_usage, next_print = start, start + args.every, start, start + 300
        stage_killed = False
        while (now := time.monotonic()) < start + seconds:
            t = now - start
            soak.tend(now)
            if now >= next_usage:
                soak.sample_usage(t)
                next_usage += args.sample
            if not stage_killed and t >= seconds / 2:
                soak.kill_stage(now, t)
                stage_killed = True
            elif now >= next_chaos:
                soak.chaos(now, t)
                next_chaos += args.every
            soak.watch(now, t)
            if now >= next_print:
                next_print += 300
                print(f"soak: {t / 60:.0f} min, {len(soak.events)} events, {len(soak.crashes)} crashes, "
                      f"longest stage-0 stall {soak.longest_stall:.0f} s", flush=True)
            time.sleep(args.poll)
        for slot in list(soak.frozen):
            os.kill(cluster.pid(slot), signal.SIGCONT)
    finally:
        cluster.close()
    return tally(soak, workdir, args)


def tally(soak: Soak, workdir: Path, args) -> dict:
    logs = list(workdir.glob("*.log"))
    text = {p.name: p.read_text(errors="replace") for p in logs}
    snapshots, bad = corrupt_snapshots(workdir)
    warm = args.warmup * 60
    usage = {}
    for name, samples in soak.usage.items():
        after = [s for s in samples if s[0] >= warm]
        usage[name] = {"rss_mb_first": after[0][1] if after else None, "rss_mb_last": after[-1][1] if after else None,
                       "rss_mb_per_10_min": round(slope_per_10_min([(s[0], s[1]) for s in after]), 3),
                       "fds_min": min((s[2] for s in after), default=None),
                       "fds_max": max((s[2] for s in after), default=None),
                       "fds_per_10_min": round(slope_per_10_min([(s[0], s[2]) for s in after]), 3),
                       "floor_mb_per_10_min": round(slope_per_10_min(floors(after)), 3),
                       "samples": len(after), "raw": samples}
    return {"minutes": args.minutes, "link": args.link or "loopback", "events": soak.events, "crashes": soak.crashes,
            "tracebacks": sum(t.count("Traceback (most recent call last)") for t in text.values()),
            "traceback_logs": sorted(n for n, t in text.items() if "Traceback (most recent call last)" in t),
            "lost": sum(soak.lost.values()), "outer_rounds": soak.rounds,
            "restores": sum(t.count("loaded stage") for t in text.values()),
            "skipped_snapshots": sum(t.count("skipping snapshot") for t in text.values()),
            "snapshots": snapshots, "corrupt_snapshots": bad, "longest_stage0_stall_s": round(soak.longest_stall, 1),
            "usage": usage, "lives": soak.lives, "log_lines_per_min": log_rates(text, soak.untouched)}


def log_rates(text: dict[str, str], untouched: set[str]) -> dict[str, dict[str, float]]:
    """Per untouched joined peer, after its start-up (from its first summary line on), per summary period
    (a minute): INFO lines besides the summary, and WARNING lines."""
    rates = {}
    for slot in sorted(untouched - {"boot"}):
        lines = text.get(f"{slot}-1.log", "").splitlines()
        first = next((i for i, line in enumerate(lines) if "node.summary" in line), len(lines))
        after = lines[first:]
        periods = max(1, sum("node.summary" in line for line in after) - 1)
        rates[slot] = {"info_besides_summary": round(sum(" INFO " in x and "node.summary" not in x for x in after)
                                                     / periods, 2),
                       "warning": round(sum(" WARNING " in x for x in after) / periods, 2), "minutes": periods}
    return rates


def report(result: dict) -> None:
    print("\n".join(result["events"]))
    print(f"soak ({result['link']}, {result['minutes']} min): crashes {len(result['crashes'])} {result['crashes']}, "
          f"tracebacks {result['tracebacks']} {result['traceback_logs']}, lost {result['lost']}, "
          f"outer rounds by stage {result['outer_rounds']}, restores {result['restores']}, snapshots "
          f"{result['snapshots']} ({result['corrupt_snapshots']} corrupt, {result['skipped_snapshots']} skipped "
          f"at load), longest stage-0 stall {result['longest_stage0_stall_s']} s (target <= 60 s); log lines a minute "
          f"of the untouched peers: {result['log_lines_per_min']}")
    rows = [[name, u["samples"], f"{u['rss_mb_first']:.1f}", f"{u['rss_mb_last']:.1f}", u["rss_mb_per_10_min"],
             u["floor_mb_per_10_min"], u["fds_min"], u["fds_max"], u["fds_per_10_min"]]
            for name, u in sorted(result["usage"].items())]
    print_table("untouched processes after warm-up (target: RSS slope < 1 MB per 10 min, fds flat)",
                ["process", "samples", "RSS MB first", "RSS MB last", "MB / 10 min", "floor MB / 10 min", "fds min",
                 "fds max", "fds / 10 min"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--link", default=None, help="a link lab profile (home, weak, ...); default: loopback")
    parser.add_argument("--per-stage", type=int, default=2)
    parser.add_argument("--every", type=float, default=60.0, help="seconds between chaos events")
    parser.add_argument("--warmup", type=float, default=5.0, help="minutes left out of the slopes")
    parser.add_argument("--sample", type=float, default=30.0, help="seconds between RSS/fd samples")
    parser.add_argument("--poll", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args()
    print(machine_line(), flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so every process is stopped, a lab torn down
    workdir = Path(tempfile.mkdtemp(prefix="bench-soak-"))  # kept: the logs and snapshots, for a look after
    print(f"soak: logs and data dirs in {workdir}", flush=True)
    result = run(args, workdir)
    report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
