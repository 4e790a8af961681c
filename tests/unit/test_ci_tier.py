"""The CI tier's list of integration tests (tests/integration/ci_tier.py) names tests that exist."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_test_ci_runs_is_collected_and_every_other_one_is_in_the_full_tier():
    sys.path.insert(0, str(ROOT / "tests" / "integration"))
    try:
        from ci_tier import CI_TESTS
    finally:
        sys.path.pop(0)

    def collected(*marks: str) -> tuple[set[str], int]:
        """The integration tests collected (``file::test[params]``), and how many unit tests: the CI tier's
        command collects both folders at once (scripts/test.sh), so both are collected here."""
        done = subprocess.run([sys.executable, "-m", "pytest", "tests/integration", "tests/unit/test_args.py",
                               "--collect-only", "-q", "-p", "no:cacheprovider", *marks],
                              cwd=ROOT, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        ids = [line for line in done.stdout.splitlines() if "::" in line]
        return ({i.split("tests/integration/", 1)[1] for i in ids if i.startswith("tests/integration/")},
                sum(i.startswith("tests/unit/") for i in ids))

    (every, units), (ci, ci_units) = collected(), collected("-m", "not full")
    assert CI_TESTS - every == set()  # a renamed or removed test is named here, not silently dropped from CI
    assert ci == CI_TESTS
    assert len(every) > 2 * len(ci)
    assert ci_units == units > 1  # the list picks integration tests only: every unit test runs in CI
