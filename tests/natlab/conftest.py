"""The NAT lab fixture; every test in this directory is marked ``natlab`` and ``integration``.

The whole directory skips, with the reason, where a lab cannot be built (not root, no ``ip netns``,
no nftables, ...). ``.ci/run`` installs the packages on CI. The labs' joins are forked into their
namespaces (``tests.forked.spawn_in_namespace``); bootstrap and relay nodes start as ``python -m p2pswarm``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from p2pswarm.testing.natlab import NamespaceLab, NatLab, lab_available
from tests.forked import spawn_in_namespace

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


@pytest.fixture(autouse=True)
def forked_joins():
    """The labs' joins (the fixture's and ``linkswarm``'s own) are forked from the tests' fork server."""
    NamespaceLab.spawner = spawn_in_namespace
    yield
    NamespaceLab.spawner = None


@pytest.fixture
def lab():
    with NatLab() as nat_lab:
        yield nat_lab
