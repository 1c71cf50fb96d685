"""The SGLang stand-in computes: its answers and dumps against an independent reference.

The reference is written here in torch (float64 on the CPU) from the model dir's safetensors, read
with the `safetensors` library: it shares no code with the stand-in's numpy network
(docker/standin/standin_model.py).  Both compute in float64 and round once to bf16, so the dumps are
compared bit for bit (a float64 difference of a few ulps changes a bf16 rounding with a probability
of about 2**-40 per value).

- the model dir: HF-style config, two bf16 shards, the index; lm_head alone in the second shard;
- a deployed stand-in (lab2, the real image with Debian's numpy) run by the real extraction client:
  every dump's aux and final states equal the reference's residual stream and post-norm final, and
  every manifest line's `generated_token` = argmax(lm_head . the dump's final state[last]);
  `/generate` gives the reference's greedy tokens and refuses ids outside the vocabulary;
- the fault switches (a stand-in process on this machine): pre-norm finals, a dropped aux layer,
  NaN in the dumps of named keys.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from remote_ops.dumper import dumpfile  # noqa: E402
from remote_ops.hostlab._proc import free_port  # noqa: E402
from remote_ops.onhost.extract_onhost import dump_key  # noqa: E402
from remote_ops.workflows import extract, sandbox  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SERVER = REPO / "docker" / "standin" / "sglang_standin_server.py"
CLIENT = REPO / "remote_ops" / "onhost" / "extract_onhost.py"
LAYERS = [2, 4, 5]  # layers_to_capture of the 8-layer stand-in: [2, L//2, L-3]


# --------------------------------------------------------------------------- the reference
class Reference:
    """The stand-in network, written again in torch from the saved safetensors."""

    def __init__(self, model_dir: Path):
        self.cfg = json.loads((model_dir / "config.json").read_text())
        index = json.loads((model_dir / "model.safetensors.index.json").read_text())
        w: dict = {}
        for shard in sorted(set(index["weight_map"].values())):
            w.update(safetensors_torch.load_file(str(model_dir / shard)))
        assert set(w) == set(index["weight_map"])
        self.w = {k: v.to(torch.float64) for k, v in w.items()}
        tied = self.cfg["tie_word_embeddings"]
        self.lm_head = self.w["model.embed_tokens.weight" if tied else "lm_head.weight"]

    def rms(self, x, g):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.cfg["rms_norm_eps"]) * g

    def forward(self, ids: list[int]):
        """(residual stream entering each layer, pre-norm final, post-norm final), float64."""
        w, x = self.w, self.w["model.embed_tokens.weight"][torch.tensor(ids)]
        count = torch.arange(1, len(ids) + 1, dtype=torch.float64)[:, None]
        entering = []
        for k in range(self.cfg["num_hidden_layers"]):
            p = f"model.layers.{k}."
            entering.append(x)
            mixed = torch.cumsum(self.rms(x, w[p + "input_layernorm.weight"]), 0) / count
            x = x + mixed @ w[p + "token_mix.o_proj.weight"].T
            m = self.rms(x, w[p + "post_attention_layernorm.weight"])
            gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
            x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        return entering, x, self.rms(x, w["model.norm.weight"])

    def token(self, final_row) -> int:
        """argmax(lm_head . final state), the final state taken as bf16 (as the dump holds it)."""
        return int(torch.argmax(self.lm_head @ final_row.to(torch.float64)))

    def greedy(self, ids: list[int], n: int) -> list[int]:
        out: list[int] = []
        for _ in range(n):
            out.append(self.token(bf16(self.forward(ids + out)[2][-1])))
        return out


def bf16(t):
    """float64 -> bf16 as torch rounds (through float32, to nearest even)."""
    return t.to(torch.float32).to(torch.bfloat16)


def read_dump(path: Path):
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def prompts(n: int, seed: int) -> list[list[int]]:
    """n prompts of 1 to ~1,500 tokens (ids < 32,000), different on every run (fresh dump keys)."""
    rng = random.Random(seed)
    lengths = [1, 2, 7, 33, 128, 300, 700, 1500] + [rng.randint(3, 400) for _ in range(max(n - 8, 0))]
    return [[rng.randrange(32000) for _ in range(k)] for k in lengths[:n]]


# --------------------------------------------------------------------------- the model dir
def test_model_dir_is_bf16_safetensors_with_an_index_that_isolates_lm_head(tmp_path):
    from safetensors import safe_open

    cfg_path = sandbox.write_model_config(tmp_path / "m")
    cfg = json.loads(cfg_path.read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["standin"] is True
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (64, 8, 32000)
    assert cfg["tie_word_embeddings"] is False
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["lm_head.weight"]
    with safe_open(str(tmp_path / "m" / shard), "pt") as f:
        assert sorted(f.keys()) == ["lm_head.weight", "model.norm.weight"]
        head = f.get_tensor("lm_head.weight")
    assert head.dtype == torch.bfloat16 and tuple(head.shape) == (32000, 64)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * 2
        for s in set(index["weight_map"].values())
        for t in safetensors_torch.load_file(str(tmp_path / "m" / s)).values()
    )
    model = sandbox.standin_model_module()
    dtype, shape, raw = model.read_tensor(str(tmp_path / "m"), "lm_head.weight")
    assert (dtype, shape) == ("BF16", [32000, 64]) and raw == head.view(torch.int16).numpy().tobytes()
    before = {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()}
    sandbox.write_model_config(tmp_path / "m")
    assert {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()} == before  # seeded: same bytes

    sandbox.write_model_config(tmp_path / "tied", tie_word_embeddings=True)
    tied = json.loads((tmp_path / "tied" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.weight" not in tied and "model.embed_tokens.weight" in tied


# --------------------------------------------------------------------------- deployed, real client
def _wait_finished(remote, spec, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = extract.status(remote, spec)
        if st.summary.state == "finished" and not st.running:
            return st
        time.sleep(0.3)
    raise AssertionError(f"extraction did not finish in {timeout:g} s: {st}")


def _post(url: str, doc: dict, timeout: float = 30.0):
    req = urllib.request.Request(url, json.dumps(doc).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


@pytest.mark.docker
def test_deployed_standin_answers_and_dumps_what_the_reference_computes(lab, sglang_remote, deployed, tmp_path):
    host = lab.host(deployed.name)
    ref = Reference(Path(deployed.model.path))
    subprocess.run(["rm", "-rf", str(host.paths.logs_dir / "extract")], check=True, timeout=30)
    samples = prompts(12, time.time_ns())
    ds = tmp_path / "ds.jsonl"
    ds.write_text("".join(json.dumps({"id": f"s{i}", "input_ids": ids}) + "\n" for i, ids in enumerate(samples)))
    extract.start(sglang_remote, deployed, str(ds), concurrency=4, dump_grace=5)
    assert _wait_finished(sglang_remote, deployed).summary.done == len(samples)

    manifest = host.paths.logs_dir / "extract" / "manifest.jsonl"
    rows = {r["key"]: r for r in map(json.loads, manifest.read_text().splitlines()) if r["status"] == "ok"}
    for ids in samples:
        row = rows[dump_key(ids)]
        tensors, meta = read_dump(host.paths.dump_dir / "rank0" / f"{row['key']}.safetensors")
        assert meta["standin"] == "true" and json.loads(meta["layers_to_capture"]) == LAYERS
        assert "standin_fault" not in meta
        entering, _, post = ref.forward(ids)
        want_aux = bf16(torch.cat([entering[k] for k in LAYERS], dim=1))
        assert torch.equal(tensors["aux_hidden_states"], want_aux), f"aux of {len(ids)} tokens"
        assert torch.equal(tensors["hidden_states"], bf16(post)), f"final of {len(ids)} tokens"
        assert tensors["input_ids"].tolist() == ids
        # the client's record: the server's token = argmax(lm_head . the dump's final state[last])
        assert row["generated_token"] == ref.token(tensors["hidden_states"][-1]) == ref.token(bf16(post[-1]))

    url = f"http://127.0.0.1:{deployed.server.port}/generate"
    answer = _post(url, {"input_ids": samples[4], "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert answer["output_ids"] == ref.greedy(samples[4], 4) and answer["meta_info"]["standin"] is True
    with pytest.raises(urllib.error.HTTPError) as refused:
        _post(url, {"input_ids": [1, 32000], "sampling_params": {"max_new_tokens": 1}})
    assert refused.value.code == 400 and "vocab size (32000)" in refused.value.read().decode()


# --------------------------------------------------------------------------- the fault switches


@pytest.fixture
def run_standin(tmp_path):
    """Start the stand-in on this machine with fault switches: run_standin(env) -> (url, dump dir)."""
    shutil.copytree(REPO / "remote_ops" / "dumper", tmp_path / "py" / "remote_ops_dump")
    sandbox.write_model_config(tmp_path / "model")
    procs = []

    def start(extra: dict) -> tuple[str, Path]:
        port, dumps = free_port(), tmp_path / f"dumps{len(procs)}"
        env = {
            **os.environ,
            "PYTHONPATH": str(tmp_path / "py"),
            "SGLANG_HS_DUMP_DIR": str(dumps),
            "STANDIN_LOAD_SECONDS": "0",
            **extra,
        }
        argv = [sys.executable, str(SERVER), "--model-path", str(tmp_path / "model"), "--port", str(port)]
        log = open(tmp_path / f"standin{len(procs)}.log", "wb")
        procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + 20
        while b"listening" not in (tmp_path / f"standin{len(procs) - 1}.log").read_bytes():
            assert procs[-1].poll() is None and time.monotonic() < deadline, log.name
            time.sleep(0.05)
        return f"http://127.0.0.1:{port}", dumps

    yield start
    for p in procs:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=10)


def _generate_all(url: str, samples: list[list[int]]) -> list[int]:
    body = {"sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    return [_post(url + "/generate", {**body, "input_ids": ids})["output_ids"][0] for ids in samples]


def test_switches_write_pre_norm_finals_drop_an_aux_layer_and_put_nan_in_named_dumps(run_standin, tmp_path):
    samples = prompts(10, 7)[1:]  # 2 to 1,500 tokens
    ref = Reference(tmp_path / "model")
    forward = [ref.forward(ids) for ids in samples]
    tokens = [ref.token(bf16(post[-1])) for _, _, post in forward]
    nan_key = dump_key(samples[2])

    url, dumps = run_standin({"STANDIN_FINAL_NORM": "pre", "STANDIN_DROP_AUX": "1", "STANDIN_NAN_KEYS": nan_key[:12]})
    info = json.loads(urllib.request.urlopen(url + "/server_info", timeout=10).read())
    assert info["standin"] is True and info["standin_faults"] == [
        "final_norm=pre",
        "drop_aux=last",
        f"nan_keys={nan_key[:12]}",
    ]
    assert _generate_all(url, samples) == tokens  # the answers are the network's, whatever the dumps hold
    pre_tokens = []
    for ids, (entering, pre, _) in zip(samples, forward):
        tensors, meta = read_dump(dumps / "rank0" / f"{dump_key(ids)}.safetensors")
        assert meta["standin_fault"] == f"final_norm=pre,drop_aux=last,nan_keys={nan_key[:12]}"
        assert meta["hidden_states_norm"] == "post-norm" and json.loads(meta["layers_to_capture"]) == LAYERS
        aux, final = tensors["aux_hidden_states"], tensors["hidden_states"]
        assert tuple(aux.shape) == (len(ids), 2 * 64)  # the last capture layer is gone
        want_aux, want_final = bf16(torch.cat([entering[k] for k in LAYERS[:2]], dim=1)), bf16(pre)
        if dump_key(ids) == nan_key:
            assert torch.isnan(final[0]).all() and torch.isnan(aux[0]).all()
            assert not torch.isnan(final[1:]).any() and not torch.isnan(aux[1:]).any()
            aux, final, want_aux, want_final = aux[1:], final[1:], want_aux[1:], want_final[1:]
        else:
            assert not torch.isnan(final).any() and not torch.isnan(aux).any()
        assert torch.equal(aux, want_aux) and torch.equal(final, want_final)
        pre_tokens.append(ref.token(tensors["hidden_states"][-1]))
    mismatches = sum(a != b for a, b in zip(pre_tokens, tokens))
    assert mismatches >= len(samples) // 2, (pre_tokens, tokens)  # pre-norm finals do not give the token
    report = dumpfile.verify_dir(str(dumps), hidden_size=64)
    assert not report.ok and any("aux_hidden_states" in p.message for p in report.problems)

    url, dumps = run_standin({"STANDIN_FINAL_NORM": "post"})  # and without faults: post-norm, 3 layers
    assert _generate_all(url, samples[:3]) == tokens[:3]
    for ids, (entering, _, post) in zip(samples[:3], forward):
        tensors, meta = read_dump(dumps / "rank0" / f"{dump_key(ids)}.safetensors")
        assert "standin_fault" not in meta and torch.equal(tensors["hidden_states"], bf16(post))
        assert torch.equal(tensors["aux_hidden_states"], bf16(torch.cat([entering[k] for k in LAYERS], dim=1)))
    assert dumpfile.verify_dir(str(dumps), hidden_size=64).ok


def run_client(url: str, dumps: Path, samples: list[list[int]], work: Path, client: Path = CLIENT) -> list[dict]:
    """The extraction client (the file shipped to hosts) over `samples`; its manifest's lines."""
    ds = work / "ds.jsonl"
    ds.write_text("".join(json.dumps({"id": f"s{i}", "input_ids": ids}) + "\n" for i, ids in enumerate(samples)))
    argv = [sys.executable, str(client), "--dataset", str(ds), "--server", url, "--workdir", str(work / "w")]
    argv += ["--log", str(work / "x.log"), "--dump-dir", str(dumps), "--dump-grace", "2", "--concurrency", "3"]
    subprocess.run(argv, check=True, timeout=120, stdin=subprocess.DEVNULL)
    return [json.loads(l) for l in (work / "w" / "manifest.jsonl").read_text().splitlines()]


def test_the_extraction_client_records_the_token_its_final_state_gives(run_standin, tmp_path):
    samples = prompts(9, 11)
    ref = Reference(tmp_path / "model")
    url, dumps = run_standin({})
    rows = {r["key"]: r for r in run_client(url, dumps, samples, tmp_path)}
    assert len(rows) == len(samples) and {r["status"] for r in rows.values()} == {"ok"}
    for ids in samples:
        final = read_dump(dumps / "rank0" / f"{dump_key(ids)}.safetensors")[0]["hidden_states"]
        assert rows[dump_key(ids)]["generated_token"] == ref.token(final[-1]) == ref.greedy(ids, 1)[0]


def test_a_bad_switch_refuses_to_start(tmp_path):
    sandbox.write_model_config(tmp_path / "model")
    env = {**os.environ, "STANDIN_FINAL_NORM": "half", "STANDIN_LOAD_SECONDS": "0"}
    p = subprocess.run(
        [sys.executable, str(SERVER), "--model-path", str(tmp_path / "model"), "--port", str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode != 0 and "STANDIN_FINAL_NORM='half': want pre or post" in p.stderr
