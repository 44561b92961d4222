"""The distribution a user installs: a wheel with license, metadata and type marker, and the
top-level import the README shows."""

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import routed_experts_cache

ROOT = Path(__file__).resolve().parents[1]
# Where each part of the installed package lives in this repository (setup.py's package_dir).
SOURCES = {"routed_experts_cache": ROOT / "src/routed_experts_cache", "routed_experts_cache/kernels": ROOT / "kernels",
           "routed_experts_cache/connector": ROOT / "connector"}


def test_top_level_import_and_version():
    from routed_experts_cache import CacheFullError, RoutedExpertsCache, RoutedExpertsCacheError

    assert RoutedExpertsCache.__module__ == "routed_experts_cache.connector.cache"
    assert issubclass(CacheFullError, RoutedExpertsCacheError)
    assert re.fullmatch(r"\d+\.\d+\.\d+", routed_experts_cache.__version__)


def test_wheel_has_license_metadata_and_py_typed(tmp_path):
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(ROOT), "-w", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    (wheel,) = tmp_path.glob("routed_experts_cache-*.whl")
    assert wheel.name.startswith(f"routed_experts_cache-{routed_experts_cache.__version__}-")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(f"{info}/METADATA").decode()
        license_text = archive.read(f"{info}/licenses/LICENSE").decode()
    modules = {n for n in names if n.startswith("routed_experts_cache/") and n.endswith(".py")}
    assert modules == {f"{package}/{p.relative_to(folder).as_posix()}" for package, folder in SOURCES.items()
                       for p in folder.rglob("*.py")}
    assert "routed_experts_cache/connector/vllm/plugin.py" in modules and "routed_experts_cache/kernels/segment_copy.py" in modules
    assert "routed_experts_cache/py.typed" in names
    assert "Apache License" in license_text and "Version 2.0" in license_text
    assert "License: Apache-2.0" in metadata and "Requires-Python: >=3.10" in metadata
    assert 'Requires-Dist: vllm<0.35,>=0.32; extra == "vllm"' in metadata
    assert "# routed-experts-cache" in metadata  # the README is the long description
    assert not any(n.startswith(("tests/", "bench/", "cpu_harness/")) for n in names)
