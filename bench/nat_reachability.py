"""Reachability verdicts through real NAT routers: time to verdict per NAT kind, and false PUBLICs.

Why: a NATed peer that believes it is PUBLIC advertises addresses nobody can dial and serves
the DHT badly; one that stays UNKNOWN never reserves relays. This runs the NAT lab scenario of
tests/natlab/test_reachability_lab.py TRIALS times — a public bootstrap, a public peer, and peers
behind an easy, a symmetric and a DMZ router, all real ``p2pswarm`` processes — and records, per
peer, the seconds from its start until its verdict settles, and every poll that showed a NATed
peer as PUBLIC. The baseline is py-libp2p's AutoNAT v1, which dials back over the connection
the request came on and so calls every NATed peer PUBLIC (defect 11): its false-PUBLIC rate
for the easy and symmetric peers is 100 % by construction; not re-run here.
Run as root: ``python bench/nat_reachability.py [--trials N]`` (~30 s a trial).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from common import machine_line, percentile, print_table

from p2pswarm.testing.natlab import (
    NatKind,
    NatLab,
    lab_available,
    p2pswarm_argv,
    read_line,
)

TRIALS = 5
PORT, API = 4001, "127.0.0.1:8700"
TRIAL_TIMEOUT = 90.0  # seconds for all five verdicts to settle
PROC_TIMEOUT = 120
EXPECTED = {"boot": "public", "pub": "public", "easy": "private", "symmetric": "private", "dmz": "public"}


def start(lab: NatLab, host, args: list[str], name: str, workdir: Path):
    return lab.run(host, p2pswarm_argv(*args, "--listen", f"/ip4/0.0.0.0/tcp/{PORT}", "--api", API,
                                       "--data-dir", str(workdir / name)),
                   log_path=workdir / f"{name}.log", timeout=PROC_TIMEOUT)


def trial() -> tuple[dict[str, float | None], int]:
    """Seconds to the expected verdict per peer (None: never), and the count of false PUBLIC polls."""
    with NatLab() as lab, tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        boot, public = lab.public_host("boot"), lab.public_host("pub")
        hosts = {"boot": boot, "pub": public}
        hosts.update({kind.value: lab.nat_host(kind.value, kind)
                      for kind in (NatKind.EASY, NatKind.SYMMETRIC, NatKind.DMZ)})
        started = time.monotonic()
        boot_proc = start(lab, boot, ["bootstrap"], "boot", workdir)
        boot_addr = next(a for a in (read_line(boot_proc, 20).strip(), read_line(boot_proc, 5).strip())
                         if f"/ip4/{boot.ip}/" in a)
        for name in ("pub", "easy", "symmetric", "dmz"):
            start(lab, hosts[name], ["join", "--bootstrap", boot_addr, "--layers", "0:2"], name, workdir)
        settled: dict[str, float | None] = dict.fromkeys(EXPECTED)
        false_public = 0
        while time.monotonic() - started < TRIAL_TIMEOUT and None in settled.values():
            for name, host in hosts.items():
                verdict = (lab.node_stats(host, API) or {}).get("reachability")
                false_public += name in ("easy", "symmetric") and verdict == "public"
                if verdict == EXPECTED[name] and settled[name] is None:
                    settled[name] = time.monotonic() - started
            time.sleep(0.5)
        return settled, false_public


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=TRIALS)
    args = parser.parse_args()
    reason = lab_available()
    if reason:
        sys.exit(f"the NAT lab cannot run here: {reason}")
    print(machine_line())
    times: dict[str, list[float]] = {name: [] for name in EXPECTED}
    false_public = 0
    for number in range(args.trials):
        settled, false = trial()
        false_public += false
        for name, seconds in settled.items():
            if seconds is not None:
                times[name].append(seconds)
        print(f"trial {number + 1}: " + ", ".join(
            f"{n} {'-' if s is None else f'{s:.1f} s'}" for n, s in settled.items()), flush=True)
    rows = [[name, EXPECTED[name], f"{len(times[name])}/{args.trials}",
             f"{percentile(times[name], 50):.1f}" if times[name] else "-",
             f"{max(times[name]):.1f}" if times[name] else "-"] for name in EXPECTED]
    print_table("time from process start to the right verdict",
                ["peer", "expected", "correct", "p50 s", "max s"], rows)
    print(f"\nfalse PUBLIC polls for the easy and symmetric peers: {false_public}"
          f" (py-libp2p AutoNAT v1: every NATed peer PUBLIC)")


if __name__ == "__main__":
    main()
