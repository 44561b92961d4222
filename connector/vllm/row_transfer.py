"""Rows across a prefill/decode split: the prefill instance exports a request's rows in the
``kv_transfer_params`` it returns, the decode instance imports them for the request.

P/D proxies forward the prefill's ``kv_transfer_params`` unchanged into the decode request, so
the rows travel with the KV's own transfer parameters, under ``"routed_experts"``: ``start``
(0: the prompt's first token), ``shape`` ``[tokens, layers, top_k]``, ``dtype`` and the raw
bytes in base64. A prefill request exports when its ``kv_transfer_params`` ask for a remote
decode (``do_remote_decode``, vLLM's P/D flag) or for the rows (``routed_experts_export``);
rows over ``ROUTED_EXPERTS_CACHE_PD_MAX_BYTES`` (default 8 MiB) are not embedded, and the
decode then recomputes (0.33, 0.34) or fails closed (0.32, whose scheduler does not ask).

The decode's scheduler side checks an import (start 0, the model's row shape and dtype, bytes
matching the shape) before it lets a hit use it, and sends it to the worker with the request's
first step (``CacheConnectorMetadata.imported_rows``); the worker publishes its full blocks
under the request's own block hashes (``RoutedExpertsCache.import_blocks``) before the step
runs. A bad or missing import is never used: the hit is capped to what rows cover.
"""

from __future__ import annotations

import base64
import logging
import math
import os
from dataclasses import dataclass, field, fields

import numpy as np
from vllm.distributed.aux_output_connector.connector import AuxOutputConnectorMetadata, AuxOutputSchedulerConnector
from vllm.model_executor.layers.fused_moe.routed_experts_capturer import _get_routed_experts_shape

from ...errors import RoutedExpertsCacheError

logger = logging.getLogger("vllm.routed_experts_cache")
ROWS_KEY = "routed_experts"
EXPORT_FLAGS = ("do_remote_decode", "routed_experts_export")
MAX_BYTES_ENV = "ROUTED_EXPERTS_CACHE_PD_MAX_BYTES"
DEFAULT_MAX_BYTES = 8 << 20


@dataclass
class CacheConnectorMetadata(AuxOutputConnectorMetadata):
    """vLLM's aux-output metadata plus rows imported from a prefill instance, per request
    (``[tokens, layers, top_k]`` from position 0), sent with the request's first step."""

    imported_rows: dict[str, np.ndarray] = field(default_factory=dict)


def max_export_bytes() -> int:
    raw = os.environ.get(MAX_BYTES_ENV, str(DEFAULT_MAX_BYTES))
    try:
        limit = int(raw)
    except ValueError:
        limit = -1
    if limit < 0:
        raise RoutedExpertsCacheError(f"{MAX_BYTES_ENV}={raw!r} must be a number of bytes >= 0 (0: never export)")
    return limit


def wants_export(params) -> bool:
    return isinstance(params, dict) and any(params.get(flag) for flag in EXPORT_FLAGS)


def encode_rows(request_id: str, rows: np.ndarray, limit: int) -> dict | None:
    """The ``kv_transfer_params`` entry for rows ``[0, len(rows))``; None (logged) over ``limit``."""
    if rows.nbytes > limit:
        logger.warning(
            "routed-experts-cache: rows of request %s (%d bytes) exceed %s=%d: not exported; the decode "
            "instance will compute them again", request_id, rows.nbytes, MAX_BYTES_ENV, limit,
        )
        return None
    return {"start": 0, "shape": list(rows.shape), "dtype": rows.dtype.name,
            "data": base64.b64encode(np.ascontiguousarray(rows).tobytes()).decode("ascii")}


def decode_rows(entry, row_shape: tuple[int, ...] | None, dtype_name: str | None) -> np.ndarray | str:
    """The rows of an import entry, or why it cannot be used (``row_shape`` / ``dtype_name``:
    the model's, when known here; the worker checks them against its pool in any case)."""
    if not isinstance(entry, dict):
        return f"{ROWS_KEY} is a {type(entry).__name__}, not a dict"
    shape, dtype, data = entry.get("shape"), entry.get("dtype"), entry.get("data")
    if entry.get("start") != 0:
        return f"rows start at {entry.get('start')!r}, not 0"
    if dtype not in ("uint8", "uint16") or dtype_name is not None and dtype != dtype_name:
        return f"rows are {dtype!r}, this model's are {dtype_name or 'uint8 or uint16'}"
    if not (isinstance(shape, list) and len(shape) == 3 and all(type(d) is int and d >= 0 for d in shape)):
        return f"shape {shape!r} is not [tokens, layers, top_k]"
    if row_shape is not None and tuple(shape[1:]) != tuple(row_shape):
        return f"rows of shape {tuple(shape[1:])}, this model's are {tuple(row_shape)}"
    try:
        raw = base64.b64decode(data, validate=True) if isinstance(data, str) else None
    except ValueError:
        raw = None
    if raw is None or len(raw) != math.prod(shape) * np.dtype(dtype).itemsize:
        return f"data does not hold {math.prod(shape)} {dtype} values"
    return np.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)


class RowTransfer:
    """Scheduler-side export and import of rows (a mixin over vLLM's scheduler-side connector).

    Exports: rows a request's ``take_output`` returns are kept while it runs, then added to the
    ``kv_transfer_params`` the scheduler returns (``exported_params``, called by the plugin's
    wrapper of ``Scheduler._connector_finished``). Imports: ``imported_tokens`` (block-aligned
    tokens an import covers, checked once per request) and the metadata that carries them.
    """

    def _init_row_transfer(self, vllm_config=None, block_size: int = 1) -> None:
        """``vllm_config`` (None where the scheduler does not pass it, vLLM 0.32): the model's
        row shape and dtype to check imports against; ``block_size``: what a hit is aligned to."""
        self._row_shape = self._row_dtype = None
        if vllm_config is not None:
            num_layers, num_experts, top_k = _get_routed_experts_shape(vllm_config)
            self._row_shape = (num_layers, top_k)
            self._row_dtype = "uint8" if num_experts <= 256 else "uint16"
        self._transfer_block_size = block_size
        self._export_limit = max_export_bytes()
        self._exports: dict[str, list[np.ndarray]] = {}  # request -> row chunks from position 0
        self._imports: dict[str, np.ndarray | None] = {}  # request -> checked rows (None: unusable)
        self._imports_sent: set[str] = set()

    def take_output(self, request, output):
        rows = super().take_output(request, output)
        if rows is not None and len(rows) and wants_export(request.kv_transfer_params):
            chunks = self._exports.setdefault(request.request_id, [])
            if sum(map(len, chunks)) == output[request.request_id].token_start:  # contiguous from 0
                chunks.append(rows)
        return rows

    def exported_params(self, request, params: dict | None) -> dict | None:
        """``params`` with the request's rows under ``"routed_experts"`` (if it exports)."""
        chunks = self._exports.pop(request.request_id, None)
        if not chunks:
            return params
        entry = encode_rows(request.request_id, np.concatenate(chunks), self._export_limit)
        if entry is None:
            return params
        return {**(params or {}), ROWS_KEY: entry}

    def imported_rows(self, request) -> np.ndarray | None:
        """The request's imported rows, checked once; None without a usable import (logged)."""
        request_id = request.request_id
        if request_id not in self._imports:
            params = request.kv_transfer_params
            entry = params.get(ROWS_KEY) if isinstance(params, dict) else None
            rows = None
            if entry is not None:
                rows = decode_rows(entry, self._row_shape, self._row_dtype)
                if isinstance(rows, str):
                    logger.warning(
                        "routed-experts-cache: request %s: imported rows are not used (%s); its prefix is "
                        "computed again", request_id, rows,
                    )
                    rows = None
                elif len(rows) > request.num_prompt_tokens:
                    rows = rows[: request.num_prompt_tokens]
            self._imports[request_id] = rows
        return self._imports[request_id]

    def imported_tokens(self, request) -> int:
        rows = self.imported_rows(request)
        return 0 if rows is None else len(rows) // self._transfer_block_size * self._transfer_block_size

    def with_imports(self, metadata, requests) -> CacheConnectorMetadata:
        """vLLM's metadata as ``CacheConnectorMetadata``, with the imports of requests scheduled
        for the first time."""
        imports = {}
        for request_id in metadata.requests:
            if request_id not in self._imports_sent:
                self._imports_sent.add(request_id)
                rows = self.imported_rows(requests[request_id])
                if rows is not None:
                    imports[request_id] = rows[: self.imported_tokens(requests[request_id])]
        base = {f.name: getattr(metadata, f.name) for f in fields(metadata)}
        return CacheConnectorMetadata(**base, imported_rows=imports)

    def forget_import(self, request_id: str) -> None:
        """At the request's finish (its export, if any, is taken after: ``exported_params``)."""
        self._imports.pop(request_id, None)
        self._imports_sent.discard(request_id)


class RowTransferConnector(RowTransfer, AuxOutputSchedulerConnector):
    """vLLM 0.32's scheduler-side connector with row export and import (0.32 has no scheduler
    pins: retention and hit caps do not exist there; the scheduler takes KV hits as they come)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._init_row_transfer()

    def build_connector_meta(self, scheduler_output, requests):
        return self.with_imports(super().build_connector_meta(scheduler_output, requests), requests)

    def request_finished(self, request) -> None:
        self.forget_import(request.request_id)
        super().request_finished(request)
