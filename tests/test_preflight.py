"""`spec preflight`'s pure decisions (remote_ops/core/preflight.py): its own dirs, the samples, the
threshold and the verdict; and the command's dry run (nothing contacted).  The chain itself runs
for real in tests/test_vllm_preflight.py (marker `vllm`)."""

from __future__ import annotations

import json
import os

import pytest
from conftest import run_cli

from remote_ops.core import preflight as pf
from remote_ops.core.inventory import HostSpec


def host(engine: str = "vllm") -> HostSpec:
    return HostSpec(name="h", serving={"engine": engine}, dump={"dir": "/data/d/"}, logs={"dir": "/data/logs"})


def test_the_preflight_host_writes_everything_under_its_own_root_and_keeps_the_server():
    spec = host()
    p = pf.preflight_host(spec)
    assert pf.root_of(spec) == "/data/d-preflight"
    assert p.dump.dir == "/data/d-preflight/dumps"
    assert (p.logs.dir, p.logs.extraction, p.logs.training) == (
        "/data/d-preflight/logs",
        "/data/d-preflight/logs/extraction.log",
        "/data/d-preflight/logs/training.log",
    )
    assert (p.container, p.server, p.model, p.lock_dir, p.audit_log) == (
        spec.container,
        spec.server,
        spec.model,
        spec.lock_dir,
        spec.audit_log,
    )
    from remote_ops.workflows import export, train

    tp = train.paths_for(p)
    assert export.default_out(p) == tp.data == "/data/d-preflight/dumps-specforge"
    assert tp.output == "/data/d-preflight/dumps-drafter" and tp.workdir.startswith("/data/d-preflight/")


def test_the_clean_keeps_the_mounted_dump_dir_and_the_vllm_connector_dir():
    cmd = pf.clean_command(host())
    assert "rm -rf /data/d-preflight " not in cmd and "! -name dumps" in cmd
    assert f"! -name {host().vllm.connector_dir}" in cmd
    assert cmd.endswith("mkdir -p /data/d-preflight/logs")
    assert "connector" not in pf.clean_command(host("sglang")) or host("sglang").vllm.connector_dir not in (
        pf.clean_command(host("sglang"))
    )


def test_the_clean_empties_the_root_on_a_real_shell(tmp_path):
    import subprocess

    spec = HostSpec(name="h", serving={"engine": "vllm"}, dump={"dir": str(tmp_path / "d")})
    root = tmp_path / "d-preflight"
    conn = root / "dumps" / spec.vllm.connector_dir
    conn.mkdir(parents=True)
    for f in (conn / "x.safetensors", root / "dumps" / "rank0" / "k.safetensors", root / "dumps-drafter" / "a"):
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("old")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "mine").write_text("the operator's")
    subprocess.run(["sh", "-c", pf.clean_command(spec)], check=True)
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == sorted(
        ["dumps", f"dumps/{spec.vllm.connector_dir}", "logs"]
    )
    assert (tmp_path / "d" / "mine").read_text() == "the operator's"


def line(doc) -> str:
    return json.dumps(doc)


def test_samples_are_the_first_lines_with_a_prompt_and_a_reply():
    lines = [
        line({"id": "no-mask", "input_ids": [1, 2]}),
        line({"id": "all-reply", "input_ids": [1, 2], "loss_mask": [1, 1]}),
        "not json",
        "",
        line({"id": "a", "input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]}),
        line({"id": "short-mask", "input_ids": [5, 6, 7], "loss_mask": [0, 1]}),
        line({"id": "b", "input_ids": [9, 10, 11], "loss_mask": [0, 1, 1]}),
        line({"id": "c", "input_ids": [1, 2, 3], "loss_mask": [0, 0, 1]}),
    ]
    got, skipped = pf.pick_samples(lines, 2)
    assert [s.id for s in got] == ["a", "b"] and skipped == 4
    assert (got[0].prompt, got[0].reply) == ([5, 6], [7, 8])
    assert pf.bench_prompts(got) == [{"input_ids": [5, 6]}, {"input_ids": [9]}]
    assert pf.max_new_tokens(got, 32) == 2 and pf.max_new_tokens(got[:1], 1) == 1
    back, _ = pf.pick_samples(pf.samples_jsonl(got).decode().splitlines(), 5)
    assert back == got


def test_the_default_threshold_is_two_thirds_of_the_draft_block_past_the_bonus_token():
    assert pf.default_threshold(3) == 3.0
    assert pf.default_threshold(1) == 1.67 and pf.default_threshold(6) == 5.0


def bench(length, drafts=10, outputs=([7, 8], [10, 11]), engine="vllm", standin=False, per=(0.9, 0.8, 0.7)):
    return {
        "engine": engine,
        "standin": standin,
        "acceptance_length": length,
        "drafts": drafts,
        "accepted_tokens": None if length is None else round((length - 1) * drafts),
        "per_position": list(per),
        "requests": len(outputs),
        "per_request": [{"prompt": i, "output_ids": list(o)} for i, o in enumerate(outputs)],
    }


SAMPLES = [pf.Sample("a", (5, 6, 7, 8), (0, 0, 1, 1)), pf.Sample("b", (9, 10, 11), (0, 1, 1))]


def test_a_high_acceptance_passes_with_its_figures():
    v = pf.judge(bench(3.4), SAMPLES, 3.0, 3, 2)
    assert (v.passed, v.state, v.full_block, v.prefix_match) == (True, "pass", 4, [2, 2])
    assert "3.4 >= 3" in v.reason
    assert "per position 0.90, 0.80, 0.70" in pf.figures_line(v) and "2/2 continuations" in pf.figures_line(v)


def test_a_low_acceptance_on_the_taught_replies_blames_the_capture():
    v = pf.judge(bench(1.1), SAMPLES, 3.0, 3, 2)
    assert (v.passed, v.state) == (False, "fail")
    assert "1.1 < 3" in v.reason and "aux layer ids" in v.reason


def test_a_low_acceptance_where_the_served_continuation_parted_asks_for_the_targets_own_replies():
    v = pf.judge(bench(1.5, outputs=([7, 99], [1, 11])), SAMPLES, 3.0, 3, 2)
    assert not v.passed and v.prefix_match == [1, 0]
    assert "on 2 of 2 prompts" in v.reason and "dataset regenerate" in v.reason


def test_a_low_acceptance_of_a_drafter_that_did_not_overfit_asks_for_more_epochs():
    v = pf.judge(bench(1.4, outputs=([7, 99], [10, 11])), SAMPLES, 3.0, 3, 2, {0: 0.43, 1: 0.3})
    assert not v.passed and "on 1 of 2 prompts" in v.reason and "dataset regenerate" in v.reason
    assert "acc_0 0.43 < 0.9" in v.reason and "more --epochs" in v.reason
    v = pf.judge(bench(1.1), SAMPLES, 3.0, 3, 2, {0: 0.97})
    assert "aux layer ids" in v.reason


def test_no_drafts_fails_and_the_sglang_standin_is_inconclusive():
    v = pf.judge(bench(None, drafts=None), SAMPLES, 3.0, 3, 2)
    assert v.state == "fail" and "no drafts" in v.reason
    v = pf.judge({**bench(3.9, engine="sglang", standin=True), "verify_steps": 5}, SAMPLES, 3.0, 3, 2)
    assert (v.passed, v.state) == (False, "inconclusive") and "STAND-IN" in v.reason
    v = pf.judge({**bench(3.9, engine="sglang"), "verify_steps": 5}, SAMPLES, 3.0, 3, 2)
    assert v.passed and v.drafts == 5


def test_the_plan_names_the_engines_own_speculative_flags():
    s = {
        "samples": 4,
        "dataset": "ds.jsonl",
        "num_steps": 3,
        "epochs": 30,
        "learning_rate": 1e-3,
        "threshold": 3.0,
        "max_new_tokens": 32,
        "draft_config": "draft.json",
    }
    steps = {x["step"]: x["does"] for x in pf.plan_steps(host(), s)}
    assert '"method": "eagle3", "num_speculative_tokens": 3' in steps["spec deploy"]
    assert "--to hf" in steps["train export"] and ">= 3 (full block 4)" in steps["verdict"]
    steps = {x["step"]: x["does"] for x in pf.plan_steps(host("sglang"), s)}
    assert "--speculative-algorithm EAGLE3" in steps["spec deploy"] and "--to sglang" in steps["train export"]


@pytest.fixture
def offline(tmp_path):
    (tmp_path / "inv.yaml").write_text(
        "hosts:\n  h1:\n    address: 127.0.0.1\n    serving: {engine: sglang}\n    dump: {dir: /data/d}\n"
    )
    rows = [{"id": "a", "input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]}]
    (tmp_path / "ds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "draft.json").write_text("{}")
    (tmp_path / "bad-draft.json").write_text("{not json")
    env = {
        **os.environ,
        "REMOTE_OPS_INVENTORY": str(tmp_path / "inv.yaml"),
        "REMOTE_OPS_STATE_DIR": str(tmp_path / "state"),
    }
    return env, tmp_path


def test_the_dry_run_prints_the_plan_and_says_the_sglang_path_is_untested(offline):
    env, tmp = offline
    args = ("spec", "preflight", "--host", "h1", "--dataset", str(tmp / "ds.jsonl"))
    rc, out, err = run_cli(env, *args, "--draft-config", str(tmp / "draft.json"), "--dry-run", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["dry_run"] and doc["samples"] == ["a"] and doc["threshold"] == 3.0
    assert "has not run against a real SGLang server" in doc["engine_note"] and "real SGLang" in err
    assert "only 1 usable sample(s) of 2" in err


def test_without_yes_and_no_terminal_it_refuses_before_connecting(offline):
    env, tmp = offline
    args = ("spec", "preflight", "--host", "h1", "--dataset", str(tmp / "ds.jsonl"))
    rc, out, err = run_cli(env, *args, "--draft-config", str(tmp / "draft.json"))
    assert rc == 9 and "--yes" in err


def test_a_dataset_with_no_usable_sample_is_a_usage_error(offline):
    env, tmp = offline
    (tmp / "ds.jsonl").write_text(json.dumps({"id": "x", "input_ids": [1], "loss_mask": [1]}) + "\n")
    args = ("spec", "preflight", "--host", "h1", "--dataset", str(tmp / "ds.jsonl"))
    rc, out, err = run_cli(env, *args, "--draft-config", str(tmp / "draft.json"), "--dry-run")
    assert rc == 2 and "no sample with a prompt and a reply" in err


def test_a_local_draft_config_that_is_not_json_is_a_config_error_before_connecting(offline):
    env, tmp = offline
    args = ("spec", "preflight", "--host", "h1", "--dataset", str(tmp / "ds.jsonl"))
    rc, out, err = run_cli(env, *args, "--draft-config", str(tmp / "bad-draft.json"), "--yes")
    assert rc == 3 and "bad-draft.json" in err
