"""The sandbox vLLM's target, committed as docker/vllm/learned-target/ (made once by
docker/vllm/learned_target.py, never trained by CI): its files match their SHA256SUMS, it loads with
`transformers` in the shape the sandbox declares, and it has learned what the drafter tests need.

Pure: no vLLM, no lab.  The real-vLLM agreement check is tests/test_vllm_real.py.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import shutil
from pathlib import Path

import pytest

from remote_ops.hostlab import vllm as labvllm
from remote_ops.hostlab._proc import LabError

ASSETS = Path(__file__).resolve().parents[1] / "docker" / "vllm"
MODEL = ASSETS / "learned-target"


def _maker():
    spec = importlib.util.spec_from_file_location("learned_target", ASSETS / "learned_target.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def model():
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL))


@pytest.fixture(scope="module")
def split():
    return json.loads((MODEL / "split.json").read_text())


def test_committed_files_match_their_checksums():
    assert labvllm.model_problems(MODEL) == []
    assert _maker().check(MODEL) == []
    listed = {line.split()[1] for line in (MODEL / "SHA256SUMS").read_text().splitlines()}
    want = {"config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json", "split.json"}
    assert want <= listed


def _tampered(tmp_path: Path) -> Path:
    copy = tmp_path / "learned-target"
    shutil.copytree(MODEL, copy)
    return copy


def test_a_changed_missing_or_extra_file_is_named(tmp_path):
    copy = _tampered(tmp_path)
    data = bytearray((copy / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (copy / "model.safetensors").write_bytes(bytes(data))
    (copy / "tokenizer.json").unlink()
    (copy / "stray.bin").write_bytes(b"x")
    for problems in (labvllm.model_problems(copy), _maker().check(copy)):
        assert any(p.startswith("model.safetensors: sha256 differs") for p in problems), problems
        assert "tokenizer.json: missing" in problems
        assert "stray.bin: not in SHA256SUMS" in problems
        assert len(problems) == 3


def test_tiny_model_dir_copies_checked_files_and_refuses_a_changed_source(tmp_path, monkeypatch):
    monkeypatch.setenv("REMOTE_OPS_CACHE_DIR", str(tmp_path / "cache"))
    out = labvllm.tiny_model_dir()
    assert out.parent == tmp_path / "cache" and labvllm.model_problems(out) == []
    assert (out / "model.safetensors").read_bytes() == (MODEL / "model.safetensors").read_bytes()
    # a changed cached copy is made again from the source
    (out / "config.json").write_text("{}")
    assert labvllm.tiny_model_dir() == out and labvllm.model_problems(out) == []
    # a changed source is refused, naming the file
    assets = tmp_path / "assets"
    shutil.copytree(ASSETS, assets)
    (assets / "learned-target" / "config.json").write_text("{}")
    monkeypatch.setattr(labvllm, "docker_assets", lambda: assets)
    with pytest.raises(LabError, match=r"config\.json: sha256 differs"):
        labvllm.tiny_model_dir()


def test_image_key_follows_the_model_checksums(tmp_path, monkeypatch):
    assets = tmp_path / "assets"
    shutil.copytree(ASSETS, assets)
    monkeypatch.setattr(labvllm, "docker_assets", lambda: assets)
    key = labvllm.image_key()
    sums = assets / "learned-target" / "SHA256SUMS"
    sums.write_text(sums.read_text().replace("  config.json", "  config.json ", 1))
    assert labvllm.image_key() != key


def test_loads_with_transformers_in_the_sandbox_shape(model):
    import torch

    cfg = model.config
    # what sandbox.vllm_overrides and the real-vLLM tests declare: 4 layers, hidden 128
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (4, 128, 2048)
    assert cfg.architectures == ["LlamaForCausalLM"] and cfg.tie_word_embeddings is False
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)  # an untied lm_head
    assert 1.0e6 < sum(p.numel() for p in model.parameters()) < 2.0e6


def test_one_index_naming_every_tensor_of_the_bf16_shard():
    from safetensors import safe_open

    # SpecForge's TargetHead needs exactly one *.index.json
    assert [p.name for p in MODEL.glob("*.index.json")] == ["model.safetensors.index.json"]
    index = json.loads((MODEL / "model.safetensors.index.json").read_text())
    with safe_open(str(MODEL / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert {str(f.get_slice(n).get_dtype()) for n in names} == {"BF16"}
    assert set(index["weight_map"]) == names and set(index["weight_map"].values()) == {"model.safetensors"}
    assert "lm_head.weight" in names


def test_the_split_is_disjoint_and_follows_its_rule(split):
    maker = _maker()
    files = split["files"]
    paths = {k: [f["file"] for f in v] for k, v in files.items()}
    everything = sorted(p for v in paths.values() for p in v)
    assert len(everything) == len(set(everything)) > 300
    for i, path in enumerate(everything):
        assert path in paths[maker.split_of(i)], path
    assert len(split["prompts"]) == 16
    assert {p["file"] for p in split["prompts"]} <= set(paths["heldout"])


def test_the_prompts_are_the_recorded_files_text_where_this_machine_has_them(split):
    """On a machine with the same Debian python3.11 sources, each prompt is its file's text at its
    offset (the split names each file's sha256)."""
    digests = {f["file"]: f["sha256"] for f in split["files"]["heldout"]}
    checked = 0
    for p in split["prompts"]:
        local = Path(_maker().STDLIB) / p["file"]
        if not local.is_file() or hashlib.sha256(local.read_bytes()).hexdigest() != digests[p["file"]]:
            continue
        text = local.read_text(encoding="utf-8")
        assert text[p["offset"] : p["offset"] + len(p["text"])] == p["text"]
        checked += 1
    if not checked:
        pytest.skip("this machine's /usr/lib/python3.11 is not the sources the split names")


def _pre_and_post(model, ids):
    import torch

    captured = {}

    def keep(_m, _i, output):
        captured["x"] = output[0] if isinstance(output, tuple) else output

    hook = model.model.layers[-1].register_forward_hook(keep)
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
    finally:
        hook.remove()
    return captured["x"][0], out.logits[0]


def test_it_has_learned_and_its_final_norm_decides_the_token(model, tokenizer, split):
    """Held-out prompts (files the target never saw): the loss is far below a uniform guess
    (ln 2048 = 7.62), and the pre-norm state read by the LM head picks another token than the
    post-norm one at a large share of positions, so a capture left pre-norm teaches a drafter
    something wrong (training.json: 47 % equal on the validation files)."""
    import torch

    losses, same, count = [], 0, 0
    for p in split["prompts"]:
        ids = tokenizer(p["text"], add_special_tokens=False)["input_ids"]
        pre, logits = _pre_and_post(model, ids)
        losses.append(float(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))))
        with torch.no_grad():
            pre_argmax = model.lm_head(pre).argmax(-1)
        same += int((pre_argmax == logits.argmax(-1)).sum())
        count += len(ids)
    mean = sum(losses) / len(losses)
    assert mean < 0.5 * math.log(2048), f"mean held-out loss {mean:.2f}"
    assert same / count < 0.8, f"pre-norm argmax equals the post-norm one at {same / count:.0%} of positions"
    report = json.loads((MODEL / "training.json").read_text())
    assert report["final_norm"]["validation"]["argmax_equal_share"] < 0.8
    assert report["final_bf16"]["validation_loss"] < report["initial"]["validation_loss"] - 3


def test_the_tokenizer_round_trips_source_text(tokenizer, split):
    text = split["prompts"][0]["text"]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode()) / 2  # a BPE that learned Python, not bytes
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, len(tokenizer)) == (0, 1, 2048)
