"""Rows across a prefill/decode split, at the scheduler level, on vLLM 0.33's and 0.34's real
scheduler: two engines in one process (a prefill instance and a decode instance, each with its
own scheduler, KV cache and worker connector of this project) share KV through the harness's
stub KV connector (``shared_store``: what the prefill saves, the decode loads, like
ExampleConnector's shared storage path).

The prefill runs each prompt for one token with ``kv_transfer_params={"do_remote_decode":
True}`` and returns ``kv_transfer_params`` carrying the rows (``row_transfer``); they go
unchanged into the decode request, whose scheduler may then load the prompt's KV (the hit is
covered by the imported rows) and whose client rows, for the whole sequence, equal the routing
oracle. Without the rows, or with rows that do not fit the model, the decode recomputes the
prompt; its rows are exact as well.
"""

import base64
import copy
import itertools
import logging

import numpy as np
import pytest

from cpu_harness.vllm_scheduler import (  # first: fails with a clear message outside vLLM 0.33 and 0.34
    SimEngine, build_our_connector, make_request, make_scheduler, random_prompt,
)
from cpu_harness.vllm_scheduler.multi_turn import TierRun, observe_hits
from routed_experts_cache import RoutedExpertsCacheError
from routed_experts_cache.connector.vllm.row_transfer import (
    MAX_BYTES_ENV, ROWS_KEY, decode_rows, encode_rows, max_export_bytes,
)

_STORES = itertools.count()


def pd_pair():
    """A prefill engine and a decode engine sharing one KV store."""
    store = f"pd-{next(_STORES)}"
    engines = []
    for _ in range(2):
        setup = make_scheduler(lookahead=0, num_spec_tokens=0, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
                               kv_connector={"load_mode": "async", "shared_store": store})
        engines.append((setup, SimEngine(setup, build_our_connector(setup))))
    run = TierRun("stub", "ours", 64, 0)
    observe_hits(engines[1][0].scheduler, run)
    return engines[0], engines[1], run


def prefill(setup, engine, prompts):
    for request_id, prompt in prompts.items():
        engine.add(make_request(setup, request_id, prompt, 1, kv_transfer_params={"do_remote_decode": True}))
    engine.flush()
    engine.check_all_finished()
    return {request_id: engine.kv_transfer_params[request_id] for request_id in prompts}


def decode(setup, engine, prompts, params):
    for request_id, prompt in prompts.items():
        engine.add(make_request(setup, request_id, prompt, 6, kv_transfer_params=params.get(request_id)))
    engine.flush()
    engine.check_all_finished()  # every client row, [0, num_tokens - 1), equal to the oracle


def test_a_decode_instance_takes_the_prefills_rows_and_does_not_recompute_the_prompt():
    (p_setup, p_engine), (d_setup, d_engine), run = pd_pair()
    rng = np.random.default_rng(5)
    prompts = {f"r{i}": random_prompt(rng, int(n)) for i, n in enumerate(rng.integers(20, 60, size=6))}
    params = prefill(p_setup, p_engine, prompts)
    for request_id, prompt in prompts.items():
        entry = params[request_id][ROWS_KEY]
        assert entry["start"] == 0 and entry["shape"][0] == len(prompt) and entry["dtype"] == "uint8"
    decode(d_setup, d_engine, prompts, params)
    for request_id, prompt in prompts.items():
        decision = run.decisions[request_id]
        assert decision.offered > 0 and decision.accepted == decision.offered  # the prompt's KV was loaded
        first_computed = d_engine.stats.spans[request_id][0][0]
        assert first_computed >= len(prompt) - d_setup.block_size  # only the last partial block recomputed
    assert d_engine.connector.stats()["imported_rows"] >= sum(len(p) // 4 * 4 for p in prompts.values()) - 4 * len(prompts)


@pytest.mark.parametrize("damage", ["none", "missing", "wrong_shape", "wrong_dtype", "truncated_data", "start"])
def test_without_usable_rows_the_decode_recomputes_the_prompt_with_exact_rows(damage):
    (p_setup, p_engine), (d_setup, d_engine), run = pd_pair()
    rng = np.random.default_rng(6)
    prompts = {"r": random_prompt(rng, 40)}
    params = prefill(p_setup, p_engine, prompts)
    entry = params["r"][ROWS_KEY]
    if damage == "missing":
        params = {}
    else:
        bad = copy.deepcopy(entry)
        # Each damage alone makes the entry unusable: shape and dtype keep the data's length right.
        if damage == "wrong_shape":
            bad["shape"] = [bad["shape"][0] * bad["shape"][1], 1, bad["shape"][2]]
        elif damage == "wrong_dtype":
            wide = np.frombuffer(base64.b64decode(bad["data"]), dtype=np.uint8).astype(np.uint16)
            bad["dtype"], bad["data"] = "uint16", base64.b64encode(wide.tobytes()).decode("ascii")
        elif damage == "truncated_data":
            bad["data"] = bad["data"][:-8]
        elif damage == "start":
            bad["start"] = 4
        params = {"r": {**params["r"], ROWS_KEY: bad}}
    decode(d_setup, d_engine, prompts, params)
    decision = run.decisions["r"]
    assert decision.offered > 0
    assert decision.accepted == (decision.offered if damage == "none" else 0)


@pytest.mark.parametrize("limit", ["100", "0"])  # below 40 rows x 3 x 2 bytes; 0: never export
def test_rows_over_the_size_limit_are_not_exported(monkeypatch, limit):
    monkeypatch.setenv(MAX_BYTES_ENV, limit)
    (p_setup, p_engine), (d_setup, d_engine), run = pd_pair()
    rng = np.random.default_rng(7)
    prompts = {"r": random_prompt(rng, 40)}
    params = prefill(p_setup, p_engine, prompts)
    assert params["r"] is None or ROWS_KEY not in params["r"]
    decode(d_setup, d_engine, prompts, {"r": params["r"]} if params["r"] else {})
    assert run.decisions["r"].accepted == 0  # recomputed


@pytest.mark.parametrize("raw", ["-1", "x", "1.5", ""])
def test_an_export_limit_that_is_not_a_byte_count_is_refused_by_name(monkeypatch, raw):
    monkeypatch.setenv(MAX_BYTES_ENV, raw)
    with pytest.raises(RoutedExpertsCacheError, match=f"{MAX_BYTES_ENV}={raw!r} must be a number of bytes >= 0"):
        max_export_bytes()


def test_imports_go_with_a_requests_first_step_only_and_again_for_its_id_after_it_finished():
    """The decode instance sends a request's imported rows to its worker once (every later
    step would carry the prompt's rows again), and a request id used again after its finish is
    a new request with its own import."""
    (p_setup, p_engine), (d_setup, d_engine), run = pd_pair()
    rng = np.random.default_rng(11)
    prompts = {f"r{i}": random_prompt(rng, 40) for i in range(3)}
    params = prefill(p_setup, p_engine, prompts)
    connector = d_setup.scheduler.aux_output_connector
    sent = []
    build = connector.build_connector_meta

    def recording(*args, **kwargs):
        metadata = build(*args, **kwargs)
        sent.extend(metadata.imported_rows)
        return metadata

    connector.build_connector_meta = recording
    decode(d_setup, d_engine, prompts, params)
    assert sorted(sent) == sorted(prompts)
    assert all(run.decisions[r].accepted == run.decisions[r].offered > 0 for r in prompts)
    sent.clear()
    decode(d_setup, d_engine, prompts, params)  # the same ids, new requests
    assert sorted(sent) == sorted(prompts)


def test_a_request_that_asks_for_no_export_gets_no_rows_in_its_params():
    (p_setup, p_engine), _, _ = pd_pair()
    rng = np.random.default_rng(8)
    for request_id, params in (("plain", None), ("other", {"some_connector_field": 1})):
        p_engine.add(make_request(p_setup, request_id, random_prompt(rng, 40), 3, kv_transfer_params=params))
    p_engine.flush()
    p_engine.check_all_finished()
    assert all(ROWS_KEY not in (p_engine.kv_transfer_params.get(r) or {}) for r in ("plain", "other"))


def test_export_size_limit_is_inclusive_and_logged(caplog):
    rows = np.arange(5 * 3 * 2, dtype=np.uint8).reshape(5, 3, 2)
    entry = encode_rows("r", rows, limit=rows.nbytes)
    assert entry is not None and np.array_equal(decode_rows(entry, (3, 2), "uint8"), rows)
    with caplog.at_level(logging.WARNING, logger="vllm.routed_experts_cache"):
        assert encode_rows("r", rows, limit=rows.nbytes - 1) is None
    assert f"rows of request r ({rows.nbytes} bytes) exceed {MAX_BYTES_ENV}={rows.nbytes - 1}" in caplog.text


def _damaged(entry: dict, **changes) -> dict:
    return {**entry, **changes}


def test_each_check_of_an_import_entry_refuses_alone():
    """Every field of an import entry is checked on its own: a damage the other checks let
    through (the data's length kept right) is still refused, with the reason named."""
    rows = np.arange(4 * 3 * 2, dtype=np.uint8).reshape(4, 3, 2)
    good = encode_rows("r", rows, limit=1 << 20)
    wide = base64.b64encode(rows.astype(np.uint16).tobytes()).decode("ascii")
    refused = [
        ("not a dict", [good], "is a list, not a dict"),
        ("start", _damaged(good, start=4), "rows start at 4, not 0"),
        ("no start", {key: value for key, value in good.items() if key != "start"}, "rows start at None"),
        ("dtype", _damaged(good, dtype="int8"), "rows are 'int8'"),
        ("model's dtype", _damaged(good, dtype="uint16", data=wide), "this model's are uint8"),
        ("shape type", _damaged(good, shape=(4, 3, 2)), "is not [tokens, layers, top_k]"),
        ("shape length", _damaged(good, shape=[4, 6]), "is not [tokens, layers, top_k]"),
        ("bool dim", _damaged(good, shape=[24, True, 1]), "is not [tokens, layers, top_k]"),
        ("negative dim", _damaged(good, shape=[-4, 3, 2]), "is not [tokens, layers, top_k]"),
        ("model's shape", _damaged(good, shape=[4, 2, 3]), "rows of shape (2, 3), this model's are (3, 2)"),
        ("data type", _damaged(good, data=rows.tobytes()), "data does not hold 24 uint8 values"),
        ("not base64", _damaged(good, data="!" + good["data"][1:]), "data does not hold 24 uint8 values"),
        ("data length", _damaged(good, data=good["data"][:-4]), "data does not hold 24 uint8 values"),
    ]
    for name, entry, reason in refused:
        result = decode_rows(entry, (3, 2), "uint8")
        assert isinstance(result, str) and reason in result, (name, result)
    # Where the model is unknown here (vLLM 0.32's scheduler), shape and dtype are checked alone.
    assert isinstance(decode_rows(_damaged(good, shape=[24, True, 1]), None, None), str)
    assert np.array_equal(decode_rows(_damaged(good, dtype="uint16", data=wide), None, None), rows.astype(np.uint16))
    assert np.array_equal(decode_rows(good, None, None), rows)


def _config_with(connector: str, prefix_caching: bool = True):
    """A VllmConfig with routed experts on and ``connector`` as its KV connector."""
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.config.aux_output import AuxOutputConfig

    from cpu_harness.vllm_scheduler.scheduler import _model_dir

    return VllmConfig(
        model_config=ModelConfig(model=_model_dir(1), skip_tokenizer_init=True, dtype="float32", max_model_len=512),
        cache_config=CacheConfig(block_size=16, enable_prefix_caching=prefix_caching),
        device_config=DeviceConfig(device="cpu"), aux_output_config=AuxOutputConfig(enable_return_routed_experts=True),
        kv_transfer_config=KVTransferConfig(kv_connector=connector, kv_role="kv_both"),
    )


def test_nixl_is_refused_with_routed_experts_unless_the_user_opts_in(monkeypatch):
    """vLLM refuses NIXL-class P/D connectors with routed experts; the plugin keeps that refusal
    unless ``ROUTED_EXPERTS_CACHE_PD_CONNECTORS`` is on, and lifts nothing else."""
    from routed_experts_cache import RoutedExpertsCacheError
    from routed_experts_cache.connector.vllm import plugin

    assert plugin.register()
    monkeypatch.delenv(plugin.PD_CONNECTORS_SWITCH, raising=False)
    with pytest.raises(ValueError, match="incompatible with NixlConnector; PD auxiliary output is not supported"):
        _config_with("NixlConnector")
    monkeypatch.setenv(plugin.PD_CONNECTORS_SWITCH, "0")
    with pytest.raises(ValueError, match="incompatible with NixlConnector"):
        _config_with("NixlConnector")
    monkeypatch.setenv(plugin.PD_CONNECTORS_SWITCH, "1")
    config = _config_with("NixlConnector")
    assert config.kv_transfer_config.kv_connector == "NixlConnector"
    assert config.aux_output_config.enable_return_routed_experts
    with pytest.raises(ValueError, match="requires prefix caching"):  # vLLM's other checks still hold
        _config_with("NixlConnector", prefix_caching=False)
    monkeypatch.setenv(plugin.PD_CONNECTORS_SWITCH, "sometimes")  # refused at start, and at the check
    with pytest.raises(RoutedExpertsCacheError, match="ROUTED_EXPERTS_CACHE_PD_CONNECTORS='sometimes' is not understood"):
        plugin.register()
    with pytest.raises(ValueError, match="ROUTED_EXPERTS_CACHE_PD_CONNECTORS='sometimes' is not understood"):
        _config_with("NixlConnector")


def test_a_request_id_used_again_takes_its_new_import_or_none_never_the_old_one():
    """An import is checked once per request and kept while the request runs; a finish must
    drop it. A new request under a finished id, with another prompt, takes its own import (its
    rows exact), and one without an import recomputes: the old request's rows would be
    published under the new prompt's block hashes."""
    (p_setup, p_engine), (d_setup, d_engine), run = pd_pair()
    rng = np.random.default_rng(12)
    first = {f"r{i}": random_prompt(rng, 40) for i in range(2)}
    decode(d_setup, d_engine, first, prefill(p_setup, p_engine, first))
    second = {request_id: random_prompt(rng, 40) for request_id in first}
    second_params = prefill(p_setup, p_engine, second)
    decode(d_setup, d_engine, second, second_params)  # every row checked against the oracle
    assert all(run.decisions[r].accepted == run.decisions[r].offered > 0 for r in second)
    third = {request_id: random_prompt(rng, 40) for request_id in first}
    third_params = prefill(p_setup, p_engine, third)
    stripped = {r: {k: v for k, v in third_params[r].items() if k != ROWS_KEY} for r in third}
    decode(d_setup, d_engine, third, stripped)
    assert all(run.decisions[r].offered > 0 and run.decisions[r].accepted == 0 for r in third)
