"""The serving engine as data: the inventory's `serving.engine`, and vLLM's server, image and logs (pure)."""

import json

import pytest

from remote_ops.core.inventory import load_inventory, parse_inventory_data
from remote_ops.errors import ConfigError
from remote_ops.serving import KINDS, module_for, serving_for

VLLM_HOST = """\
hosts:
  v1:
    address: 127.0.0.1
    serving:
      engine: vllm
    vllm:
      version: "0.32.0"
      base_image: remote-ops/vllm-cpu:0.32.0
    model: {path: /models/tiny-llama, served_name: tiny, num_layers: 4, hidden_size: 128}
    dump: {dir: /data/dumps, layers: [1, 2, 3]}
    server: {port: 8000, tp: 1}
"""


def vllm_host(tmp_path, text=VLLM_HOST):
    path = tmp_path / "inv.yaml"
    path.write_text(text)
    return load_inventory([path]).one("v1")


def test_sglang_is_the_default_serving_engine():
    (host,) = parse_inventory_data({"hosts": {"h": {}}}, source="f.yaml")
    assert host.serving.engine == "sglang"
    assert serving_for(host).NEEDS_PATCH is True
    assert set(KINDS) == {"sglang", "vllm"}


def test_unknown_serving_engine_names_file_field_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("hosts:\n  h1:\n    serving:\n      engine: tgi\n")
    with pytest.raises(ConfigError) as exc:
        load_inventory([path])
    text = str(exc.value)
    assert str(path) in text and "hosts.h1.serving.engine" in text and "line 4" in text
    assert "sglang" in text and "vllm" in text


def test_serving_is_not_the_container_engine(tmp_path):
    host = vllm_host(tmp_path)
    assert host.engine == "docker" and host.serving.engine == "vllm"


def test_connector_dir_is_one_name_under_the_dump_dir():
    with pytest.raises(ConfigError, match=r"hosts\.h\.vllm\.connector_dir"):
        parse_inventory_data({"hosts": {"h": {"vllm": {"connector_dir": "../etc"}}}}, source="f.yaml")


def test_vllm_server_command_asks_the_aux_layers_and_the_final_state(tmp_path):
    host = vllm_host(tmp_path)
    v = serving_for(host)
    assert v.NEEDS_PATCH is False
    assert v.capture_layer_ids(host) == [1, 2, 3, 4]
    argv = list(v.command(host))
    assert argv[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert "--no-enable-chunked-prefill" in argv and "--no-enable-prefix-caching" in argv
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3, 4]}},
    }
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv["kv_role"] == "kv_producer"
    assert kv["kv_connector_module_path"] == v.CONNECTOR_MODULE
    assert kv["kv_connector_extra_config"] == {"shared_storage_path": "/data/dumps/vllm-out"}
    assert argv[argv.index("--port") + 1] == "8000"


def test_vllm_run_spec_has_no_sglang_dumper_settings_and_its_own_run_config(tmp_path):
    host = vllm_host(tmp_path)
    v = serving_for(host)
    spec = v.run_spec(host, "remote-ops/sglang-eagle3:x")
    assert not any(k.startswith("SGLANG_") for k in spec.env)
    assert spec.env["VLLM_PORT"] == "8000"
    assert spec.entrypoint == ()
    assert "/data/dumps:/data/dumps" in spec.volumes
    other = v.run_spec(host.model_copy(update={"dump": host.dump.model_copy(update={"layers": [1, 2, 2]})}), "x")
    from remote_ops.engine.labels import RUN_CONFIG

    assert spec.labels[RUN_CONFIG] != other.labels[RUN_CONFIG]


def test_vllm_image_is_rendered_from_the_pinned_release(tmp_path):
    host = vllm_host(tmp_path)
    v = serving_for(host)
    text = v.render_dockerfile(host)
    assert "FROM remote-ops/vllm-cpu:0.32.0" in text
    assert 'org.remote-ops.vllm.version="0.32.0"' in text
    assert "/health" in text and "ENTRYPOINT []" in text
    assert v.image_ref(host).startswith("remote-ops/sglang-eagle3:vllm-0.32.0-")
    newer = host.model_copy(update={"vllm": host.vllm.model_copy(update={"version": "0.33.0"})})
    assert v.image_ref(newer) != v.image_ref(host)


def test_vllm_log_stats_lines():
    log = (
        "INFO 12-02 11:15:03 [api_server.py:1] Starting vLLM API server 0 on http://0.0.0.0:8000\n"
        "INFO 12-02 11:15:13 [loggers.py:123] Engine 000: Avg prompt throughput: 1234.5 tokens/s, "
        "Avg generation throughput: 12.0 tokens/s, Running: 3 reqs, Waiting: 1 reqs, "
        "GPU KV cache usage: 4.5%, Prefix cache hit rate: 0.0%\n"
        "(APIServer pid=1) INFO 12-02 11:15:23 [loggers.py:257] Engine 000: Avg prompt throughput: 99.0 tokens/s, "
        "Avg generation throughput: 0.5 tokens/s, Running: 0 reqs, Waiting: 2 reqs, Preemptions: 1, "
        "CPU KV cache usage: 0.1%\n"
    )
    rec, cpu = module_for("vllm").log_stats(log)
    assert cpu["prompt_tokens_per_s"] == 99.0 and cpu["waiting"] == 2 and cpu["kv_cache_usage_pct"] == 0.1
    assert rec == {
        "time": "12-02 11:15:13",
        "prompt_tokens_per_s": 1234.5,
        "generation_tokens_per_s": 12.0,
        "running": 3,
        "waiting": 1,
        "kv_cache_usage_pct": 4.5,
    }


def http_answer(version: str) -> str:
    """The HTTP probe's curl output format (`@@http GROUP PATH CURL_EXIT HTTP_CODE SECONDS`, then the body)."""
    return (
        "@@http /health /health 0 200 0.001\n\n"
        '@@http /v1/models /v1/models 0 200 0.002\n{"object":"list","data":[{"id":"tiny"}]}\n'
        f'@@http /version /version 0 200 0.001\n{{"version":"{version}"}}\n'
    )


def test_health_asks_vllms_own_endpoints_and_checks_the_pinned_release(tmp_path):
    from remote_ops.probes.endpoints import HttpEndpoints, check_http

    host = vllm_host(tmp_path)
    probe = HttpEndpoints(host, deep=True)
    cmd = probe.command()
    assert "/health" in cmd and "/version" in cmd and "/v1/completions" in cmd and "/get_model_info" not in cmd
    checks = {(c.tier, c.name): c for c in check_http(host, (0, http_answer("0.32.0")), None)}
    assert list(checks) == [("vllm", "health"), ("vllm", "v1_models"), ("vllm", "version"), ("vllm", "release")]
    assert all(c.status == "ok" for c in checks.values())
    cut = http_answer("0.32.0").rstrip("\n")  # a batch section hands the text back without its last newline
    assert [c.status for c in check_http(host, (0, cut), None) if c.name == "release"] == ["ok"]
    (bad,) = [c for c in check_http(host, (0, http_answer("0.31.0")), None) if c.name == "release"]
    assert bad.status == "fail" and "vllm 0.31.0, the inventory pins 0.32.0" in bad.reason


def test_health_of_a_vllm_host_skips_the_patch_and_counts_vllm_endpoints_as_answering(tmp_path):
    from remote_ops.probes.base import Check
    from remote_ops.probes.patch import PatchInContainer
    from remote_ops.workflows import health

    host = vllm_host(tmp_path)
    assert not any(isinstance(p, PatchInContainer) for p in health.probes(host))
    starting = Check("container", "state", "warn", "running, health check still starting")
    out = health.starting_but_answering([starting, Check("vllm", "health", "ok", "/health -> HTTP 200")])
    assert out[0].status == "ok"


def test_extract_start_runs_the_client_in_vllm_mode_with_the_served_name(tmp_path):
    from remote_ops.core.extractplan import launch_command, paths_for

    host = vllm_host(tmp_path)
    cmd = launch_command(paths_for(host), "http://127.0.0.1:8000", 4, 2, "/d.jsonl", None, 30.0, None, v_args(host))
    assert "--serving vllm --model tiny" in cmd
    sglang = launch_command(paths_for(host), "http://127.0.0.1:8000", 4, 2, "/d.jsonl")
    assert "--serving" not in sglang


def v_args(host):
    return serving_for(host).client_args(host)


def test_a_vllm_image_built_by_deploy_is_the_expected_image_without_patch_labels():
    from remote_ops.engine import labels
    from remote_ops.engine.types import ContainerInfo, ImageInfo
    from remote_ops.probes.engine import check_image

    ref = "remote-ops/vllm-eagle3:vllm-0.32.0-abc"
    c = ContainerInfo("c1", "vllm-eagle3", "sha256:i", ref, "running", "healthy")
    built = ImageInfo("sha256:i", (ref,), {labels.LABEL_PREFIX + "serving": "vllm", labels.CONTEXT_HASH: "x"})
    assert check_image(c, built, ref).status == "ok"
    assert check_image(c, ImageInfo("sha256:i", (ref,), {}), ref).status == "fail"


# --------------------------------------------------------------------------- vLLM's own layer numbering


def test_vllm_numbers_a_drafters_ids_as_the_layers_it_captures():
    """vLLM 0.32.0 uses the ids as given (id k: the state after k layers, the state entering layer
    k), sorted: the dumps' layers_to_capture are the ids a drafter served by vLLM must carry."""
    from remote_ops.core import layerids

    c = layerids.vllm_convention("0.32.0")
    assert c is not None and c.rule == "as_given" and c.engine == "vLLM" and "gpu_model_runner.py" in c.source
    assert layerids.served_layers("as_given", [3, 1, 2], 4) == [1, 2, 3]
    assert layerids.served_layers("as_given", None, 40) == [2, 20, 37]  # get_eagle3_default_aux_hidden_state_layers
    assert layerids.ids_for("as_given", [1, 2, 3]) == [1, 2, 3]
    assert layerids.vllm_convention("not a release") is None


def test_vllm_reads_the_top_level_ids_first_then_eagle_config():
    from remote_ops.core import layerids

    c = layerids.vllm_convention("0.32.0")
    top = layerids.read_draft_config({"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "hidden_size": 128})
    assert layerids.layer_problems([1, 2, 3], [0, 1, 2], c, "0.32.0", 4, top) == ([], [])
    both = layerids.read_draft_config(
        {"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}
    )
    assert layerids.layer_problems([1, 2, 3], [0, 1, 2], c, "0.32.0", 4, both) == ([], [])
    # a drafter numbered for SGLang (ids = layers - 1) is one layer off under vLLM
    sglang_numbered = layerids.read_draft_config({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}})
    fails, _ = layerids.layer_problems([1, 2, 3], [0, 1, 2], c, "0.32.0", 4, sglang_numbered)
    assert len(fails) == 1 and "would make vLLM 0.32.0 (as_given" in fails[0]
    assert (
        "capture layers [0, 1, 2]; the dumps hold layers [1, 2, 3] (a drafter served there needs [1, 2, 3])" in fails[0]
    )
    # no drafter: the note names the ids a drafter served by vLLM needs
    fails, notes = layerids.layer_problems([1, 2, 3], [0, 1, 2], c, "0.32.0", 4)
    assert not fails and "vLLM 0.32.0" in notes[0] and "= [1, 2, 3]" in notes[0]


def test_the_audit_of_a_vllm_host_judges_under_vllms_numbering(tmp_path):
    """`dumps audit`, `train start`'s contract and `spec deploy` ask `audit.serving`: on a vLLM host
    it is the host's vLLM release, not its (unused) SGLang release; --serving-sglang still asks SGLang."""
    from remote_ops.workflows import audit

    host = vllm_host(tmp_path)
    srv = audit.serving(host, None, ["LlamaForCausalLM"])
    assert srv.engine == "vLLM" and srv.version == "0.32.0" and srv.convention.rule == "as_given"
    assert srv.to_dict()["engine"] == "vLLM" and "vllm.version" in srv.how
    asked = audit.serving(host, "0.5.9", ["LlamaForCausalLM"])
    assert asked.engine == "SGLang" and asked.convention.rule == "plus_one"


# --------------------------------------------------------------------------- spec deploy on vLLM (pure)


def test_vllm_spec_host_serves_the_drafter_with_eagle3_and_extraction_off(tmp_path):
    from remote_ops.engine.labels import RUN_CONFIG
    from remote_ops.serving import vllm as v

    host = vllm_host(tmp_path)
    spec = v.spec_host(v.spec_host(host, "/data/drafter", 5), "/data/drafter", 3)  # a re-run replaces
    argv = list(v.command(spec))
    assert argv.count("--speculative-config") == 1 and "--kv-transfer-config" not in argv
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {
        "method": "eagle3",
        "model": "/data/drafter",
        "num_speculative_tokens": 3,
    }
    assert "extract_hidden_states" not in " ".join(argv)
    assert spec == v.spec_host(spec, "/data/drafter", 3)
    run = v.run_spec(spec, "img")
    assert run.volumes.count("/data/drafter:/data/drafter:ro") == 1
    assert run.labels[v.SERVES_LABEL] == "eagle3" and run.env[v.SERVE_ENV] == "eagle3"
    target = v.run_spec(v.spec_host(spec, None, 3), "img")
    assert "--speculative-config" not in target.command and "--kv-transfer-config" not in target.command
    assert target.labels[v.SERVES_LABEL] == "target" and "/data/drafter:/data/drafter:ro" not in target.volumes
    extract = v.run_spec(host, "img")  # the extraction server: no label, its run-config as before
    assert v.SERVES_LABEL not in extract.labels and v.SERVE_ENV not in extract.env
    assert len({run.labels[RUN_CONFIG], target.labels[RUN_CONFIG], extract.labels[RUN_CONFIG]}) == 3
    assert v.serves(host) == "extract" and v.serves(spec) == "eagle3"
