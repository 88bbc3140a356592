"""Suite-wide test settings.

Hypothesis's per-example deadline is a timing assertion: on a loaded 2-core CI machine it
fails tests that are correct. Tests check behaviour; timings live in bench/.

Two hypothesis profiles, chosen by the environment variable HYPOTHESIS_PROFILE:
- ``p2pswarm`` (the default, for local runs): explores new examples on every run and keeps
  the failures it finds in ``.hypothesis/`` to replay them.
- ``ci`` (``.ci/run`` exports HYPOTHESIS_PROFILE=ci): derandomized, so a CI run tests the same
  examples every time and its verdict depends on the code, not on luck; no example database.
"""

import os

import pytest
from hypothesis import HealthCheck, settings

PROFILE_VARIABLE = "HYPOTHESIS_PROFILE"  # the variable hypothesis users already know
DEFAULT_PROFILE = "p2pswarm"  # local runs keep exploring: that is how the rare bugs are found
SUPPRESSED = [HealthCheck.too_slow]  # "too slow" on a busy 2-core machine says nothing of the code

# Based explicitly on hypothesis's "default" profile: otherwise, with CI=true in the environment,
# hypothesis's own "ci" profile is the parent and the "exploring" profile would not explore.
settings.register_profile(DEFAULT_PROFILE, parent=settings.get_profile("default"), deadline=None,
                          suppress_health_check=SUPPRESSED)
settings.register_profile("ci", derandomize=True, database=None, print_blob=True, deadline=None,
                          suppress_health_check=SUPPRESSED)
settings.load_profile(os.environ.get(PROFILE_VARIABLE) or DEFAULT_PROFILE)


PROCESS_GROUP = "processes"  # pytest-xdist group: the tests that start swarms that train
LAB_GROUP = "labs"  # the namespace labs that start nodes but train nothing
TRAINING_LABS = ("test_shaped_training.py",)  # lab tests that train a swarm: with the processes


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the group marks into scopes
def pytest_collection_modifyitems(config, items):
    """Tests that start node processes (``integration``) run one after another on one xdist worker
    (``--dist loadgroup``): each swarm that trains already uses both cores. The namespace labs
    (``tests/natlab``) that train nothing run one after another on the other worker meanwhile, then
    the pure tests beside the swarms (each lab's namespaces are named by its pid, so labs on two
    workers never share a name). The swarms hold under that load (docs/benchmarks.md: the suite
    under ``stress-ng --cpu 1``)."""
    for item in items:  # (tests/natlab/conftest.py marks its tests ``integration`` only after this hook)
        lab = "natlab" in item.path.parts
        if lab and item.path.name not in TRAINING_LABS:
            item.add_marker(pytest.mark.xdist_group(LAB_GROUP))
        elif lab or item.get_closest_marker("integration"):
            item.add_marker(pytest.mark.xdist_group(PROCESS_GROUP))
