"""Drive vLLM 0.33's or 0.34's real scheduler side against a worker connector, without a model.

What differs between the two releases comes from ``routed_experts_cache.connector.vllm.versions``
(``CONTRACT``: the installed release's row). ``build_our_connector`` builds this project's
connector through the plugin's factory the way the installed release's Model Runner V2 does
(0.34: the real ``GPUModelRunner.profile_run``, then ``initialize_output_storage``).

Real vLLM pieces: ``VllmConfig`` (a DeepSeek-V3 MTP speculative config, so
``num_hash_lookahead_tokens`` is 1 or 2 exactly as vLLM derives it), the real
``Scheduler`` / ``AsyncScheduler`` with its ``KVCacheManager`` and ``BlockPool``,
``Request`` with the block hasher of ``vllm.v1.core.kv_cache_utils`` (lookahead tokens
included), and ``AuxOutputSchedulerConnector`` (built by the scheduler itself; its
``take_output`` trims every worker chunk).

Simulated pieces (no GPU, no model): ``SimModelRunner`` mirrors what Model Runner V2 does
around the aux-output hooks: it keeps the device-side view of each request (the real
``num_computed_tokens``, corrected for rejected drafts, while the CPU value in the input
batch assumes every draft was accepted under async scheduling), feeds the scheduled
tokens plus its own drafts, samples with a deterministic "true" next-token function and a
rejection sampler, and hands the connector a snapshot of routing rows. ``SimEngine``
mirrors ``EngineCore.step`` (sync) and ``EngineCore.step_with_batch_queue`` (async).

With a KV connector (``make_scheduler(kv_connector={...})``: the stub of
``kv_connector.py``, loaded by vLLM through ``kv_transfer_config``) the runner
also drives the worker side of the connector as MRV2's ``ActiveKVConnector`` does, and keeps
a model of invalid KV (a failed load) so rows computed over it are wrong (``poison``). What
vLLM 0.33 does there, read from its source and observed with this harness:

- Rows of externally loaded tokens are not computed: they are prefix rows. The scheduler
  (``AuxOutputSchedulerConnector.cap_external_hit``) accepts an external hit only if it ends
  on a KV block boundary and every block of local + external hit is GPU-cached or retained
  by the aux-output scheduler (``_kv_cached``, up to ``_capacity`` = 2 x ``num_blocks`` with
  a KV connector); otherwise it drops the whole external hit. ``request_loading`` keeps an
  async load's blocks retained until the request is scheduled. The worker gets the hashes
  of the loaded blocks like any prefix hit and returns their rows from what it retained;
  the client receives them (from ``routed_experts_prompt_start``).
- With a KV connector vLLM keeps the legacy block hashes (``num_hash_lookahead_tokens`` 0).
- A failed *synchronous* load (recompute policy): ``update_from_output`` ->
  ``_handle_invalid_blocks`` sets the running request's ``num_computed_tokens`` to its
  first invalid block and skips its output of the step (no ``take_output``, no tokens);
  running requests that share an invalid block another request marks are set back to
  their count before the step. The next step schedules them as running requests at the
  lower count: the input batch's ``num_computed_tokens_np`` goes backwards; the block hashes
  already sent (up to the failed step's end) are not sent again, no terminal event. MRV2
  0.33's ``update_requests`` writes only that CPU mirror: its device ``num_computed_tokens``,
  sampled token and drafts are not rolled back. This harness's device follows the scheduler
  (``SimModelRunner.follow_rollback``), the behaviour the scheduler asks for.
- A failed *asynchronous* load is handled while the request waits for its KV: the worker
  first sees it at the lowered count; nothing goes backwards.
- Under ``AsyncScheduler`` the roll-back subtracts only the processed step's tokens from a
  count that includes the step in flight; the harness refuses to simulate that
  (``HarnessError``).

Routing rows are a pure function of the token prefix: the row of position ``p`` is derived
from a chained hash of ``tokens[0..p]``. Rows computed for a rejected draft therefore
differ from the true row of that position, and rows of equal prefixes (prefix-cache hits)
are equal. Every row a connector returns is checked against that function, and every
request's rows as the client assembles them (``take_output`` chunks, concatenated) must be
exactly ``[routed_experts_prompt_start, num_tokens - 1)``.

The pieces, each importable on its own (no module imports one that imports it back):
``installed`` (the release and its contract row), ``toy_model`` (the routing oracle),
``scheduler`` (``make_scheduler``, ``make_request``), ``kv_connector`` (the stub KV
connector), ``connectors`` (ours, vLLM's own, the capturer stand-in), ``reference`` (a
plain-Python connector), ``runner`` (``SimModelRunner``), ``engine`` (``SimEngine``,
``RetainedPins``). The names tests use are re-exported here.
"""

from .installed import CONTRACT, VLLM_VERSION
from .toy_model import BLOCK_SIZE, ROW_SHAPE, HarnessError, expected_rows, random_prompt
from .scheduler import SchedulerSetup, make_request, make_scheduler
from .connectors import (
    HarnessMoEModel, SnapshotCapturer, build_connector_like_vllm, build_our_connector, build_vllm_connector, feed_rows,
)
from .reference import ReferenceWorkerConnector, build_reference_connector
from .runner import RunStats, SimModelRunner
from .engine import RetainedPins, RollbackEvent, SimEngine

__all__ = [
    "BLOCK_SIZE", "CONTRACT", "HarnessError", "HarnessMoEModel", "ROW_SHAPE", "ReferenceWorkerConnector",
    "RetainedPins", "RollbackEvent", "RunStats", "SchedulerSetup", "SimEngine", "SimModelRunner",
    "SnapshotCapturer", "VLLM_VERSION", "build_connector_like_vllm", "build_our_connector",
    "build_reference_connector", "build_vllm_connector", "expected_rows", "feed_rows", "make_request",
    "make_scheduler", "random_prompt",
]
