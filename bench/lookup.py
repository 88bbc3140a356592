"""Stage lookup latency and success rate in a 32-node swarm, against py-libp2p's own DHT get.

Why: whenever a trainer builds or repairs its route it asks "who serves stage s?" (``StageIndex.lookup_stage``:
a Kademlia closest-peer search, then a record fetch from the 3 closest peers). This measures
how long that takes and how often it returns every peer that serves the stage, one lookup at
a time and 20 at a time. The baseline, on the same hosts in the same run, is py-libp2p's
``KadDHT.get_value`` for keys stored once with ``put_value``.

The whole swarm (1 bootstrap + 31 joiners) runs in ONE process on 2 cores, so all 32 nodes
share the one core a Python process can use, and every node's background traffic (announces
every 5 s, stage-map refreshes every 5 s, candidate checks of the neighbouring stages every 5 s)
competes with the lookups. At the shipped periods that
background alone needs several cores, so by default the benchmark stretches the node's periods
(and the record TTL) by TIME_DILATION = 32, the number of nodes per core: each node then
spends the same share of its CPU on background work as one node per core would.
``--time-dilation 1`` runs the shipped periods. Joiners start one at a time (``--start-batch``).
Latencies here are upper bounds for a real deployment with one node per machine.
Run: ``python bench/lookup.py`` (about 5 minutes on this machine: the swarm start, the waits for DHT
servers and maps, 400 lookups and the baseline).
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field
from functools import partial

import trio
from common import (
    LOOPBACK,
    machine_line,
    ms,
    percentile,
    print_table,
    quiet_logs,
    ratio,
)

from p2pswarm.dht.discovery import ANNOUNCE_PERIOD, RECORD_TTL, STAGE_MAP_PERIOD
from p2pswarm.model.catalog import get_model
from p2pswarm.node.config import NodeConfig, Role
from p2pswarm.node.running import run_node
from p2pswarm.run.spec import default_run
from p2pswarm.run.training import Training

MODEL = "tiny-lm"  # 8 layers in 4 stages of 2
TRAINING = Training.of(default_run().with_values(model=MODEL))  # the run whose records the swarm announces
JOINERS = 31  # + 1 bootstrap = 32 nodes
START_BATCH = 1  # joiners started together: with 4, hundreds of py-libp2p stream opens fail during
# the joins, py-libp2p evicts those peers from its routing tables, and some joiners end up with an
# empty table (see docs/benchmarks.md); one at a time, every table fills. --start-batch to vary.
LOOKUPS = 200  # per mode (one at a time, CONCURRENCY at a time)
CONCURRENCY = 20  # lookups in flight in the concurrent mode
K = 8  # records asked for; at most 8 joiners serve a stage, so k=8 can return them all
TIME_DILATION = 1 + JOINERS  # nodes sharing one core: background periods and TTL stretched by this
CONVERGE_TIMEOUT = 30.0  # the stage maps must be complete within this long (else: reported)
CONVERGE_POLL = 1.0
PROBE_NODES = 4  # complete = every stage's lookup from each of this many nodes finds every server
ANNOUNCE_BATCH = 8  # nodes re-announcing together after the swarm is up
KAD_NAMESPACE = "bench"
KAD_KEYS = 10  # keys stored with put_value; each lands on the 20 closest of the 32 nodes
KAD_GETS = 40  # get_value calls timed; each is much slower than a stage lookup
KAD_GET_TIMEOUT = 15.0  # the library's per-query timeout is 10 s
SEED = 1  # node/stage choices are reproducible


@dataclass
class Swarm:
    nodes: list = field(default_factory=list)  # NodeState of every node, bootstrap first
    servers: dict[int, set[str]] = field(default_factory=dict)  # stage -> peer ids serving it


@dataclass
class Sample:
    seconds: float
    ok: bool
    found: float = 0.0  # share of the stage's serving peers the lookup returned
    error: str = ""


# --- swarm -------------------------------------------------------------------------------


def joiner_config(boot_addr: str, index: int) -> NodeConfig:
    stage_range = get_model(MODEL).stage_range(index % get_model(MODEL).n_stages)
    return NodeConfig(role=Role.JOIN, listen=(LOOPBACK,), bootstrap=(boot_addr,), training=TRAINING,
                      layers=stage_range)


async def start_swarm(nursery: trio.Nursery, batch_size: int = START_BATCH) -> Swarm:
    swarm = Swarm()
    boot = await nursery.start(partial(run_node, NodeConfig(role=Role.BOOTSTRAP, listen=(LOOPBACK,),
                                                            training=TRAINING)))
    swarm.nodes.append(boot)
    boot_addr = boot.addrs()[0]

    async def start_joiner(index: int) -> None:
        state = await nursery.start(partial(run_node, joiner_config(boot_addr, index)))
        swarm.nodes.append(state)
        swarm.servers.setdefault(state.stage, set()).add(state.identity.peer_id_text)

    for first in range(0, JOINERS, batch_size):
        async with trio.open_nursery() as batch:
            for index in range(first, min(first + batch_size, JOINERS)):
                batch.start_soon(start_joiner, index)
    return swarm


def dilate_node_periods(factor: float) -> None:
    """Stretch the node's announce, stage-map and candidate-check periods and the record TTL (and
    its cap) in this process."""
    import p2pswarm.dht.candidates as candidates
    import p2pswarm.dht.records as records
    import p2pswarm.dht.stagemap as stagemap
    import p2pswarm.node.running as node

    stagemap.ANNOUNCE_PERIOD *= factor
    stagemap.STAGE_MAP_PERIOD *= factor
    stagemap.CHECK_PERIOD *= factor
    candidates.CHECK_PERIOD *= factor
    candidates.RETRY_AFTER *= factor
    candidates.ANSWER_FRESH *= factor
    node.RECORD_TTL *= factor
    records.MAX_TTL *= factor


async def announce_all(swarm: Swarm) -> None:
    """One announce round by every joiner, as a node's own loop does every ANNOUNCE_PERIOD.

    The first announces happened while the swarm was still growing, so they went to peers that
    were closest then; a round with everyone present puts each record where lookups now look.
    """
    async def announce(state, limiter: trio.CapacityLimiter) -> None:
        async with limiter:
            await state.index.announce(*state.signed_record(time.time()))

    limiter = trio.CapacityLimiter(ANNOUNCE_BATCH)
    async with trio.open_nursery() as nursery:
        for state in swarm.nodes[1:]:
            nursery.start_soon(announce, state, limiter)


async def wait_for_dht_servers(swarm: Swarm) -> float | None:
    """Seconds until every joiner is a DHT server (a PUBLIC verdict: records are stored only on
    servers, so the closest sets settle only then); None if some never became one."""
    started = time.perf_counter()
    with trio.move_on_after(CONVERGE_TIMEOUT):
        while not all(state.index.server for state in swarm.nodes):
            await trio.sleep(CONVERGE_POLL)
        return time.perf_counter() - started
    return None


async def maps_complete(swarm: Swarm) -> bool:
    for state in swarm.nodes[:PROBE_NODES]:
        for stage, peers in swarm.servers.items():
            records = await state.index.lookup_stage(MODEL, stage, k=K, run=state.run.identity)
            if {r.peer_id for r in records} != peers:
                return False
    return True


async def wait_for_stage_maps(swarm: Swarm) -> float | None:
    """Seconds until lookups from PROBE_NODES nodes find every server of every stage; None if never."""
    started = time.perf_counter()
    with trio.move_on_after(CONVERGE_TIMEOUT):
        while not await maps_complete(swarm):
            await trio.sleep(CONVERGE_POLL)
        return time.perf_counter() - started
    return None


def background_lookups(swarm: Swarm) -> int:
    return sum(state.index.stats.lookups for state in swarm.nodes)


# --- measurements ------------------------------------------------------------------------


async def one_lookup(swarm: Swarm, state, stage: int) -> Sample:
    started = time.perf_counter()
    try:
        records = await state.index.lookup_stage(MODEL, stage, k=K, run=state.run.identity)
    except Exception as exc:  # a failed lookup is a data point, not the end of the benchmark
        return Sample(time.perf_counter() - started, False, error=type(exc).__name__)
    found, servers = {r.peer_id for r in records}, swarm.servers[stage]
    return Sample(time.perf_counter() - started, found == servers, len(found & servers) / len(servers))


def draw_jobs(swarm: Swarm, rng: random.Random, count: int) -> list[tuple[object, int]]:
    """``count`` (random node, random stage) pairs."""
    return [(rng.choice(swarm.nodes), rng.randrange(get_model(MODEL).n_stages)) for _ in range(count)]


async def run_lookups(swarm: Swarm, jobs: list[tuple[object, int]],
                      concurrency: int) -> tuple[list[Sample], float, float]:
    """One lookup per (node, stage) job, ``concurrency`` at a time.

    Returns the samples, the wall time, and the share of one core the process used meanwhile.
    """
    samples: list[Sample] = []
    limiter = trio.CapacityLimiter(concurrency)

    async def run(state, stage: int) -> None:
        async with limiter:
            samples.append(await one_lookup(swarm, state, stage))

    started, cpu_started = time.perf_counter(), time.process_time()
    async with trio.open_nursery() as nursery:
        for state, stage in jobs:
            nursery.start_soon(run, state, stage)
    wall = time.perf_counter() - started
    return samples, wall, (time.process_time() - cpu_started) / wall


async def kad_put_keys(swarm: Swarm, rng: random.Random) -> tuple[dict[str, bytes], list[float]]:
    """Store KAD_KEYS values with put_value from random nodes; return them and the put times."""
    from libp2p.records.validator import BlankValidator

    for state in swarm.nodes:
        state.kad.register_validator(KAD_NAMESPACE, BlankValidator())
    values, put_times = {}, []
    for i in range(KAD_KEYS):
        key, value = f"/{KAD_NAMESPACE}/layer-key-{i}", f"value {i}".encode()
        started = time.perf_counter()
        await rng.choice(swarm.nodes).kad.put_value(key, value)
        put_times.append(time.perf_counter() - started)
        values[key] = value
    return values, put_times


async def kad_gets(swarm: Swarm, values: dict[str, bytes], rng: random.Random,
                   count: int) -> tuple[list[Sample], int]:
    """Time get_value on (node, key) pairs where the node does not hold the key locally.

    get_value answers from the local store (and caches what it fetched for 24 h), and put_value
    leaves a copy on 20 of the 32 nodes, so only the other pairs measure a network lookup.
    """
    samples: list[Sample] = []
    local_hits = 0
    pairs = [(state, key) for state in swarm.nodes for key in values]
    rng.shuffle(pairs)
    for state, key in pairs:
        if len(samples) >= count:
            break
        if state.kad.value_store.get(key.encode()) is not None:
            local_hits += 1
            continue
        started = time.perf_counter()
        with trio.move_on_after(KAD_GET_TIMEOUT):
            got = await state.kad.get_value(key)
        samples.append(Sample(time.perf_counter() - started, got == values[key], float(got == values[key])))
    return samples, local_hits


# --- report ------------------------------------------------------------------------------


def summary_row(name: str, samples: list[Sample], wall: float | None = None) -> list[str]:
    seconds = [s.seconds for s in samples]
    ok = sum(s.ok for s in samples)
    rate = f"{len(samples) / wall:,.0f}" if wall else "-"
    return [name, str(len(samples)), ms(percentile(seconds, 50)), ms(percentile(seconds, 95)),
            ms(max(seconds)), f"{100 * ok / len(samples):.1f}%",
            f"{100 * sum(s.found for s in samples) / len(samples):.0f}%", rate]


def errors_of(samples: list[Sample]) -> str:
    errors = {}
    for s in samples:
        if s.error:
            errors[s.error] = errors.get(s.error, 0) + 1
    return ", ".join(f"{name} x{count}" for name, count in errors.items()) or "none"


async def measure_swarm_start(nursery: trio.Nursery, args: argparse.Namespace, results: dict) -> Swarm:
    started = time.perf_counter()
    swarm = await start_swarm(nursery, args.start_batch)
    results["start_s"] = time.perf_counter() - started
    results["empty_tables"] = sum(state.kad.get_routing_table_size() == 0 for state in swarm.nodes)
    results["servers_s"] = await wait_for_dht_servers(swarm)
    if args.time_dilation > 1:  # with the shipped periods the nodes' own loops re-announce
        await announce_all(swarm)
    results["converge_s"] = await wait_for_stage_maps(swarm)
    results["replicas"] = {stage: len(peers) for stage, peers in sorted(swarm.servers.items())}
    return swarm


async def measure_lookups(swarm: Swarm, rng: random.Random, count: int, results: dict) -> None:
    before, started = background_lookups(swarm), time.perf_counter()
    jobs = draw_jobs(swarm, rng, count)
    results["sequential"] = await run_lookups(swarm, jobs, concurrency=1)
    results["concurrent"] = await run_lookups(swarm, draw_jobs(swarm, rng, count), concurrency=CONCURRENCY)
    background = background_lookups(swarm) - before - 2 * count  # minus our own lookups
    results["background_per_s"] = background / (time.perf_counter() - started)


async def measure(args: argparse.Namespace) -> dict:
    rng = random.Random(SEED)
    results: dict = {"dilation": args.time_dilation, "start_batch": args.start_batch}
    async with trio.open_nursery() as nursery:
        swarm = await measure_swarm_start(nursery, args, results)
        await measure_lookups(swarm, rng, args.lookups, results)
        if args.kad_gets:
            values, results["kad_puts"] = await kad_put_keys(swarm, rng)
            results["kad_gets"], results["kad_local_hits"] = await kad_gets(swarm, values, rng, args.kad_gets)
        nursery.cancel_scope.cancel()
    return results


def report_swarm(results: dict) -> None:
    converged = (f"stage maps complete after {results['converge_s']:.1f} s more"
                 if results["converge_s"] is not None else
                 f"stage maps still INCOMPLETE after {CONVERGE_TIMEOUT:.0f} s (measured anyway)")
    print(f"swarm: 1 bootstrap + {JOINERS} joiners in ONE process: all 32 nodes share one Python "
          f"process on 2 cores,\nso per-node CPU is far below a real deployment's. Started in "
          f"{results['start_s']:.1f} s; {converged}.")
    print(f"joiners started {results['start_batch']} at a time; nodes whose DHT routing table was empty "
          f"after the start: {results['empty_tables']} of {JOINERS + 1}")
    servers = results["servers_s"]
    print("every joiner a DHT server (PUBLIC) " + (f"{servers:.1f} s after the start" if servers is not None
                                                   else f"NOT within {CONVERGE_TIMEOUT:.0f} s"))
    dilation = results["dilation"]
    print(f"node periods x{dilation:g}: announce every {ANNOUNCE_PERIOD * dilation:g} s, stage-map "
          f"refresh every {STAGE_MAP_PERIOD * dilation:g} s, record TTL {RECORD_TTL * dilation:g} s")
    print(f"replicas per stage: {results['replicas']}")
    print(f"background: {results['background_per_s']:.1f} lookup_stage/s swarm-wide from stage-map "
          f"refreshes (plus announces); process CPU busy {100 * results['sequential'][2]:.0f}% of one "
          f"core during the sequential lookups, {100 * results['concurrent'][2]:.0f}% during the concurrent ones")


def report_kad(results: dict) -> None:
    puts = results["kad_puts"]
    print(f"KadDHT.put_value: {len(puts)} keys, p50 {ms(percentile(puts, 50))} ms; get_value pairs "
          f"skipped because the node held the key locally (answered from cache): {results['kad_local_hits']}")
    p50_ours = percentile([s.seconds for s in results["sequential"][0]], 50)
    p50_kad = percentile([s.seconds for s in results["kad_gets"]], 50)
    print(f"ratio lookup_stage p50 / KadDHT.get_value p50 (one at a time): {ratio(p50_ours, p50_kad)}")


def report(results: dict) -> None:
    report_swarm(results)
    (seq, seq_wall, _), (conc, conc_wall, _) = results["sequential"], results["concurrent"]
    rows = [summary_row("lookup_stage, one at a time", seq, seq_wall),
            summary_row(f"lookup_stage, {CONCURRENCY} at a time", conc, conc_wall)]
    if "kad_gets" in results:
        rows.append(summary_row("KadDHT.get_value, one at a time (baseline)", results["kad_gets"]))
    print_table(f"lookup latency, {MODEL}, k={K} (success = every serving peer returned; "
                f"servers found = mean share returned)",
                ["what", "n", "p50 ms", "p95 ms", "max ms", "success", "servers found", "per s"], rows)
    print(f"\nlookup errors: sequential {errors_of(seq)}; concurrent {errors_of(conc)}")
    if "kad_gets" in results:
        report_kad(results)
    else:
        print("KadDHT baseline skipped (--kad-gets 0)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-dilation", type=float, default=TIME_DILATION,
                        help=f"stretch node periods and TTL by this (default {TIME_DILATION}; 1 = shipped)")
    parser.add_argument("--start-batch", type=int, default=START_BATCH,
                        help=f"joiners started together (default {START_BATCH})")
    parser.add_argument("--lookups", type=int, default=LOOKUPS, help=f"per mode (default {LOOKUPS})")
    parser.add_argument("--kad-gets", type=int, default=KAD_GETS,
                        help=f"KadDHT.get_value baseline calls, 0 to skip (default {KAD_GETS})")
    args = parser.parse_args()
    dilate_node_periods(args.time_dilation)
    quiet_logs()
    print(machine_line())
    report(trio.run(measure, args))


if __name__ == "__main__":
    main()
