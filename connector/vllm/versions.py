"""What each supported vLLM release asks of this project: the one place for version glue.

Every difference between the releases the plugin supports is a field of ``VllmContract``,
read from the two wheels' sources (``pip download --no-deps vllm==X`` and unzip). Supporting
a new release is one more row in ``CONTRACTS`` (plus a test tier); a release without a row is
refused by the plugin, which then leaves vLLM's built-in path in place.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VllmContract:
    series: str
    # Model Runner V2 builds the worker connector in two steps: ``get_aux_output_connector(model,
    # vllm_config)`` in ``profile_run``, then ``initialize_output_storage(kv_cache_config)`` once
    # the KV layout is resolved (0.34). Before: one call with ``kv_cache_config`` as third argument.
    two_step_storage: bool
    # ``AuxOutputConnectorMetadata`` carries ``retained_block_hashes`` / ``released_block_hashes``:
    # the scheduler pins up to its KV capacity of finished blocks (0.33+).
    scheduler_pins: bool
    # Block hashes may trail full blocks by the EAGLE/MTP lookahead tokens (0.33+).
    lookahead_hashing: bool
    # vLLM's own ``RoutedExpertsBuffer.read`` takes the request's pending blocks, so its built-in
    # path reads across them instead of failing (the lookahead bug, fixed in 0.34).
    builtin_reads_pending_blocks: bool
    # Model Runner V1 still exists, chosen by ``VLLM_USE_V2_MODEL_RUNNER`` / ``use_v2_model_runner``.
    has_model_runner_v1: bool
    # ``CachedRequestData.resumed_req_ids`` (removed in 0.34: resumed requests are new requests).
    cached_requests_have_resumed_ids: bool
    # ``ModelRunnerOutput.req_id_to_index`` (removed in 0.34).
    runner_output_has_req_id_to_index: bool
    # A KV connector may keep lookahead hashing (``supports_lookahead_block_hashes``, 0.34);
    # before, any KV connector turned it off.
    kv_connectors_may_keep_lookahead: bool


CONTRACTS: dict[str, VllmContract] = {
    contract.series: contract
    for contract in (
        VllmContract("0.32", two_step_storage=False, scheduler_pins=False, lookahead_hashing=False,
                     builtin_reads_pending_blocks=False, has_model_runner_v1=True,
                     cached_requests_have_resumed_ids=True, runner_output_has_req_id_to_index=True,
                     kv_connectors_may_keep_lookahead=False),
        VllmContract("0.33", two_step_storage=False, scheduler_pins=True, lookahead_hashing=True,
                     builtin_reads_pending_blocks=False, has_model_runner_v1=True,
                     cached_requests_have_resumed_ids=True, runner_output_has_req_id_to_index=True,
                     kv_connectors_may_keep_lookahead=False),
        VllmContract("0.34", two_step_storage=True, scheduler_pins=True, lookahead_hashing=True,
                     builtin_reads_pending_blocks=True, has_model_runner_v1=False,
                     cached_requests_have_resumed_ids=False, runner_output_has_req_id_to_index=False,
                     kv_connectors_may_keep_lookahead=True),
    )
}


def series_of(version: str) -> str:
    """``"0.34.0"``, ``"0.34.1.dev3+g..."`` -> ``"0.34"``."""
    return ".".join(version.split(".")[:2])


def contract_for(version: str) -> VllmContract | None:
    """The contract of a vLLM version string, or None when the release is not supported."""
    return CONTRACTS.get(series_of(version))


def supported_series() -> str:
    """For messages: ``"0.32.x, 0.33.x, 0.34.x"``."""
    return ", ".join(f"{series}.x" for series in CONTRACTS)


def installed_contract() -> VllmContract:
    """The contract of the installed vLLM; raises for a release without one."""
    import vllm

    from ...errors import RoutedExpertsCacheError

    contract = contract_for(vllm.__version__)
    if contract is None:
        raise RoutedExpertsCacheError(
            f"vLLM {vllm.__version__} is not supported (supported: {supported_series()})"
        )
    return contract
