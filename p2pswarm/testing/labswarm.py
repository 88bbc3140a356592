"""Real p2pswarm processes in a NAT lab: start bootstrap, relay and join nodes, wait on their APIs.

The NAT lab tests and ``bench/nat_matrix.py`` build the same kind of swarm: a bootstrap node and
relays on the lab's internet, joining peers at home behind NAT routers, every node with its
status API on its own namespace's loopback. ``LabSwarm`` starts them (real ``p2pswarm``
processes, each under a time bound) and answers the questions the tests ask: is this peer
PRIVATE and reachable through a relay yet, does that peer see it in its stage map, and what
does ``/api/ping`` measure between two of them.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from p2pswarm.testing.natlab import LabHost, NamespaceLab, p2pswarm_argv, read_line

PORT = 4001
API = "127.0.0.1:8700"  # each node's API on its own namespace's loopback
ADDR_TIMEOUT = 20.0  # a node prints its addresses once listening (start-up imports included)
POLL = 0.5


@dataclass
class LabNode:
    name: str
    host: LabHost
    process: subprocess.Popen[str]
    addr: str = ""  # its multiaddr on the lab internet (bootstrap and relay nodes)
    peer_id: str = ""


@dataclass
class LabSwarm:
    lab: NamespaceLab  # a NatLab, or a LinkLab
    workdir: Path
    proc_timeout: float = 300.0  # no node outlives its test or benchmark
    nodes: dict[str, LabNode] = field(default_factory=dict)

    def start(self, name: str, host: LabHost, args: list[str]) -> LabNode:
        argv = p2pswarm_argv(*args, "--listen", f"/ip4/0.0.0.0/tcp/{PORT}", "--api", API,
                             "--data-dir", str(self.workdir / name))
        process = self.lab.run(host, argv, log_path=self.log_path(name), timeout=self.proc_timeout)
        node = self.nodes[name] = LabNode(name, host, process)
        return node

    def start_public(self, name: str, host: LabHost, args: list[str]) -> LabNode:
        """A bootstrap or relay node; its lab-internet multiaddr is read from its stdout."""
        node = self.start(name, host, args)
        lines = [read_line(node.process, ADDR_TIMEOUT).strip(), read_line(node.process, 5).strip()]
        node.addr = next((a for a in lines if f"/ip4/{host.ip}/" in a), "")
        if not node.addr:
            raise RuntimeError(f"{name} printed no address on {host.ip}: {lines}; log: {self.log_tail(name)}")
        node.peer_id = node.addr.rsplit("/p2p/", 1)[1]
        return node

    def log_path(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def log_tail(self, name: str, chars: int = 2000) -> str:
        try:
            return self.log_path(name).read_text()[-chars:]
        except OSError:
            return "(no log)"

    def stats(self, name: str) -> dict:
        doc = self.lab.node_get(self.nodes[name].host, API, "/api/stats") or {}
        if doc.get("peer_id"):
            self.nodes[name].peer_id = doc["peer_id"]
        return doc

    def get(self, name: str, path: str, timeout: float = 5.0) -> dict:
        return self.lab.node_get(self.nodes[name].host, API, path, timeout=timeout) or {}

    def wait_until(self, names: list[str], predicate, timeout: float) -> dict[str, dict]:
        """Poll the stats of ``names`` until ``predicate(stats)`` holds for each; the last stats."""
        deadline = time.monotonic() + timeout
        while True:
            current = {name: self.stats(name) for name in names}
            if all(predicate(doc) for doc in current.values()) or time.monotonic() > deadline:
                return current
            time.sleep(POLL)

    def wait_relayed(self, names: list[str], timeout: float) -> dict[str, dict]:
        """Until each of ``names`` is PRIVATE and advertises a /p2p-circuit address."""
        return self.wait_until(names, lambda d: d.get("reachability") == "private" and d.get("circuit_addrs"),
                               timeout)

    def circuit_in_stage_map(self, asker: str, target: str) -> bool:
        doc = self.get(asker, "/api/stages", timeout=10)
        records = [r for stage in doc.get("stages", {}).values() for r in stage["peers"]
                   if r["peer_id"] == self.nodes[target].peer_id]
        return any("/p2p-circuit" in a for r in records for a in r["addrs"])

    def wait_in_stage_map(self, asker: str, target: str, timeout: float) -> bool:
        """Until ``asker``'s stage map offers a /p2p-circuit address of ``target``."""
        deadline = time.monotonic() + timeout
        while not self.circuit_in_stage_map(asker, target):
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL)
        return True

    def ping(self, src: str, dst: str, nbytes: int = 0, *, fresh: bool = True, upgrade_wait: float = 0.0) -> dict:
        """``/api/ping`` from ``src`` to ``dst`` (by peer id: addresses from the stage map)."""
        query = f"peer={self.nodes[dst].peer_id}&bytes={nbytes}&fresh={int(fresh)}&upgrade_wait={upgrade_wait:g}"
        return self.get(src, f"/api/ping?{query}", timeout=90 + upgrade_wait)

    def stop(self, name: str) -> None:
        """End one node (a process this swarm started, by pid) and wait for it."""
        process = self.nodes[name].process
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:  # still running after SIGTERM: kill it
            process.kill()
            process.wait(timeout=5)
