"""``run_demo(tune=...)``: the ``--tune KEY=VALUE`` strings reach every joining peer's command line."""

from __future__ import annotations

import pytest

import p2pswarm.demo as demo
from p2pswarm.errors import ConfigError


class _FakeProcess:
    returncode = 0

    def poll(self):
        return 0

    def wait(self, timeout=None):
        return 0


def test_every_joining_peer_gets_the_tune_pairs(tmp_path, monkeypatch):
    spawned: list[list[str]] = []
    monkeypatch.setattr(demo, "spawn", lambda args, log_path: spawned.append(args) or _FakeProcess())
    monkeypatch.setattr(demo, "read_first_addr", lambda process, what: "/ip4/127.0.0.1/tcp/1/p2p/boot")
    monkeypatch.setattr(demo, "_wait_formed", lambda members, processes, n_stages: False)
    monkeypatch.setattr(demo.signal, "signal", lambda signum, handler: None)
    assert demo.run_demo(4, 10.0, tmp_path, stages=2, tune=("eval_share=1", "affinity=0")) == 1
    assert len(spawned) == 5 and spawned[0][0] == "bootstrap" and "--tune" not in spawned[0]
    for args in spawned[1:]:
        assert args[0] == "join"
        pairs = [args[i + 1] for i, arg in enumerate(args) if arg == "--tune"]
        assert pairs == ["eval_share=1", "affinity=0"]


def test_a_bad_tune_pair_is_refused_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "spawn", lambda *args: pytest.fail("nothing may start"))
    with pytest.raises(ConfigError, match="--tune"):
        demo.run_demo(2, 10.0, tmp_path, tune=("no_such_knob=1",))
