"""Shared test set-up: hypothesis profiles and the persistent rank worlds.

Tests call ``tplayers.testing.get_world(n).run(fn, ...)`` with a module-level ``fn(group, ...)``;
the worlds of 1, 2 and 4 ranks are started once per session and rebuilt after a failure.
"""
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tplayers import testing
from tplayers.testing import shutdown_worlds

# Ranks are forked from a server that has these imported already: a world rebuilt after a
# failing hypothesis example is back in a fraction of a second.
testing.FORKSERVER_PRELOAD.extend(["pytest", "hypothesis", "einops"])

# Cross-process calls take milliseconds to seconds: no per-example deadline. Each property test
# states its base example count with examples(n); the profile scales it:
#   ci (the default, what CI runs)  x5, derandomized: a red run reproduces; ~1200 examples in all
#   explore                         x5, a new random draw every run
#   dev                             x1, randomized: quick local iterations
#   deep                            x50 (10x ci), randomized: an occasional long local run
PROFILES = {"ci": (5, True), "explore": (5, False), "dev": (1, False), "deep": (50, False)}
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
if PROFILE not in PROFILES:
    raise pytest.UsageError(f"HYPOTHESIS_PROFILE={PROFILE!r}: choose one of {sorted(PROFILES)}")
for _name, (_scale, _derandomize) in PROFILES.items():
    settings.register_profile(_name, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True,
                              derandomize=_derandomize)
settings.load_profile(PROFILE)


def examples(base: int) -> int:
    """The example count of a property test whose base count is ``base``, under the active profile."""
    return base * PROFILES[PROFILE][0]


@pytest.fixture(scope="session", autouse=True)
def _stop_worlds():
    yield
    shutdown_worlds()


ROOT = Path(__file__).resolve().parents[1]  # the checkout: `python -m tplayers` subprocesses run from here


def subprocess_env() -> dict:
    """The environment of a ``python -m tplayers`` subprocess: this checkout first on PYTHONPATH, and
    none of torchrun's variables (the command would take them for a launcher's)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(var, None)
    return env
