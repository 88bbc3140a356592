"""A swarm of real processes trains: 2 stages x 2 replicas on loopback, one replica SIGKILLed midway.

Runs ``p2pswarm demo --rounds --run`` itself (a bootstrap node and four ``p2pswarm join`` peers, each its
own process; the demo's model and DiLoCo values with micro-batches of ``TEST_ROWS`` rows,
``tests.procs.small_batch_run``) until the held-out figure of outer round ``ROUNDS`` is in, and reads its summary: the
held-out loss of the agreed weights, measured by the last stage on the fixed held-out set through
every chain, must fall from round 0's (the untrained model, the same on every replica); every
chain must give the same figure for the same round (replicas agree); after the kill, outer rounds
must go on being completed and evaluated, and the restarted peer must load its stage from the
survivor; no process may crash (the demo exits 1 if one does, or if the rounds never come). The
peers' own logs must show no traceback. The demo's --duration is only a guard against a hang:
nothing here depends on how fast the machine is.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from p2pswarm.demo import DEMO_OUTER_LR, DEMO_OUTER_MOMENTUM
from tests.procs import small_batch_run

pytest.importorskip("torch")
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

MODEL = "tiny-lm/2"  # the demo's 2 stages
ROUNDS = 2  # outer rounds to evaluate; the kill comes once round ROUNDS // 2 is evaluated (keeps the suite short)
INNER_STEPS = 20  # half the demo's H: rounds come twice as often (keeps the suite short)
EVERY_ROUND = ("--tune", "eval_share=1")  # the held-out figure of every round, not of one in ten seconds' worth
GUARD_S = 480  # the demo's --duration: a guard only, far beyond what 2 rounds of H = 20 take
AGREEMENT = 0.05  # bits/byte between chains evaluating the same round (bit-equal weights give 0)


def test_two_by_two_swarm_learns_and_survives_a_sigkill(tmp_path):
    summary = tmp_path / "summary.json"
    run = small_batch_run(tmp_path, MODEL, INNER_STEPS, DEMO_OUTER_LR, DEMO_OUTER_MOMENTUM)  # the demo's values
    result = subprocess.run(
        [sys.executable, "-m", "p2pswarm", "demo", "--peers", "4", *run, "--rounds", str(ROUNDS),
         "--duration", str(GUARD_S), "--kill-one", "--dir", str(tmp_path / "demo"), "--summary", str(summary),
         *EVERY_ROUND],
        capture_output=True, text=True, timeout=GUARD_S + 100)
    out = result.stdout
    logs = {p.name: p.read_text(errors="replace") for p in (tmp_path / "demo").glob("*.log")}
    assert result.returncode == 0, (out, result.stderr, {n: t[-3000:] for n, t in logs.items()})

    doc = json.loads(summary.read_text())
    curve = doc["curve"]
    assert curve[0]["round"] == 0 and curve[-1]["round"] >= ROUNDS, out
    assert curve[-1]["bpb"] < curve[0]["bpb"], out  # the agreed weights learned
    assert all(p["spread"] < AGREEMENT for p in curve if p["chains"] > 1), out
    # Both stage-0 replicas' held-out reached the last stage. That two chains measured the same round on
    # the same agreed weights is not asserted: on a loaded machine a stage can be more than EVAL_HOLD behind
    # stage 0's round, and such a round is left out of the curve (CI once saw one chain per round).
    assert len(doc["sources"]) >= 2, out

    lines = out.splitlines()
    killed_at = next(i for i, line in enumerate(lines) if "SIGKILLed peer" in line)
    later = [line for line in lines[killed_at + 1:] if line.startswith("demo: held-out after outer round")]
    assert later or curve[-1]["round"] > ROUNDS // 2, out  # rounds went on being evaluated after the kill
    assert any("loaded stage" in line for line in lines[killed_at + 1:]), out  # from the surviving replica
    assert "0 crashed processes" in out
    for name, text in logs.items():
        assert "Traceback" not in text, (name, text[-3000:])
