"""Worker connectors to drive: ours built by the plugin's factory the way the installed vLLM builds
it, vLLM's own (``AuxOutputWorkerConnector``), and the capturer stand-in that feeds them rows."""

from __future__ import annotations

import contextlib
import socket
import threading
import weakref
from math import prod
from types import SimpleNamespace
from unittest import mock

from .installed import CONTRACT  # first: checks the installed vLLM, sets its environment
import numpy as np
import torch
import vllm.v1.worker.gpu.model_runner as runner_module
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed.aux_output_connector.routed_experts import RoutedExpertsBuffer
from vllm.distributed.aux_output_connector.store import BackgroundBlockObjectStore, BlockObjectStore
from vllm.distributed.aux_output_connector.worker import AuxOutputWorkerConnector
from vllm.distributed.parallel_state import (
    ensure_model_parallel_initialized,
    init_distributed_environment,
    model_parallel_is_initialized,
)
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.fused_moe import routed_experts_capturer
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

from routed_experts_cache import RoutedExpertsCache
from routed_experts_cache.connector.vllm import plugin as vllm_plugin
from routed_experts_cache.connector.vllm.worker import CacheWorkerConnector, build_cache

from .scheduler import SchedulerSetup
from .toy_model import HarnessError, ROW_SHAPE


class SnapshotCapturer:
    """Stands in for ``RoutedExpertsCapturer``: the step's rows, in batch order, on the CPU."""

    shape_per_token = ROW_SHAPE
    output_dtype = torch.uint8
    output_dtype_name = "uint8"

    def __init__(self) -> None:
        self.device_buffer = torch.empty(0, dtype=torch.int32)
        self.next_snapshot: torch.Tensor | None = None

    def snapshot_routing_data(self, num_tokens: int) -> torch.Tensor:
        snapshot, self.next_snapshot = self.next_snapshot, None
        if snapshot is None or snapshot.shape[0] != num_tokens:
            raise HarnessError(f"snapshot of {num_tokens} rows asked, {None if snapshot is None else snapshot.shape}")
        return snapshot


class HarnessMoEModel(torch.nn.Module):
    """The model the factory binds vLLM's capturer to: one capture source per MoE layer (the
    ``RoutedExpertsCaptureSource`` protocol: ``layer_id`` and the ``capture_fn`` vLLM sets)."""

    def __init__(self, num_layers: int) -> None:
        super().__init__()
        self.moe_layers = torch.nn.ModuleList(_CaptureSource(layer) for layer in range(num_layers))

    def route(self, rows: torch.Tensor, vllm_config: VllmConfig) -> None:
        """What the MoE layers do in a forward pass (under inference mode, as Model Runner V2's
        ``execute_model``): hand each layer's top-k ids to its hook."""
        with torch.inference_mode(), set_forward_context(None, vllm_config):
            for layer in self.moe_layers:
                layer.capture_fn(rows[:, layer.layer_id])


class _CaptureSource(torch.nn.Module):
    def __init__(self, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.capture_fn = None


# connector -> the model its capturer is bound to; weak, so a collected connector's id, reused
# by a later object, never routes that object's rows into a stale model
_MODELS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_DISTRIBUTED_LOCK = threading.Lock()


def ensure_single_rank_group(vllm_config: VllmConfig) -> None:
    """A one-process gloo world, so ``get_tp_group()`` answers as on a single-GPU worker."""
    with _DISTRIBUTED_LOCK:
        if model_parallel_is_initialized():
            return
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        with set_current_vllm_config(vllm_config):
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{port}")
            ensure_model_parallel_initialized(1, 1)


@contextlib.contextmanager
def set_up_as_a_worker():
    """What differs from a GPU worker here, and nothing else: the light environment's vLLM has
    no platform (a CUDA wheel without CUDA), so the capturer's buffer goes to the CPU, and
    ``profile_run``'s device sync has no accelerator to wait for."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(
            routed_experts_capturer, "current_platform", SimpleNamespace(device_type="cpu")))
        if not torch.accelerator.is_available():
            stack.enter_context(mock.patch.object(torch.accelerator, "synchronize", lambda *args, **kwargs: None))
        yield


def build_connector_like_vllm(setup: SchedulerSetup) -> CacheWorkerConnector:
    """This project's connector, built by the plugin's factory as the installed vLLM builds it.

    The plugin is registered as vLLM does at start-up (it replaces the factory in the model
    runner's module). vLLM 0.34: the real ``GPUModelRunner.profile_run`` calls the factory
    ``(model, vllm_config)`` and runs its dummy pass (the harness model routes
    ``max_num_batched_tokens`` rows through the live capture hooks), then
    ``initialize_output_storage(kv_cache_config)`` as ``initialize_kv_cache`` calls it.
    vLLM 0.33: one call ``(model, vllm_config, kv_cache_config)``, as its ``initialize_kv_cache``.
    """
    vllm_config = setup.vllm_config
    ensure_single_rank_group(vllm_config)
    model = HarnessMoEModel(vllm_config.model_config.get_total_num_hidden_layers())
    saved = runner_module.get_aux_output_connector
    try:
        with set_up_as_a_worker():
            if not vllm_plugin.register():
                raise HarnessError("the plugin did not install its worker connector factory")
            if CONTRACT.two_step_storage:
                runner = profiling_runner(vllm_config, model)
                runner.profile_run()
                connector = runner.aux_output_connector
                if connector is None or connector.cache is not None:
                    raise HarnessError(f"profile_run built {connector!r}, expected a connector without storage")
                connector.initialize_output_storage(setup.kv_cache_config)
            else:
                connector = runner_module.get_aux_output_connector(model, vllm_config, setup.kv_cache_config)
    finally:
        runner_module.get_aux_output_connector = saved
    if not isinstance(connector, CacheWorkerConnector):
        raise HarnessError(f"the model runner's factory built {type(connector).__name__}")
    _MODELS[connector] = model
    return connector


def profiling_runner(vllm_config: VllmConfig, model: HarnessMoEModel):
    """vLLM 0.34's ``GPUModelRunner`` with the attributes ``profile_run`` reads (its ``__init__``
    needs a GPU); the dummy pass routes rows through the model's capture hooks."""
    runner = object.__new__(runner_module.GPUModelRunner)
    runner.vllm_config, runner.model = vllm_config, model
    runner.supports_mm_inputs, runner.is_first_pp_rank, runner.is_last_pp_rank = False, True, False
    runner.encoder_cache = runner.pooling_runner = None
    runner.aux_output_connector = None
    runner.dummy_rows_routed = 0

    def dummy_run(num_tokens: int, **_options):
        model.route(torch.zeros((num_tokens, *ROW_SHAPE), dtype=torch.int64), vllm_config)
        runner.dummy_rows_routed += num_tokens
        return None, None

    runner._dummy_run = dummy_run
    runner.max_num_tokens = vllm_config.scheduler_config.max_num_batched_tokens
    return runner


def feed_rows(connector, rows: torch.Tensor, vllm_config: VllmConfig) -> None:
    """A step's routing rows, as the connector's capturer receives them: through the model's
    capture hooks for a factory-built connector, as the stand-in's next snapshot otherwise."""
    model = _MODELS.get(connector)
    if model is not None:
        model.route(rows, vllm_config)
    else:
        connector._capturer.next_snapshot = rows


def build_our_connector(setup: SchedulerSetup, capturer: SnapshotCapturer | None = None, *,
                        backend: str | None = None, num_pages: int | None = None) -> CacheWorkerConnector:
    """This project's connector: built the way vLLM builds it (``build_connector_like_vllm``)
    unless a stand-in capturer is given or a pool is forced; then constructed directly, sized
    by its own ``build_cache`` unless ``num_pages`` is given."""
    if capturer is None and backend is None and num_pages is None:
        return build_connector_like_vllm(setup)
    capturer = capturer or SnapshotCapturer()
    if backend is None and num_pages is None:
        cache = build_cache(setup.vllm_config, setup.kv_cache_config, capturer)
    else:
        if num_pages is None:
            num_pages = build_cache(setup.vllm_config, setup.kv_cache_config, capturer).num_pages
        _, page_size = resolve_kv_cache_block_sizes(setup.kv_cache_config, setup.vllm_config)
        cache = RoutedExpertsCache(num_pages, page_size, ROW_SHAPE, dtype=torch.uint8, device="cpu",
                                   backend=backend or "auto")
    return CacheWorkerConnector(
        capturer=capturer, cache=cache, max_concurrent_batches=setup.vllm_config.max_concurrent_batches
    )


def build_vllm_connector(setup: SchedulerSetup, capturer: SnapshotCapturer) -> AuxOutputWorkerConnector:
    """vLLM 0.33's own worker connector, built the way its unit tests build it.

    ``object.__new__`` without ``__init__`` (which needs a model and a GPU capturer), then
    the attributes its methods use: a real ``RoutedExpertsBuffer`` and a real
    ``BackgroundBlockObjectStore`` over a ``BlockObjectStore`` sized as ``__init__`` sizes
    it; the capturer returns a CPU tensor in place of the GPU snapshot.
    """
    vllm_config = setup.vllm_config
    scheduler_config = vllm_config.scheduler_config
    _, hash_block_size = resolve_kv_cache_block_sizes(setup.kv_cache_config, vllm_config)
    dtype = np.dtype(capturer.output_dtype_name)
    row_shape = tuple(capturer.shape_per_token)
    block_nbytes = hash_block_size * prod(row_shape) * dtype.itemsize
    connector = object.__new__(AuxOutputWorkerConnector)
    connector._capturer = capturer
    connector._requests = {}
    connector._generation = 0
    connector._step_metadata = None
    connector._pending_outputs = []
    connector._lock = threading.Lock()
    connector._max_concurrent_batches = vllm_config.max_concurrent_batches
    connector._store = BackgroundBlockObjectStore(
        BlockObjectStore(max_bytes=setup.kv_cache_config.num_blocks * block_nbytes, object_nbytes=block_nbytes),
        max_pending_batches=2 * scheduler_config.max_num_seqs,
    )
    connector._buffer = RoutedExpertsBuffer(
        dtype, row_shape, hash_block_size, scheduler_config.max_num_seqs,
        scheduler_config.max_num_batched_tokens, vllm_config.max_concurrent_batches,
    )
    return connector
