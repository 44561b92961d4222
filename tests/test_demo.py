"""The demo as a newcomer runs it: quiet, exact, compared with vLLM's built-in path, says why
it failed, and leaves no temporary folder behind."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _demo(tmp_path, *args, **env):
    """Run the demo with its own temporary folder; its result and what it left in that folder."""
    scratch = tmp_path / f"tmp-{len(list(tmp_path.iterdir()))}"
    scratch.mkdir()
    command = [sys.executable, "examples/multiturn_demo.py", "--conversations", "2", "--turns", "2", "--max-tokens", "6", *args]
    done = subprocess.run(command, cwd=ROOT, env=dict(os.environ, TMPDIR=str(scratch), **env), capture_output=True, text=True, timeout=900)
    return done, sorted(p.name for p in scratch.iterdir())


def test_demo_reports_exact_rows_equal_to_the_builtin_path_quietly_and_cleans_up(tmp_path):
    done, left = _demo(tmp_path, "--compare-builtin")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "result                OK: every row exact" in done.stdout
    assert "vs vLLM built-in path identical tokens and rows" in done.stdout
    assert "worker connector      CacheWorkerConnector" in done.stdout
    # vLLM's own output went to the log file, not to the terminal.
    assert "WARNING" not in done.stdout + done.stderr and "Loading safetensors" not in done.stderr
    assert left == []


def test_demo_says_why_it_failed(tmp_path):
    workdir = tmp_path / "new" / "workdir"  # not there yet: the demo makes it (and keeps it)
    done, left = _demo(tmp_path, "--workdir", str(workdir), ROUTED_EXPERTS_CACHE="0")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "vLLM used AuxOutputWorkerConnector, not this cache" in done.stdout
    assert (workdir / "tiny-moe" / "config.json").exists() and (workdir / "vllm.log").exists()
    assert left == []
    done, left = _demo(tmp_path, ROUTED_EXPERTS_CACHE="maybe")
    assert done.returncode == 1
    assert "FAILED: RoutedExpertsCacheError: ROUTED_EXPERTS_CACHE='maybe' is not understood" in done.stdout
    assert left == []


def test_demo_refuses_counts_below_one_before_starting_anything(tmp_path):
    for flag in ("--turns", "--conversations", "--max-tokens"):
        done = subprocess.run([sys.executable, "examples/multiturn_demo.py", flag, "0"], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 2 and f"argument {flag}: must be at least 1, got 0" in done.stderr
