"""Leased pooled streams against a fresh stream per frame: 1 MiB request/ack round trips, side by side.

Why: activations travel as ~1-16 MiB frames, each acknowledged, many per second. The stream
pool (``p2pswarm/net/pool.py``) keeps streams open and leases them; the naive alternative opens
a new libp2p stream (multistream-select negotiation, 5-11 ms) for every frame. This measures
both on the same connection in the same run: round-trip time of one frame and its ack, and the
throughput of a sequence of them, and prints the ratio.

Client and server run in separate processes; ``--serve`` runs the server (a ``StreamPool``
serving the bench protocol, acking each frame), which prints its address as one JSON line.
Run: ``python bench/pool.py`` (``--frame-kib 1`` shows the small-frame case).
"""

from __future__ import annotations

import argparse
import time

import trio
from common import LOOPBACK, announce, median, ms, percentile, print_table, quiet_logs, ratio, run_client_server

from p2pswarm import wire
from p2pswarm.identity import generate_identity
from p2pswarm.net.connect import Connector
from p2pswarm.net.host import connect, open_host, peer_info_from_multiaddr
from p2pswarm.net.pool import StreamPool
from p2pswarm.net.streams import open_stream

POOL_PROTOCOL = "/p2pswarm/bench-pool/1.0.0"
KIB = 1024
DEFAULT_FRAME_KIB = 1024  # 1 MiB: a small activation batch
FRAMES = 32  # round trips per run
REPEATS = 5  # runs per method, interleaved; medians reported (throughput varies ±30 % here)
WARMUP_FRAMES = 4  # discarded first, per method
RUN_TIMEOUT = 120.0  # one run far slower than this is a stall, not a figure


# --- server ------------------------------------------------------------------------------


async def ack(peer: str, message: wire.Message, payload: bytes) -> wire.Message:
    return wire.Pong(nonce=len(payload))


async def serve() -> None:
    async with open_host(generate_identity(), [LOOPBACK]) as host, trio.open_nursery() as nursery:
        StreamPool(host, nursery).serve(POOL_PROTOCOL, ack)
        announce({"libp2p": str(host.get_addrs()[0])})
        await trio.sleep_forever()


# --- client ------------------------------------------------------------------------------


def frame(payload: bytes) -> wire.TensorFrame:
    return wire.TensorFrame(name="activations", dtype="uint8", shape=(len(payload),))


async def leased(pool: StreamPool, peer_id, payload: bytes) -> None:
    async with pool.lease(peer_id, POOL_PROTOCOL) as stream:
        await stream.write_frame(frame(payload), payload)
        reply, _ = await stream.read_frame()
    if reply != wire.Pong(nonce=len(payload)):
        raise RuntimeError(f"bad ack {reply}")


async def fresh(host, peer_id, payload: bytes) -> None:
    stream = await open_stream(host, peer_id, POOL_PROTOCOL)
    try:
        await wire.write_frame(stream, frame(payload), payload)
        reply = await wire.read_frame(stream)
    finally:
        await stream.close()
    if reply is None or reply[0] != wire.Pong(nonce=len(payload)):
        raise RuntimeError(f"bad ack {reply}")


async def timed_run(one, n: int) -> tuple[float, list[float]]:
    """(total seconds, per-round-trip seconds) for ``n`` sequential round trips."""
    rtts = []
    started = time.perf_counter()
    for _ in range(n):
        began = time.perf_counter()
        await one()
        rtts.append(time.perf_counter() - began)
    return time.perf_counter() - started, rtts


async def client(info: dict, frame_bytes: int) -> dict[str, list[tuple[float, list[float]]]]:
    payload = bytes(range(256)) * (frame_bytes // 256)
    results: dict[str, list] = {"fresh stream per frame": [], "leased pooled stream": []}
    async with open_host(generate_identity(), [LOOPBACK]) as host, trio.open_nursery() as nursery:
        target = peer_info_from_multiaddr(info["libp2p"])
        await connect(host, target)
        pool = StreamPool(host, nursery, Connector(host, nursery))
        runs = {
            "fresh stream per frame": lambda: fresh(host, target.peer_id, payload),
            "leased pooled stream": lambda: leased(pool, target.peer_id, payload),
        }
        with trio.fail_after(RUN_TIMEOUT * (REPEATS + 1) * len(runs)):
            for one in runs.values():
                await timed_run(one, WARMUP_FRAMES)
            for _ in range(REPEATS):  # interleaved, so drift in machine load hits both alike
                for name, one in runs.items():
                    results[name].append(await timed_run(one, FRAMES))
        results["streams opened by the pool"] = pool.stats.opened
        nursery.cancel_scope.cancel()
    return results


# --- report ------------------------------------------------------------------------------


def report(results: dict, frame_bytes: int) -> None:
    opened = results.pop("streams opened by the pool")
    rows, speeds, p50s = [], {}, {}
    for name, runs in results.items():
        mbps = [FRAMES * frame_bytes / 1e6 / seconds for seconds, _ in runs]
        rtts = [r for _, run_rtts in runs for r in run_rtts]
        speeds[name], p50s[name] = median(mbps), percentile(rtts, 50)
        rows.append([name, f"{speeds[name]:,.1f}", " / ".join(f"{m:,.1f}" for m in mbps),
                     ms(p50s[name]), ms(percentile(rtts, 99))])
    print_table(f"{FRAMES} sequential round trips of a {frame_bytes // KIB} KiB frame + ack, "
                f"median of {REPEATS} runs (MB = 10^6 bytes)",
                ["method", "MB/s (median)", "MB/s (runs)", "round trip p50 ms", "p99 ms"], rows)
    pooled, naive = "leased pooled stream", "fresh stream per frame"
    print(f"\nratio leased / fresh: throughput {ratio(speeds[pooled], speeds[naive])}, "
          f"round-trip p50 {ratio(p50s[pooled], p50s[naive])} "
          f"(the pool opened {opened} stream(s) for {(WARMUP_FRAMES + REPEATS * FRAMES)} leases)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", help="run the receiving side")
    parser.add_argument("--frame-kib", type=int, default=DEFAULT_FRAME_KIB,
                        help=f"KiB per frame (default {DEFAULT_FRAME_KIB})")
    args = parser.parse_args()
    quiet_logs()
    run_client_server(__file__, serve, client, report, args.frame_kib * KIB)


if __name__ == "__main__":
    main()
