"""A non-DeepSeek spec deployed end to end on a lab host (real sshd + dockerd, SGLang stand-in image).

The host's checkout and the stand-in base image hold the same real SGLang 0.5.9
tree; the inventory names no spec, the model's config.json says LlamaForCausalLM,
so deploy patches llama.py, the image's verifier checks llama.py (the shipped
spec names it) before the stand-in server starts, and health finds the patched
file in the container.
"""

from __future__ import annotations

import json

import pytest

from remote_ops.engine import labels
from remote_ops.workflows import container, deploy, health, patching

pytestmark = [pytest.mark.docker, pytest.mark.slow]


@pytest.fixture
def llama_spec(spec, sglang_host):
    """lab2's deployable entry with no `sglang.patch` and a Llama config.json at its model path."""
    (sglang_host.paths.model_dir / "config.json").write_text(
        json.dumps(
            {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 8}
        )
    )
    return spec.model_copy(update={"sglang": spec.sglang.model_copy(update={"patch": None})})


def test_deploy_llama_derived_from_config_json(sglang_remote, llama_spec, sglang_host):
    host, derivation = patching.bind_host(sglang_remote, llama_spec)
    assert derivation.spec == "llama" and "LlamaForCausalLM" in derivation.detail
    try:
        result = deploy.deploy(sglang_remote, host, why="test llama")
        llama = sglang_host.paths.checkout / "python/sglang/srt/models/llama.py"
        assert "remote_ops_dump.attach(self)" in llama.read_text()
        assert "remote-ops:" not in (sglang_host.paths.checkout / "python/sglang/srt/models/deepseek_v2.py").read_text()
        img = container.inspect_image(sglang_remote, result.image)
        assert img.labels[labels.SHA_AFTER] == result.shas["after"]
        assert container.inspect_container(sglang_remote, host.container.name).running
        result_h = health.check_host(lambda _h: sglang_remote, host, expected_image=deploy.image_ref(host))
        by = {f"{c.tier}/{c.name}": c for c in result_h.checks}
        assert by["patch/in_container"].status == "ok", by["patch/in_container"]
        again = deploy.deploy(sglang_remote, host, why="test llama again")
        assert again.up_to_date
    finally:
        sglang_remote.run(["docker", "rm", "-f", llama_spec.container.name], check=False)
