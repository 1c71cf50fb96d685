"""The inventory's `dump.storage` (bf16 | fp8_e4m3): validated at the boundary, passed to both engines (pure)."""

import pytest

from remote_ops.core.inventory import load_inventory, parse_inventory_data
from remote_ops.engine.spec import dump_env, for_host
from remote_ops.errors import ConfigError
from remote_ops.serving import serving_for

VLLM = {"serving": {"engine": "vllm"}, "model": {"num_layers": 4, "hidden_size": 128}, "dump": {"layers": [1, 2, 3]}}


def host_with(storage=None, **extra):
    dump = {} if storage is None else {"storage": storage}
    data = {"hosts": {"h": {**extra, "dump": {**extra.get("dump", {}), **dump}}}}
    (host,) = parse_inventory_data(data, source="f.yaml")
    return host


def test_default_is_bf16_and_adds_no_variable_to_either_engine():
    host = host_with()
    assert host.dump.storage == "bf16"
    assert not any(k.endswith("_DTYPE") for k in dump_env(host))
    assert "SGLANG_HS_DUMP_DTYPE" not in for_host(host, "img").env
    vllm = host_with(**VLLM)
    assert "REMOTE_OPS_DUMP_DTYPE" not in serving_for(vllm).run_spec(vllm, "img").env


def test_fp8_reaches_the_sglang_dumper_and_the_vllm_connector():
    host = host_with("fp8_e4m3")
    assert dump_env(host)["SGLANG_HS_DUMP_DTYPE"] == "fp8_e4m3"
    assert for_host(host, "img").env["SGLANG_HS_DUMP_DTYPE"] == "fp8_e4m3"
    vllm = host_with("fp8_e4m3", **VLLM)
    env = serving_for(vllm).run_spec(vllm, "img").env
    assert env["REMOTE_OPS_DUMP_DTYPE"] == "fp8_e4m3" and not any(k.startswith("SGLANG_") for k in env)


def test_the_two_engines_take_the_same_names():
    from remote_ops.dumper import config

    assert config.STORAGES == ("bf16", "fp8_e4m3")
    from remote_ops.core.inventory import DumpSpec

    assert set(DumpSpec.model_fields["storage"].annotation.__args__) == set(config.STORAGES)


def test_an_unknown_storage_names_file_field_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("hosts:\n  h1:\n    dump:\n      dir: /data/d\n      storage: fp4\n")
    with pytest.raises(ConfigError) as exc:
        load_inventory([path])
    text = str(exc.value)
    assert str(path) in text and "hosts.h1.dump.storage" in text and "line 5" in text
    assert "bf16" in text and "fp8_e4m3" in text
