"""``vllm.general_plugins`` entry point: serve routed experts from the device cache.

vLLM loads this in every process. On supported versions it swaps the worker-side factory
``get_aux_output_connector`` (which Model Runner V2 imports by name) for ours; vLLM's
scheduler-side connector stays. ``ROUTED_EXPERTS_CACHE=0`` keeps vLLM's built-in path.
"""

import logging
import os
import sys

SUPPORTED_VERSIONS = ("0.32.", "0.33.")
ENV_SWITCH = "ROUTED_EXPERTS_CACHE"
_WORKER_MODULE = "vllm.distributed.aux_output_connector.worker"
_RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"

# A child of vLLM's logger, so lines show with vLLM's format once vLLM configures logging
# (after plugins load: the "active" line is therefore logged by the worker connector).
logger = logging.getLogger("vllm.routed_experts_cache")


def is_supported(version: str) -> bool:
    return version.startswith(SUPPORTED_VERSIONS)


def register() -> bool:
    """Install the cache-backed worker connector; return whether it is active."""
    if os.environ.get(ENV_SWITCH, "1").strip() == "0":
        logger.info("routed-experts-cache: off (%s=0); vLLM's built-in routed-experts path runs", ENV_SWITCH)
        return False
    import vllm

    if not is_supported(vllm.__version__):
        logger.warning(
            "routed-experts-cache: vLLM %s is not supported (supported: 0.32.x, 0.33.x); "
            "vLLM is left untouched and its built-in routed-experts path runs",
            vllm.__version__,
        )
        return False
    import importlib

    from . import vllm_worker

    importlib.import_module(_WORKER_MODULE).get_aux_output_connector = vllm_worker.get_aux_output_connector
    runner = sys.modules.get(_RUNNER_MODULE)
    if runner is not None:
        runner.get_aux_output_connector = vllm_worker.get_aux_output_connector
    logger.debug("routed-experts-cache: worker connector factory installed on vLLM %s", vllm.__version__)
    return True
