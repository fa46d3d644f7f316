"""The hypothesis budget CI promises: the default profile (``ci``) runs at least 1000 property-test
examples over the suite, derandomized (a red run reproduces), and ``deep`` ten times as many."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from hypothesis import settings

from conftest import PROFILE, PROFILES

ROOT = Path(__file__).resolve().parents[1]

# Collects the suite (no test runs, no rank starts) and prints every property test's max_examples.
_COUNT = textwrap.dedent("""
    import json, pytest

    class Count:
        examples = []

        def pytest_collection_finish(self, session):
            for item in session.items:
                fn = getattr(item, "obj", None)
                configured = getattr(fn, "_hypothesis_internal_use_settings", None)
                if configured is not None and hasattr(fn, "hypothesis"):
                    Count.examples.append(configured.max_examples)

    rc = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests"], plugins=[Count()])
    print("EXAMPLES " + json.dumps([int(rc), Count.examples]))
""")


def _configured_examples(profile):
    proc = subprocess.run([sys.executable, "-c", _COUNT], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, HYPOTHESIS_PROFILE=profile))
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("EXAMPLES ")]
    assert line, proc.stdout[-2000:] + proc.stderr[-2000:]
    rc, examples = json.loads(line[-1][len("EXAMPLES "):])
    assert rc == 0, proc.stdout[-2000:]
    return examples


def _session_examples(session):
    """The property tests' example counts of this very session, when it collected the whole suite under the ci
    profile (CI's run: no second collection needed), else None."""
    files = {Path(str(item.fspath)).name for item in session.items}
    every = {path.name for path in (ROOT / "tests").glob("test_*.py")}
    if PROFILE != "ci" or not every <= files:
        return None
    return [item.obj._hypothesis_internal_use_settings.max_examples for item in session.items
            if hasattr(getattr(item, "obj", None), "hypothesis")
            and getattr(item.obj, "_hypothesis_internal_use_settings", None) is not None]


def test_ci_profile_runs_at_least_1000_property_examples_and_deep_ten_times_that(request):
    """The ci profile's counts: from this session when it collected the whole suite under ci (CI), else from one
    collection in a subprocess (a run of this file alone). ``deep`` is ten times ``ci`` for every test that takes
    its count from ``examples(n)``; every property test must: checked in the sources (a literal count would not
    scale with the profile)."""
    ci = _session_examples(request.session)
    if ci is None:
        ci = _configured_examples("ci")
    assert len(ci) >= 20, len(ci)
    assert sum(ci) >= 1000, f"the ci profile configures {sum(ci)} property-test examples over {len(ci)} tests"
    literal = [f"{path.name}:{n}" for path in sorted((ROOT / "tests").glob("test_*.py"))
               for n, line in enumerate(path.read_text().splitlines(), 1)
               if "max_examples=" in line and "max_examples=examples(" not in line]
    assert not literal, f"property tests with a fixed example count (use max_examples=examples(n)): {literal}"
    assert PROFILES["deep"][0] == 10 * PROFILES["ci"][0]
    assert settings.get_profile("ci").derandomize and not settings.get_profile("deep").derandomize
