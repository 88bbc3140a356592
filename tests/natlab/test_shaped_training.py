"""A 2 x 2 ``tiny-lm/2`` swarm over home lines (20 Mbit/s up, 100 down, ``tc tbf``), real processes.

Each join runs in its own network namespace on a bridge, its uplink and downlink shaped
(``p2pswarm.testing.linklab``). Before issue 14 this swarm trained nothing: fixed 200 ms ack
deadlines failed every 512 KiB frame and the re-sends collapsed the links. The swarm must train,
lose a micro-batch only where a peer was judged failed, judge at most 5 % of its sends in the
measured window failed (10 % since the peers' start, when start-up sends may fail too),
and train no micro-batch twice: the stage-1 peers together train at most as many forwards as the
stage-0 peers had acked (each micro-batch is acked once, and a receiver drops a copy it already
took).
"""

from __future__ import annotations

import pytest

from p2pswarm.testing.linklab import link_lab_available
from p2pswarm.testing.linkswarm import run_link_arm

REASON = link_lab_available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

TRAIN_SECONDS = 25.0  # the window measured once training runs (a 2 x 2 swarm on 2 cores; suite time)
FAILED_SHARE = 0.05  # of a stage's sends in the measured window judged failed: far from the collapse (94.5 %).
# Once the round-0 held-out evaluation (16.8 MB of activations, ~7 s of the 20 Mbit/s uplink) began to share the
# window's start, 4-7 % timed out until an ack's deadline counted every other byte on the way from the sender;
# since: 1 in 515 sends.
FAILED_SHARE_WITH_START = 0.10  # of every send since the peers started: start-up sends can fail (a full suite run:
# 9 of a stage's 112 sends since the start, 1 in the window; likely to a replica still loading its stage)


def failures(figures: dict, stage: int) -> tuple[float, float]:
    """(sends judged failed, sends) of one stage in a section of ``run_link_arm``'s figures."""
    counts = figures.get(stage, {})
    return counts.get("timeouts", 0) + counts.get("errors", 0), max(1, counts.get("sent", 0))


def total(result: dict, section: str, stage: int, key: str) -> float:
    return result["totals"][section].get(stage, {}).get(key, 0)


def test_home_line_swarm_trains_without_collapse_loss_or_duplicate_training(tmp_path):
    result = run_link_arm("home", TRAIN_SECONDS, tmp_path)
    figures = {k: result[k] for k in ("tokens", "tokens_per_s", "link_bound_tok_s", "delivery", "counts")}
    print(f"home line: {figures}")
    assert result["training_started"] and result["tokens"] > 0, figures
    for stage in (0, 1):
        # a micro-batch is lost only after a peer was judged failed (no progress within its
        # deadline, or an error); on 2 shared cores a receiver's loop can stall for seconds,
        # so the test bounds losses by failures instead of asking for none
        failed, sends = failures(result["totals"]["delivery"], stage)
        assert total(result, "delivery", stage, "lost") <= failed, figures
        assert failed <= FAILED_SHARE_WITH_START * sends, (failed, sends, figures)
        failed, sends = failures(result["delivery"], stage)
        assert failed <= FAILED_SHARE * sends, figures  # far from the collapse: 481 of 485 timed out before
    trained = total(result, "counts", 1, "forwards_trained")
    acked = total(result, "delivery", 0, "training_forwards_acked")
    assert 0 < trained <= acked, figures  # nothing trained twice by the stage-1 replicas together
