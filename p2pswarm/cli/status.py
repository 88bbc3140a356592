"""``p2pswarm status`` and ``p2pswarm ping``: ask a running node's API and print what it says."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import urllib.error
import urllib.parse
import urllib.request

from p2pswarm.api.client import API_TIMEOUT, get_json
from p2pswarm.net.probe import PROBE_TIMEOUT

log = logging.getLogger("p2pswarm")


def _stage(stats: dict) -> str:
    layers = stats.get("layers")
    return f"{stats['stage']} (layers [{layers[0]}, {layers[1]}))" if layers else "none"


def _stun(stats: dict) -> str:
    stun = stats.get("stun")
    if not stun:
        return "not asked"
    public = stun["public"] or "no public address"
    return f"{stun['nat_type']}, {public}"


def _inbound(stats: dict) -> str:
    inbound = stats.get("inbound_connections")
    if not inbound:
        return ""
    return (f"   inbound {inbound['open']}/{inbound['limit']} open, {inbound['accepted']} accepted, "
            f"{inbound['refused']} refused at the limit")


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def format_swarm(swarm: dict) -> list[str]:
    """The training lines of ``status``, from ``/api/swarm``."""
    engine, delivery, counts = swarm["engine"], swarm["delivery"], swarm["counts"]
    return [
        f"training      step {swarm['step']}  {swarm['tokens']} tokens  {swarm['tokens_per_s']:.0f} tok/s  "
        f"held-out {_fmt(swarm['heldout_bpb'])} bits/byte  train {_fmt(swarm['train_loss_bpb'])}"
        f"{'  NOT TRAINING: ' + swarm['blocked'] if swarm.get('blocked') else ''}",
        f"engine        busy {engine['busy_fraction']:.1%}  local-only {engine['local_only']}  drops "
        f"{engine['drops']}  in flight {swarm['in_flight']}  inbound {swarm['inbound']['items']}/"
        f"{swarm['inbound']['capacity']} (mean fill {swarm['inbound']['mean_fill']:.1%})",
        f"delivery      sent {delivery.get('sent', 0)}  acked {delivery.get('acked', 0)}  "
        f"busy {delivery.get('busy', 0)}"
        f"  failovers {delivery.get('rerouted', 0)} (p50 {_fmt(delivery.get('failover_ms_p50'), '.0f')} ms)  lost "
        f"{delivery.get('lost', 0)}  timeouts {delivery.get('timeouts', 0)}  duplicates dropped "
        f"{counts.get('duplicates_dropped', 0)}  ack p50/p99 {_fmt(delivery.get('ack_ms_p50'), '.0f')}/"
        f"{_fmt(delivery.get('ack_ms_p99'), '.0f')} ms  garbage frames {counts.get('garbage_frames', 0)}",
        *(_link_line(peer, doc) for peer, doc in swarm["router"]["peers"].items()),
    ]


def _link_line(peer: str, doc: dict) -> str:
    """One next-stage peer as the router sees it: path, deadline in force, throughput, window."""
    rate = doc.get("throughput_mbit_s")
    slow = f"  SLOW: {doc['slow']}" if doc.get("slow") else ""
    return (f"  -> {peer[-8:]}  stage {doc['stage']}  {'relayed' if doc['relayed'] else 'direct'}"
            f"{'' if doc['live'] else ' (backed off)'}  deadline {_fmt(doc.get('deadline_ms'), '.0f')} ms  "
            f"throughput {'-' if rate is None else f'{rate:.1f} Mbit/s'}  window {doc.get('window', 0):.1f} "
            f"({doc.get('on_the_way', 0)} on the way){slow}")


def format_diloco(doc: dict) -> list[str]:
    """The DiLoCo lines of ``status``, from ``/api/diloco``."""
    last = doc.get("last_round")
    rejected = sum(doc.get("rejected_contributions", {}).values())
    lines = [f"diloco        outer round {doc['outer_round']} ({doc['phase']})  inner step "
             f"{doc['inner_steps_this_round']}/{doc['inner_steps_per_round']} of this round  sent "
             f"{doc['bytes_sent'] / 1e6:.1f} MB  received {doc['bytes_received'] / 1e6:.1f} MB  rejected {rejected}  "
             f"communicating {doc['communicating_s']:.0f} s / computing {doc['computing_s']:.0f} s"]
    if last:
        lines.append(f"last round    {last['round']}: {len(last['members'])} replica(s) "
                     f"({', '.join(m[-8:] for m in last['members'])}), {last['seconds']:.1f} s, "
                     f"{len(last['missing_shards'])} shard(s) missing")
    if doc.get("loaded_from"):
        source = doc["loaded_from"].get("peer") or doc["loaded_from"].get("file")
        lines.append(f"loaded from   {source[-40:]} (outer round {doc['loaded_from']['round']})")
    return lines


def format_status(stats: dict, stages: dict, swarm: dict | None = None, diloco: dict | None = None) -> str:
    lines = [
        f"peer          {stats['peer_id']}  ({stats['role']}, p2pswarm {stats['version']})",
        f"addresses     {', '.join(stats['addrs']) or '-'}",
        f"reachability  {stats['reachability']}   DHT mode {stats['dht_mode']}   NAT (STUN) {_stun(stats)}",
        f"connected     {len(stats['connected_peers'])} peer(s)   routing table {stats['routing_table_size']}"
        f"{_inbound(stats)}",
        f"serving       {stats['model']} stage {_stage(stats)}   uptime {stats['uptime_s']:.0f} s",
        f"stage map     {stages['model']}, {stages['n_layers']} layers in {stages['n_stages']} stages",
    ]
    relay = stats.get("relay")
    if relay:
        refused = ", ".join(f"{reason} {n}" for reason, n in sorted(relay["refused"].items())) or "none"
        lines.insert(5, f"relay         {relay['reservations_active']} reservation(s), "
                        f"{relay['circuits_active']} circuit(s) active; refused: {refused}")
    if stats.get("relays"):
        held = ", ".join(f"{r['peer'][-8:]} ({r['expires_in_s']:.0f} s)" for r in stats["relays"])
        lines.insert(5, f"relays        {held}; {len(stats.get('circuit_addrs', []))} circuit address(es)")
    blocked = stages.get("health", {}).get("blocked")
    if blocked:
        lines.append(f"blocked:      {blocked}")
    for stage, doc in stages["stages"].items():
        peers = ", ".join(f"{r['peer_id'][-8:]} (queue {r['queue_depth']}{', answered' if r.get('answered') else ''})"
                          for r in doc["peers"]) or "(nobody)"
        served = f"{doc['health']}, {doc['replicas']} replica(s)" if "health" in doc else f"{len(doc['peers'])} peer(s)"
        lines.append(f"  stage {int(stage):>3}  layers [{doc['start']}, {doc['end']})  "
                     f"{served}  {peers}{_backups(doc)}")
    if swarm:
        lines[5:5] = format_swarm(swarm) + (format_diloco(diloco) if diloco else [])
    return "\n".join(lines)


def _backups(stage: dict) -> str:
    """A stage's backup holders, the freshest first: "  backups: 2 (round 7, 0 behind, 40 s old)"."""
    if "backups" not in stage:  # a node from before backups
        return ""
    backups = stage["backups"]
    if not backups:
        return "  backups: 0"
    best = backups[0]
    behind = "" if best["rounds_behind"] is None else f", {best['rounds_behind']} behind"
    age = "" if best["age_s"] is None else f", {best['age_s']:.0f} s old"
    return f"  backups: {len(backups)} (round {best['round']}{behind}{age})"


def cmd_status(args: argparse.Namespace) -> int:
    get = functools.partial(get_json, args.api, token=args.api_token)
    stats, stages = get("/api/stats"), get("/api/stages")
    joined = stats.get("role") == "join"
    swarm = get("/api/swarm") if joined else None
    diloco = get("/api/diloco") if joined else None
    if args.json:
        print(json.dumps({"stats": stats, "stages": stages, "swarm": swarm, "diloco": diloco}, indent=1,
                         sort_keys=True))
    else:
        print(format_status(stats, stages, swarm, diloco))
    return 0


def format_ping(doc: dict) -> str:
    rate = f", {doc['mib_per_s']} MiB/s" if doc["mib_per_s"] is not None else ""
    return (f"{doc['peer']}: reached by {doc['method']} in {doc['connect_ms']} ms, round trip {doc['rtt_ms']} ms, "
            f"first byte after {doc['first_byte_ms']} ms; {doc['bytes']} bytes in {doc['transfer_ms']} ms{rate}; "
            f"path now {doc['path']}")


def cmd_ping(args: argparse.Namespace) -> int:
    query = urllib.parse.urlencode({"peer": args.peer, "bytes": args.bytes})
    doc = get_json(args.api, f"/api/ping?{query}", timeout=PROBE_TIMEOUT + API_TIMEOUT, token=args.api_token)
    print(json.dumps(doc, indent=1, sort_keys=True) if args.json else format_ping(doc))
    return 0
