"""``vllm.general_plugins`` entry point: serve routed experts from the device cache.

vLLM loads this in every process (the engine core before it builds its scheduler). On
supported versions (``vllm_versions.CONTRACTS``) it swaps the worker-side factory
``get_aux_output_connector`` (which Model Runner V2 imports by name) for ours, which takes every
supported release's call shape, and vLLM's scheduler-side ``AuxOutputSchedulerConnector`` (in
its source module and in the scheduler module, which imports it by name) for
``scheduler.CacheSchedulerConnector`` where the scheduler pins blocks for the worker (0.33+),
``row_transfer.RowTransferConnector`` on 0.32; it wraps ``Scheduler._connector_finished`` so a
prefill's returned ``kv_transfer_params`` carry its rows (``row_transfer``).
``ROUTED_EXPERTS_CACHE=0`` keeps vLLM's built-in path. ``ROUTED_EXPERTS_CACHE_PD_CONNECTORS=1``
lifts vLLM's refusal of NIXL-class P/D connectors with routed experts (an explicit opt-in; off
by default).
"""

import logging
import os
import sys
import time

from ...errors import RoutedExpertsCacheError
from .versions import contract_for, supported_series

ENV_SWITCH = "ROUTED_EXPERTS_CACHE"
PD_CONNECTORS_SWITCH = "ROUTED_EXPERTS_CACHE_PD_CONNECTORS"
_CONFIG_MODULE = "vllm.config.vllm"
# The end of the error VllmConfig._verify_aux_output_compatibility raises for NIXL / MoRIIO /
# Mooncake P/D connectors (0.32-0.34); that check is the method's last, so every other check
# has passed when it is raised.
_PD_REFUSAL = "PD auxiliary output is not supported."
_WORKER_MODULE = "vllm.distributed.aux_output_connector.worker"
_RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"
SCHEDULER_CONNECTOR_SITES = ("vllm.distributed.aux_output_connector.connector", "vllm.v1.core.sched.scheduler")

_SWITCH_VALUES = {"1": True, "true": True, "on": True, "0": False, "false": False, "off": False}

# A child of vLLM's logger, so lines show with vLLM's format once vLLM configures logging
# (after plugins load: the "active" line is therefore logged by the worker connector).
logger = logging.getLogger("vllm.routed_experts_cache")


def _log_state(level: int, message: str, *args) -> None:
    """Log the plugin's state so that it shows in every run: through vLLM's logging when it is
    configured, else (plugins load before vLLM applies its logging config, where an INFO line
    would be dropped) straight to stderr in vLLM's layout."""
    if logging.getLogger("vllm").handlers:
        logger.log(level, message, *args)
    else:
        stamp = time.strftime("%m-%d %H:%M:%S")
        print(f"{logging.getLevelName(level)} {stamp} [plugin.py] {message % args}", file=sys.stderr, flush=True)


def is_supported(version: str) -> bool:
    return contract_for(version) is not None


def _switch(name: str, default: bool) -> bool:
    """An on/off environment variable: 1 / true / on or 0 / false / off, any case.

    Any other value stops vLLM's start (plugins run unguarded there) with a message naming the
    accepted values, rather than silently choosing a path.
    """
    raw = os.environ.get(name, "1" if default else "0")
    value = raw.strip().lower()
    if value not in _SWITCH_VALUES:
        on, off = ("1, true or on (the default)", "0, false or off") if default else ("1, true or on", "0, false or off (the default)")
        raise RoutedExpertsCacheError(f"{name}={raw!r} is not understood; use {on} or {off}")
    return _SWITCH_VALUES[value]


def switched_on() -> bool:
    """``ROUTED_EXPERTS_CACHE``: unset or on -> the cache serves routed experts."""
    return _switch(ENV_SWITCH, default=True)


def pd_connectors_allowed() -> bool:
    """``ROUTED_EXPERTS_CACHE_PD_CONNECTORS``: on -> NIXL-class P/D connectors are admitted."""
    return _switch(PD_CONNECTORS_SWITCH, default=False)


def _exporting_rows(original):
    """``Scheduler._connector_finished`` (vLLM 0.32-0.34: ``(request) -> (delay_free_blocks,
    kv_transfer_params)``), with the request's exported rows added to the parameters."""

    def connector_finished(scheduler, request):
        delay_free_blocks, params = original(scheduler, request)
        aux = scheduler.aux_output_connector
        if hasattr(aux, "exported_params"):
            params = aux.exported_params(request, params)
        return delay_free_blocks, params

    connector_finished.exports_rows = True
    return connector_finished


def _admitting_pd_connectors(original):
    """``VllmConfig._verify_aux_output_compatibility`` (0.32-0.34), admitting the P/D connectors
    it refuses when ``ROUTED_EXPERTS_CACHE_PD_CONNECTORS`` is on (read at each check): the rows
    then travel in the ``kv_transfer_params`` those connectors' proxies forward."""

    def verify(config):
        try:
            original(config)
        except ValueError as error:
            if not str(error).endswith(_PD_REFUSAL) or not pd_connectors_allowed():
                raise
            _log_state(
                logging.WARNING, "routed-experts-cache: %s=1 admits a P/D connector vLLM refuses with routed "
                "experts (%s); the prefill's rows travel in its kv_transfer_params, a decode without them recomputes "
                "(0.33, 0.34) or fails closed (0.32)",
                PD_CONNECTORS_SWITCH, config.kv_transfer_config.kv_connector,
            )

    verify.admits_pd_connectors = True
    return verify


def register() -> bool:
    """Install the cache-backed connectors; return whether they are active."""
    if not switched_on():
        _log_state(
            logging.INFO, "routed-experts-cache: off (%s=%s); vLLM's built-in routed-experts path runs", ENV_SWITCH,
            os.environ[ENV_SWITCH],
        )
        return False
    pd_connectors_allowed()  # a value that is not understood stops the start here
    import vllm

    if not is_supported(vllm.__version__):
        _log_state(
            logging.WARNING, "routed-experts-cache: vLLM %s is not supported (supported: %s); "
            "vLLM is left untouched and its built-in routed-experts path runs",
            vllm.__version__, supported_series(),
        )
        return False
    import importlib

    from . import worker as vllm_worker

    importlib.import_module(_WORKER_MODULE).get_aux_output_connector = vllm_worker.get_aux_output_connector
    runner = sys.modules.get(_RUNNER_MODULE)
    if runner is not None:
        runner.get_aux_output_connector = vllm_worker.get_aux_output_connector
    if contract_for(vllm.__version__).scheduler_pins:
        from .scheduler import CacheSchedulerConnector as scheduler_connector
    else:
        from .row_transfer import RowTransferConnector as scheduler_connector
    for module in SCHEDULER_CONNECTOR_SITES:
        importlib.import_module(module).AuxOutputSchedulerConnector = scheduler_connector
    scheduler_class = importlib.import_module("vllm.v1.core.sched.scheduler").Scheduler
    if not getattr(scheduler_class._connector_finished, "exports_rows", False):
        scheduler_class._connector_finished = _exporting_rows(scheduler_class._connector_finished)
    config_class = importlib.import_module(_CONFIG_MODULE).VllmConfig
    if not getattr(config_class._verify_aux_output_compatibility, "admits_pd_connectors", False):
        config_class._verify_aux_output_compatibility = _admitting_pd_connectors(
            config_class._verify_aux_output_compatibility
        )
    logger.debug("routed-experts-cache: connectors installed on vLLM %s", vllm.__version__)
    return True
