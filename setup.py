"""routed-experts-cache: a GPU-resident cache of MoE routing rows and a vLLM drop-in.

The installed package ``routed_experts_cache`` is put together from three folders of this
repository: ``src/routed_experts_cache`` (the top-level import, errors, ``py.typed``),
``kernels/`` (the Triton segment copy and its torch twin) and ``connector/`` (the engine-agnostic
cache and, in ``connector/vllm/``, its vLLM adapter).
"""

import re
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
PACKAGES = ["routed_experts_cache", "routed_experts_cache.kernels", "routed_experts_cache.connector",
            "routed_experts_cache.connector.vllm"]
VERSION = re.search(r'__version__ = "([^"]+)"', (HERE / "src/routed_experts_cache/__init__.py").read_text())[1]

setup(
    name="routed-experts-cache",
    version=VERSION,
    description="GPU-resident paged cache of MoE routed-expert rows, with a vLLM worker connector",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    license_files=["LICENSE"],
    python_requires=">=3.10",
    package_dir={
        "routed_experts_cache": "src/routed_experts_cache",
        "routed_experts_cache.kernels": "kernels",
        "routed_experts_cache.connector": "connector",
        "routed_experts_cache.connector.vllm": "connector/vllm",
    },
    packages=PACKAGES,
    package_data={"routed_experts_cache": ["py.typed"]},
    # Triton only where its kernels can run (Linux); the torch backend needs neither.
    install_requires=["torch>=2.4", "numpy", "triton>=3.6,<3.9; platform_system == 'Linux'"],
    extras_require={
        "vllm": ["vllm>=0.32,<0.35"],
        "test": ["pytest", "hypothesis"],
    },
    entry_points={
        "vllm.general_plugins": [
            "routed_experts_cache = routed_experts_cache.connector.vllm.plugin:register",
        ]
    },
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "License :: OSI Approved :: Apache Software License",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Typing :: Typed",
    ],
)
