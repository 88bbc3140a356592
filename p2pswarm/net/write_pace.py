"""How big the pieces of a bulk frame are: the pure core of ``pool.PoolStream.write``'s pacing. No I/O.

A bulk frame goes to its connection in pieces, so that the connection's other streams (a ping, a record,
an ack) wait for at most one piece of it: trio keeps at most 16 KiB unsent in the kernel
(TCP_NOTSENT_LOWAT) and py-libp2p writes a connection under a FIFO lock. On a 0.2 Mbit/s line a piece
of ``MIN_PIECE`` already takes 0.65 s; on loopback 16 KiB pieces pay py-libp2p's per-write cost 16 times
a MiB: a 64 MiB int8 outer round of 4 peers took 3.1 s, 2.4 s with 256 KiB pieces (``docs/benchmarks.md``
§27). So each stream sizes its pieces to take about ``PIECE_SECONDS``: twice the size after two full pieces
in a row that took under half of that, half after one that took over twice it, within [MIN_PIECE,
MAX_PIECE]. Two, because the first write after a pause goes into an empty kernel buffer at once whatever
the line: on a 0.2 Mbit/s line one fast piece grew the next to 32 KiB, 1.3 s that other streams waited.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_PIECE = 16 * 1024  # a piece on a thin line: 0.65 s at 0.2 Mbit/s, what another stream may wait behind
MAX_PIECE = 1024 * 1024  # ...and on a fast one: 10 ms at 100 MB/s
PIECE_SECONDS = 0.01  # a piece's target duration: another stream's frame waits about this long behind it


@dataclass
class WritePace:
    """One stream's piece size (module docstring); ``observe`` each piece as it is written."""

    size: int = MIN_PIECE
    fast: bool = False  # the last full piece took under half of PIECE_SECONDS

    def observe(self, nbytes: int, seconds: float) -> None:
        """A piece of ``nbytes`` took ``seconds`` to write; a short one (a frame's last) says nothing."""
        if nbytes < self.size:
            return
        fast, self.fast = self.fast, seconds < PIECE_SECONDS / 2
        if fast and self.fast:
            self.size, self.fast = min(MAX_PIECE, self.size * 2), False
        elif seconds > 2 * PIECE_SECONDS:
            self.size = max(MIN_PIECE, self.size // 2)
