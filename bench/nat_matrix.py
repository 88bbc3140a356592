"""Connections across the NAT lab matrix: success per pair, time to first byte per method,
time to direct after a relayed start, and relayed against direct throughput.

Why: a peer must reach every other peer, directly if it can, by hole punching if both NATs
allow it, through a relay otherwise — and the relay is the slow path, so upgrades must be fast.
One swarm of real ``p2pswarm`` processes (a bootstrap node, a relay, a public peer, a DMZ peer,
two peers behind easy NATs and two behind symmetric ones) runs while each ordered pair is
pinged TRIALS times over a fresh connection (``/api/ping?fresh=1``): connect by peer id with
the addresses of the stage map, one round trip, PUSH_BYTES pushed, then up to UPGRADE_WAIT
seconds for a relayed connection to become direct. The baseline of each figure is measured in
the same run: relayed throughput against direct throughput, time to first byte through the
relay against a direct dial.
Run as root: ``python bench/nat_matrix.py [--trials N]`` (~10 min at 20 trials).
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from common import machine_line, percentile, print_table

from p2pswarm.testing.labswarm import LabSwarm
from p2pswarm.testing.natlab import NatKind, NatLab, lab_available

TRIALS = 20
PUSH_BYTES = 1024 * 1024  # per trial; the relay allows 16 MiB per circuit
UPGRADE_WAIT = 4.0  # the target is p95 < 2 s
READY_TIMEOUT = 150.0
PEERS = {"pub": None, "dmz": NatKind.DMZ, "easy1": NatKind.EASY, "easy2": NatKind.EASY,
         "sym1": NatKind.SYMMETRIC, "sym2": NatKind.SYMMETRIC}
PAIRS = [("easy1", "pub"), ("pub", "easy1"), ("easy1", "dmz"), ("dmz", "easy1"), ("easy1", "easy2"),
         ("pub", "sym1"), ("easy1", "sym1"), ("sym1", "easy1"), ("sym1", "sym2")]
KIND = {"pub": "public", "dmz": "DMZ", "easy1": "easy", "easy2": "easy", "sym1": "symmetric", "sym2": "symmetric"}


def build(lab: NatLab, workdir: Path, trials: int) -> LabSwarm:
    swarm = LabSwarm(lab, workdir, proc_timeout=READY_TIMEOUT + trials * len(PAIRS) * 15 + 120)
    boot = swarm.start_public("boot", lab.public_host("boot"), ["bootstrap"])
    relay = swarm.start_public("relay", lab.public_host("relay"), ["relay", "--bootstrap", boot.addr])
    join = ["join", "--bootstrap", boot.addr, "--layers", "0:2", "--relay", relay.addr]
    for name, kind in PEERS.items():
        host = lab.public_host(name) if kind is None else lab.nat_host(name, kind)
        swarm.start(name, host, join)
    natted = [n for n, k in PEERS.items() if k not in (None, NatKind.DMZ)]
    ready = swarm.wait_relayed(natted, READY_TIMEOUT)
    missing = [n for n, d in ready.items() if not d.get("circuit_addrs")]
    public = swarm.wait_until(["pub", "dmz"], lambda d: d.get("reachability") == "public", 60)
    if missing or any(d.get("reachability") != "public" for d in public.values()):
        sys.exit(f"swarm not ready: no relay address for {missing}, verdicts "
                 f"{ {n: d.get('reachability') for n, d in public.items()} }")
    for src, dst in PAIRS:
        if PEERS[dst] not in (None, NatKind.DMZ) and not swarm.wait_in_stage_map(src, dst, 30):
            sys.exit(f"{src} never saw {dst}'s circuit address")
    return swarm


def run_trials(swarm: LabSwarm, trials: int) -> dict[tuple[str, str], list[dict]]:
    results: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for number in range(trials):
        for src, dst in PAIRS:
            results[src, dst].append(swarm.ping(src, dst, PUSH_BYTES, upgrade_wait=UPGRADE_WAIT))
        line = ", ".join(f"{s}>{d} {_short(results[s, d][-1])}" for s, d in PAIRS)
        print(f"trial {number + 1}: {line}", flush=True)
        for s, d in PAIRS:
            if "bytes" not in results[s, d][-1]:
                print(f"  {s} -> {d} failed: {results[s, d][-1]}", flush=True)
    return results


def _short(doc: dict) -> str:
    if "bytes" not in doc:
        return "FAIL"
    return f"{doc['method'][0]}{'>d' if doc['method'] == 'relay' and doc['path'] == 'direct' else ''}"


def report(results: dict[tuple[str, str], list[dict]], trials: int) -> None:
    rows = []
    by_method: dict[str, list[float]] = defaultdict(list)
    rate: dict[str, list[float]] = defaultdict(list)
    for (src, dst), docs in results.items():
        ok = [d for d in docs if d.get("bytes") == PUSH_BYTES]
        relayed = [d for d in ok if d["method"] == "relay"]
        upgraded = [d["upgrade_ms"] for d in relayed if d["upgrade_ms"] is not None]
        for d in ok:
            by_method[d["method"]].append(d["first_byte_ms"])
            if d["mib_per_s"]:
                rate[d["push_path"]].append(d["mib_per_s"])
        methods = "/".join(f"{m} {sum(d['method'] == m for d in ok)}" for m in ("direct", "relay") if
                           any(d["method"] == m for d in ok))
        rows.append([f"{KIND[src]} -> {KIND[dst]}", f"{len(ok)}/{trials}", methods or "-",
                     f"{len(upgraded)}/{len(relayed)}" if relayed else "-",
                     f"{percentile(upgraded, 50):.0f}" if upgraded else "-",
                     f"{percentile(upgraded, 95):.0f}" if upgraded else "-",
                     f"{percentile([d['first_byte_ms'] for d in ok], 50):.0f}" if ok else "-"])
    print_table(f"connection matrix, {trials} fresh connections per ordered pair",
                ["pair (dialer -> dialed)", "reached", "connected by", "upgraded to direct",
                 "upgrade p50 ms", "upgrade p95 ms", "first byte p50 ms"], rows)
    print_table("time to first byte (connect + one round trip) by method",
                ["method", "n", "p50 ms", "p95 ms"],
                [[m, len(v), f"{percentile(v, 50):.0f}", f"{percentile(v, 95):.0f}"]
                 for m, v in sorted(by_method.items())])
    print_table(f"throughput of a {PUSH_BYTES // 1024} KiB push by path",
                ["path", "n", "p50 MiB/s", "p95 MiB/s"],
                [[p, len(v), f"{percentile(v, 50):.1f}", f"{percentile(v, 95):.1f}"] for p, v in sorted(rate.items())])
    if rate.get("relayed") and rate.get("direct"):
        print(f"\nrelayed / direct throughput (p50): "
              f"{percentile(rate['relayed'], 50) / percentile(rate['direct'], 50):.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=TRIALS)
    parser.add_argument("--keep-logs", type=Path, help="copy node logs here")
    args = parser.parse_args()
    reason = lab_available()
    if reason:
        sys.exit(f"the NAT lab cannot run here: {reason}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the lab is torn down
    print(machine_line())
    began = time.monotonic()
    with NatLab() as lab, tempfile.TemporaryDirectory() as tmp:
        swarm = build(lab, Path(tmp), args.trials)
        print(f"swarm ready after {time.monotonic() - began:.0f} s", flush=True)
        results = run_trials(swarm, args.trials)
        stats = {name: swarm.stats(name) for name in PEERS}
        if args.keep_logs:
            args.keep_logs.mkdir(parents=True, exist_ok=True)
            for log in Path(tmp).glob("*.log"):
                (args.keep_logs / log.name).write_text(log.read_text())
    report(results, args.trials)
    print("\nhole punches started by the receiving side (node counters):")
    for name, doc in stats.items():
        print(f"  {name:6} {doc.get('holepunch')}")
    print(f"\ntotal {time.monotonic() - began:.0f} s")


if __name__ == "__main__":
    main()
