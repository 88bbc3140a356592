"""A swarm that heals itself: how long a stage whose every replica died takes to train again, what it
loses, and what its backups cost.

Starts a bootstrap node and ``--per-stage`` x 3 ``p2pswarm join`` peers of ``tiny-lm/3`` (the demo's DiLoCo
values, each peer its own process, rebalancing on), waits until every stage is healthy and backed up, and
measures a steady window: the bytes the peers' backup services served against every payload byte the peers
sent (``/api/backups``, ``/api/stats`` pool.payload_bytes_sent). Then ``--events`` times: SIGKILL every
replica of one stage (stages in turn), and time from the last death to tokens flowing again (stage 0's
trained-token count rising after a peer moved in and loaded the stage); read the outer rounds lost (the
stage's agreed round at the kill minus the round the mover loaded) and the moves made; then start two fresh
peers on the least served stages (with ``--rebalance``) so the swarm is whole again before the next event.

    python bench/heal.py [--events 10] [--per-stage 2] [--steady-s 120] [--inner-steps H] [--outer-momentum M]

Targets (issue 18): trains again within 60 s (p50 and p99), <= 1 outer round lost, backups < 5 % of the
bytes a peer sends, <= 1 move per stage per 5 minutes.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import machine_line, median, percentile, print_table

from p2pswarm.demo import DEMO_GATHER_S, DEMO_INNER_STEPS, DEMO_OUTER_LR, DEMO_OUTER_MOMENTUM, free_port, get_json
from p2pswarm.model.catalog import get_model

MODEL = get_model("tiny-lm/3")
AGREED = ("--model", MODEL.name, "--outer-lr", str(DEMO_OUTER_LR), "--gather", str(DEMO_GATHER_S))  # + H, momentum
READY_TIMEOUT = 400.0  # a guard: every stage healthy and backed up (7 processes on 2 cores start slowly)
RECOVERY_TIMEOUT = 240.0  # a guard: an event that takes longer counts as not recovered
POLL_S = 0.5


class Swarm:
    """The bench's processes, ended by pid."""

    def __init__(self, workdir: Path, inner_steps: int, momentum: float) -> None:
        self.workdir, self.peers, self.count = workdir, {}, 0
        self.agreed = (*AGREED, "--inner-steps", str(inner_steps), "--outer-momentum", str(momentum))
        self.boot = self._spawn(["bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--data-dir", str(workdir / "boot")],
                                "bootstrap")
        self.boot_addr = self.boot.stdout.readline().strip()

    def _spawn(self, args: list[str], name: str) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "w")
        return subprocess.Popen([sys.executable, "-m", "p2pswarm", *args], stdout=subprocess.PIPE, stderr=log,
                                stdin=subprocess.DEVNULL, text=True)

    def join(self, layers: str) -> str:
        """A new peer (a fresh identity and data dir); its API address."""
        self.count += 1
        name, api = f"peer{self.count}", f"127.0.0.1:{free_port()}"
        pinned = ["--rebalance"]  # a chosen start, free to move
        self.peers[api] = self._spawn(["join", "--bootstrap", self.boot_addr, "--listen", "/ip4/127.0.0.1/tcp/0",
                                       "--layers", layers, *pinned, "--api", api, "--data-dir",
                                       str(self.workdir / name), "--threads", "1", *self.agreed], name)
        return api

    def kill(self, api: str) -> None:
        process = self.peers.pop(api)
        os.kill(process.pid, signal.SIGKILL)
        process.wait()

    def close(self) -> None:
        for process in [self.boot, *self.peers.values()]:
            if process.poll() is None:
                process.terminate()
        for process in [self.boot, *self.peers.values()]:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def stage_of(api: str) -> int | None:
    stats = get_json(api, "/api/stats")
    return stats.get("stage") if stats else None


def members(swarm: Swarm) -> dict[int, list[str]]:
    """Live peers by the stage they serve now (their own /api/stats)."""
    by_stage: dict[int, list[str]] = {}
    for api in swarm.peers:
        stage = stage_of(api)
        if stage is not None:
            by_stage.setdefault(stage, []).append(api)
    return by_stage


def whole(swarm: Swarm, per_stage: int) -> bool:
    """Every stage served by ``per_stage`` live peers, healthy in the map, and backed up by 2 holders."""
    by_stage = members(swarm)
    if any(len(by_stage.get(s, [])) < per_stage for s in range(MODEL.n_stages)):
        return False
    doc = get_json(next(iter(swarm.peers)), "/api/stages") or {}
    stages = doc.get("stages", {})
    return all(stages.get(str(s), {}).get("health") == "healthy" and len(stages.get(str(s), {}).get("backups", [])) >= 2
               for s in range(MODEL.n_stages))


def wait(predicate, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(POLL_S)
    return None


def stage0_tokens(swarm: Swarm) -> int:
    return sum(d.get("tokens", 0) for d in (get_json(a, "/api/swarm") for a in swarm.peers) if d and d.get("first"))


def traffic(swarm: Swarm) -> tuple[int, int]:
    """(backup bytes moved, payload bytes sent) summed over the live peers: what holders fetched from
    replicas (the refreshes) and what they served (to movers)."""
    served = sent = 0
    for api in swarm.peers:
        backups, stats = get_json(api, "/api/backups") or {}, get_json(api, "/api/stats") or {}
        served += backups.get("bytes_fetched", 0) + backups.get("bytes_served", 0)
        sent += stats.get("pool", {}).get("payload_bytes_sent", 0)
    return served, sent


def moves(swarm: Swarm) -> int:
    return sum(((get_json(a, "/api/stats") or {}).get("rebalance") or {}).get("moves", 0) for a in swarm.peers)


def event(swarm: Swarm, stage: int) -> dict:
    """Kill every replica of ``stage``; time until a mover loaded it and stage 0's tokens rose again."""
    victims = members(swarm).get(stage, [])
    agreed = max((get_json(a, "/api/diloco") or {}).get("outer_round", 0) for a in victims)
    for api in victims:
        swarm.kill(api)
    moves_before = moves(swarm)  # the survivors' (a victim may have moved in an earlier event)
    died = time.monotonic()

    def mover():
        for api, stage_now in ((a, stage_of(a)) for a in swarm.peers):
            loaded = (get_json(api, "/api/diloco") or {}).get("loaded_from") or {} if stage_now == stage else {}
            if loaded:
                return api, loaded
        return None

    found = wait(mover, RECOVERY_TIMEOUT)
    if not found:
        return {"stage": stage, "recovered": False}
    api, loaded = found
    base = stage0_tokens(swarm)
    flowing = wait(lambda: stage0_tokens(swarm) > base, RECOVERY_TIMEOUT - (time.monotonic() - died))
    seconds = time.monotonic() - died
    return {"stage": stage, "recovered": bool(flowing), "seconds": seconds, "agreed": agreed,
            "loaded": loaded.get("round"), "source": "backup" if loaded.get("backup") else "replica",
            "moves": moves(swarm) - moves_before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=10)
    parser.add_argument("--per-stage", type=int, default=2)
    parser.add_argument("--steady-s", type=float, default=120.0)
    parser.add_argument("--inner-steps", type=int, default=DEMO_INNER_STEPS, help="H (the demo's by default)")
    parser.add_argument("--outer-momentum", type=float, default=DEMO_OUTER_MOMENTUM, help="the demo's by default")
    args = parser.parse_args()
    print(machine_line())
    with tempfile.TemporaryDirectory(prefix="bench-heal-") as tmp:
        swarm = Swarm(Path(tmp), args.inner_steps, args.outer_momentum)
        print(f"bench: tiny-lm/3, {args.per_stage} replicas per stage, H = {args.inner_steps}, outer momentum "
              f"{args.outer_momentum}", flush=True)
        try:
            for s in range(MODEL.n_stages):
                for _ in range(args.per_stage):
                    swarm.join(":".join(map(str, MODEL.stage_range(s))))
            if not wait(lambda: whole(swarm, args.per_stage), READY_TIMEOUT):
                sys.exit(f"bench: the swarm was not whole within {READY_TIMEOUT:.0f} s; logs in {tmp}")
            served0, sent0 = traffic(swarm)
            time.sleep(args.steady_s)  # the steady window: a measured span, not a wait for an event
            served1, sent1 = traffic(swarm)
            share = (served1 - served0) / max(1, sent1 - sent0)
            per_hour = (served1 - served0) * 3600 / args.steady_s
            print(f"bench: steady window: {served1 - served0} backup bytes, {sent1 - sent0} payload bytes sent",
                  flush=True)
            results = []
            for i in range(args.events):
                stage = 1 if i % 2 == 0 else (i // 2) % MODEL.n_stages  # the middle stage every other event
                results.append(event(swarm, stage))
                print(f"bench: event {i + 1}: {results[-1]}", flush=True)
                for _ in range(args.per_stage):  # the swarm whole again: a new peer on the least served stage
                    by_stage = members(swarm)
                    least = min(range(MODEL.n_stages), key=lambda s: (len(by_stage.get(s, [])), s))
                    swarm.join(":".join(map(str, MODEL.stage_range(least))))
                    wait(lambda: len([a for a in swarm.peers if stage_of(a) is not None]) == len(swarm.peers), 120)
                if not wait(lambda: whole(swarm, args.per_stage), READY_TIMEOUT):
                    print("bench: the swarm did not become whole again; stopping", flush=True)
                    break
        finally:
            swarm.close()
    report(results, share, per_hour, sent1 - sent0, args.steady_s)


def report(results: list[dict], share: float, per_hour: float, sent: int, steady_s: float) -> None:
    done = [r for r in results if r.get("recovered")]
    secs = [r["seconds"] for r in done]
    lost = [r["agreed"] - r["loaded"] for r in done if r.get("loaded") is not None]
    rows = [[i + 1, r["stage"], f"{r['seconds']:.1f}" if r.get("recovered") else "no", r.get("source", "-"),
             r.get("agreed", "-"), r.get("loaded", "-"), r.get("moves", "-")] for i, r in enumerate(results)]
    print_table("recovery events", ["event", "stage", "s to tokens", "loaded from", "agreed round", "loaded round",
                                    "moves"], rows)
    if secs:
        print(f"recovery: p50 {median(secs):.1f} s, p99 {percentile(secs, 99):.1f} s over {len(secs)} of "
              f"{len(results)} events (target < 60 s)")
        print(f"outer rounds lost: max {max(lost) if lost else '-'}, mean "
              f"{sum(lost) / len(lost) if lost else float('nan'):.2f} (target <= 1)")
    print(f"backups: {share * 100:.2f} % of the payload bytes the peers sent over {steady_s:.0f} s "
          f"({sent / 1e6:.1f} MB sent), {per_hour / 1e6:.1f} MB/hour moved (target < 5 %)")


if __name__ == "__main__":
    main()
