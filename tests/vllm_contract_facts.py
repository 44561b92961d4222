"""Each field of the version table, read off the installed vLLM's own code.

``connector/vllm/versions.py`` states per release what vLLM asks of the plugin; these are the
facts in vLLM that each field stands for, so a test can compare the row of the installed
release with the code it describes (an entry written wrong, or a new release that changed one
of them, fails there).
"""

import importlib.util
import inspect
from dataclasses import fields


def observed_contract_fields() -> dict[str, bool]:
    from vllm.distributed.aux_output_connector.connector import AuxOutputConnectorMetadata
    from vllm.distributed.aux_output_connector.routed_experts import RoutedExpertsBuffer
    from vllm.distributed.aux_output_connector.worker import AuxOutputWorkerConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.core.sched.output import CachedRequestData
    from vllm.v1.outputs import ModelRunnerOutput

    def field_names(cls) -> set[str]:
        return {field.name for field in fields(cls)}

    return {
        "two_step_storage": hasattr(AuxOutputWorkerConnector, "initialize_output_storage"),
        "scheduler_pins": "retained_block_hashes" in field_names(AuxOutputConnectorMetadata),
        "lookahead_hashing": "num_hash_lookahead_tokens" in inspect.signature(get_request_block_hasher).parameters,
        "builtin_reads_pending_blocks": "pending_blocks" in inspect.signature(RoutedExpertsBuffer.read).parameters,
        "has_model_runner_v1": importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is not None,
        "cached_requests_have_resumed_ids": "resumed_req_ids" in field_names(CachedRequestData),
        "runner_output_has_req_id_to_index": "req_id_to_index" in field_names(ModelRunnerOutput),
        "kv_connectors_may_keep_lookahead": hasattr(KVConnectorBase_V1, "supports_lookahead_block_hashes"),
    }


def assert_installed_contract_matches_vllm() -> None:
    """The installed release's row of the table equals what its code shows, field by field."""
    import vllm

    from routed_experts_cache.connector.vllm import versions

    contract = versions.installed_contract()
    stated = {field.name: getattr(contract, field.name) for field in fields(contract) if field.name != "series"}
    observed = observed_contract_fields()
    assert set(observed) == set(stated), "every field of the table needs a fact to check it against"
    wrong = {name: (stated[name], observed[name]) for name in stated if stated[name] != observed[name]}
    assert not wrong, f"vLLM {vllm.__version__}: table says / code shows: {wrong}"
