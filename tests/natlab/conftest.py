"""The NAT lab fixture; every test in this directory is marked ``natlab`` and ``integration``.

The whole directory skips, with the reason, where a lab cannot be built (not root, no ``ip netns``,
no nftables, ...). ``.ci/run`` installs the packages on CI.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from p2pswarm.testing.natlab import NatLab, lab_available

HERE = Path(__file__).parent


def pytest_configure(config):
    config.addinivalue_line("markers", "natlab: builds a NAT lab of network namespaces (root, nftables)")


def pytest_collection_modifyitems(config, items):
    ours = [item for item in items if HERE in Path(item.path).parents]
    if not ours:
        return
    reason = lab_available()
    for item in ours:
        item.add_marker(pytest.mark.natlab)
        item.add_marker(pytest.mark.integration)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def lab():
    with NatLab() as nat_lab:
        yield nat_lab
