"""How a snapshot fetch paces itself, the pure core of ``snapshots.fetch_snapshot``: the size of each
chunk it asks for, the pause after it, and how long the whole fetch may take. No I/O.

A snapshot or a backup leaves the serving peer through the uplink that also carries its activations
and gradients. On a thin line, 4 MiB replies (the server's largest) took minutes each: training's
frames queued behind them, and a fetch whose reply missed its 20 s deadline started over from byte 0
at the next try, so a backup of a few MB was never held and its fetches used the line for ever
(``docs/benchmarks.md`` §25). So the client asks for one chunk at a time (never more than one chunk
of bulk queued ahead of training on the server's uplink) and sizes each one to take about
``CHUNK_SECONDS`` at the rate the chunks before it came at:

- the first chunk is ``MIN_CHUNK_BYTES``; each next one is ``rate × CHUNK_SECONDS`` within
  [``MIN_CHUNK_BYTES``, ``MAX_CHUNK_BYTES``] and at most ``GROWTH`` times the one before (a LAN reaches
  4 MiB in five chunks; a 0.2 Mbit/s line stays near 16 KiB);
- the rate is a moving mean (weight ``RATE_WEIGHT`` on the newest chunk) of bytes per second of chunk
  time, from request to the reply's last byte (so a round trip counts: on a long line the chunks grow
  until it is small next to them);
- ``share`` below 1 (background fetches: a backup holder's refresh) pauses after each chunk for
  ``seconds × (1 / share − 1)``, so the fetch takes at most that share of the line's time and training
  keeps the rest; a joiner that cannot train before its load completes fetches with share 1;
- the whole fetch may take ``max(timeout, total / (MIN_FETCH_RATE × share))``: progress, not size,
  decides (a trickling peer is still cut off); each reply still within ``CHUNK_TIMEOUT``.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_CHUNK_BYTES = 16 * 1024  # a chunk on the thinnest line: ~0.65 s at 0.2 Mbit/s, the pool's write grain
MAX_CHUNK_BYTES = 4 * 1024 * 1024  # the server's largest reply (snapshots.CHUNK_BYTES)
CHUNK_SECONDS = 1.0  # a chunk's target duration: bulk ahead of training's frames, at most about this long
GROWTH = 4  # a chunk is at most this many times the one before: a rate measured on a small chunk is rough
RATE_WEIGHT = 0.5  # the newest chunk's weight in the rate's moving mean
MIN_FETCH_RATE = 4 * 1024  # bytes/s of the line's share: a slower fetch has stalled (below every line we serve)


@dataclass
class ChunkPace:
    """One fetch's chunk sizes and pauses (module docstring); ``observe`` each chunk as it completes."""

    share: float = 1.0  # of the line's time this fetch may take, in (0, 1]
    rate: float | None = None  # bytes/s, the moving mean; None before the first chunk
    last: int = 0  # the last chunk's size

    def __post_init__(self) -> None:
        if not 0 < self.share <= 1:
            raise ValueError(f"share {self.share} is not in (0, 1]")

    def next_length(self) -> int:
        """The bytes to ask for next."""
        if self.rate is None:
            return MIN_CHUNK_BYTES
        wanted = int(self.rate * CHUNK_SECONDS)
        return max(MIN_CHUNK_BYTES, min(wanted, MAX_CHUNK_BYTES, GROWTH * self.last))

    def observe(self, nbytes: int, seconds: float) -> float:
        """A chunk of ``nbytes`` came ``seconds`` after its request; the pause to take before the next."""
        sample = nbytes / max(seconds, 1e-6)
        self.rate = sample if self.rate is None else RATE_WEIGHT * sample + (1 - RATE_WEIGHT) * self.rate
        self.last = nbytes
        return max(seconds, 0.0) * (1 / self.share - 1)

    def allowed(self, timeout: float, total: int) -> float:
        """Seconds a whole fetch of ``total`` bytes may take (``timeout`` for a small one)."""
        return max(timeout, total / (MIN_FETCH_RATE * self.share))
