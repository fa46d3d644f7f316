"""Shared test set-up: hypothesis profiles and the persistent rank worlds.

Tests call ``tplayers.testing.get_world(n).run(fn, ...)`` with a module-level ``fn(group, ...)``;
the worlds of 1, 2 and 4 ranks are started once per session and rebuilt after a failure.
"""
import os

import pytest
from hypothesis import HealthCheck, settings

from tplayers import testing
from tplayers.testing import shutdown_worlds

# Ranks are forked from a server that has these imported already: a world rebuilt after a
# failing hypothesis example is back in a fraction of a second.
testing.FORKSERVER_PRELOAD.extend(["pytest", "hypothesis", "einops"])

# Cross-process calls take milliseconds to seconds: no per-example deadline. Example counts are
# set per test. CI is derandomized so a red run reproduces; locally every run explores anew.
settings.register_profile(
    "default", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.register_profile(
    "ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True, derandomize=True
)
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(scope="session", autouse=True)
def _stop_worlds():
    yield
    shutdown_worlds()
