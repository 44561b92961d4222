"""routed-experts-cache: a GPU-resident cache of MoE routing rows and a vLLM drop-in.

The repository keeps ``kernels/`` and ``connector/`` at the root; they install as
``routed_experts_cache.kernels`` and ``routed_experts_cache.connector`` (never as top-level
``kernels`` / ``connector``). ``routed_experts_cache`` itself is a namespace package.
"""

from setuptools import setup

setup(
    name="routed-experts-cache",
    version="0.1.0",
    description="GPU-resident paged cache of MoE routed-expert rows, with a vLLM worker connector",
    python_requires=">=3.10",
    packages=["routed_experts_cache.kernels", "routed_experts_cache.connector"],
    package_dir={
        "routed_experts_cache.kernels": "kernels",
        "routed_experts_cache.connector": "connector",
    },
    install_requires=["torch>=2.4", "triton>=3.6,<3.9", "numpy"],
    extras_require={"test": ["pytest", "hypothesis"]},
    entry_points={
        "vllm.general_plugins": [
            "routed_experts_cache = routed_experts_cache.connector.vllm_plugin:register",
        ]
    },
)
