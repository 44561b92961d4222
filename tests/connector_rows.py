"""Shared by the connector tests of the vLLM 0.33 tier: rows, hashes and batches without a model."""

from types import SimpleNamespace

import cpu_harness.vllm_scheduler  # noqa: F401  (first: fails with a clear message outside vLLM 0.33 and 0.34)
import numpy as np
import torch
from vllm.distributed.aux_output_connector.connector import PackedBlockHashes

PAGE, ROW = 4, (2, 3)


def row_of(request_id: str, position: int) -> np.ndarray:
    """The routing row of a request's position: a fixed function, distinct per request."""
    seed = sum(map(ord, request_id)) * 7919 + position * 104729
    return ((np.arange(6) * 31 + seed) % 251).astype(np.uint8).reshape(ROW)


def pack_hashes(hashes) -> PackedBlockHashes | None:
    hashes = list(hashes)
    return PackedBlockHashes(b"".join(hashes), len(hashes[0])) if hashes else None


class FixedCapturer:
    """Stands in for vLLM's capturer: returns the rows the test put in ``rows``."""

    rows: torch.Tensor | None = None

    def snapshot_routing_data(self, num_tokens: int) -> torch.Tensor:
        if self.rows is None or self.rows.shape[0] != num_tokens:
            raise AssertionError(f"snapshot of {num_tokens} rows asked")
        return self.rows


def input_batch(request_ids, query_start_loc, num_computed_tokens) -> SimpleNamespace:
    """The three fields of Model Runner V2's InputBatch that the connector reads."""
    return SimpleNamespace(
        req_ids=list(request_ids),
        query_start_loc_np=np.array(query_start_loc, dtype=np.int32),
        num_computed_tokens_np=np.array(num_computed_tokens, dtype=np.int32),
    )
