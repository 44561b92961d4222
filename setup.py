"""routed-experts-cache: a GPU-resident cache of MoE routing rows and a vLLM drop-in.

The package lives in ``src/routed_experts_cache`` (the cache and its page pool at the top,
``kernels/``: the Triton segment copy and its torch twin; ``connector/``: the vLLM adapter).
"""

import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent
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
    package_dir={"": "src"},
    packages=find_packages("src"),
    package_data={"routed_experts_cache": ["py.typed"]},
    # Triton only where its kernels can run (Linux); the torch backend needs neither.
    install_requires=["torch>=2.4", "numpy", "triton>=3.6,<3.9; platform_system == 'Linux'"],
    extras_require={
        "vllm": ["vllm>=0.32,<0.34"],
        "test": ["pytest", "hypothesis"],
    },
    entry_points={
        "vllm.general_plugins": [
            "routed_experts_cache = routed_experts_cache.connector.vllm_plugin:register",
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
