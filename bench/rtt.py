"""Small-message round-trip latency on a warm p2pswarm stream, against raw trio TCP.

Why: control traffic (heartbeats, status queries, layer-record fetches) is many tiny
request/response exchanges, so its cost is per-message latency, not bandwidth. This measures
the same framed Ping/Pong exchange three ways in one run: raw trio TCP (the baseline), a
dedicated libp2p stream (TCP + Noise + Yamux), and ``ControlService.request`` on its
long-lived control stream (the path discovery actually uses).

Client and server run in separate processes; ``--serve`` runs the server, which prints its
addresses as one JSON line. Run: ``python bench/rtt.py``.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import trio
from common import (
    LOOPBACK,
    LOOPBACK_HOST,
    RawStream,
    announce,
    percentile,
    print_table,
    quiet_logs,
    ratio,
    run_client_server,
    us,
)

from p2pswarm import wire
from p2pswarm.identity import generate_identity
from p2pswarm.net.control import ControlService
from p2pswarm.net.host import connect, open_host, peer_info_from_multiaddr
from p2pswarm.net.streams import ByteStream, open_stream

ECHO_PROTOCOL = "/p2pswarm/bench-echo/1.0.0"
ROUND_TRIPS = 2000  # measured exchanges per transport
WARMUP_ROUND_TRIPS = 200  # discarded first: connection, window and code-path warm-up
RUN_TIMEOUT = 60.0  # per transport; 2,000 round trips take a few seconds at most
NONCE_BASE = 2**40  # makes each Ping/Pong frame a realistic 30-odd bytes, constant in size
UNFRAMED_BYTES = len(wire.encode_frame(wire.Ping(nonce=NONCE_BASE)))  # same size, no framing


# --- server ------------------------------------------------------------------------------


async def echo_pings(stream) -> None:
    """Answer every Ping frame with a Pong of the same nonce until EOF."""
    while (frame := await wire.read_frame(stream)) is not None:
        await wire.write_frame(stream, wire.Pong(nonce=frame[0].nonce))


async def serve_libp2p_stream(raw_stream) -> None:
    stream = ByteStream(raw_stream)
    await echo_pings(stream)
    await stream.close()


async def serve_raw_stream(sock) -> None:
    await echo_pings(RawStream(sock))
    await sock.aclose()


async def serve_raw_bytes(sock) -> None:
    """Echo bytes as they come: the floor of a round trip, with no framing or decoding."""
    while data := await sock.receive_some(UNFRAMED_BYTES):
        await sock.send_all(data)
    await sock.aclose()


async def answer_ping(peer: str, message: wire.Ping) -> wire.Pong:
    return wire.Pong(nonce=message.nonce)


async def serve() -> None:
    async with open_host(generate_identity(), [LOOPBACK]) as host, trio.open_nursery() as nursery:
        host.set_stream_handler(ECHO_PROTOCOL, serve_libp2p_stream)
        ControlService(host, nursery).handle(wire.Ping, answer_ping)
        framed = await nursery.start(partial(trio.serve_tcp, serve_raw_stream, 0, host=LOOPBACK_HOST))
        unframed = await nursery.start(partial(trio.serve_tcp, serve_raw_bytes, 0, host=LOOPBACK_HOST))
        announce({"libp2p": str(host.get_addrs()[0]), "tcp": framed[0].socket.getsockname()[1],
                  "tcp_unframed": unframed[0].socket.getsockname()[1]})
        await trio.sleep_forever()


# --- client ------------------------------------------------------------------------------


async def ping_pong(stream, nonce: int) -> None:
    await wire.write_frame(stream, wire.Ping(nonce=nonce))
    frame = await wire.read_frame(stream)
    if frame is None or frame[0] != wire.Pong(nonce=nonce):
        raise RuntimeError(f"expected Pong({nonce}), got {frame}")


async def echo_bytes(sock, message: bytes, nonce: int) -> None:
    await sock.send_all(message)
    got = b""
    while len(got) < len(message):
        got += await sock.receive_some(len(message) - len(got))


async def control_ping(control: ControlService, peer_id, nonce: int) -> None:
    reply = await control.request(peer_id, wire.Ping(nonce=nonce))
    if reply != wire.Pong(nonce=nonce):
        raise RuntimeError(f"expected Pong({nonce}), got {reply}")


async def time_round_trips(exchange) -> list[float]:
    """Seconds per round trip of ``exchange(nonce)``, after a discarded warm-up."""
    with trio.fail_after(RUN_TIMEOUT):
        for i in range(WARMUP_ROUND_TRIPS):
            await exchange(NONCE_BASE + i)
        times = []
        for i in range(ROUND_TRIPS):
            started = time.perf_counter()
            await exchange(NONCE_BASE + i)
            times.append(time.perf_counter() - started)
    return times


async def client(info: dict) -> dict[str, list[float]]:
    results = {}
    sock = await trio.open_tcp_stream(LOOPBACK_HOST, info["tcp_unframed"])
    results["raw trio TCP, unframed bytes"] = await time_round_trips(
        partial(echo_bytes, sock, b"x" * UNFRAMED_BYTES))
    await sock.aclose()
    sock = await trio.open_tcp_stream(LOOPBACK_HOST, info["tcp"])
    results["raw trio TCP"] = await time_round_trips(partial(ping_pong, RawStream(sock)))
    await sock.aclose()
    async with open_host(generate_identity(), [LOOPBACK]) as host, trio.open_nursery() as nursery:
        target = peer_info_from_multiaddr(info["libp2p"])
        await connect(host, target)
        stream = await open_stream(host, target.peer_id, ECHO_PROTOCOL)
        results["p2pswarm stream"] = await time_round_trips(partial(ping_pong, stream))
        await stream.close()
        control = ControlService(host, nursery)
        results["ControlService.request"] = await time_round_trips(
            partial(control_ping, control, target.peer_id))
        nursery.cancel_scope.cancel()
    return results


# --- report ------------------------------------------------------------------------------


def report(results: dict[str, list[float]]) -> None:
    frame_bytes = len(wire.encode_frame(wire.Ping(nonce=NONCE_BASE)))
    raw_p50 = percentile(results["raw trio TCP"], 50)
    rows = [[name, us(percentile(t, 50)), us(percentile(t, 99)), us(max(t)),
             ratio(percentile(t, 50), raw_p50)] for name, t in results.items()]
    print_table(f"Ping/Pong round trip ({frame_bytes} B frames each way), warm stream, "
                f"{ROUND_TRIPS} round trips after {WARMUP_ROUND_TRIPS} warm-up",
                ["transport (framed Ping/Pong unless noted)", "p50 µs", "p99 µs", "max µs", "p50 / raw p50"], rows)
    print("(raw = raw trio TCP doing the same framed Ping/Pong; the unframed row is the socket floor)")
    print(f"\nratio p2pswarm stream / raw TCP p50: "
          f"{ratio(percentile(results['p2pswarm stream'], 50), raw_p50)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", help="run the answering side")
    parser.parse_args()
    quiet_logs()
    run_client_server(__file__, serve, client, report)


if __name__ == "__main__":
    main()
