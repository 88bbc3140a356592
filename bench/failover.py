"""Failover: from sending a micro-batch to a dead (SIGKILL) or hung (SIGSTOP) peer to its ack by another.

A real swarm on loopback: a bootstrap node, one stage-0 peer (it drives micro-batches) and three
stage-1 peers of tiny-lm/2, all ``p2pswarm`` processes. Repeatedly, one stage-1 peer that the
stage-0 peer's router holds live is SIGKILLed (then restarted with the same key) or SIGSTOPped
(then SIGCONTed); the stage-0 peer's deliverer records, for every micro-batch whose attempt went
to a failed peer, the time from the start of that attempt to the ack of the re-routed micro-batch
(``/api/swarm`` ``delivery.failover_ms_recent``). Prints p50/p99 per kind, and the ack timeout
in force, as the baseline the hung case is bound by.

    python bench/failover.py [--events 15]
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2pswarm.demo import free_port, get_json, read_first_addr, spawn, stop_all

MODEL = "tiny-lm/2"
WAIT = 20.0  # seconds for a peer to become (again) a live candidate


def swarm_doc(api: str) -> dict:
    return get_json(api, "/api/swarm")


def live_stage1(api: str) -> set[str]:
    peers = swarm_doc(api).get("router", {}).get("peers", {})
    return {p for p, s in peers.items() if s["stage"] == 1 and s["live"]}


def wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def record_ages(api: str, samples: int = 20) -> None:
    """How old the stage-1 records the driver's stage map holds are: the capacity it routes on."""
    from p2pswarm.dht.discovery import RECORD_TTL

    ages = []
    for _ in range(samples):
        doc = get_json(api, "/api/stages")
        ages += [RECORD_TTL - r["expires_in_s"] for r in doc.get("stages", {}).get("1", {}).get("peers", [])]
        time.sleep(0.5)
    if ages:
        print(f"capacity in stage-1 records as the driver sees them: {len(ages)} readings, age mean "
              f"{statistics.mean(ages):.1f} s, max {max(ages):.1f} s (stale after 15 s)", flush=True)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=15, help="kills (and stops) of a stage-1 peer each")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="p2pswarm-failover-"))
    processes, peers = [], {}
    try:
        boot = spawn(["bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--data-dir", str(workdir / "boot")],
                     workdir / "boot.log")
        processes.append(boot)
        boot_addr = read_first_addr(boot, "bootstrap")

        def join(name: str, layers: str, api: str):
            process = spawn(["join", "--bootstrap", boot_addr, "--listen", "/ip4/127.0.0.1/tcp/0", "--data-dir",
                             str(workdir / name), "--api", api, "--model", MODEL, "--layers", layers,
                             "--threads", "1"], workdir / f"{name}.log")
            processes.append(process)
            return process

        driver_api = f"127.0.0.1:{free_port()}"
        join("s0", "0:4", driver_api)
        for i in range(3):
            api = f"127.0.0.1:{free_port()}"
            peers[f"s1-{i}"] = [join(f"s1-{i}", "4:8", api), api, None]
        if not wait_until(lambda: len(live_stage1(driver_api)) == 3, 90):
            print("the swarm did not form", file=sys.stderr)
            return 1
        record_ages(driver_api)
        for entry in peers.values():
            entry[2] = get_json(entry[1], "/api/stats")["peer_id"]
        results = {}
        for kind in ("SIGKILL", "SIGSTOP"):
            samples: list[float] = []
            for event in range(args.events):
                live = live_stage1(driver_api)
                name, entry = next((n, e) for n, e in peers.items() if e[2] in live)
                before = swarm_doc(driver_api)["delivery"]
                seen = before["rerouted"]
                timeout_ms = swarm_doc(driver_api)["router"]["peers"][entry[2]]["deadline_ms"]
                entry[0].send_signal(signal.SIGKILL if kind == "SIGKILL" else signal.SIGSTOP)
                wait_until(lambda seen=seen: swarm_doc(driver_api).get("delivery", {}).get("rerouted", 0) > seen, 10)
                time.sleep(1.0)  # the micro-batches in flight at the kill all fail over
                after = swarm_doc(driver_api)["delivery"]
                new = after["rerouted"] - seen
                got = after["failover_ms_recent"][-new:] if new > 0 else []
                samples.extend(got)
                print(f"{kind} {event + 1}/{args.events}: {name}, deadline {timeout_ms:.0f} ms, "
                      f"{len(got)} failovers {got}", flush=True)
                if kind == "SIGKILL":
                    entry[0].wait()
                    processes.remove(entry[0])
                    entry[0] = join(name, "4:8", entry[1])
                else:
                    entry[0].send_signal(signal.SIGCONT)
                wait_until(lambda entry=entry: entry[2] in live_stage1(driver_api), WAIT)
            results[kind] = samples
        print()
        for kind, samples in results.items():
            if samples:
                print(f"{kind}: {len(samples)} failovers, p50 {statistics.median(samples):.1f} ms, "
                      f"p99 {pct(samples, 0.99):.1f} ms, max {max(samples):.1f} ms")
            else:
                print(f"{kind}: no failover measured")
        return 0
    finally:
        for entry in peers.values():
            if entry[0].poll() is None:
                entry[0].send_signal(signal.SIGCONT)
        stop_all(processes)
        print(f"logs in {workdir}")


if __name__ == "__main__":
    sys.exit(main())
