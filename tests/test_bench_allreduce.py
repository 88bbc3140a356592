"""The outer-round benchmark still runs: ``bench/diloco_allreduce.py`` drives the real ``DilocoService`` on
a stand-in engine and stage map, and each time the driver came to read more of them (issues 24-26) the
benchmark broke unnoticed until issue 27 measured with it. One small arm, 4 real processes on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parent.parent


def test_the_outer_round_benchmark_completes_its_rounds_with_every_member():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "diloco_allreduce.py"), "--sizes", "1", "--arms",
                           "sparse-clip-verify"], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    rounds = [line for line in done.stdout.splitlines() if '"bench": "p2pswarm_outer_round"' in line]
    assert rounds and all('"members": [4, 4, 4, 4]' in line and '"missing": 0' in line for line in rounds), rounds
    assert "| 1 MiB | sparse-clip-verify |" in done.stdout
