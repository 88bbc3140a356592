"""Outer-round time against pseudo-gradient size among 4 peer processes, beside hivemind's all-reduce.

Why: an outer round must be dominated by moving bytes, not by Python, and must be no slower
than the incumbent's all-reduce of the same tensor on the same machine. Each of 4 worker
processes runs a real py-libp2p host (Noise, Yamux, TCP on 127.0.0.1), the stream pool and the
real ``DilocoService`` round driver (``p2pswarm/diloco/service.py``: gather, agree, butterfly
reduce, outer step), on a stand-in engine holding one flat float32 tensor of 1, 16 or 64 MiB
whose pseudo-gradient is fresh random data each round. The coordinator says "go" to all four
at once and times each round from "go" to the last worker's outer step (hivemind's harness
times ``step()`` to the last result the same way: matchmaking included).

Arms: ``fp32-mean`` (hivemind's work: fp32 on the wire, plain mean, no verification), our
default ``int8-trimmed-verify`` (int8 with per-chunk scales, verification, trimmed mean) and
``sparse-clip-verify`` (issue 27: the top 64 of each 4,096-element chunk at 2 bits, verification,
the chunk-clipped mean).

Side by side in one run, inside a loopback-only network namespace (hivemind's p2pd must not
probe NATs; see ../shared/anchors/hivemind/README.md)::

    unshare -n sh -c 'ip link set lo up && /tmp/hm-venv/bin/python \\
        ../shared/anchors/hivemind/bench_hivemind.py --skip-dht --md-out /tmp/hm.md && \\
        python bench/diloco_allreduce.py --hivemind /tmp/hm.md'

``python bench/diloco_allreduce.py`` alone runs only our arms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PEERS = 4  # as hivemind's anchor: 4 averagers
SIZES_MIB = (1, 16, 64)
ROUNDS = 5  # measured rounds per size and arm (hivemind's anchor: 5)
WARMUP = 1  # unmeasured first round per size and arm (hivemind's anchor: 1)
ROUND_TIMEOUT = 300.0  # one round far slower than this is a stall, not a figure
ARMS = {"fp32-mean": ("float32", "mean", False), "int8-trimmed-verify": ("int8", "trimmed_mean", True),
        "sparse-clip-verify": ("sparse", "chunk_clip", True)}  # issue 27's codec and its chunk-clipped mean
MIB = 1024 * 1024


# --- worker ----------------------------------------------------------------------------------


async def worker(mib: int, codec: str, aggregator: str, verify: bool, index: int) -> None:
    import torch
    import trio

    from p2pswarm.diloco.service import DilocoService
    from p2pswarm.identity import generate_identity
    from p2pswarm.net.connect import Connector
    from p2pswarm.net.host import open_host
    from p2pswarm.net.pool import StreamPool
    from p2pswarm.run.diloco import DilocoSettings

    torch.set_num_threads(1)
    numel = mib * MIB // 4
    engine = SimpleNamespace(params={"w": torch.zeros(numel)}, step=0, tokens=0, weights_changed=lambda: None,
                             agree=lambda round_, flat: None)  # (the real engine keeps agreed weights to evaluate)
    stand_in = SimpleNamespace(engine=engine)

    async def with_engine(fn):
        return await trio.to_thread.run_sync(fn, engine)

    stand_in.with_engine = with_engine
    identity = generate_identity()
    async with open_host(identity, ["/ip4/127.0.0.1/tcp/0"]) as host, trio.open_nursery() as nursery:
        connector = Connector(host, nursery)
        pool = StreamPool(host, nursery, connector)
        stage_map = _StageMap()
        settings = DilocoSettings(inner_steps=1, outer_lr=1.0, momentum=0.0, codec=codec, aggregator=aggregator,
                                  verify=verify, gather_s=30.0)
        service = DilocoService(settings=settings, spec=SimpleNamespace(name="bench", n_stages=2), stage=0,
                                me=identity.peer_id_text, pool=pool, stage_map=stage_map)
        await service.prepare(stand_in)
        print(json.dumps({"peer": identity.peer_id_text, "addr": str(host.get_addrs()[0])}), flush=True)
        others = json.loads(await trio.to_thread.run_sync(sys.stdin.readline))
        for other in others:
            if other["peer"] != identity.peer_id_text:
                await connector.connect(other["peer"], [other["addr"]])
        stage_map.stages = {0: [SimpleNamespace(peer_id=o["peer"], capacity=SimpleNamespace(outer_round=0),
                                                agreed=None) for o in others]}
        nursery.start_soon(service.run, stand_in)
        await _rounds(service, engine, numel, index)
        nursery.cancel_scope.cancel()


class _StageMap:
    """What the round driver reads of a node's stage map: the 4 peers of stage 0, each seen working."""

    def __init__(self) -> None:
        self.stages: dict = {}

    def workers(self) -> dict[int, set[str]]:
        return {stage: {r.peer_id for r in records} for stage, records in self.stages.items()}

    def saw(self, peer: str, stage: int, weight: float = 1.0) -> None:
        pass

    async def refresh_stages(self, stages) -> None:
        pass


async def _rounds(service, engine, numel: int, index: int) -> None:
    import torch
    import trio

    while (await trio.to_thread.run_sync(sys.stdin.readline)).strip() == "go":
        round_ = service.outer.rounds
        generator = torch.Generator().manual_seed(1000 * round_ + index)
        start = service.outer.start.clone()
        engine.params["w"].copy_(start - torch.randn(numel, generator=generator))  # pseudo-gradient = the noise
        sent, received = service.bytes_sent, service.bytes_received
        finished = service.counts["rounds"] + service.counts["left_out"]
        began = time.perf_counter()
        engine.step += 1
        service._wake.set()
        while service.counts["rounds"] + service.counts["left_out"] <= finished:
            await trio.sleep(0.002)
        seconds = time.perf_counter() - began
        last = service.history[-1] if service.history else {}
        print(json.dumps({"round": round_, "seconds": seconds, "members": len(last.get("members", [])),
                          "sent": service.bytes_sent - sent, "received": service.bytes_received - received,
                          "missing": len(last.get("missing_shards", [])), "phases": last.get("phases_s")}), flush=True)


# --- coordinator -----------------------------------------------------------------------------


def run_arm(mib: int, arm: str) -> list[float]:
    codec, aggregator, verify = ARMS[arm]
    args = [sys.executable, __file__, "--worker", str(mib), codec, aggregator, str(int(verify))]
    workers = [subprocess.Popen([*args, str(i)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True) for i in range(PEERS)]
    try:
        infos = [json.loads(w.stdout.readline()) for w in workers]
        for w in workers:
            w.stdin.write(json.dumps(infos) + "\n")
            w.stdin.flush()
        times = []
        for r in range(WARMUP + ROUNDS):
            for w in workers:
                w.stdin.write("go\n")
                w.stdin.flush()
            reports = [json.loads(w.stdout.readline()) for w in workers]
            seconds = max(rep["seconds"] for rep in reports)
            print(json.dumps({"bench": "p2pswarm_outer_round", "arm": arm, "size_mib": mib, "round": r,
                              "warmup": r < WARMUP, "seconds": round(seconds, 4),
                              "members": [rep["members"] for rep in reports],
                              "sent_mb": [round(rep["sent"] / 1e6, 2) for rep in reports],
                              "missing": sum(rep["missing"] for rep in reports),
                              "phases": [rep["phases"] for rep in reports]}), flush=True)
            if r >= WARMUP:
                times.append(seconds)
        return times
    finally:
        for w in workers:
            w.kill()
            w.wait()


def hivemind_figures(path: str | None) -> dict[int, float]:
    """Size in MiB -> hivemind's p50 step time, from the anchor's JSON lines in its --md-out file."""
    if not path:
        return {}
    figures = {}
    for line in Path(path).read_text().splitlines():
        if line.startswith("{") and '"measure": "allreduce"' in line:
            doc = json.loads(line)
            figures[int(doc["size_mib"])] = doc["step_p50_s"]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=",".join(map(str, SIZES_MIB)), help="MiB per tensor, comma-separated")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"of {', '.join(ARMS)}")
    parser.add_argument("--hivemind", metavar="MD", help="the hivemind anchor's --md-out file of this run")
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import trio

        mib, codec, aggregator, verify, index = (int(args.worker[0]), args.worker[1], args.worker[2],
                                                 args.worker[3] == "1", int(args.worker[4]))
        trio.run(worker, mib, codec, aggregator, verify, index)
        return
    print(f"load average at start: {Path('/proc/loadavg').read_text().strip()}", flush=True)
    hivemind = hivemind_figures(args.hivemind)
    rows = []
    for mib in map(int, args.sizes.split(",")):
        for arm in args.arms.split(","):
            times = run_arm(mib, arm)
            p50 = statistics.median(times)
            hm = hivemind.get(mib)
            rows.append((mib, arm, p50, min(times), max(times), hm))
    print(f"load average at end: {Path('/proc/loadavg').read_text().strip()}\n", flush=True)
    print("| tensor | p2pswarm arm | p50 round | range | MB/s (tensor / p50) | hivemind step() p50 | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for mib, arm, p50, low, high, hm in rows:
        ratio = f"{p50 / hm:.2f}x" if hm else "-"
        print(f"| {mib} MiB | {arm} | {p50:.3f} s | {low:.3f}-{high:.3f} s | {mib * MIB / 1e6 / p50:.1f} | "
              f"{f'{hm:.3f} s' if hm else '-'} | {ratio} |")


if __name__ == "__main__":
    main()
