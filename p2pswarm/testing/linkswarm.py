"""The demo's swarm on shaped links (``LinkLab``) or through a relay (``NatLab``), with its figures.

``run_link_arm`` starts one ``p2pswarm bootstrap`` on an unshaped host and a 2 stages x 2 replicas
``tiny-lm/2`` swarm of ``p2pswarm join`` peers, each on its own host shaped by a ``LinkProfile``
and with the flags ``p2pswarm demo`` gives its joins. ``run_relayed_arm`` starts two peers, stage 0
and stage 1, behind symmetric NATs (no hole punch can work), so every micro-batch crosses a relay.

``boundary`` (``q8``, ``q4``) trains a run file of ``tiny-lm/2`` with the demo's DiLoCo values
whose ``[wire]`` sends activations and gradients that way (``swarm/quant.py``) instead of dense;
``sKq4`` (``sK``, ``sKq8``) a model constrained to a subspace of K directions whose coordinates
travel that way (``model/subspace.py``).

Both wait until training runs (stage-0 tokens move), train for ``seconds``, and read each peer's
``GET /api/swarm`` at the start and the end of that window (the last stage's training loss too);
every CONTROL_PING_S of it they ping a stage-0 and a last-stage peer each way over the connection
training uses (the control plane's round trip while bulk fills the uplinks), and at the end they
read the peers' logs (``log_figures``).
Counters of ``delivery`` and ``counts`` are read generically (every numeric key, so new ones appear
without a change here) and summed per stage over the window; keys with ``_ms`` in their name are
latencies, reported at the window's end as the worst (max) of the stage's peers. Every process is
stopped by pid at the end.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from p2pswarm.demo import DEMO_GATHER_S, DEMO_INNER_STEPS, DEMO_OUTER_MOMENTUM, DEMO_SNAPSHOT_PERIOD, stop_all
from p2pswarm.model.catalog import ModelSpec, get_model
from p2pswarm.testing.labswarm import API, LabSwarm
from p2pswarm.testing.linklab import PROFILES, LinkLab, LinkProfile
from p2pswarm.testing.natlab import NatKind, NatLab

MODEL = "tiny-lm/2"
REPLICAS = 2  # per stage: 2 x 2 peers, as in the demo
FLOAT32_BYTES = 4  # activations and gradients travel as float32 (the default run's dtype, run.spec.DEFAULT_DTYPE)
WIRE_OVERHEAD = 1514 / 1448  # Ethernet + IP + TCP (timestamps) headers per full segment, what tbf counts
TRAIN_TIMEOUT = 180.0  # seconds from start-up until stage-0 tokens move (torch imports on 2 cores)
RELAY_TIMEOUT = 120.0  # PRIVATE verdict (~25 s) and a reservation round
POLL = 2.0  # each look starts one small python per peer: keep it light on 2 cores
API_TIMEOUT = 5.0  # a peer busy computing on a loaded 2-core machine answers late
COUNTER_SECTIONS = ("delivery", "counts")
CONTROL_PING_S = 10.0  # a control-plane ping each way this often during a window (control_pings)

Doc = dict  # one peer's GET /api/swarm
DocGetter = Callable[[str], Doc]  # peer name -> its /api/swarm JSON ({} when it does not answer)


def join_args(spec: ModelSpec, stage: int, boot_addr: str, peers: int, run: Path | None = None) -> list[str]:
    """``p2pswarm join`` arguments as ``p2pswarm demo`` gives them (listen, API, data dir aside); with
    ``run`` (a run file carrying the demo's DiLoCo values, ``boundary_run``) that run instead."""
    start, end = spec.stage_range(stage)
    trained = ["--run", str(run)] if run is not None else [
        "--model", spec.name, "--inner-steps", str(DEMO_INNER_STEPS), "--outer-momentum", str(DEMO_OUTER_MOMENTUM)]
    return ["join", "--bootstrap", boot_addr, *trained, "--layers", f"{start}:{end}",
            "--threads", str(max(1, (os.cpu_count() or 1) // peers)),  # the demo's share of the cores
            "--gather", str(DEMO_GATHER_S), "--snapshot-period", str(DEMO_SNAPSHOT_PERIOD)]


def parse_boundary(boundary: str) -> tuple[int, str]:
    """(subspace directions, encoding) of a boundary name: ``q8`` is (0, "q8"), ``s16q4`` (16, "q4"),
    ``s16`` (16, "dense"); ValueError for anything else."""
    match = re.fullmatch(r"(?:s(\d+))?(dense|q8|q4)?", boundary)
    if not boundary or match is None or (match[1] is None and match[2] is None):
        raise ValueError(f"a boundary is dense, q8, q4, sK, sKq8 or sKq4, not {boundary!r}")
    return int(match[1] or 0), match[2] or "dense"


def boundary_run(workdir: Path, boundary: str, eval_batches: int | None = None, outer: str = "") -> Path:
    """A run file: the default run on MODEL with the demo's DiLoCo values, ``boundary`` both ways (and
    ``eval_batches`` held-out micro-batches a round, where given; ``outer``: more [diloco] lines)."""
    subspace, encoding = parse_boundary(boundary)
    path = workdir / f"tiny-lm-{boundary}.toml"
    batch = "" if eval_batches is None else f"[batch]\neval_batches = {eval_batches}\n"
    path.write_text(f'''name = "tiny-lm-{boundary}"\nmodel = "{MODEL}"\n[diloco]\ninner_steps = {DEMO_INNER_STEPS}
momentum = {DEMO_OUTER_MOMENTUM}\n{outer}\n{batch}[wire]\nactivations = "{encoding}"\ngradients = "{encoding}"
subspace = {subspace}\n''')
    return path


def boundary_bytes(spec: ModelSpec, boundary: str = "dense") -> tuple[int, int]:
    """Payload bytes of one training micro-batch crossing a stage boundary: (forward, backward).

    A forward carries hidden states [rows, context, width] (float32, or quantized per token; a subspace
    model's K coordinates instead) plus one target byte per token (a subspace model's window: one more a
    row); the gradient coming back is the same tensor without targets."""
    from p2pswarm import wire
    from p2pswarm.swarm.service import BATCH_ROWS  # imports torch: only when figures are computed

    subspace, encoding = parse_boundary(boundary)
    tokens, width = BATCH_ROWS * spec.context, subspace or spec.width
    bits = wire.QUANTIZED_BITS.get(encoding)
    tensor = tokens * (wire.quantized_row_bytes(bits, width) if bits else width * FLOAT32_BYTES)
    return tensor + tokens + (BATCH_ROWS if subspace else 0), tensor


def link_bound_tok_s(spec: ModelSpec, profile: LinkProfile, replicas: int = REPLICAS,
                     boundary: str = "dense") -> float | None:
    """Tokens/s the links alone could carry for a two-stage swarm of REPLICAS peers per stage.

    A stage-0 peer sends forwards on its uplink and receives gradients on its downlink; a stage-1
    peer the opposite. Each side's limit is the slower of its two directions, times its peers;
    the swarm's is the lower side. None when the profile is unshaped."""
    if profile.up_mbit is None and profile.down_mbit is None:
        return None
    from p2pswarm.swarm.service import BATCH_ROWS  # imports torch: only when figures are computed

    forward, backward = boundary_bytes(spec, boundary)
    tokens = BATCH_ROWS * spec.context

    def rate(mbit: float | None, nbytes: int) -> float:
        return float("inf") if mbit is None else mbit * 1e6 / 8 / (nbytes * WIRE_OVERHEAD) * tokens

    first = min(rate(profile.up_mbit, forward), rate(profile.down_mbit, backward))
    last = min(rate(profile.down_mbit, forward), rate(profile.up_mbit, backward))
    return replicas * min(first, last)


def stage_sums(docs: dict[str, Doc], stages: dict[str, int], section: str) -> dict[int, dict[str, float]]:
    """Per stage, every numeric key of SECTION summed over its peers (``_ms`` keys: their max)."""
    out: dict[int, dict[str, float]] = {}
    for name, doc in docs.items():
        sums = out.setdefault(stages[name], {})
        for key, value in (doc.get(section) or {}).items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue  # nested (per-peer links, recent lists) and flags
            sums[key] = max(sums.get(key, value), value) if "_ms" in key else sums.get(key, 0) + value
    return out


def window(start: dict[str, Doc], end: dict[str, Doc], stages: dict[str, int], seconds: float) -> dict:
    """The figures of one window between two rounds of /api/swarm documents."""
    first = [name for name, stage in stages.items() if stage == 0]
    tokens = sum(end[n].get("tokens", 0) - start[n].get("tokens", 0) for n in first if n in start and n in end)
    figures: dict = {"seconds": round(seconds, 1), "tokens": tokens, "tokens_per_s": tokens / seconds}
    for section in COUNTER_SECTIONS:
        before, after = stage_sums(start, stages, section), stage_sums(end, stages, section)
        figures[section] = {
            stage: {k: v if "_ms" in k else v - before.get(stage, {}).get(k, 0) for k, v in sums.items()}
            for stage, sums in after.items()}
    figures["totals"] = {section: stage_sums(end, stages, section) for section in COUNTER_SECTIONS}  # since start
    figures["busy"] = {n: (d.get("engine") or {}).get("busy_fraction") for n, d in end.items()}  # since start
    figures["train_loss_bpb"] = {"start": mean_loss(start), "end": mean_loss(end)}
    return figures


def mean_loss(docs: dict[str, Doc]) -> float | None:
    """The last stage's training loss (bits/byte, an EMA) averaged over the peers that report one."""
    losses = [d["train_loss_bpb"] for d in docs.values() if d.get("train_loss_bpb") is not None]
    return sum(losses) / len(losses) if losses else None


HEALTH_REPORT = re.compile(r"stage \d+ is (?:degraded|down): [^\n]*\(was healthy")  # dht.health: a level fell


def log_figures(swarm: LabSwarm, names: list[str]) -> dict[str, int]:
    """What happened, from the peers' logs and backup services: a stage reported degraded or down after it
    was healthy (every peer being alive in these arms, each one is a false report), backups taken, backup
    fetches cut short (unreachable; resumed next)."""
    text = "\n".join(swarm.log_tail(name, 10**8) for name in names)
    backups = [swarm.get(name, "/api/backups", timeout=API_TIMEOUT) for name in names]
    return {"degraded_reports": len(HEALTH_REPORT.findall(text)),
            "backups_held": sum(int(b.get("taken", 0)) for b in backups),
            "backup_fetches_cut": sum(int((b.get("refused") or {}).get("unreachable", 0)) for b in backups)}


def check_alive(swarm: LabSwarm) -> None:
    for name, node in swarm.nodes.items():
        if node.process.poll() is not None:
            raise RuntimeError(f"{name} exited with code {node.process.returncode}: {swarm.log_tail(name, 800)}")


def snapshot(stages: dict[str, int], get_doc: DocGetter) -> tuple[float, dict[str, Doc]]:
    """Every peer's /api/swarm, asked at once: (the round's mid time, the docs of those that answered)."""
    began = time.monotonic()
    with ThreadPoolExecutor(len(stages)) as pool:
        docs = dict(zip(stages, pool.map(get_doc, stages)))
    return (began + time.monotonic()) / 2, {name: doc for name, doc in docs.items() if doc}


def measure(swarm: LabSwarm, stages: dict[str, int], get_doc: DocGetter, seconds: float) -> dict:
    """Wait (bounded) until stage-0 tokens move, then train SECONDS; the window's figures."""
    began = time.monotonic()
    first = [name for name, stage in stages.items() if stage == 0]
    while True:
        check_alive(swarm)
        t0, start = snapshot(stages, get_doc)
        started = len(start) == len(stages) and sum(start[n].get("tokens", 0) for n in first) > 0
        if started or t0 - began > TRAIN_TIMEOUT:  # never started: the window still runs and reports zeros
            break
        time.sleep(POLL)
    rtts: list[float | None] = []
    while time.monotonic() - t0 < seconds:
        check_alive(swarm)
        if len(rtts) < 2 * (time.monotonic() - t0) // CONTROL_PING_S + 2:
            rtts += control_pings(swarm, stages)
        time.sleep(min(POLL, max(0.0, seconds - (time.monotonic() - t0))))
    t1, end = snapshot(stages, get_doc)
    measured = sorted(r for r in rtts if r is not None)
    control = {"control_rtt_ms_p50": measured[len(measured) // 2] if measured else None,
               "control_rtt_ms_max": measured[-1] if measured else None, "control_pings": len(rtts),
               "control_pings_failed": len(rtts) - len(measured)}
    return {**window(start, end, stages, t1 - t0), **control, "training_started": started,
            "wait_s": round(t0 - began, 1)}


def control_pings(swarm: LabSwarm, stages: dict[str, int]) -> list[float | None]:
    """One ``/api/ping`` each way between a stage-0 and a last-stage peer on the connection training
    uses (fresh=0): the control plane's round trip while activations and gradients fill both uplinks;
    None for a ping that failed."""
    first = min(n for n, s in stages.items() if s == 0)
    last = min(n for n, s in stages.items() if s == max(stages.values()))
    rtts: list[float | None] = []
    for src, dst in ((first, last), (last, first)):
        if not swarm.nodes[dst].peer_id:
            swarm.stats(dst)
        reply = swarm.ping(src, dst, fresh=False) if swarm.nodes[dst].peer_id else {}
        rtts.append(reply.get("rtt_ms"))
    return rtts


@contextlib.contextmanager
def link_swarm(profile: LinkProfile | str, workdir: Path, boundary: str = "dense", *, lifetime: float,
               eval_batches: int | None = None,
               outer: str = "") -> Iterator[tuple[LabSwarm, dict[str, int], DocGetter]]:
    """The demo's 2 x 2 swarm with every join on a PROFILE line, alive for at most ``lifetime`` seconds:
    (the lab swarm, each peer's stage, a getter of a peer's /api/swarm). Every process is stopped and
    the lab torn down on exit."""
    profile = PROFILES[profile] if isinstance(profile, str) else profile
    spec = get_model(MODEL)
    workdir.mkdir(parents=True, exist_ok=True)
    run = boundary_run(workdir, boundary, eval_batches, outer)  # "dense" too: the packaged run's is not dense
    peers = spec.n_stages * REPLICAS
    with LinkLab() as lab:
        swarm = LabSwarm(lab, workdir, proc_timeout=lifetime)
        try:
            boot = swarm.start_public("boot", lab.host("boot"), ["bootstrap"])
            stages = {f"s{i % spec.n_stages}r{i // spec.n_stages}": i % spec.n_stages for i in range(peers)}
            for name, stage in stages.items():
                swarm.start(name, lab.profile_host(name, profile), join_args(spec, stage, boot.addr, peers, run))
            hosts = {name: swarm.nodes[name].host for name in stages}

            def get_doc(name: str) -> Doc:
                return lab.get(hosts[name], API, "/api/swarm", timeout=API_TIMEOUT) or {}

            yield swarm, stages, get_doc
        finally:
            stop_all([node.process for node in swarm.nodes.values()])


def run_link_arm(profile: LinkProfile | str, seconds: float, workdir: Path, boundary: str = "dense") -> dict:
    """The demo's 2 x 2 swarm with every join on a PROFILE line; figures of SECONDS of training."""
    profile = PROFILES[profile] if isinstance(profile, str) else profile
    began = time.monotonic()
    with link_swarm(profile, Path(workdir), boundary, lifetime=TRAIN_TIMEOUT + seconds + 120) as (swarm, stages, get):
        result = measure(swarm, stages, get, seconds)
        result.update(log_figures(swarm, list(stages)))
    return {"arm": profile.name, "up_mbit": profile.up_mbit, "down_mbit": profile.down_mbit,
            "delay_ms": profile.delay_ms, "boundary": boundary,
            "link_bound_tok_s": link_bound_tok_s(get_model(MODEL), profile, boundary=boundary), **result,
            "total_s": round(time.monotonic() - began, 1)}


def run_relayed_arm(seconds: float, workdir: Path) -> dict:
    """Stage 0 and stage 1 of tiny-lm/2, each behind a symmetric NAT: every byte goes through a relay
    (default relay limits); figures of SECONDS of training. The demo's run: the packaged boundary."""
    spec, began = get_model(MODEL), time.monotonic()
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    stages = {"sym0": 0, "sym1": 1}
    with NatLab() as lab:
        swarm = LabSwarm(lab, workdir, proc_timeout=RELAY_TIMEOUT + TRAIN_TIMEOUT + seconds + 120)
        try:
            boot = swarm.start_public("boot", lab.public_host("boot"), ["bootstrap"])
            relay = swarm.start_public("relay", lab.public_host("relay"), ["relay", "--bootstrap", boot.addr])
            for name, stage in stages.items():
                args = [*join_args(spec, stage, boot.addr, len(stages)), "--relay", relay.addr]
                swarm.start(name, lab.nat_host(name, NatKind.SYMMETRIC), args)
            ready = swarm.wait_relayed(list(stages), RELAY_TIMEOUT)
            relayed = all(d.get("circuit_addrs") for d in ready.values())
            result = measure(swarm, stages, lambda n: swarm.get(n, "/api/swarm", timeout=API_TIMEOUT), seconds)
            result.update(log_figures(swarm, list(stages)))
            relay_doc = swarm.stats("relay").get("relay", {})
        finally:
            stop_all([node.process for node in swarm.nodes.values()])
    return {"arm": "relayed", "up_mbit": None, "down_mbit": None, "link_bound_tok_s": None, "boundary": "packaged",
            "relay_reserved": relayed, "relay": relay_doc, **result, "total_s": round(time.monotonic() - began, 1)}
