"""scripts/mutate.py, the mutation run: it runs the test command against each mutant, names the
ones it misses, and leaves the file as it found it."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "mutate.py"
MODULE = '''def shift(value, low):
    """Error messages and docstrings are left alone: 0 < 1."""
    if value < low:
        value = low
    return value + 1
'''


def mutation_run(tmp_path: Path, check: str, *options: str) -> list[str]:
    (tmp_path / "target.py").write_text(MODULE)
    command = [sys.executable, "-c", f"import target; assert {check}"]
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "target.py", "10", *options, "--", *command],
        cwd=tmp_path, capture_output=True, text=True, check=True,
    )
    assert (tmp_path / "target.py").read_text() == MODULE
    return result.stdout.splitlines()


def test_each_mutant_runs_the_tests_and_only_the_equivalent_one_survives_a_test_of_every_branch(tmp_path):
    lines = mutation_run(tmp_path, "target.shift(-1, 0) == 1 and target.shift(5, 0) == 6 and target.shift(0, 0) == 1")
    mutants = {(m["before"], m["after"]): m["caught"] for m in map(json.loads, lines[:-1])}
    assert mutants == {
        ("value < low", "value <= low"): False,  # equivalent: at value == low both give low
        ("value = low", "pass"): True,
        ("value + 1", "value - 1"): True,
        ("1", "2"): True,
    }
    assert lines[-1] == "survived: 1 of 4 (sites: 4)"


def test_a_test_that_checks_nothing_lets_every_mutant_survive_and_only_limits_the_functions(tmp_path):
    assert mutation_run(tmp_path, "True")[-1] == "survived: 4 of 4 (sites: 4)"
    assert mutation_run(tmp_path, "True", "--only", "other")[-1] == "survived: 0 of 0 (sites: 0)"
