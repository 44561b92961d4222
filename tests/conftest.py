"""Shared fixtures: the cache and kernel tests' backends and devices, and the vLLM tiers'
tiny models with their Hugging Face reference.

The core tests run on CPU by default: Triton kernels then run on CPU tensors under the
interpreter, which must be switched on before any Triton kernel module is imported (hence the
environment variable at import time). ``ROUTED_EXPERTS_TEST_DEVICE=cuda`` runs the same tests
on a GPU with compiled kernels (``bench/run_gpu.sh`` does). ``ROUTED_EXPERTS_SOAK=k`` runs the
state machines at random instead of deterministically, with k times their examples, and
``ROUTED_EXPERTS_SEGMENT_ORDER`` runs the torch backend's copies one segment at a time
(``scripts/soak.sh`` sets both).
"""

import os

TEST_DEVICE = os.environ.get("ROUTED_EXPERTS_TEST_DEVICE", "cpu")
ON_CPU = TEST_DEVICE == "cpu"
if ON_CPU:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from routed_experts_cache import RoutedExpertsCache  # noqa: E402

if not ON_CPU and not torch.cuda.is_available():
    raise RuntimeError(f"ROUTED_EXPERTS_TEST_DEVICE={TEST_DEVICE!r} but CUDA is not available")


def soak_scale() -> float:
    """``ROUTED_EXPERTS_SOAK`` as a positive number (0: unset, the deterministic runs)."""
    value = os.environ.get("ROUTED_EXPERTS_SOAK", "")
    try:
        scale = float(value) if value else 0.0
    except ValueError:
        scale = -1.0
    if not 0 <= scale < float("inf"):  # negative, unparsable, infinite or NaN
        raise RuntimeError(f"ROUTED_EXPERTS_SOAK must be a positive number of times the examples, got {value!r}")
    return scale


SOAK = soak_scale()
SEGMENT_ORDER = os.environ.get("ROUTED_EXPERTS_SEGMENT_ORDER", "")
if SEGMENT_ORDER not in ("", "in_order", "reversed"):
    raise RuntimeError(f"ROUTED_EXPERTS_SEGMENT_ORDER must be in_order or reversed, got {SEGMENT_ORDER!r}")


def rows_differing_from(rows, expected):
    """Positions whose routed experts (any order within a row) differ from Hugging Face's sorted ids."""
    import numpy as np

    return np.flatnonzero((np.sort(rows, axis=-1) != expected).any(axis=(1, 2)))


def run_state_machine(machine, budget: dict) -> None:
    """Run a Hypothesis state machine deterministically (no database, one shrunk failure) on one
    intra-op thread: every tensor is tiny, and thread wake-ups cost ~ms per op on a loaded
    2-core machine (results do not depend on the thread count). Under ``ROUTED_EXPERTS_SOAK``
    the run is random, ``SOAK`` times as long, and a failure prints the ``@reproduce_failure``
    line that replays it."""
    from hypothesis import HealthCheck, settings
    from hypothesis.stateful import run_state_machine_as_test

    if SOAK:
        budget = {**budget, "max_examples": max(1, round(budget["max_examples"] * SOAK))}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_state_machine_as_test(machine, settings=settings(
            deadline=None, derandomize=not SOAK, database=None, print_blob=bool(SOAK),
            report_multiple_bugs=False,  # shrink one failure only (stateful shrinking is slow)
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
            **budget,
        ))
    finally:
        torch.set_num_threads(threads)


def copy_one_segment_at_a_time(reverse: bool = False):
    """A segment copy (``copy_segments_torch``'s arguments) that runs the kernel's programs (one
    per segment when compiled) one after another, in segment order or reversed. On a GPU they
    run at once, and one may finish before another starts; the interpreter and the torch copy
    read every segment before writing any, so only this order shows a copy whose segments write
    rows that others of the same launch read."""

    def copy(source, target, seg_start, seg_source_row, seg_target_row, total_rows):
        bounds, sources, targets = seg_start.tolist(), seg_source_row.tolist(), seg_target_row.tolist()
        segments = list(zip(bounds, bounds[1:], sources, targets))
        for first, end, source_row, target_row in reversed(segments) if reverse else segments:
            target[target_row : target_row + end - first] = source[source_row : source_row + end - first].clone()

    return copy


@pytest.fixture(autouse=True)
def segment_order(monkeypatch):
    """Under ``ROUTED_EXPERTS_SEGMENT_ORDER`` (``scripts/soak.sh``), every copy of the torch
    backend goes through ``copy_one_segment_at_a_time`` in that order, row copies included."""
    if SEGMENT_ORDER:
        from routed_experts_cache.connector import cache as cache_module

        monkeypatch.setattr(cache_module, "SMALL_COPY_ROWS", 0)
        monkeypatch.setattr(cache_module, "copy_segments_torch", copy_one_segment_at_a_time(SEGMENT_ORDER == "reversed"))


@pytest.fixture(params=["torch", "triton"])
def backend(request) -> str:
    """The cache's copy backend; 'triton' runs under the interpreter on CPU."""
    return request.param


@pytest.fixture
def make_cache(backend):
    """Factory: ``make_cache(num_pages, page_size=4, row_shape=(3, 2), dtype=torch.uint8, host_pages=0)``."""

    def make(num_pages, page_size=4, row_shape=(3, 2), dtype=torch.uint8, host_pages=0):
        return RoutedExpertsCache(num_pages, page_size, row_shape, dtype=dtype, device=TEST_DEVICE, backend=backend,
                                  host_pages=host_pages)

    return make


@pytest.fixture
def gen() -> torch.Generator:
    """A fixed-seed generator for deterministic random rows."""
    return torch.Generator().manual_seed(1234)


# The vLLM tiers' tiny models and their Hugging Face routing reference (built once per run).
@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """``(tiny MoE, its EAGLE3 draft)`` checkpoint folders."""
    from cpu_harness.tiny_moe import build_tiny_eagle3_draft, build_tiny_qwen3_moe

    base = tmp_path_factory.mktemp("models")
    model = build_tiny_qwen3_moe(base / "tiny-moe")
    return model, build_tiny_eagle3_draft(base / "tiny-eagle3", model)


@pytest.fixture(scope="session")
def hf_reference(model_dirs):
    """``reference(token_ids)``: Hugging Face's sorted top-k expert ids ``[n, layers, k]``."""
    from transformers import Qwen3MoeForCausalLM

    from cpu_harness.engine import hf_routed_experts

    model = Qwen3MoeForCausalLM.from_pretrained(model_dirs[0], torch_dtype=torch.float32).eval()
    memo = {}

    def reference(token_ids):
        key = tuple(token_ids)
        if key not in memo:
            memo[key] = hf_routed_experts(model, token_ids)
        return memo[key]

    return reference
