"""The command line as a user meets it: keys, bad input, exit codes, messages on stderr."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from typing import ClassVar

import pytest

from p2pswarm.identity import generate_identity, load_key, write_key


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "p2pswarm", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def assert_one_line_error(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode == 1, result
    lines = [line for line in result.stderr.splitlines() if line.startswith("p2pswarm: error:")]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_keygen_writes_0600_key_and_prints_peer_id(tmp_path):
    path = tmp_path / "node.key"
    result = run("keygen", str(path))
    assert result.returncode == 0, result.stderr
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert result.stdout.strip() == load_key(path).peer_id_text
    assert result.stdout.startswith("12D3KooW")


def test_keygen_refuses_to_overwrite(tmp_path):
    path = tmp_path / "node.key"
    assert run("keygen", str(path)).returncode == 0
    assert_one_line_error(run("keygen", str(path)), "already exists")


def test_key_with_loose_permissions_is_refused(tmp_path):
    path = tmp_path / "node.key"
    write_key(path, generate_identity())  # as keygen writes one (its own tests run it)
    os.chmod(path, 0o644)
    assert_one_line_error(run("bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--key", str(path)), "chmod 600")


def test_garbage_key_is_refused(tmp_path):
    path = tmp_path / "node.key"
    path.write_bytes(b"not a key at all")
    os.chmod(path, 0o600)
    assert_one_line_error(run("bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--key", str(path)), "private key")


def test_bad_multiaddr(tmp_path):
    assert_one_line_error(run("join", "--bootstrap", "/ip4/999.1.1.1/tcp/1"), "bad multiaddr")
    assert_one_line_error(run("join", "--bootstrap", "/ip4/127.0.0.1/tcp/1"), "/p2p/")


def test_unreachable_bootstrap_peer(tmp_path):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    peer = generate_identity().peer_id_text  # a peer id nobody listens for
    result = run("join", "--bootstrap", f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer}", "--listen", "/ip4/127.0.0.1/tcp/0")
    assert_one_line_error(result, "bootstrap")


def test_port_in_use(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run("bootstrap", "--listen", f"/ip4/127.0.0.1/tcp/{port}")
    assert_one_line_error(result, "in use")


def test_bad_layers_and_model():
    boot = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWDNBaynwLzcwCmDKXNd7PjbJZbCJaUrWxtrAeAEd6D6Ge"
    assert_one_line_error(run("join", "--bootstrap", boot, "--layers", "5:2"), "--layers")
    assert_one_line_error(run("join", "--bootstrap", boot, "--model", "nope"), "unknown model")
    assert_one_line_error(run("join", "--bootstrap", boot, "--model", "tiny-lm/5"), "cut into 1, 2, 3, 4, 8")
    assert_one_line_error(run("join", "--bootstrap", boot, "--threads", "0"), "--threads")


def test_bad_data(tmp_path):
    boot = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWDNBaynwLzcwCmDKXNd7PjbJZbCJaUrWxtrAeAEd6D6Ge"
    empty_file, empty_dir = tmp_path / "empty.txt", tmp_path / "nothing"
    empty_file.write_bytes(b"")
    empty_dir.mkdir()
    for path, words in [(tmp_path / "missing", "no such file"), (empty_file, "empty"),
                        (empty_dir, "no readable, non-empty text file")]:
        assert_one_line_error(run("join", "--bootstrap", boot, "--data", str(path)), words)


def test_status_without_a_node():
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    assert_one_line_error(run("status", "--api", f"127.0.0.1:{port}"), "no p2pswarm node")


def test_ping_without_a_node_and_demo_with_too_few_peers():
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    assert_one_line_error(run("ping", "12D3KooWabc", "--api", f"127.0.0.1:{port}"), "no p2pswarm node")
    assert_one_line_error(run("demo", "--peers", "1"), "--peers must be at least 2")
    assert_one_line_error(run("demo", "--stages", "5"), "it can be cut into 1, 2, 3, 4, 8 stages")
    assert_one_line_error(run("demo", "--peers", "3", "--kill-one"), "--peers at least 4")


def test_ping_reports_what_the_node_answers(tmp_path):
    """A bad peer is a 400 from the node, an unreachable one a 502: both one line and exit 1."""
    node = subprocess.Popen([sys.executable, "-m", "p2pswarm", "bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0",
                             "--api", "127.0.0.1:0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        api = None
        deadline = time.monotonic() + 30
        while api is None and time.monotonic() < deadline:
            line = node.stderr.readline()
            if "status API on http://" in line:
                api = line.split("http://", 1)[1].split("/", 1)[0]
        assert api, "the node never served its API"
        assert_one_line_error(run("ping", "/ip4/1.2.3.4/tcp/1", "--api", api), "must end in /p2p/")
        unknown = "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"
        assert_one_line_error(run("ping", unknown, "--api", api), "cannot reach")
    finally:
        node.terminate()
        node.wait(timeout=20)


@pytest.mark.parametrize("command", ["bootstrap", "relay", "join", "status", "keygen", "demo", "ping"])
def test_help_explains_each_command(command):
    result = run(command, "--help")
    assert result.returncode == 0
    assert "usage: p2pswarm " + command in result.stdout


def test_ctrl_c_shuts_down_cleanly_and_json_logs_parse(tmp_path):
    import json
    import signal

    process = subprocess.Popen([sys.executable, "-m", "p2pswarm", "--log-format", "json", "bootstrap",
                                "--listen", "/ip4/127.0.0.1/tcp/0", "--key", str(tmp_path / "k")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        addr = process.stdout.readline().strip()
        assert addr.startswith("/ip4/127.0.0.1/tcp/") and addr.endswith(load_key(tmp_path / "k").peer_id_text)
        port = int(addr.split("/")[4])
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, stderr
    entries = [json.loads(line) for line in stderr.splitlines()]
    assert any("shutting down" in entry["msg"] for entry in entries)
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0, "the listener outlived the node"


def assert_only_one_stderr_line(result: subprocess.CompletedProcess, *words: str) -> None:
    assert_one_line_error(result, *words)
    assert len(result.stderr.splitlines()) == 1, result.stderr


def test_key_or_data_dir_that_cannot_be_created_is_one_line(tmp_path):
    """A file used as a folder: the key cannot be written (as root, nothing else is read-only)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    listen = ("--listen", "/ip4/127.0.0.1/tcp/0")
    for flags in (("--key", str(blocker / "sub" / "node.key")), ("--data-dir", str(blocker / "sub")),
                  ("--data-dir", str(blocker))):
        result = run("bootstrap", *listen, *flags)
        assert_only_one_stderr_line(result, str(blocker))
        assert result.stdout == "", result.stdout
    assert_only_one_stderr_line(run("keygen", str(blocker / "node.key")), str(blocker))


@pytest.mark.parametrize("api", ["nonsense", "127.0.0.1:99999", "127.0.0.1:", ":8700", "127.0.0.1:-1"])
def test_bad_api_address_fails_before_the_node_listens(api):
    result = run("bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--api", api)
    assert_only_one_stderr_line(result, "--api", api)
    assert result.stdout == "", "the node listened and printed its addresses first"


def test_an_api_port_in_use_fails_before_the_node_listens():
    """A well-formed --api that cannot be bound (here: a port in use) is one line and exit 1, and
    the node never prints its addresses first."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run("bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--api", f"127.0.0.1:{port}")
    assert_only_one_stderr_line(result, "cannot serve the API")
    assert result.stdout == "", "the node listened and printed its addresses first"


def test_status_shows_training_from_a_real_swarm_doc():
    import json

    import trio

    from p2pswarm.cli import format_status
    from p2pswarm.model.catalog import get_model
    from p2pswarm.swarm.service import SwarmService

    async def doc() -> dict:
        service = SwarmService(spec=get_model("tiny-lm/2"), stage=1, me="me", pool=None, stage_map=None, host=None)
        return json.loads(json.dumps(service.doc()))  # as it crosses the API

    stats = {"peer_id": "12D3KooWme", "role": "join", "version": "x", "addrs": [], "reachability": "public",
             "dht_mode": "server", "connected_peers": [], "routing_table_size": 0, "model": "tiny-lm/2",
             "stage": 1, "layers": [4, 8], "uptime_s": 3}
    stages = {"model": "tiny-lm/2", "n_layers": 8, "n_stages": 2, "stages": {}}
    text = format_status(stats, stages, trio.run(doc))
    assert "training      step 0" in text and "held-out - bits/byte" in text and "failovers 0" in text
    assert "duplicates dropped 0" in text and "timeouts 0" in text


def test_status_shows_each_next_stage_peer_link():
    import json
    import time

    import trio

    from p2pswarm.cli import format_swarm
    from p2pswarm.dht.records import FLAG_RELAYED
    from p2pswarm.model.catalog import get_model
    from p2pswarm.swarm.router import Candidate
    from p2pswarm.swarm.service import SwarmService

    async def doc() -> dict:
        service = SwarmService(spec=get_model("tiny-lm/2"), stage=0, me="me", pool=None, stage_map=None, host=None)
        service.router.offer([Candidate("12D3KooWdirect01", 1, 0, 0, time.time()),
                              Candidate("12D3KooWrelay002", 1, 0, FLAG_RELAYED, time.time())], time.time())
        service.router.observe_sent("12D3KooWrelay002", 1 << 19)
        service.router.observe_ack("12D3KooWrelay002", 4.194304, time.time(), 0, 1 << 19)  # 1 Mbit/s
        service._note_slow_links()
        return json.loads(json.dumps(service.doc()))

    lines = format_swarm(trio.run(doc))
    direct = next(line for line in lines if "direct01"[-8:] in line)
    relayed = next(line for line in lines if "relay002"[-8:] in line)
    assert "direct" in direct and "throughput -" in direct and "SLOW" not in direct
    assert "relayed" in relayed and "throughput 1.0 Mbit/s" in relayed and "deadline" in relayed
    assert "SLOW: its only path is a relay at 1.0 Mbit/s" in relayed


def test_status_shows_diloco_from_a_real_diloco_doc():
    import json

    import trio

    from p2pswarm.cli import format_diloco
    from p2pswarm.diloco.service import DilocoService
    from p2pswarm.model.catalog import get_model
    from p2pswarm.run.diloco import DilocoSettings

    async def doc() -> dict:
        service = DilocoService(settings=DilocoSettings(inner_steps=40), spec=get_model("tiny-lm/2"), stage=1,
                                me="me", pool=None, stage_map=None)
        service.history.append({"round": 3, "members": ["12D3KooWaaaaaaaa", "12D3KooWbbbbbbbb"], "seconds": 1.5,
                                "missing_shards": [], "bytes_sent": 10, "bytes_received": 10})
        service.loaded_from = {"peer": "12D3KooWcccccccc", "round": 2, "step": 80, "bytes": 1, "seconds": 0.5}
        return json.loads(json.dumps(service.doc()))  # as it crosses the API

    lines = format_diloco(trio.run(doc))
    assert lines[0].startswith("diloco        outer round 0 (training)  inner step 0/40")
    assert "3: 2 replica(s) (aaaaaaaa, bbbbbbbb), 1.5 s, 0 shard(s) missing" in lines[1]
    assert "loaded from   12D3KooWcccccccc (outer round 2)" in lines[2]


def test_the_demo_combines_a_rounds_parts_and_takes_each_replicas_highest_round():
    from p2pswarm.demo import latest_rounds

    rounds = [  # replica a's round 1 was split between two last-stage peers; a late part of its round 0 came last
        {"source": "a", "round": 1, "bpb": 4.0, "tokens": 300, "at": 10.0},
        {"source": "a", "round": 1, "bpb": 5.0, "tokens": 100, "at": 11.0},
        {"source": "a", "round": 0, "bpb": 8.0, "tokens": 100, "at": 12.0},
        {"source": "b", "round": 0, "bpb": 6.0, "tokens": 400, "at": 9.0},
    ]
    assert latest_rounds(rounds) == {"a": (1, 11.0, 4.25), "b": (0, 9.0, 6.0)}


def test_status_shows_inbound_connections():
    from p2pswarm.cli import format_status

    stats = {"peer_id": "12D3KooWme", "role": "bootstrap", "version": "x", "addrs": [], "reachability": "public",
             "dht_mode": "server", "connected_peers": [], "routing_table_size": 0, "model": "tiny-lm",
             "stage": None, "layers": None, "uptime_s": 3,
             "inbound_connections": {"open": 3, "limit": 256, "accepted": 2041, "refused": 7}}
    stages = {"model": "tiny-lm", "n_layers": 8, "n_stages": 4, "stages": {}}
    assert "inbound 3/256 open, 2041 accepted, 7 refused at the limit" in format_status(stats, stages)


def test_status_shows_each_stages_health_its_backups_and_what_blocks_training():
    import json

    import trio

    from p2pswarm.cli import format_status, format_swarm
    from p2pswarm.dht.health import BlockWatch
    from p2pswarm.dht.records import BackupClaim, Capacity, StageRecord
    from p2pswarm.dht.stagemap import StageMap
    from p2pswarm.model.catalog import get_model
    from p2pswarm.swarm.service import SwarmService

    model = get_model("tiny-lm/3")

    def record(peer: str, stage: int, agreed: int, backups=()) -> StageRecord:
        return StageRecord(peer, (), model.name, stage, *model.stage_range(stage), Capacity(0, 0), time.time(), 60.0,
                           agreed=(agreed, bytes(32)), backups=tuple(BackupClaim(s, r, bytes(32)) for s, r in backups))

    class Index:
        me = "12D3KooWaaaaaaaa"
        records: ClassVar[dict] = {0: [record("12D3KooWaaaaaaaa", 0, 7, [(1, 7), (2, 5)]),
                                       record("12D3KooWbbbbbbbb", 0, 7)],
                                   1: [record("12D3KooWcccccccc", 1, 7, [(2, 6)])]}

        async def lookup_stage(self, model, stage, k, standing=None, run=None):
            return self.records.get(stage, [])

    class Map:
        async def current(self, wait=0.0):
            return {}

        def counts(self, claimed=False):
            return {0: 2, 1: 1, 2: 0}

    async def docs() -> tuple[dict, dict]:
        async with trio.open_nursery() as nursery:
            stage_map = StageMap(Index(), model, nursery)
            await stage_map.current()
            for peer, stage in (("12D3KooWbbbbbbbb", 0), ("12D3KooWcccccccc", 1)):  # seen working: replicas
                stage_map.saw(peer, stage)
            stages = stage_map.doc()
            nursery.cancel_scope.cancel()
        service = SwarmService(spec=model, stage=0, me="me", pool=None, stage_map=Map(), host=None)
        service.blocks = BlockWatch(after_s=0.0, serving=0)
        await service._check_blocked()
        return json.loads(json.dumps(stages)), json.loads(json.dumps(service.doc()))  # as they cross the API

    stages, swarm = trio.run(docs)
    stats = {"peer_id": "12D3KooWme", "role": "bootstrap", "version": "x", "addrs": [], "reachability": "public",
             "dht_mode": "server", "connected_peers": [], "routing_table_size": 0, "model": "tiny-lm/3",
             "stage": None, "layers": None, "uptime_s": 3}
    lines = format_status(stats, stages).splitlines()
    assert "blocked:      stage 2 is down; waiting for a peer to take it" in lines
    line = {n: next(x for x in lines if x.startswith(f"  stage   {n}")) for n in range(3)}
    assert "healthy, 2 replica(s)" in line[0] and "backups: 0" in line[0]
    assert "degraded, 1 replica(s)" in line[1] and "backups: 1 (round 7, 0 behind, " in line[1]
    assert line[1].endswith(" s old)")  # round 7 of stage 1 was seen agreed (c's record): its age is known
    assert "down, 0 replica(s)  (nobody)  backups: 2 (round 6" in line[2]  # never seen agreed: no age
    assert line[2].endswith("(round 6)")
    assert "NOT TRAINING: stage 2 is down" in format_swarm(swarm)[0]


def test_demo_keeps_each_replicas_newest_heldout_when_survivors_report_older_rounds():
    from p2pswarm.demo import newest

    seen = {"a": (3, 30.0, 4.5), "b": (2, 28.0, 4.9)}
    # the last-stage replica that took a's later rounds died: the survivor still reports a's round 0
    # (whose last part it finished late, after a's round 3 completed elsewhere)
    merged = newest(seen, {"a": (0, 31.0, 7.93), "b": (3, 35.0, 4.4), "c": (0, 36.0, 5.0)})
    assert merged == {"a": (3, 30.0, 4.5), "b": (3, 35.0, 4.4), "c": (0, 36.0, 5.0)}


def test_the_demo_curve_is_one_figure_per_outer_round_with_the_spread_between_chains(capsys):
    from p2pswarm.demo.progress import Progress, round_verdict

    progress = Progress()
    entry = {"tokens": 8192, "at": 0.0}
    progress.remember([  # two last-stage peers, one chain each; round 2 only partly agreed
        {**entry, "source": "a", "round": 0, "bpb": 7.93, "rounds": [0, 0], "chain": ["A", "X"]},
        {**entry, "source": "b", "round": 0, "bpb": 7.93, "rounds": [0, 0], "chain": ["B", "Y"]},
        {**entry, "source": "a", "round": 1, "bpb": 5.10, "rounds": [1, 1], "chain": ["A", "X"]},
        {**entry, "source": "b", "round": 1, "bpb": 5.14, "rounds": [1, 1], "chain": ["B", "Y"]},
        {**entry, "source": "b", "round": 2, "bpb": 4.90, "rounds": [2, 1], "chain": ["B", "Y"]},  # mixed: left out
        {**entry, "source": "a", "round": 2, "bpb": 4.60, "rounds": [2, 2], "chain": ["A", "X"]},
    ])
    progress.round_tokens.update({(0, 1): 40_000, (2, 1): 41_000, (0, 2): 80_000})
    curve = progress.curve()
    assert [(a.round, len(a.chains)) for a in curve] == [(0, 2), (1, 2), (2, 1)]
    assert curve[1].spread == pytest.approx(0.04) and progress.tokens_at(1) == 81_000 and progress.tokens_at(0) == 0
    lines = progress.new_round_lines()  # the newest round may still be missing chains: not shown yet
    assert len(lines) == 2 and "outer round 1: 5.120 bits/byte (81000 tokens" in lines[1] and "spread 0.040" in lines[1]
    assert progress.new_round_lines() == []
    assert round_verdict([(progress.tokens_at(a.round), a) for a in curve]) == 0
    assert "held-out loss 7.930 -> 4.600 bits/byte at outer round 2 after 121000 tokens" in capsys.readouterr().out


def test_the_demo_names_a_load_from_a_snapshot_and_a_rejoin_through_an_agreed_backup():
    """A rejoin through a replica's agreed backup has no inner step (the backup holds the round's start):
    the demo's line for it crashed the demo once (KeyError 'step') after a replica was left out of a round."""
    from p2pswarm.demo.procs import Peer
    from p2pswarm.demo.progress import _loaded_text

    peer = Peer(1, 0, "127.0.0.1:1", process=None)  # type: ignore[arg-type]
    snapshot = {"peer": "12D3KooWpeer0001", "round": 3, "step": 120, "bytes": 16_600_000, "seconds": 1.25}
    backup = {"peer": "12D3KooWpeer0002", "round": 4, "bytes": 5_500_000, "seconds": 2.5, "rebased": True}
    assert _loaded_text(peer, snapshot) == ("demo: peer 1 loaded stage 0 from peer0001: outer round 3, inner step "
                                            "120, 16.6 MB in 1.2 s")
    assert _loaded_text(peer, backup) == ("demo: peer 1 loaded stage 0 from peer0002: outer round 4 (its agreed "
                                          "backup), 5.5 MB in 2.5 s; its own progress kept (rebased)")
