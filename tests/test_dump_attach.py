"""attach(): layer mapping, settings, the hazard switch, the all-reduce-fusion window, version-tolerant probes."""

from __future__ import annotations

import json
import logging
import sys
import types
from types import SimpleNamespace

import pytest

from remote_ops.dumper import config as cfg, runtime as rt

torch = pytest.importorskip("torch")
from remote_ops.dumper import attach  # noqa: E402


def standin_model(layers=61, hidden=64, communicators=False):
    """DeepseekV2ForCausalLM-shaped: config, model.layers(_to_capture), the capture flag."""
    decoder = [
        SimpleNamespace(layer_communicator=SimpleNamespace(should_fuse_mlp_allreduce_with_next_layer=lambda fb: True))
        if communicators
        else SimpleNamespace()
        for _ in range(layers)
    ]
    return SimpleNamespace(
        config=SimpleNamespace(num_hidden_layers=layers, hidden_size=hidden, architectures=["DeepseekV3ForCausalLM"]),
        model=SimpleNamespace(layers_to_capture=[], layers=decoder),
        capture_aux_hidden_states=False,
    )


def runtime(version="0.5.9", rank=0, tp=8, **args):
    return rt.Runtime(version, rank, tp, rt.ServerArgsView(SimpleNamespace(tp_size=tp, **args)), "test")


def env(tmp_path, **extra):
    out = {"SGLANG_HS_DUMP_DIR": str(tmp_path), "SGLANG_HS_DUMP_WRITERS": "1"}
    out.update({"SGLANG_HS_DUMP_" + k.upper(): str(v) for k, v in extra.items()})
    return out


@pytest.fixture
def attached():
    made = []

    def do(model, *args, **kwargs):
        d = attach(model, *args, **kwargs)
        made.append(d)
        return d

    yield do
    for d in made:
        if d is not None:
            d.close(timeout=5)


# --------------------------------------------------------------------------- layers


@pytest.mark.parametrize("layers,want", [(61, [2, 30, 58]), (40, [2, 20, 37]), (27, [2, 13, 24])])
def test_default_layers_follow_sglang_eagle3_default(layers, want):
    assert cfg.resolve_layers(layers) == want == [2, layers // 2, layers - 3]


def test_kimi_layers_in_both_conventions():
    layers = cfg.resolve_layers(61)
    assert layers == [2, 30, 58] and cfg.eagle_layer_ids(layers) == [1, 29, 57]


def test_env_override_is_sorted_and_validated():
    assert cfg.resolve_layers(61, cfg.parse_layer_list("58, 2,30")) == [2, 30, 58]
    for bad in ("0,30,58", "2,30,61", "2,30", "2,2,30"):
        with pytest.raises(ValueError):
            cfg.resolve_layers(61, cfg.parse_layer_list(bad))
    with pytest.raises(ValueError, match="SGLANG_HS_DUMP_LAYERS"):
        cfg.parse_layer_list("2,x,3")


def test_attach_turns_capture_on_with_env_layers(tmp_path, attached):
    model = standin_model()
    d = attached(model, env=env(tmp_path, layers="3,31,59"), runtime=runtime())
    assert model.capture_aux_hidden_states is True and model.model.layers_to_capture == [3, 31, 59]
    assert model._remote_ops_dump is d and d.writer
    assert d.metadata["eagle_aux_hidden_state_layer_ids"] == "[2, 30, 58]"
    assert d.metadata["layers_to_capture"] == "[3, 31, 59]" and d.metadata["num_hidden_layers"] == "61"


def test_non_writer_ranks_capture_but_do_not_write(tmp_path, attached):
    model = standin_model()
    d = attached(model, env=env(tmp_path), runtime=runtime(rank=3))
    assert model.capture_aux_hidden_states and model.model.layers_to_capture == [2, 30, 58]
    assert not d.writer and not (tmp_path / "rank3").exists()
    d_all = attached(standin_model(), env=env(tmp_path, all_ranks=1), runtime=runtime(rank=3))
    assert d_all.writer and (tmp_path / "rank3" / "stats.json").exists()


def test_config_defaults_and_bad_values():
    c = cfg.config_from_env({"SGLANG_HS_DUMP_DIR": "/d"})
    assert (c.policy, c.buffers, c.writers, c.fusion, c.all_ranks, c.layers) == (
        "backpressure",
        4,
        8,
        "disable",
        False,
        None,
    )
    assert (c.gather_tokens, c.gather_steps, c.gather_ms, c.writer) == (4096, 8, 500, "process")
    off = cfg.config_from_env({"SGLANG_HS_DUMP_DIR": "/d", "SGLANG_HS_DUMP_GATHER_TOKENS": "0"})
    assert off.gather_tokens == 0
    bad = (("POLICY", "maybe"), ("BUFFERS", "0"), ("WRITERS", "x"), ("FUSION", "off"), ("GATHER_TOKENS", "-1"))
    for name, value in bad + (("GATHER_STEPS", "0"), ("GATHER_MS", "soon"), ("WRITER", "fork")):
        with pytest.raises(ValueError, match="SGLANG_HS_DUMP_" + name):
            cfg.config_from_env({"SGLANG_HS_DUMP_DIR": "/d", "SGLANG_HS_DUMP_" + name: value})


def test_bad_settings_refuse_without_touching_the_model(tmp_path, attached, caplog):
    model = standin_model()
    with caplog.at_level(logging.ERROR, logger="remote_ops_dump"):
        assert attached(model, env=env(tmp_path, policy="sometimes"), runtime=runtime()) is None
    assert model.capture_aux_hidden_states is False and model._remote_ops_dump is None
    assert "REFUSED" in caplog.text and "SGLANG_HS_DUMP_POLICY" in caplog.text


# --------------------------------------------------------------------------- hazards


@pytest.mark.parametrize(
    "flag,value",
    [
        ("pp_size", 2),
        ("enable_dp_attention", True),
        ("enable_two_batch_overlap", True),
        ("enable_piecewise_cuda_graph", True),
        ("enable_attn_tp_input_scattered", True),
        ("enable_nsa_prefill_context_parallel", True),
        ("dp_size", 2),
    ],
)
def test_hazard_switch_refuses_with_a_clear_log_error(tmp_path, attached, caplog, flag, value):
    model = standin_model()
    with caplog.at_level(logging.ERROR, logger="remote_ops_dump"):
        d = attached(model, env=env(tmp_path), runtime=runtime(**{flag: value}))
    assert d is None and model._remote_ops_dump is None
    assert model.capture_aux_hidden_states is False and model.model.layers_to_capture == []
    assert "REFUSED" in caplog.text and flag in caplog.text
    stats = json.loads((tmp_path / "rank0" / "stats.json").read_text())
    assert stats["state"] == "refused" and flag in stats["reason"][0]


def test_harmless_flags_do_not_refuse(tmp_path, attached):
    args = dict(
        pp_size=1,
        dp_size=1,
        enable_dp_attention=False,
        enable_two_batch_overlap=False,
        enable_piecewise_cuda_graph=False,
        enable_attn_tp_input_scattered=False,
        enable_torch_compile=True,
    )
    assert rt.hazards(rt.ServerArgsView(SimpleNamespace(**args))) == []
    assert attached(standin_model(), env=env(tmp_path), runtime=runtime(**args)) is not None


def test_old_dict_shaped_server_args_are_read_too():
    view = rt.ServerArgsView({"enable_dp_attention": True})
    assert view.get("enable_dp_attention") and view.get("missing", 7) == 7
    assert rt.hazards(view) and view.set("enable_dp_attention", False) and rt.hazards(view) == []


# --------------------------------------------------------------------------- all-reduce fusion


@pytest.mark.parametrize(
    "version,inside",
    [
        ("0.5.6", False),
        ("0.5.7", True),
        ("0.5.9", True),
        ("0.5.10rc0", True),
        ("0.5.13", True),
        ("0.5.14", False),
        ("0.5.23", False),
        ("unknown", False),
    ],
)
def test_fusion_window_is_0_5_7_to_0_5_13(version, inside):
    assert rt.in_fusion_window(version) is inside


def test_fusion_disable_turns_the_flag_off_and_says_so(tmp_path, attached, caplog):
    run = runtime(enable_flashinfer_allreduce_fusion=True)
    with caplog.at_level(logging.WARNING, logger="remote_ops_dump"):
        d = attached(standin_model(), env=env(tmp_path), runtime=run)
    assert run.server_args.source.enable_flashinfer_allreduce_fusion is False
    assert d.metadata["allreduce_fusion"].startswith("disabled") and "fusion: disabled" in caplog.text


def test_fusion_allreduce_unfuses_only_the_layers_before_each_capture(tmp_path, attached):
    model = standin_model(communicators=True)
    run = runtime(enable_flashinfer_allreduce_fusion=True)
    d = attached(model, env=env(tmp_path, fusion="allreduce"), runtime=run)
    assert run.server_args.source.enable_flashinfer_allreduce_fusion is True
    fused = [
        i
        for i, layer in enumerate(model.model.layers)
        if layer.layer_communicator.should_fuse_mlp_allreduce_with_next_layer(None)
    ]
    assert sorted(set(range(61)) - set(fused)) == [1, 29, 57]
    assert d.metadata["allreduce_fusion"].startswith("allreduce")


def test_fusion_allreduce_falls_back_to_disable_without_communicators(tmp_path, attached):
    run = runtime(enable_flashinfer_allreduce_fusion=True)
    d = attached(standin_model(), env=env(tmp_path, fusion="allreduce"), runtime=run)
    assert run.server_args.source.enable_flashinfer_allreduce_fusion is False
    assert "allreduce not possible" in d.metadata["allreduce_fusion"]


@pytest.mark.parametrize(
    "version,tp,flag,word",
    [("0.5.14", 8, True, "not-needed"), ("0.5.9", 1, True, "not-needed"), ("0.5.9", 8, False, "off")],
)
def test_fusion_left_alone_outside_the_hazard(tmp_path, attached, version, tp, flag, word):
    run = runtime(version=version, tp=tp, enable_flashinfer_allreduce_fusion=flag)
    d = attached(standin_model(), env=env(tmp_path), runtime=run)
    assert run.server_args.source.enable_flashinfer_allreduce_fusion is flag
    assert d.metadata["allreduce_fusion"].startswith(word)


# --------------------------------------------------------------------------- probes


def test_probes_without_sglang_fall_back_quietly(monkeypatch):
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "sglang", None)  # import fails like a missing package
    probed = rt.probe_runtime()
    assert probed.rank == 0 and probed.version == "unknown" and probed.tp_size == 1
    assert rt.hazards(probed.server_args) == []


def standin_module(name, **attrs):
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


def test_probes_read_sglang_0_5_9_names(monkeypatch):
    """Stand-in modules with 0.5.9's module paths and helper names."""
    args = SimpleNamespace(tp_size=4, enable_dp_attention=False)
    mods = {
        "sglang": standin_module("sglang", __version__="0.5.9"),
        "sglang.srt": standin_module("sglang.srt"),
        "sglang.srt.server_args": standin_module("sglang.srt.server_args", get_global_server_args=lambda: args),
        "sglang.srt.layers": standin_module("sglang.srt.layers"),
        "sglang.srt.layers.dp_attention": standin_module(
            "sglang.srt.layers.dp_attention", get_attention_tp_rank=lambda: 3, get_attention_tp_size=lambda: 4
        ),
    }
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    probed = rt.probe_runtime()
    assert (probed.version, probed.rank, probed.tp_size) == ("0.5.9", 3, 4)
    assert probed.rank_source.startswith("dp_attention") and probed.server_args.source is args


def test_rank_falls_back_to_the_tp_rank_when_dp_attention_helpers_are_missing(monkeypatch):
    def not_initialized():
        raise AssertionError("dp attention not initialized!")

    mods = {
        "sglang": standin_module("sglang"),
        "sglang.srt": standin_module("sglang.srt"),
        "sglang.srt.layers": standin_module("sglang.srt.layers"),
        "sglang.srt.layers.dp_attention": standin_module(
            "sglang.srt.layers.dp_attention", get_attention_tp_rank=not_initialized
        ),
        "sglang.srt.distributed": standin_module("sglang.srt.distributed", get_tensor_model_parallel_rank=lambda: 5),
    }
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    assert rt.attention_tp_rank() == (5, "distributed.get_tensor_model_parallel_rank")


def test_package_works_as_the_top_level_copy_in_the_image(tmp_path):
    """The image holds a copy named `remote_ops_dump`: relative imports only, attach() works."""
    import shutil
    import subprocess
    from pathlib import Path

    src = Path(rt.__file__).parent
    shutil.copytree(src, tmp_path / "remote_ops_dump", ignore=shutil.ignore_patterns("__pycache__"))
    code = (
        "import sys; from types import SimpleNamespace as NS; import remote_ops_dump; "
        "m = NS(config=NS(num_hidden_layers=61, hidden_size=8), model=NS(layers_to_capture=[], layers=[])); "
        "d = remote_ops_dump.attach(m, env={'SGLANG_HS_DUMP_DIR': sys.argv[1]}); "
        "assert m.model.layers_to_capture == [2, 30, 58] and m._remote_ops_dump is d and d.writer; "
        "assert 'remote_ops' not in sys.modules; d.close(5); print('ok')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "dumps")], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
