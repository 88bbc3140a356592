"""Stage discovery between real processes on loopback: one ``p2pswarm bootstrap`` and five ``join``s.

One swarm serves the three tests (it starts once: six processes on two cores take most of a
test's time). Three peers serve stages 0, 1 and 3 of tiny-lm; a fourth joins with
``--layers auto`` once their records are in the DHT and must take stage 2, the one nobody serves;
a fifth serves stage 1 again as a ``--dht-mode client`` peer, which stores nothing itself yet
must be in every map and see them all. Every node's /api/stages must list every peer (within a
guard), and a node killed with SIGKILL must be in no stage map once its last record's TTL
(RECORD_TTL) has passed. The kill comes last: it is the only test that changes the swarm, and it
kills a peer whose stage another peer serves (the auto peer rebalances: a stage left empty would
draw it away).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import pytest

from p2pswarm.dht.discovery import RECORD_TTL
from tests.procs import Swarm, free_port, get_json, wait_until

pytestmark = pytest.mark.integration

SERVED = ["0:2", "2:4", "6:8"]  # tiny-lm: 4 stages of 2 layers; 4:6 is left for the --layers auto peer
AUTO_STAGE, AUTO_LAYERS = 2, [4, 6]
CLIENT_LAYERS = "2:4"  # the DHT client serves a stage another peer serves too
VICTIM = SERVED.index(CLIENT_LAYERS)  # the peer SIGKILLed: its stage stays served, by the DHT client
API_DEADLINE = 60.0  # seconds for a started peer's API to answer: a guard (six processes start on two cores)
CONVERGE_DEADLINE = 120.0  # seconds, a guard: converging takes 2-8 s on a quiet machine (docs/benchmarks.md);
#                           six training peers on two shared cores once took over 60 s (a full-suite failure)


@dataclass(frozen=True)
class DiscoverySwarm:
    nodes: list  # (process, api) of every join peer: the SERVED ones, the auto one, the DHT client
    auto_api: str
    client_api: str
    expected: set  # (peer id, start, end) of every join peer, read from each one's own /api/stats


def announced(stages_doc: dict | None) -> set[tuple[str, int, int]]:
    """(peer, start, end) of every record a node's /api/stages shows."""
    if not stages_doc:
        return set()
    return {(r["peer_id"], doc["start"], doc["end"]) for doc in stages_doc["stages"].values() for r in doc["peers"]}


def own_entry(api: str) -> tuple[str, int, int]:
    """(peer id, start, end) of the peer behind ``api``, once it answers with its layers."""
    stats = wait_until(lambda: (doc := get_json(api, "/api/stats")) and doc.get("layers") and doc, API_DEADLINE)
    assert stats, f"node {api} never answered its API with its layers"
    start, end = stats["layers"]
    return stats["peer_id"], start, end


@pytest.fixture(scope="module")
def discovery(tmp_path_factory):
    swarm = Swarm(tmp_path_factory.mktemp("discovery"))
    try:
        boot = swarm.bootstrap()
        served = [swarm.join(boot, layers, name=f"peer{i}") for i, layers in enumerate(SERVED)]
        for _, api in served:
            assert wait_until(lambda api=api: get_json(api, "/api/stages"), timeout=API_DEADLINE)
        assert wait_until(lambda: len(announced(get_json(served[-1][1], "/api/stages"))) == len(SERVED),
                          timeout=API_DEADLINE)
        auto = swarm.join(boot, "auto", name="auto")
        client_api = "127.0.0.1:" + str(free_port())
        client = swarm.start("join", "--bootstrap", boot, "--listen", "/ip4/127.0.0.1/tcp/0", "--layers",
                             CLIENT_LAYERS, "--dht-mode", "client", "--api", client_api, "--data-dir",
                             str(swarm.workdir / "client"), "--threads", "1", name="client")
        nodes = [*served, auto, (client, client_api)]
        expected = {own_entry(api) for _, api in nodes}
        yield DiscoverySwarm(nodes, auto[1], client_api, expected)
    finally:
        swarm.close()


def test_layers_auto_picks_the_unserved_stage(discovery):
    """Three stages of tiny-lm are served; a peer joining with --layers auto takes the fourth."""
    stats = wait_until(lambda: get_json(discovery.auto_api, "/api/stats"), timeout=API_DEADLINE)
    assert stats and stats["layers"] == AUTO_LAYERS and stats["stage"] == AUTO_STAGE, stats


def test_dht_client_peer_announces_and_reads_through_servers(discovery):
    """A --dht-mode client peer stores nothing itself, yet its record reaches every map and it sees all."""
    apis = [api for _, api in discovery.nodes]
    assert wait_until(lambda: all(announced(get_json(api, "/api/stages")) == discovery.expected for api in apis),
                      timeout=CONVERGE_DEADLINE), {api: announced(get_json(api, "/api/stages")) for api in apis}
    stats = get_json(discovery.client_api, "/api/stats")
    assert stats["dht_mode"] == "client" and stats["records_held"] == 0


def test_stage_map_converges_and_forgets_killed_peer(discovery):
    nodes, expected = discovery.nodes, discovery.expected
    apis = [api for _, api in nodes]

    def all_converged():
        return all(announced(get_json(api, "/api/stages")) == expected for api in apis)

    started = time.monotonic()
    # a deadline, not a timing: five training peers (each with a DiLoCo start-up) share two cores here
    assert wait_until(all_converged, timeout=CONVERGE_DEADLINE), \
        {api: announced(get_json(api, "/api/stages")) for api in apis}
    print(f"stage map converged on all {len(apis)} nodes after {time.monotonic() - started:.1f} s")

    # The victim serves stage 1, which the DHT client serves too: the auto peer (which rebalances)
    # sees no stage left unserved, so no survivor moves and every survivor's record stays as it was.
    victim, victim_api = nodes[VICTIM]
    victim_id = get_json(victim_api, "/api/stats")["peer_id"]
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    killed_at = time.time()  # wall-clock seconds: the clock records' timestamps and expiry use
    living = [node for node in nodes if node[0] is not victim]
    survivors = [api for _, api in living]
    remaining = {entry for entry in expected if entry[0] != victim_id}

    def views() -> dict[str, set | None]:
        """What each survivor's /api/stages shows (None: it did not answer)."""
        return {api: (None if (doc := get_json(api, "/api/stages")) is None else announced(doc)) for api in survivors}

    # The victim's last record was made before the kill, so it expires at most RECORD_TTL after it,
    # and a map never shows an expired record (it is filtered on every read, whatever the rebuilds
    # do). Waiting for that moment races nothing: it is when the guarantee starts, and from then on
    # no survivor may show the victim, in any answer.
    time.sleep(max(0.0, killed_at + RECORD_TTL - time.time()))
    for (process, api) in living:
        doc = wait_until(lambda api=api: get_json(api, "/api/stages"), timeout=API_DEADLINE)
        assert doc is not None, f"survivor {api} stopped answering after the kill (exit status {process.poll()})"
        shown = {entry for entry in announced(doc) if entry[0] == victim_id}
        assert not shown, f"{api} still shows the killed peer {time.time() - killed_at:.1f} s after the kill: {shown}"
    print(f"the killed peer was in no map {time.time() - killed_at:.1f} s after SIGKILL (RECORD_TTL {RECORD_TTL} s)")

    # and every survivor still shows every live peer (a guard: the same convergence as above)
    assert wait_until(lambda: all(view == remaining for view in views().values()), timeout=CONVERGE_DEADLINE), \
        {api: ("no answer" if view is None else {"missing": remaining - view, "extra": view - remaining})
         for api, view in views().items()}
    assert all(p.poll() is None for p, _ in living), "a surviving node died"
