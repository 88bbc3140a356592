"""The link lab shapes for real: a bulk TCP transfer out of a host on a 20 Mbit/s uplink runs at
about 20 Mbit/s, and no lab namespace outlives the lab."""

from __future__ import annotations

import json

import pytest

from p2pswarm.testing.linklab import LinkLab, link_lab_available
from p2pswarm.testing.natlab import netns_names, read_line

pytestmark = pytest.mark.timeout(30)

UP_MBIT = 20
PORT = 5001
NBYTES = 6_000_000  # ~2.4 s at 20 Mbit/s: long enough that the 64 KiB burst is noise
STARTUP_TIMEOUT = 10.0
TRANSFER_TIMEOUT = 15.0  # 3x the time at half the shaped rate

# Prints "ready", takes one connection, then {"bytes", "seconds"} from its first byte to its last.
RECEIVER = f"""import json, socket, time
server = socket.create_server(("0.0.0.0", {PORT}))
print("ready", flush=True)
conn, _ = server.accept()
total, first, last = 0, None, None
while chunk := conn.recv(1 << 16):
    last = time.monotonic()
    first = first or last
    total += len(chunk)
print(json.dumps({{"bytes": total, "seconds": last - first}}), flush=True)
"""

SENDER = """import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10) as s:
    s.sendall(bytes(int(sys.argv[3])))
"""


@pytest.fixture(autouse=True)
def _needs_link_lab():
    reason = link_lab_available()
    if reason:
        pytest.skip(reason)


def test_a_bulk_transfer_runs_at_the_shaped_uplink_rate_and_teardown_leaves_nothing():
    with LinkLab() as lab:  # torn down before the last assertion
        sender, receiver = lab.host("sender", up_mbit=UP_MBIT), lab.host("receiver")
        namespaces = list(lab.namespaces)
        server = lab.run(receiver, ["python3", "-c", RECEIVER], timeout=TRANSFER_TIMEOUT + STARTUP_TIMEOUT)
        assert read_line(server, STARTUP_TIMEOUT).strip() == "ready"
        lab.exec(sender, ["python3", "-c", SENDER, receiver.ip, str(PORT), str(NBYTES)], timeout=TRANSFER_TIMEOUT)
        result = json.loads(read_line(server, STARTUP_TIMEOUT))
    mbit = result["bytes"] * 8 / result["seconds"] / 1e6
    print(f"{result['bytes']} bytes in {result['seconds']:.2f} s: {mbit:.1f} Mbit/s through a {UP_MBIT} Mbit/s uplink")
    assert result["bytes"] == NBYTES
    assert 0.5 * UP_MBIT < mbit < 1.3 * UP_MBIT
    assert len(namespaces) == 3 and not set(namespaces) & set(netns_names())
