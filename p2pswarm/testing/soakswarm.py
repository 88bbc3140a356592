"""The processes of a chaos soak (``bench/soak.py``): a local swarm on loopback, or in the link lab with
each join on its own shaped line, started, read and ended by name.

Both clusters answer the same few questions: start a node (a bootstrap's address comes back), the pid
of the node itself (to SIGKILL, SIGSTOP and read /proc), whether it has ended, and its ``PATHS``
documents in one look. Every process is stopped by pid on ``close``; the lab is torn down.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from p2pswarm.demo import free_port, get_json, stop_all
from p2pswarm.testing.labswarm import API, PORT
from p2pswarm.testing.linklab import PROFILES, LinkHost, LinkLab
from p2pswarm.testing.natlab import p2pswarm_argv, read_line

PATHS = ("/api/swarm", "/api/diloco")
MULTI_GET = """import json, sys, urllib.request
out = {}
for path in sys.argv[3:]:
    try:
        with urllib.request.urlopen(sys.argv[1] + path, timeout=float(sys.argv[2])) as r: out[path] = json.load(r)
    except Exception: out[path] = {}
print(json.dumps(out))
"""


class LoopbackCluster:
    """Nodes as plain processes on loopback."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: dict[str, subprocess.Popen] = {}
        self.apis: dict[str, str] = {}

    def start(self, name: str, args: list[str], log: Path, public: bool = False) -> str:
        api = self.apis.setdefault(name, f"127.0.0.1:{free_port()}")
        argv = [*p2pswarm_argv(*args), "--listen", "/ip4/127.0.0.1/tcp/0", "--api", api,
                "--data-dir", str(self.workdir / name)]
        with open(log, "w") as stderr:
            self.procs[name] = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr,
                                                stdin=subprocess.DEVNULL, text=True)
        return read_line(self.procs[name], 30).strip() if public else ""

    def pid(self, name: str) -> int:
        return self.procs[name].pid

    def ended(self, name: str) -> int | None:
        return self.procs[name].poll()

    def get(self, name: str) -> dict:
        return {path: get_json(self.apis[name], path) for path in PATHS}

    def close(self) -> None:
        stop_all(list(self.procs.values()))


class LabCluster:
    """Nodes on shaped lines of a link lab: the bootstrap unshaped, each join on a PROFILE line."""

    def __init__(self, workdir: Path, profile: str, lifetime: float) -> None:
        self.workdir, self.profile, self.lifetime = workdir, PROFILES[profile], lifetime
        self.lab = LinkLab().__enter__()
        self.hosts: dict[str, LinkHost] = {}
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, args: list[str], log: Path, public: bool = False) -> str:
        if name not in self.hosts:
            self.hosts[name] = (self.lab.host(name) if public else self.lab.profile_host(name, self.profile))
        argv = p2pswarm_argv(*args, "--listen", f"/ip4/0.0.0.0/tcp/{PORT}", "--api", API,
                             "--data-dir", str(self.workdir / name))
        self.procs[name] = self.lab.run(self.hosts[name], argv, log_path=log, timeout=self.lifetime)
        if not public:
            return ""
        lines = [read_line(self.procs[name], 30).strip(), read_line(self.procs[name], 5).strip()]
        return next(a for a in lines if f"/ip4/{self.hosts[name].ip}/" in a)

    def pid(self, name: str) -> int:
        """The node itself: the child of the ``timeout`` the lab runs it under."""
        wrapper = self.procs[name].pid
        children = Path(f"/proc/{wrapper}/task/{wrapper}/children").read_text().split()
        return int(children[0]) if children else wrapper

    def ended(self, name: str) -> int | None:
        return self.procs[name].poll()

    def get(self, name: str) -> dict:
        argv = [sys.executable, "-c", MULTI_GET, f"http://{API}", "5", *PATHS]
        try:
            return json.loads(self.lab.exec(self.hosts[name], argv, timeout=20).stdout)
        except (subprocess.SubprocessError, ValueError):
            return {}

    def close(self) -> None:
        stop_all(list(self.procs.values()))
        self.lab.__exit__(None, None, None)
