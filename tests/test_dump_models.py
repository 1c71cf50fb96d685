"""attach() follows the model: stand-ins whose `set_eagle3_layers_to_capture` is the REAL
method, compiled from the released SGLang source (PyPI wheels), on CPU.

Conventions covered: Llama (+1 on explicit ids), Qwen3-MoE (the inner model marks
its decoder layers), Qwen2.5-VL (also flips the inner model's flag), DeepSeek
0.5.14 (+1 only when the first id is 1: attach calls again with the layers as
given), a class without the method (attributes), the Kimi-K2.5 wrapper (language
model one level down), and a non-last pipeline rank (the method returns early:
refused, nothing captured).
"""

from __future__ import annotations

import ast
import importlib
import json
import textwrap
from types import SimpleNamespace as NS
from typing import List, Optional

import pytest

from remote_ops import wheels
from remote_ops.dumper import runtime as rt

torch = pytest.importorskip("torch")
import remote_ops.dumper as dump_pkg  # noqa: E402

_entry = dump_pkg.__dict__.get("attach")
_attach_mod = importlib.import_module("remote_ops.dumper.attach")
if callable(_entry):
    dump_pkg.attach = _entry  # importing the submodule rebinds the package's `attach` to it; undo that
attach, language_model, turn_on = _attach_mod.attach, _attach_mod.language_model, _attach_mod.turn_on

MODELS = "python/sglang/srt/models/"


def real_method(version: str, file: str, cls: str, name: str = "set_eagle3_layers_to_capture"):
    """The method `cls.name` exactly as released, compiled into a plain function."""
    text = wheels.sglang_source(version, MODELS + file).decode()
    node = next(n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ClassDef) and n.name == cls)
    fn = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == name)
    src = textwrap.dedent("\n".join(text.splitlines()[fn.lineno - 1 : fn.end_lineno]))
    scope = {"Optional": Optional, "List": List, "get_pp_group": lambda: NS(is_last_rank=True)}
    exec(compile(src, f"{file}:{cls}.{name}", "exec"), scope)
    return scope[name]


def standin(
    cls_name: str, method=None, inner_method=None, layers: int = 48, last_rank: bool = True, arch: str | None = None
):
    """A module shaped like the real class: config, pp_group, model.layers(_to_capture), the flag."""
    inner_cls = type(cls_name.replace("ForCausalLM", "Model"), (), {})
    if inner_method:
        inner_cls.set_eagle3_layers_to_capture = inner_method
    inner = inner_cls()
    inner.layers, inner.layers_to_capture = [NS() for _ in range(layers)], []
    outer_cls = type(cls_name, (), {"set_eagle3_layers_to_capture": method} if method else {})
    m = outer_cls()
    m.config = NS(num_hidden_layers=layers, hidden_size=64, architectures=[arch or cls_name])
    m.pp_group, m.model, m.capture_aux_hidden_states = NS(is_last_rank=last_rank), inner, False
    return m


def runtime():
    return rt.Runtime("0.5.9", 0, 1, rt.ServerArgsView(NS(tp_size=1)), "test")


@pytest.fixture
def attached(tmp_path):
    made = []

    def do(model, layers=None):
        env = {"SGLANG_HS_DUMP_DIR": str(tmp_path), "SGLANG_HS_DUMP_WRITERS": "1"}
        if layers:
            env["SGLANG_HS_DUMP_LAYERS"] = ",".join(map(str, layers))
        d = attach(model, env=env, runtime=runtime())
        made.append(d)
        return d

    yield do
    for d in made:
        if d is not None:
            d.close(timeout=5)


# ------------------------------------------------------------------ conventions
def test_llama_plus_one_on_explicit_ids(attached):
    m = standin("LlamaForCausalLM", real_method("0.5.9", "llama.py", "LlamaForCausalLM"))
    d = attached(m, [3, 25, 45])
    assert m.capture_aux_hidden_states is True and m.model.layers_to_capture == [3, 25, 45]
    assert d.metadata["capture_convention"] == "plus_one" and d.metadata["model_class"] == "LlamaForCausalLM"
    assert d.metadata["capture_method"] == "set_eagle3_layers_to_capture"
    assert d.metadata["eagle_aux_hidden_state_layer_ids"] == json.dumps([2, 24, 44])


def test_llama_default_layers_go_through_none(attached):
    m = standin("LlamaForCausalLM", real_method("0.5.23", "llama.py", "LlamaForCausalLM"))
    d = attached(m)
    assert m.model.layers_to_capture == [2, 24, 45] and d.metadata["capture_convention"] == "default"


def test_qwen3_moe_marks_its_decoder_layers(attached):
    """Qwen3-MoE only captures layers marked `_is_layer_to_capture` (Qwen2MoeModel's own setter):
    setting the attribute list alone would capture nothing."""
    m = standin(
        "Qwen3MoeForCausalLM",
        real_method("0.5.9", "qwen3_moe.py", "Qwen3MoeForCausalLM"),
        inner_method=real_method("0.5.9", "qwen2_moe.py", "Qwen2MoeModel"),
    )
    d = attached(m, [3, 25, 45])
    marked = [i for i, layer in enumerate(m.model.layers) if getattr(layer, "_is_layer_to_capture", False)]
    assert marked == [3, 25, 45] == m.model.layers_to_capture
    assert d.metadata["capture_convention"] == "plus_one" and d.metadata["model_class"] == "Qwen3MoeForCausalLM"


def test_qwen2_5_vl_flips_the_inner_flag(attached):
    m = standin(
        "Qwen2_5_VLForConditionalGeneration",
        real_method("0.5.9", "qwen2_5_vl.py", "Qwen2_5_VLForConditionalGeneration"),
    )
    attached(m)
    assert m.capture_aux_hidden_states is True and m.model.capture_aux_hidden_states is True
    assert m.model.layers_to_capture == [2, 24, 45]


def test_deepseek_0_5_14_takes_ids_as_given(attached):
    """From 0.5.13 DeepSeek adds 1 only when the first id is 1: attach reads back and calls again."""
    m = standin(
        "DeepseekV2ForCausalLM",
        real_method("0.5.14", "deepseek_v2.py", "DeepseekV2ForCausalLM"),
        layers=61,
        arch="DeepseekV3ForCausalLM",
    )
    d = attached(m, [3, 31, 59])
    assert m.model.layers_to_capture == [3, 31, 59] and d.metadata["capture_convention"] == "as_given"
    kimi = standin("DeepseekV2ForCausalLM", real_method("0.5.14", "deepseek_v2.py", "DeepseekV2ForCausalLM"), layers=61)
    assert turn_on(kimi, [2, 30, 58], 61)["capture_convention"] == "default"
    assert kimi.model.layers_to_capture == [2, 30, 58]


def test_class_without_the_method_gets_the_attributes(attached):
    m = standin("SomeForCausalLM")
    d = attached(m, [3, 25, 45])
    assert m.capture_aux_hidden_states is True and m.model.layers_to_capture == [3, 25, 45]
    assert d.metadata["capture_convention"] == d.metadata["capture_method"] == "attributes"


def test_kimi_wrapper_finds_the_language_model(attached):
    """Kimi-K2.5 (0.5.9) wraps DeepseekV3ForCausalLM as `language_model` and has no setter itself."""
    inner = standin("DeepseekV3ForCausalLM", real_method("0.5.9", "deepseek_v2.py", "DeepseekV2ForCausalLM"), layers=61)
    wrapper = type("KimiK25ForConditionalGeneration", (), {})()
    wrapper.language_model, wrapper.config = inner, NS(architectures=["KimiK25ForConditionalGeneration"])
    assert language_model(wrapper) == (inner, "language_model")
    d = attached(wrapper)
    assert inner._remote_ops_dump is d and inner.model.layers_to_capture == [2, 30, 58]
    assert d.metadata["language_model"] == "language_model"
    assert d.metadata["model_class"] == "DeepseekV3ForCausalLM"


def test_non_last_pipeline_rank_is_refused(attached, tmp_path):
    m = standin("LlamaForCausalLM", real_method("0.5.9", "llama.py", "LlamaForCausalLM"), last_rank=False)
    assert attached(m) is None
    assert m.capture_aux_hidden_states is False and m._remote_ops_dump is None
