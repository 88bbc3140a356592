"""libp2p streams as plain byte streams, with libp2p's exceptions translated at this one boundary.

Reading: EOF and a remote reset both come back as ``b""`` (py-libp2p reports a reset as a
clean EOF anyway, defect 4), so every protocol length-prefixes its frames and treats EOF
inside a frame as an error (see ``wire.read_exactly``). Writing to a dead stream raises
``DialError``.
"""

from __future__ import annotations

import trio

from p2pswarm.errors import DialError

OPEN_STREAM_TIMEOUT = 5.0  # a live connection negotiates a stream in ~10 ms; 5 s means it is dead


def _stream_errors() -> tuple[type[BaseException], ...]:
    from libp2p.network.stream.exceptions import StreamClosed, StreamEOF, StreamError, StreamReset

    return (StreamClosed, StreamEOF, StreamError, StreamReset)


class ByteStream:
    """A libp2p stream with ``read``/``write`` that raise only p2pswarm errors."""

    def __init__(self, stream) -> None:
        self._stream = stream
        self._errors = _stream_errors()

    @property
    def remote_peer(self) -> str:
        return str(self._stream.muxed_conn.peer_id)

    async def read(self, max_bytes: int) -> bytes:
        try:
            return await self._stream.read(max_bytes)
        except self._errors:
            return b""

    async def write(self, data: bytes) -> None:
        try:
            await self._stream.write(data)
        except self._errors as exc:
            raise DialError(f"stream to {self.remote_peer} closed: {type(exc).__name__}") from None

    async def close(self) -> None:
        # Shielded: an interrupted close or reset skips the library's stream bookkeeping.
        with trio.CancelScope(shield=True), trio.move_on_after(1):
            try:
                await self._stream.close()
            except Exception:  # closing a dead stream is not an error worth reporting
                pass

    async def reset(self) -> None:
        with trio.CancelScope(shield=True), trio.move_on_after(1):
            try:
                await self._stream.reset()
            except Exception:  # resetting a dead stream is not an error worth reporting
                pass


async def close_quietly(closable, timeout: float = 5.0) -> None:
    """Close a connection (or anything with ``close()``) shielded and bounded; errors from one
    already closing or broken are not worth reporting."""
    with trio.CancelScope(shield=True), trio.move_on_after(timeout):
        try:
            await closable.close()
        except Exception:  # already closed or broken: nothing left to release
            pass


async def open_stream(host, peer_id, protocol: str, timeout: float = OPEN_STREAM_TIMEOUT) -> ByteStream:
    """Open a stream to a connected (or known) peer; DialError on any failure."""
    from libp2p.custom_types import TProtocol

    with trio.move_on_after(timeout):
        try:
            return ByteStream(await host.new_stream(peer_id, [TProtocol(protocol)]))
        except trio.Cancelled:
            raise
        except Exception as exc:
            raise DialError(f"cannot open {protocol} to {peer_id}: {type(exc).__name__}: {exc}") from None
    raise DialError(f"cannot open {protocol} to {peer_id}: no answer within {timeout:.0f} s")
