"""A swarm of real processes trains: 2 stages x 2 replicas on loopback, one replica SIGKILLed midway.

Runs ``p2pswarm demo`` itself (a bootstrap node and four ``p2pswarm join`` peers, each its own
process) and reads what it reports: the held-out loss, measured by the last stage on the fixed
held-out set, must fall from the untrained model's; after the kill, micro-batches must keep
completing and the held-out loss keep being measured; no process may crash (the demo exits 1
if one does). The peers' own logs must show no traceback.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(300)

DURATION = 60  # seconds of training: the kill comes at 30 s
LEARNED = 5.5  # bits/byte: well below the untrained ~8 and the byte unigram entropy (~4.6 here); 60 s reach ~4.5


def test_two_by_two_swarm_learns_and_survives_a_sigkill(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "p2pswarm", "demo", "--peers", "4", "--stages", "2", "--duration", str(DURATION),
         "--kill-one", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=280)
    out = result.stdout
    logs = {p.name: p.read_text(errors="replace") for p in tmp_path.glob("*.log")}
    assert result.returncode == 0, (out, result.stderr, {n: t[-3000:] for n, t in logs.items()})

    lines = out.splitlines()
    killed_at = next(i for i, line in enumerate(lines) if "SIGKILLed peer" in line)
    after = [line for line in lines[killed_at + 1:] if line.startswith("demo: t=")]
    assert after, out
    rates = [float(re.search(r"(\d+) tok/s", line).group(1)) for line in after]
    assert rates[-1] > 0, out  # micro-batches still complete without the killed replica

    first, last, late = map(float, re.search(r"held-out loss ([\d.]+) -> ([\d.]+) bits/byte \(mean of the last \d+ "
                                             r"rounds ([\d.]+)", out).groups())
    # ~8 bits/byte untrained. The last round measures the model as it ends; on a loaded machine the
    # paced held-out rounds are few, so the mean of the last ones may still hold early rounds: it
    # must only have fallen from the first (the first round may come after some steps).
    assert last < min(first, LEARNED) and late < first, out
    assert "0 crashed processes" in out
    for name, text in logs.items():
        assert "Traceback" not in text, (name, text[-3000:])
