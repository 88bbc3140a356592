"""How long to wait for one peer's ack, and how many frames to have on the way to it: the pure link core.

A fixed ack deadline cannot fit every link: 512 KiB take 5 ms on loopback, 42 ms at 100 Mbit/s
and 840 ms at 5 Mbit/s. A deadline shorter than the transfer fails a healthy peer, the same
micro-batch is sent again elsewhere, and the duplicates fill the link and the queues until no
ack comes in time at all (congestion collapse, issue 14). So each peer gets a ``Link``, measured
from our side only (what a peer claims never enters it):

- **throughput**: an average of ``size / seconds`` over acked frames of at least
  SAMPLE_MIN_BYTES, from send to ack; a smaller frame alone says nothing of the link's rate (its
  time is latency), but one acked while others were on the way behind it is a *delivery-rate*
  sample (as BBR's): its bytes over the shorter of its own send-to-ack time and the time since
  the ack before it. On a saturated thin line frames are acked one transfer time apart, so the
  line is measured (a subspace run's 13 KB frames on 25 KB/s: 0.5 s each, not the 10 ms that
  10 Mbit/s would assume); on a fast line that a slow sender leaves idle, the frame's own
  send-to-ack time is the shorter one and the sample stays high;
- **slack**: what the ack latency adds to the transfer time expected at that throughput (the
  receiver's loop, its buffering), smoothed with its variation as TCP does (RFC 6298);
- **deadline(size)** = ``size / throughput`` x TRANSFER_MARGIN + slack + RTT_K x variation,
  at least DEADLINE_FLOOR, times the **backoff** (1; doubled by each timeout up to MAX_BACKOFF, 1
  again on an ack, as RFC 6298 5.5 backs off its timer), at most DEADLINE_CEILING. The driver
  counts it from the first byte and does not fail a peer while the frame's bytes are still moving
  (``sender``): the deadline bounds how long a peer may make *no* progress, so a hung peer is
  found within one deadline. Without the backoff a path slower than its deadline (a stream that
  takes seconds to open on a 0.2 Mbit/s line) failed every attempt, and no ack ever came to
  teach the link otherwise;
- **window**: frames allowed on the way to the peer (sent, not yet answered), additive increase
  by one frame per window of acks, halved on a timeout or a ``Busy`` (AIMD), within
  [WINDOW_MIN, WINDOW_MAX]. An ack that took over QUEUE_FACTOR times what the fastest rate seen
  on this link explains (plus QUEUE_ALLOWANCE) means our own frames wait in a queue on the way
  (a full uplink buffer): the window then shrinks by one frame per window instead of growing,
  so a slow line is kept full but not queued behind seconds of our own data (as TCP Vegas). A sender
  takes a slot before it writes and gives it back on the answer; stage 0 cuts a micro-batch only
  when some next-stage peer has room.

A liar cannot game this: acking what it never read makes its samples look like a fast link,
which only sends it frames whose gradients then never come (``inflight`` gives those up and the
router backs the peer off); ``Busy`` forever shrinks only its own window; the window never
exceeds WINDOW_MAX whatever the acks say. Pure: no clock, no I/O; every update returns a new Link.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

INITIAL_THROUGHPUT = 1.25e6  # bytes/s assumed before a sample (10 Mbit/s): generous deadlines on a new link
MIN_THROUGHPUT = 12_500.0  # bytes/s (100 kbit/s): an estimate never falls below, so no deadline is unbounded
SAMPLE_MIN_BYTES = 64 * 1024  # frames smaller than this measure latency, not throughput
THROUGHPUT_ALPHA = 1 / 4  # weight of a new throughput sample
TRANSFER_MARGIN = 2.0  # a transfer may take this much longer than the estimate before it is late
INITIAL_SLACK = 2.0  # seconds of slack assumed before a sample (RFC 6298 starts at 1 s): a loaded receiver's loop
SLACK_ALPHA = 1 / 8  # RFC 6298 gain of the smoothed slack
SLACK_BETA = 1 / 4  # RFC 6298 gain of its variation
RTT_K = 4  # RFC 6298: deadline = transfer + srtt + 4 * rttvar
DEADLINE_FLOOR = 1.0  # seconds (RFC 6298's minimum RTO): a GC pause or a busy 2-core loop never fails a healthy peer
DEADLINE_CEILING = 60.0  # seconds: at MIN_THROUGHPUT a 512 KiB frame still fits
MAX_BACKOFF = 8.0  # RFC 6298 5.5: each timeout doubles the deadline, up to this factor, until an ack
QUEUE_FACTOR = 3.0  # an ack this many times slower than the link's best means a queue of our own frames
QUEUE_ALLOWANCE = 0.05  # seconds of loop and scheduling noise never counted as a queue
WINDOW_INITIAL = 2.0  # frames on the way to a new peer
WINDOW_MIN = 1.0  # a peer that answers at all always gets one frame at a time
WINDOW_MAX = 8.0  # frames on the way to one peer, at most, whatever its acks say


@dataclass(frozen=True)
class Link:
    """What we measured of the path to one peer, and how much we may have on it."""

    throughput: float | None = None  # bytes/s, None before a sample
    fastest: float | None = None  # the highest throughput sample seen: the link without our queue
    slack: float | None = None  # smoothed seconds an ack adds to the expected transfer
    slack_var: float = 0.0  # smoothed variation of that
    window: float = WINDOW_INITIAL  # frames allowed on the way (AIMD)
    backoff: float = 1.0  # the deadline's factor: doubled by each timeout (RFC 6298 5.5), 1 again on an ack
    on_the_way: int = 0  # frames sent and not yet answered
    last_ack_at: float | None = None  # when the last ack came (the caller's clock): delivery-rate samples
    acks: int = 0
    timeouts: int = 0
    busies: int = 0

    @property
    def rate(self) -> float:
        """Bytes/s the deadlines assume."""
        return INITIAL_THROUGHPUT if self.throughput is None else self.throughput

    def transfer_time(self, size: int) -> float:
        """Seconds ``size`` bytes are expected to take at the measured throughput."""
        return max(0, size) / self.rate

    def deadline(self, size: int) -> float:
        """Seconds an attempt of ``size`` bytes may go without progress before the peer is failed."""
        slack = INITIAL_SLACK if self.slack is None else self.slack + RTT_K * self.slack_var
        seconds = TRANSFER_MARGIN * self.transfer_time(size) + slack
        return min(DEADLINE_CEILING, max(DEADLINE_FLOOR, seconds) * self.backoff)

    @property
    def has_room(self) -> bool:
        return self.on_the_way < int(self.window)

    def sent(self) -> Link:
        """A frame is on the way (the caller checked ``has_room``, or it is a gradient: one place to go)."""
        return replace(self, on_the_way=self.on_the_way + 1)

    def acked(self, size: int, seconds: float, now: float | None = None) -> Link:
        """An ack ``seconds`` after the first byte of ``size`` bytes (at ``now`` on the caller's clock,
        where known): learn, and open the window."""
        seconds = max(0.0, seconds)
        throughput, fastest, queued = self.throughput, self.fastest, False
        busy = self._busy_time(size, seconds, now)
        if busy is not None and busy > 0:
            sample = max(MIN_THROUGHPUT, size / busy)
            throughput = sample if throughput is None else throughput + THROUGHPUT_ALPHA * (sample - throughput)
            queued = fastest is not None and seconds > QUEUE_FACTOR * size / fastest + QUEUE_ALLOWANCE
            fastest = sample if fastest is None else max(fastest, sample)
        excess = max(0.0, seconds - size / (throughput or INITIAL_THROUGHPUT))
        if self.slack is None:
            slack, var = excess, excess / 2
        else:
            var = (1 - SLACK_BETA) * self.slack_var + SLACK_BETA * abs(self.slack - excess)
            slack = (1 - SLACK_ALPHA) * self.slack + SLACK_ALPHA * excess
        step = -1 / self.window if queued else 1 / self.window
        window = min(WINDOW_MAX, max(WINDOW_MIN, self.window + step))
        return replace(self, throughput=throughput, fastest=fastest, slack=slack, slack_var=var, window=window,
                       on_the_way=max(0, self.on_the_way - 1), acks=self.acks + 1, backoff=1.0,
                       last_ack_at=self.last_ack_at if now is None else now)

    def _busy_time(self, size: int, seconds: float, now: float | None) -> float | None:
        """The seconds a frame's acked bytes measure the link over, or None if it measures nothing:
        a large frame its send-to-ack time; a small one acked behind others, the shorter of that and
        the time since the previous ack (module docstring)."""
        if size >= SAMPLE_MIN_BYTES:
            return seconds
        if size <= 0 or now is None or self.last_ack_at is None or self.on_the_way < 2:
            return None
        return min(seconds, now - self.last_ack_at)

    def busy(self) -> Link:
        """A ``Busy``: the peer is alive but full; have less on the way to it."""
        return replace(self, window=max(WINDOW_MIN, self.window / 2), on_the_way=max(0, self.on_the_way - 1),
                       busies=self.busies + 1)

    def timed_out(self, late: bool = True) -> Link:
        """No progress within the deadline (``late``) or an error: halve the window, as TCP does on a loss;
        a late one also doubles the deadline until the next ack (RFC 6298 5.5): a deadline that fits no
        answer on this path would otherwise fail every attempt alike, and no ack would ever teach it."""
        backoff = min(MAX_BACKOFF, self.backoff * 2) if late else self.backoff
        return replace(self, window=max(WINDOW_MIN, self.window / 2), on_the_way=max(0, self.on_the_way - 1),
                       timeouts=self.timeouts + 1, backoff=backoff)

    def doc(self, size: int) -> dict[str, Any]:
        """For /api/swarm: the deadline in force for a ``size``-byte frame, throughput, window."""
        return {"deadline_ms": round(1000 * self.deadline(size), 1),
                "throughput_mbit_s": None if self.throughput is None else round(self.throughput * 8 / 1e6, 2),
                "window": round(self.window, 2), "on_the_way": self.on_the_way}
