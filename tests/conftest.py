"""Shared fixtures of the core tests (cache and kernels).

Triton kernels run on CPU tensors under the interpreter, which must be switched on before
any Triton kernel module is imported: hence the environment variable at import time.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from routed_experts_cache.connector import RoutedExpertsCache  # noqa: E402


@pytest.fixture(params=["torch", "triton"])
def backend(request) -> str:
    """The cache's copy backend; 'triton' runs under the interpreter on CPU."""
    return request.param


@pytest.fixture
def make_cache(backend):
    """Factory: ``make_cache(num_pages, page_size=4, row_shape=(3, 2), dtype=torch.uint8)``."""

    def make(num_pages, page_size=4, row_shape=(3, 2), dtype=torch.uint8):
        return RoutedExpertsCache(num_pages, page_size, row_shape, dtype=dtype, device="cpu", backend=backend)

    return make


@pytest.fixture
def gen() -> torch.Generator:
    """A fixed-seed generator for deterministic random rows."""
    return torch.Generator().manual_seed(1234)
