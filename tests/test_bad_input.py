"""Bad input is refused by explicit checks, also under ``python -O`` (asserts stripped)."""

import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
SCRIPT = TESTS / "bad_input_checks.py"


@pytest.mark.parametrize("flags", [[], ["-O"]], ids=["plain", "optimized"])
def test_every_bad_call_raises_a_typed_error_and_changes_nothing(flags):
    done = subprocess.run([sys.executable, *flags, str(SCRIPT)], capture_output=True, text=True, timeout=300)
    optimize = 1 if flags else 0
    assert f"optimize={optimize} " in done.stdout, done.stdout + done.stderr
    assert done.returncode == 0 and "failures=0" in done.stdout, done.stdout + done.stderr


def test_the_input_property_tests_hold_under_python_O():
    """test_cache_inputs.py and the host tier's tests again with the library's asserts stripped
    (pytest keeps its own)."""
    done = subprocess.run(
        [sys.executable, "-O", "-m", "pytest", "-q", "-p", "no:cacheprovider", str(TESTS / "test_cache_inputs.py"),
         str(TESTS / "test_host_tier.py"), "-W", "ignore::pytest.PytestConfigWarning"],
        capture_output=True, text=True, timeout=900, cwd=TESTS.parent,
    )
    assert done.returncode == 0 and " passed" in done.stdout and "failed" not in done.stdout, done.stdout + done.stderr
