"""Registers the stand-in Triton backend in every Python process started with this folder on
``PYTHONPATH``: vLLM's OpenAI server spawns its engine core and workers as fresh interpreters,
which import ``sitecustomize`` at start-up but nothing of the launching test."""

from cpu_harness import triton_cpu_backend  # noqa: F401
