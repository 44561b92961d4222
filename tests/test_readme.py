"""The README's cache example runs as written and does what its comments say."""

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_cache_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    example = next(b for b in blocks if "RoutedExpertsCache(" in b)
    done = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "'req-1' is unknown" in done.stdout and "[0, 1)" in done.stdout
    assert "'published': 1" in done.stdout and "'evictable': 1" in done.stdout
