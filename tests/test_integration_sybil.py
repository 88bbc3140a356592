"""No stranger steers the swarm (issue 25's probe), between real processes on loopback.

An honest peer serves stage 0 of tiny-lm/2. 16 fresh identities, each a real py-libp2p host,
store signed records claiming stage 1 (plausible free memory, throughput and outer round) at the
bootstrap node over the DHT's own store request, and refresh them every 10 s; their addresses
(TEST-NET-3) answer nothing. Before this issue an honest ``--layers auto`` joiner took stage 0,
stage 1 was shown healthy with 2 replicas (two fakes) and the swarm trained nothing. Now:

* the honest peer's map lists the fakes under stage 1 but counts no replica there: stage 1 is down;
* the joiner takes stage 1;
* micro-batches go through both stages (stage 0 gets gradients back), and the honest peer counts
  the joiner, and no fake, as stage 1's working replica.
"""

from __future__ import annotations

import threading
import time
from contextlib import AsyncExitStack

import pytest
import trio

from p2pswarm.dht.protocol import StoreRecord, StoreReply
from p2pswarm.dht.record_codec import sign_record
from p2pswarm.dht.records import FLAG_SNAPSHOT, FLAG_TRAINING, MAX_TTL, Capacity, StageRecord
from p2pswarm.identity import generate_identity
from p2pswarm.model.catalog import get_model
from p2pswarm.net.control import ControlService
from p2pswarm.net.host import connect, open_host, peer_info_from_multiaddr
from p2pswarm.testing.churn import LOOPBACK
from tests.procs import Swarm, get_json, small_batch_run, wait_until

pytestmark = pytest.mark.integration

MODEL = get_model("tiny-lm/2")
FAKES = 16
REFRESH_S = 10.0  # how often the attacker re-stores its records, as in the probe
DEADLINE = 120.0  # seconds, a guard for each wait: three processes and 16 hosts share two cores


def fake_record(identity, i: int, run: str) -> bytes:
    """A plausible stage-1 claim: a GPU-sized free memory, a CPU peer's throughput, a few outer rounds."""
    start, end = MODEL.stage_range(1)
    record = StageRecord(identity.peer_id_text, (f"/ip4/203.0.113.7/tcp/{4001 + i}",), MODEL.name, 1, start, end,
                         Capacity(24_000, 0, FLAG_TRAINING | FLAG_SNAPSHOT, 3000.0, 3), time.time(), MAX_TTL, run)
    return sign_record(record, identity)


async def store_fakes(boot: str, run: str, stop: threading.Event, accepted: list[int]) -> None:
    """16 hosts store their identity's record at ``boot`` every REFRESH_S until ``stop``."""
    target = peer_info_from_multiaddr(boot)
    identities = [generate_identity() for _ in range(FAKES)]
    async with AsyncExitStack() as stack:
        hosts = [await stack.enter_async_context(open_host(identity, LOOPBACK)) for identity in identities]
        async with trio.open_nursery() as nursery:
            controls = [ControlService(host, nursery) for host in hosts]
            for host in hosts:
                await connect(host, target)
            while not stop.is_set():
                replies = [await control.request(target.peer_id, StoreRecord(record=fake_record(identity, i, run)),
                                                 5.0, via_relay=False)
                           for i, (identity, control) in enumerate(zip(identities, controls))]
                accepted.append(sum(isinstance(r, StoreReply) and r.accepted for r in replies))
                next_at = trio.current_time() + REFRESH_S
                while not stop.is_set() and trio.current_time() < next_at:
                    await trio.sleep(0.2)
            nursery.cancel_scope.cancel()


def stage_doc(api: str, stage: int) -> dict | None:
    doc = get_json(api, "/api/stages")
    return doc["stages"].get(str(stage)) if doc else None


def test_sixteen_fake_identities_claiming_stage_1_do_not_stop_the_run(tmp_path):
    swarm, stop, accepted = Swarm(tmp_path), threading.Event(), []
    attacker = None
    try:
        run = small_batch_run(tmp_path, MODEL.name)
        boot = swarm.bootstrap()
        _, honest = swarm.join(boot, "0:4", "honest", *run)
        stats = wait_until(lambda: (doc := get_json(honest, "/api/stats")) and doc.get("layers") and doc, DEADLINE)
        assert stats, "the honest peer never served stage 0"
        attacker = threading.Thread(target=trio.run, args=(store_fakes, boot, stats["run"]["identity"], stop, accepted))
        attacker.start()
        assert wait_until(lambda: accepted, DEADLINE) and accepted[0] == FAKES, accepted

        fakes_listed = wait_until(lambda: (doc := stage_doc(honest, 1)) and len(doc["peers"]) >= 2 and doc, DEADLINE)
        assert fakes_listed, "the fake records never reached the honest peer's map"
        assert fakes_listed["replicas"] == 0 and fakes_listed["health"] == "down", fakes_listed
        assert not any(peer["working"] for peer in fakes_listed["peers"])

        started = time.monotonic()
        _, joiner = swarm.join(boot, "auto", "joiner", *run)
        joined = wait_until(lambda: (doc := get_json(joiner, "/api/stats")) and doc.get("layers") and doc, DEADLINE)
        assert joined and joined["stage"] == 1, joined

        def trained() -> bool:
            doc = get_json(honest, "/api/swarm") or {}
            return doc.get("counts", {}).get("micro_batches_done", 0) > 0
        assert wait_until(trained, DEADLINE), get_json(honest, "/api/swarm")
        print(f"{len(fakes_listed['peers'])} stage-1 records listed at the honest peer, {fakes_listed['replicas']} "
              f"counted; the joiner took stage {joined['stage']} and stage 0 had a gradient back "
              f"{time.monotonic() - started:.1f} s after the joiner started")
        served = wait_until(lambda: (doc := stage_doc(honest, 1)) and doc["replicas"] >= 1 and doc, DEADLINE)
        assert served, stage_doc(honest, 1)
        working = {peer["peer_id"] for peer in served["peers"] if peer["working"]}
        assert working == {joined["peer_id"]}, served
        refreshes = len(accepted)  # the attack goes on: after its next refresh, still no fake counts
        assert wait_until(lambda: len(accepted) > refreshes, DEADLINE) and all(n == FAKES for n in accepted), accepted
        after = stage_doc(honest, 1)
        assert after and {peer["peer_id"] for peer in after["peers"] if peer["working"]} <= {joined["peer_id"]}, after
    finally:
        stop.set()
        if attacker is not None:
            attacker.join(timeout=30)
        swarm.close()
