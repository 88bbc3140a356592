"""Connection set-up time on loopback: p2pswarm's host config against the library default and raw TCP.

Why: a trainer dials new peers whenever its route changes, so connect latency is on the
critical path of recovering from a lost peer. py-libp2p 0.8.1 with its default
``max_connections_per_peer`` (3) waits a fixed ~250 ms happy-eyeballs delay after every
successful dial; p2pswarm sets it to 1. This measures a fresh host dialling an existing one
(TCP + Noise + Yamux handshake) with both settings, and a raw trio TCP connect as the floor.

Client and server run in separate processes; ``--serve`` runs the server, which prints its
addresses as one JSON line. Run: ``python bench/connect.py``.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import trio
from common import (
    LOOPBACK,
    LOOPBACK_HOST,
    announce,
    ms,
    percentile,
    print_table,
    quiet_logs,
    ratio,
    run_client_server,
)

from p2pswarm.identity import generate_identity
from p2pswarm.net.host import HostLimits, connect, open_host, peer_info_from_multiaddr

ROUNDS = 20  # fresh connections measured per configuration
WARMUP_ROUNDS = 2  # discarded first: imports, key generation paths, server caches
RUN_TIMEOUT = 90.0  # per configuration; 20 library-default connects take ~6 s with host close
CONFIGS = {  # name -> limits of the dialling host
    "p2pswarm (HostLimits(), max_connections_per_peer=1)": HostLimits(),
    "library default (max_connections_per_peer=3)": HostLimits(max_connections_per_peer=3),
}
RAW = "raw trio TCP connect"


# --- server ------------------------------------------------------------------------------


async def hold_until_closed(sock) -> None:
    while await sock.receive_some(1024):
        pass
    await sock.aclose()


async def serve() -> None:
    async with open_host(generate_identity(), [LOOPBACK]) as host, trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, hold_until_closed, 0, host=LOOPBACK_HOST))
        announce({"libp2p": str(host.get_addrs()[0]), "tcp": listeners[0].socket.getsockname()[1]})
        await trio.sleep_forever()


# --- client ------------------------------------------------------------------------------


async def libp2p_connect_once(target, limits: HostLimits) -> float:
    """Seconds for a brand-new host to connect (dial + Noise + Yamux) to ``target``."""
    async with open_host(generate_identity(), [LOOPBACK], limits) as host:
        started = time.perf_counter()
        await connect(host, target)
        return time.perf_counter() - started


async def raw_connect_once(port: int) -> float:
    started = time.perf_counter()
    sock = await trio.open_tcp_stream(LOOPBACK_HOST, port)
    elapsed = time.perf_counter() - started
    await sock.aclose()
    return elapsed


async def time_connects(connect_once) -> list[float]:
    with trio.fail_after(RUN_TIMEOUT):
        for _ in range(WARMUP_ROUNDS):
            await connect_once()
        return [await connect_once() for _ in range(ROUNDS)]


async def client(info: dict) -> dict[str, list[float]]:
    target = peer_info_from_multiaddr(info["libp2p"])
    results = {name: await time_connects(partial(libp2p_connect_once, target, limits))
               for name, limits in CONFIGS.items()}
    results[RAW] = await time_connects(partial(raw_connect_once, info["tcp"]))
    return results


# --- report ------------------------------------------------------------------------------


def report(results: dict[str, list[float]]) -> None:
    ours_name, library_name = CONFIGS
    medians = {name: percentile(times, 50) for name, times in results.items()}
    rows = [[name, ms(medians[name]), ms(percentile(times, 95)), ms(min(times)), ms(max(times)),
             ratio(medians[name], medians[RAW])] for name, times in results.items()]
    print_table(f"new connection on loopback, {ROUNDS} fresh connections each (after {WARMUP_ROUNDS} warm-up)",
                ["dialler", "median ms", "p95 ms", "min ms", "max ms", "median / raw TCP"], rows)
    print(f"\nratio library default / p2pswarm (median): {ratio(medians[library_name], medians[ours_name])}")
    print(f"ratio p2pswarm / raw TCP (median): {ratio(medians[ours_name], medians[RAW])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", help="run the side being dialled")
    parser.parse_args()
    quiet_logs()
    run_client_server(__file__, serve, client, report)


if __name__ == "__main__":
    main()
