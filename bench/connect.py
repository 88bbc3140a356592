"""Connection set-up time on loopback: p2pswarm's dial against py-libp2p's own, and raw TCP.

Why: a trainer dials new peers whenever its route changes, so connect latency is on the
critical path of recovering from a lost peer. py-libp2p 0.8.1's own dial path
(``BasicHost.connect`` -> ``Swarm.dial_peer``) with its default ``max_connections_per_peer``
(3) waits a fixed ~250 ms happy-eyeballs delay after a dial has already succeeded. p2pswarm
builds its hosts with ``net/host.build_host`` and dials with ``net/host.connect``, which
replaces that path (every address tried, the first connection wins).

The baseline must be the library's own path, untouched: its process builds plain
``libp2p.new_host`` hosts (Noise + Yamux, everything else default) and imports no p2pswarm
networking code. It is measured with the default connection config and with
``max_connections_per_peer=1`` (the fixed wait alone). Each dialler configuration runs in a
fresh process of its own (``--dialler NAME``), one after the other, so none inherits another's
heap or patches; each time a brand-new host dials the same server process (a p2pswarm host,
``--serve``), which prints its addresses as one JSON line. A raw trio TCP connect is the floor.
Run: ``python bench/connect.py`` (``--repeat N``: N passes over the configurations).
"""

from __future__ import annotations

import argparse
import json
import sys
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

ROUNDS = 20  # fresh connections measured per configuration
WARMUP_ROUNDS = 2  # discarded first: imports, key generation paths, server caches
RUN_TIMEOUT = 90.0  # per dialler process; 22 library-default connects take ~10 s with host close
OURS = "p2pswarm: build_host + net.host.connect()"
LIBRARY = {  # row name -> max_connections_per_peer of the plain host (None: the library default, 3)
    "py-libp2p default: new_host + host.connect()": None,
    "py-libp2p, max_connections_per_peer=1": 1,
}
RAW = "raw trio TCP connect"


# --- server ------------------------------------------------------------------------------


async def hold_until_closed(sock) -> None:
    while await sock.receive_some(1024):
        pass
    await sock.aclose()


async def serve() -> None:
    from p2pswarm.identity import generate_identity
    from p2pswarm.net.host import open_host

    async with open_host(generate_identity(), [LOOPBACK]) as host, trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, hold_until_closed, 0, host=LOOPBACK_HOST))
        announce({"libp2p": str(host.get_addrs()[0]), "tcp": listeners[0].socket.getsockname()[1]})
        await trio.sleep_forever()


# --- the baseline: py-libp2p's own dial path, in its own process ---------------------------


def plain_host(max_connections_per_peer: int | None):
    """A py-libp2p host as the library builds it, with Noise and Yamux as its only choices."""
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.crypto.x25519 import create_new_key_pair as new_x25519_key_pair
    from libp2p.network.config import ConnectionConfig
    from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_ID
    from libp2p.security.noise.transport import Transport as NoiseTransport
    from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_ID
    from libp2p.stream_muxer.yamux.yamux import Yamux

    key_pair = create_new_key_pair()
    noise = NoiseTransport(key_pair, noise_privkey=new_x25519_key_pair().private_key)
    config = None if max_connections_per_peer is None else ConnectionConfig(
        max_connections_per_peer=max_connections_per_peer)
    return new_host(key_pair=key_pair, sec_opt={NOISE_ID: noise}, muxer_opt={YAMUX_ID: Yamux},
                    connection_config=config)


async def library_connect_once(target, max_connections_per_peer: int | None) -> float:
    """Seconds for a brand-new plain host's ``host.connect`` (dial + Noise + Yamux) to ``target``."""
    from multiaddr import Multiaddr

    host = plain_host(max_connections_per_peer)
    async with host.run(listen_addrs=[Multiaddr(LOOPBACK)]):
        try:
            started = time.perf_counter()
            await host.connect(target)
            return time.perf_counter() - started
        finally:
            with trio.CancelScope(shield=True):
                await host.close()  # leaving run() alone leaves a listener (defect 5)


def run_dialler(name: str, target_addr: str) -> None:
    """``--dialler NAME MULTIADDR``: time one configuration in this process, print JSON times."""
    if name in LIBRARY:
        import logging

        import libp2p  # noqa: F401 - sets up its own logger, which is then quietened
        from libp2p.peer.peerinfo import info_from_p2p_addr
        from multiaddr import Multiaddr

        logging.getLogger("libp2p").setLevel(logging.CRITICAL)
        connect_once = partial(library_connect_once, info_from_p2p_addr(Multiaddr(target_addr)), LIBRARY[name])
    else:
        from p2pswarm.net.host import peer_info_from_multiaddr

        quiet_logs()
        connect_once = partial(ours_connect_once, peer_info_from_multiaddr(target_addr))
    times = trio.run(time_connects, connect_once)
    networking = sorted(m for m in sys.modules if m.startswith(("p2pswarm.net", "p2pswarm.nat", "p2pswarm.dht")))
    assert name not in LIBRARY or not networking, f"the baseline loaded p2pswarm networking code: {networking}"
    print(json.dumps(times), flush=True)


# --- client ------------------------------------------------------------------------------


async def ours_connect_once(target) -> float:
    """Seconds for a brand-new p2pswarm host to connect (dial + Noise + Yamux) to ``target``."""
    from p2pswarm.identity import generate_identity
    from p2pswarm.net.host import connect, open_host

    async with open_host(generate_identity(), [LOOPBACK]) as host:
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


async def client(info: dict, repeat: int) -> dict[str, list[float]]:
    """Each configuration in a fresh process, one after the other, ``repeat`` passes."""
    results: dict[str, list[float]] = {name: [] for name in (OURS, *LIBRARY)}
    for _ in range(repeat):
        for name in results:
            with trio.fail_after(RUN_TIMEOUT):
                done = await trio.run_process([sys.executable, __file__, "--dialler", name, info["libp2p"]],
                                              capture_stdout=True, check=True)
            results[name] += json.loads(done.stdout.decode().strip().splitlines()[-1])
    results[RAW] = await time_connects(partial(raw_connect_once, info["tcp"]))
    return results


# --- report ------------------------------------------------------------------------------


def report(results: dict[str, list[float]], repeat: int) -> None:
    library_default, library_one = LIBRARY
    medians = {name: percentile(times, 50) for name, times in results.items()}
    rows = [[name, ms(medians[name]), ms(percentile(times, 95)), ms(min(times)), ms(max(times)),
             ratio(medians[name], medians[RAW])] for name, times in results.items()]
    print_table(f"new connection on loopback, {repeat} x {ROUNDS} fresh connections per dialler "
                f"(each process after {WARMUP_ROUNDS} warm-up)",
                ["dialler", "median ms", "p95 ms", "min ms", "max ms", "median / raw TCP"], rows)
    print(f"\nratio py-libp2p default / p2pswarm (median): {ratio(medians[library_default], medians[OURS])}")
    print(f"ratio py-libp2p max_connections_per_peer=1 / p2pswarm (median): "
          f"{ratio(medians[library_one], medians[OURS])}")
    print(f"ratio p2pswarm / raw TCP (median): {ratio(medians[OURS], medians[RAW])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", help="run the side being dialled")
    parser.add_argument("--dialler", nargs=2, metavar=("NAME", "MULTIADDR"),
                        help="time one dialler configuration against MULTIADDR in this process, print JSON")
    parser.add_argument("--repeat", type=int, default=1, help="passes over the configurations (default 1)")
    args = parser.parse_args()
    if args.dialler:
        run_dialler(*args.dialler)
        return
    quiet_logs()
    run_client_server(__file__, serve, client, report, args.repeat)


if __name__ == "__main__":
    main()
