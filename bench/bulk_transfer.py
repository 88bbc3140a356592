"""Bulk throughput of one p2pswarm framed stream against raw trio TCP, measured side by side.

Why: activations and gradients travel between stages as TensorFrames on libp2p streams
(TCP + Noise + Yamux). This shows how many MB/s one such stream carries on this machine and
what fraction of the raw socket that is, so a slow training step can be blamed (or not) on
the transport. The baseline is raw trio TCP in the same run, with the same chunking.

Client and server run in separate processes; ``--serve`` runs the server, which prints its
addresses as one JSON line. Run: ``python bench/bulk_transfer.py``.
"""

from __future__ import annotations

import argparse
import struct
import time
from functools import partial

import trio
from common import (
    LOOPBACK,
    LOOPBACK_HOST,
    BenchAck,
    announce,
    median,
    print_table,
    quiet_logs,
    ratio,
    run_client_server,
)

from p2pswarm import wire
from p2pswarm.identity import generate_identity
from p2pswarm.net.host import connect, open_host, peer_info_from_multiaddr
from p2pswarm.net.streams import ByteStream, open_stream

BULK_PROTOCOL = "/p2pswarm/bench-bulk/1.0.0"
MIB = 1024 * 1024
TOTAL_BYTES = 64 * MIB  # one large activation/gradient batch
DEFAULT_CHUNK_MIB = 1  # one TensorFrame per MiB
REPEATS = 3  # report the median of these
WARMUP_BYTES = 8 * MIB  # one discarded transfer per transport first
RAW_HEADER = struct.Struct(">Q")  # raw TCP: the byte count that follows
RAW_ACK = struct.Struct(">QQ")  # raw TCP: bytes received, receiver CPU in µs
STREAM_TIMEOUT = 60.0  # one transfer far slower than this is a stall, not a figure


# --- server ------------------------------------------------------------------------------


async def serve_libp2p_stream(raw_stream) -> None:
    """Receive TensorFrames until a Ping, then answer with the total and the CPU spent."""
    cpu_started = time.process_time()
    stream, total = ByteStream(raw_stream), 0
    while (frame := await wire.read_frame(stream)) is not None:
        message, payload = frame
        if isinstance(message, wire.Ping):
            cpu_us = round((time.process_time() - cpu_started) * 1e6)
            await wire.write_frame(stream, BenchAck(total=total, cpu_us=cpu_us))
            break
        total += len(payload)
    await stream.close()


async def serve_raw_stream(sock) -> None:
    """Read the announced number of bytes with receive_some, then send the total and CPU."""
    cpu_started = time.process_time()
    header = b""
    while len(header) < RAW_HEADER.size:
        header += await sock.receive_some(RAW_HEADER.size - len(header))
    (expected,), total = RAW_HEADER.unpack(header), 0
    while total < expected:
        data = await sock.receive_some(MIB)
        if not data:
            break
        total += len(data)
    cpu_us = round((time.process_time() - cpu_started) * 1e6)
    await sock.send_all(RAW_ACK.pack(total, cpu_us))
    await sock.aclose()


async def serve() -> None:
    async with open_host(generate_identity(), [LOOPBACK]) as host, trio.open_nursery() as nursery:
        host.set_stream_handler(BULK_PROTOCOL, serve_libp2p_stream)
        listeners = await nursery.start(partial(trio.serve_tcp, serve_raw_stream, 0, host=LOOPBACK_HOST))
        announce({"libp2p": str(host.get_addrs()[0]), "tcp": listeners[0].socket.getsockname()[1]})
        await trio.sleep_forever()


# --- client ------------------------------------------------------------------------------


async def send_libp2p(host, peer_id, total: int, chunk: bytes) -> tuple[float, float, float]:
    """(seconds, client CPU s, server CPU s) for ``total`` bytes as TensorFrames on a new stream."""
    stream = await open_stream(host, peer_id, BULK_PROTOCOL)
    header = wire.TensorFrame(name="chunk", dtype="uint8", shape=(len(chunk),))
    cpu_started, started = time.process_time(), time.perf_counter()
    for _ in range(total // len(chunk)):
        await wire.write_frame(stream, header, chunk)
    await wire.write_frame(stream, wire.Ping(nonce=0))
    reply = await wire.read_frame(stream)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    await stream.close()
    if reply is None or not isinstance(reply[0], BenchAck) or reply[0].total != total:
        raise RuntimeError(f"libp2p transfer incomplete: receiver answered {reply}")
    return elapsed, cpu, reply[0].cpu_us / 1e6


async def send_raw(port: int, total: int, chunk: bytes) -> tuple[float, float, float]:
    """(seconds, client CPU s, server CPU s) for ``total`` bytes with plain send_all."""
    sock = await trio.open_tcp_stream(LOOPBACK_HOST, port)
    cpu_started, started = time.process_time(), time.perf_counter()
    await sock.send_all(RAW_HEADER.pack(total))
    for _ in range(total // len(chunk)):
        await sock.send_all(chunk)
    ack = b""
    while len(ack) < RAW_ACK.size:
        data = await sock.receive_some(RAW_ACK.size - len(ack))
        if not data:
            break
        ack += data
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    await sock.aclose()
    received, server_cpu_us = RAW_ACK.unpack(ack)
    if received != total:
        raise RuntimeError(f"raw transfer incomplete: {received} of {total} bytes")
    return elapsed, cpu, server_cpu_us / 1e6


async def client(info: dict, chunk_bytes: int) -> dict[str, list[tuple[float, float, float]]]:
    chunk = bytes(range(256)) * (chunk_bytes // 256)
    results: dict[str, list] = {"raw trio TCP": [], "p2pswarm stream": []}
    async with open_host(generate_identity(), [LOOPBACK]) as host:
        target = peer_info_from_multiaddr(info["libp2p"])
        await connect(host, target)
        runs = {
            "raw trio TCP": lambda n: send_raw(info["tcp"], n, chunk),
            "p2pswarm stream": lambda n: send_libp2p(host, target.peer_id, n, chunk),
        }
        with trio.fail_after(STREAM_TIMEOUT * (REPEATS + 1) * len(runs)):
            for run in runs.values():
                await run(max(WARMUP_BYTES, chunk_bytes))
            for _ in range(REPEATS):  # interleaved, so drift in machine load hits both alike
                for name, run in runs.items():
                    results[name].append(await run(TOTAL_BYTES))
    return results


# --- report ------------------------------------------------------------------------------


def report(results: dict[str, list[tuple[float, float, float]]], chunk_bytes: int) -> None:
    rows, speeds = [], {}
    for name, runs in results.items():
        mbps = [TOTAL_BYTES / 1e6 / seconds for seconds, _, _ in runs]
        speeds[name] = median(mbps)
        client_cpu = median([c for _, c, _ in runs])
        server_cpu = median([s for _, _, s in runs])
        cpu_per_gb = (client_cpu + server_cpu) * 1e9 / TOTAL_BYTES
        rows.append([name, f"{speeds[name]:,.0f}", " / ".join(f"{m:,.0f}" for m in mbps),
                     f"{client_cpu:.3f}", f"{server_cpu:.3f}", f"{cpu_per_gb:.2f}"])
    print_table(f"{TOTAL_BYTES // MIB} MiB in {chunk_bytes // 1024} KiB chunks, one stream, "
                f"median of {REPEATS} (MB = 10^6 bytes)",
                ["transport", "MB/s (median)", "MB/s (runs)", "sender CPU s", "receiver CPU s",
                 "CPU s per GB (both)"], rows)
    print(f"\nratio p2pswarm / raw TCP throughput: "
          f"{ratio(speeds['p2pswarm stream'], speeds['raw trio TCP'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", help="run the receiving side")
    parser.add_argument("--chunk-mib", type=int, default=DEFAULT_CHUNK_MIB,
                        help=f"MiB per frame/send (default {DEFAULT_CHUNK_MIB})")
    args = parser.parse_args()
    quiet_logs()
    run_client_server(__file__, serve, client, report, args.chunk_mib * MIB)


if __name__ == "__main__":
    main()
