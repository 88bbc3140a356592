"""Suite-wide test settings.

Hypothesis's per-example deadline is a timing assertion: on a loaded 2-core CI machine it
fails tests that are correct. Tests check behaviour; timings live in bench/.
"""

from hypothesis import HealthCheck, settings

settings.register_profile("p2pswarm", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("p2pswarm")
