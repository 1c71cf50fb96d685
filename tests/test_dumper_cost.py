"""`dumps stats`: the dumper's capture() time beside the forward time of the same steps.

Pure, from captured text: SGLang 0.5.9's prefill and decode lines (through `docker logs
--timestamps`, with a TP prefix, with SGLANG_LOG_MS, with SGLANG_LOG_FORWARD_ITERS; 0.5.4's
lines, which carry no input throughput), a step's time (previous #new-token / input
throughput), busy steps, the share and its notes, every rank's stats.json.  The probe on a real
/bin/sh.  The real dumper (CPU torch) counts its capture() time; the stand-in writes the same
stats.json and SGLang-format lines.  Lab: a deployed stand-in, an extraction, then `dumps stats`
and `dataset regenerate`'s server figure, both labelled STAND-IN.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from remote_ops.core import dumpercost, sglanglog
from remote_ops.hostlab._proc import free_port
from remote_ops.probes.throughput import DumperStats

REPO = Path(__file__).resolve().parents[1]
STANDIN = REPO / "docker" / "standin" / "sglang_standin_server.py"

# SGLang 0.5.9, through `docker logs --timestamps` (scheduler_metrics_mixin.log_prefill_stats /
# log_decode_stats), between other server lines
LOG_059 = """\
2026-01-29T10:00:00.000000000Z [2026-01-29 10:00:00 TP0] server_args=ServerArgs(model_path='/models/kimi')
2026-01-29T10:00:01.000000000Z [2026-01-29 10:00:01 TP0] Prefill batch, #new-seq: 2, #new-token: 4000, \
#cached-token: 0, token usage: 0.01, #running-req: 0, #queue-req: 3, input throughput (token/s): 0.00, cuda graph: False
2026-01-29T10:00:01.100000000Z [2026-01-29 10:00:01 TP0] Prefill batch, #new-seq: 2, #new-token: 8000, \
#cached-token: 0, token usage: 0.02, #running-req: 0, #queue-req: 2, input throughput (token/s): 40000.00, cuda graph: False
2026-01-29T10:00:01.300000000Z [2026-01-29 10:00:01 TP0] Prefill batch, #new-seq: 1, #new-token: 2000, \
#cached-token: 0, token usage: 0.02, #running-req: 0, #queue-req: 0, input throughput (token/s): 40000.00, cuda graph: False
2026-01-29T10:00:03.300000000Z [2026-01-29 10:00:03 TP0] Prefill batch, #new-seq: 1, #new-token: 1000, \
#cached-token: 0, token usage: 0.00, #running-req: 0, #queue-req: 0, input throughput (token/s): 1000.00, cuda graph: False
2026-01-29T10:00:04.000000000Z [2026-01-29 10:00:04 TP0] Decode batch, #running-req: 64, #token: 90000, \
token usage: 0.40, cuda graph: True, gen throughput (token/s): 2000.00, #queue-req: 0
2026-01-29T10:00:05.000000000Z [2026-01-29 10:00:05 TP0] Decode batch, #running-req: 64, #token: 91000, \
token usage: 0.41, cuda graph: True, gen throughput (token/s): 3000.00, #queue-req: 0
2026-01-29T10:00:05.500000000Z [2026-01-29 10:00:05 TP0] INFO:     127.0.0.1:5000 - "POST /generate HTTP/1.1" 200 OK
"""
# SGLang 0.5.4.post1: no input throughput outside PD-prefill mode; SGLANG_LOG_MS; SGLANG_LOG_FORWARD_ITERS
LOG_054 = """\
[2025-10-01 09:00:00.123] Prefill batch [7], #new-seq: 1, #new-token: 512, #cached-token: 0, token usage: 0.00, \
#running-req: 0, #queue-req: 0,
[2025-10-01 09:00:00.456] Prefill batch [8], #new-seq: 1, #new-token: 512, #cached-token: 0, token usage: 0.00, \
#running-req: 0, #queue-req: 0,
"""


def test_sglang_059_lines_parse_with_the_engine_time_the_prefix_and_every_figure():
    lines = sglanglog.parse_lines(LOG_059)
    assert [ln.kind for ln in lines] == ["prefill"] * 4 + ["decode"] * 2
    first = lines[0]
    assert (first.when, first.prefix, first.standin) == ("2026-01-29 10:00:01", "TP0", False)
    assert first.engine_time == sglanglog.engine_seconds("2026-01-29T10:00:01Z") == 1769680801.0
    assert first.fields["#new-token"] == 4000 and first.fields["#queue-req"] == 3 and "cuda graph" not in first.fields
    assert lines[1].engine_time == pytest.approx(1769680801.1)
    old = sglanglog.parse_lines(LOG_054)
    assert [(ln.when, ln.prefix, ln.num("#new-token")) for ln in old] == [
        ("2025-10-01 09:00:00", ".123", 512),
        ("2025-10-01 09:00:00", ".456", 512),
    ]
    assert sglanglog.prefill_steps(old).timed == 0  # no throughput figure: no step time
    standin = sglanglog.parse_line(
        "[2026-01-29 10:00:00 STAND-IN] Decode batch, #running-req: 1, gen throughput (token/s): 5.00"
    )
    assert standin is not None and standin.standin and standin.num(sglanglog.GEN_THROUGHPUT) == 5.0
    for junk in ("", "[x] Prefill batch, a: 1", "Prefill batch, #new-token: 3", "2026 [2026-01-29 10:00:00] hello"):
        assert sglanglog.parse_line(junk) is None


def test_a_step_is_the_previous_tokens_over_this_line_s_throughput_and_busy_when_requests_waited():
    steps = sglanglog.prefill_steps(sglanglog.parse_lines(LOG_059))
    # step 2: 4000 / 40000 = 0.1 s (3 waited), step 3: 8000 / 40000 = 0.2 s (2 waited),
    # step 4: 2000 / 1000 = 2 s (none waited: a wait for requests)
    assert (steps.lines, steps.tokens, steps.timed, steps.busy) == (4, 15000, 3, 2)
    assert steps.timed_s == pytest.approx(2.3) and steps.busy_s == pytest.approx(0.3)
    gen = sglanglog.gen_throughput(sglanglog.parse_lines(LOG_059))
    assert (gen.lines, gen.mean_tokens_s, gen.max_tokens_s, gen.standin) == (2, 2500.0, 3000.0, False)
    window = sglanglog.within(sglanglog.parse_lines(LOG_059), since=1769680801.05, until=1769680804.5)
    assert [ln.num("#new-token") for ln in window if ln.kind == "prefill"] == [8000, 2000, 1000]


def _stats(rank=0, steps=10, steps_us=5000, started=1769680800.0, updated=1769680806.0, **extra) -> dict:
    doc = {"rank": rank, "state": "running", "capture_steps": steps, "capture_steps_us": steps_us}
    doc.update(capture_calls=steps + 5, capture_us=steps_us + 50, started=started, updated=updated, tokens=15000)
    doc.update(files=steps, skipped={"decode": 5})
    doc.update(extra)
    return doc


def _probe_text(*docs) -> str:
    return "".join(f"==> /data/dumps/rank{d['rank']}/stats.json\n{json.dumps(d)}\n" for d in docs)


def test_stats_json_per_rank_read_back_from_the_probe_text_torn_files_left_out():
    text = _probe_text(_stats(0), _stats(1, steps_us=9000)) + '==> /data/dumps/rank2/stats.json\n{"rank": 2, "sta\n'
    ranks = dumpercost.parse_stats(text)
    assert sorted(ranks) == [0, 1] and ranks[1].steps_us == 9000 and ranks[0].skipped == {"decode": 5}
    assert dumpercost.parse_stats("") == {}
    no_rank = dumpercost.parse_stats("==> /d/rank5/stats.json\n" + json.dumps({"capture_steps": 1}) + "\n")
    assert list(no_rank) == [5] and no_rank[5].steps_us is None


def _lines(n: int, tokens: int, step_s: float, queue: int, t0: float = 1769680801.0, prefix: str = "TP0") -> str:
    out = []
    for k in range(n):
        rate = 0.0 if k == 0 else tokens / step_s
        stamp = (
            time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t0 + k * step_s))
            + f".{int((t0 + k * step_s) % 1 * 1e9):09d}Z"
        )
        out.append(
            f"{stamp} [2026-01-29 10:00:01 {prefix}] Prefill batch, #new-seq: 4, #new-token: {tokens}, #cached-token: 0, "
            f"token usage: 0.1, #running-req: 0, #queue-req: {queue}, input throughput (token/s): {rate:.2f}, cuda graph: False"
        )
    return "\n".join(out) + "\n"


def test_the_share_is_the_slowest_rank_s_mean_capture_over_the_mean_busy_step():
    lines = sglanglog.parse_lines(_lines(11, 8192, 0.25, queue=5))  # 10 timed busy steps of 250 ms
    ranks = dumpercost.parse_stats(_probe_text(_stats(0, 11, 1100), _stats(1, 11, 2200)))
    cost = dumpercost.dumper_cost(ranks, lines)
    assert (cost.basis, cost.slowest_rank, cost.capture_steps, cost.mean_capture_us) == ("busy", 1, 11, 200.0)
    assert cost.mean_forward_us == pytest.approx(250000.0) and cost.share == pytest.approx(0.0008)
    assert cost.notes == [] and not cost.standin
    idle = dumpercost.dumper_cost(ranks, sglanglog.parse_lines(_lines(11, 8192, 0.25, queue=0)))
    assert idle.basis == "all timed" and idle.share == pytest.approx(0.0008) and "lower bound" in idle.notes[0]
    fewer = dumpercost.dumper_cost(ranks, sglanglog.parse_lines(_lines(40, 8192, 0.01, queue=5)))
    assert "the log shows 40 prefill batch(es), rank 1 captured 11 step(s) and skipped 5" in fewer.notes[0]


def test_the_window_is_the_dumper_s_life_and_missing_pieces_are_said():
    lines = sglanglog.parse_lines(_lines(11, 8192, 0.25, queue=5, t0=1769680801.0))
    late = dumpercost.parse_stats(_probe_text(_stats(0, 11, 1100, started=1769690000.0, updated=1769690005.0)))
    assert dumpercost.dumper_cost(late, lines).prefill.lines == 0  # lines before the dumper attached
    early = dumpercost.parse_stats(_probe_text(_stats(0, 11, 1100, updated=1769680800.0)))
    assert dumpercost.dumper_cost(early, lines).prefill.lines == 5  # to its last stats write + 2 s only
    none = dumpercost.dumper_cost({}, lines)
    assert none.share is None and "no stats.json" in none.notes[0]
    old = dumpercost.parse_stats(_probe_text({"rank": 0, "state": "running", "files": 3}))
    assert "no capture timing" in dumpercost.dumper_cost(old, lines).notes[0]
    quiet = dumpercost.dumper_cost(dumpercost.parse_stats(_probe_text(_stats())), sglanglog.parse_lines(LOG_054))
    assert quiet.share is None and "no prefill line with an input throughput" in quiet.notes[-1]
    standin = dumpercost.dumper_cost(
        dumpercost.parse_stats(_probe_text(_stats(0, 11, 1100, standin=True))),
        sglanglog.parse_lines(_lines(11, 100, 0.01, queue=1, prefix="STAND-IN")),
    )
    assert standin.standin and standin.prefill.standin


def test_the_probe_reads_every_rank_s_stats_json_on_a_real_shell(tmp_path):
    for rank, doc in ((0, _stats(0)), (3, _stats(3, steps_us=7))):
        (tmp_path / f"rank{rank}").mkdir()
        (tmp_path / f"rank{rank}" / "stats.json").write_text(json.dumps(doc))
    (tmp_path / "rank9").mkdir()  # a rank dir without stats.json
    probe = DumperStats(str(tmp_path))
    out = subprocess.run(["/bin/sh", "-c", probe.command()], capture_output=True, text=True, timeout=30)
    ranks = probe.parse(out.returncode, out.stdout)
    assert out.returncode == 0 and sorted(ranks) == [0, 3] and ranks[3].steps_us == 7
    empty = DumperStats(str(tmp_path / "absent"))
    out = subprocess.run(["/bin/sh", "-c", empty.command()], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and empty.parse(0, out.stdout) == {} and empty.read({}) == {}


# --------------------------------------------------------------------------- the real dumper (CPU torch)


def test_the_real_dumper_counts_its_capture_time_in_stats_json(tmp_path):
    torch = pytest.importorskip("torch")
    from remote_ops.dumper.attach import attach
    from remote_ops.dumper.runtime import Runtime, ServerArgsView

    env = {
        "SGLANG_HS_DUMP_DIR": str(tmp_path),
        "SGLANG_HS_DUMP_BUFFERS": "2",
        "SGLANG_HS_DUMP_WRITERS": "1",
        "SGLANG_HS_DUMP_WRITER": "thread",
        "SGLANG_HS_DUMP_FSYNC": "0",
    }
    cfg = SimpleNamespace(num_hidden_layers=61, hidden_size=16, architectures=["DeepseekV3ForCausalLM"])
    model = SimpleNamespace(
        config=cfg, model=SimpleNamespace(layers_to_capture=[], layers=[]), capture_aux_hidden_states=False
    )
    before = time.time()
    d = attach(model, env=env, runtime=Runtime("0.5.9", 0, 1, ServerArgsView({"tp_size": 1}), "test"))
    try:

        class Mode:
            def __init__(self, name):
                self.name = name

        def batch(mode, lens):
            n = sum(lens)
            fb = SimpleNamespace(
                forward_mode=Mode(mode),
                batch_size=len(lens),
                input_ids=torch.arange(n),
                positions=torch.cat([torch.arange(k) for k in lens]),
                extend_seq_lens_cpu=list(lens),
                extend_prefix_lens_cpu=[0] * len(lens),
                can_run_tbo=False,
            )
            return fb, torch.zeros(n, 16).bfloat16(), [torch.zeros(n, 16).bfloat16() for _ in range(3)]

        for lens in ([3, 4], [5], [2, 2, 2]):
            d.capture(*batch("EXTEND", lens))
        d.capture(*batch("DECODE", [1, 1]))
        assert d.flush(30)
        d.stats.maybe_write(force=True)
        stats = json.loads((tmp_path / "rank0" / "stats.json").read_text())
    finally:
        d.close(timeout=10)
    assert (stats["capture_steps"], stats["capture_calls"]) == (3, 4)
    assert 0 < stats["capture_steps_us"] <= stats["capture_us"]
    assert before - 1 <= stats["started"] <= stats["updated"]
    ranks = dumpercost.parse_stats(f"==> {tmp_path}/rank0/stats.json\n" + json.dumps(stats) + "\n")
    assert ranks[0].steps == 3 and ranks[0].timed and ranks[0].skipped == {"decode": 1}


# --------------------------------------------------------------------------- the stand-in


def test_the_standin_writes_stats_json_and_sglang_prefill_lines_of_the_same_steps(tmp_path):
    from remote_ops.workflows import sandbox

    sandbox.write_model_config(tmp_path / "model")
    (tmp_path / "pkgs").mkdir()
    (tmp_path / "pkgs" / "remote_ops_dump").symlink_to(REPO / "remote_ops" / "dumper")
    env = {
        **os.environ,
        "PYTHONPATH": str(tmp_path / "pkgs"),
        "STANDIN_LOAD_SECONDS": "0",
        "SGLANG_HS_DUMP_DIR": str(tmp_path / "dumps"),
        "STANDIN_GPU_MS_PER_1K_TOKENS": "100",  # 20 ms a prefill: the 4 in flight queue up
    }
    port, logf = free_port(), tmp_path / "standin.log"
    proc = subprocess.Popen(
        [sys.executable, str(STANDIN), "--port", str(port), "--model-path", str(tmp_path / "model")],
        env=env,
        stdout=open(logf, "wb"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 20
        while b"listening" not in logf.read_bytes():
            assert proc.poll() is None and time.monotonic() < deadline, logf.read_text()
            time.sleep(0.1)

        def send(i):
            body = json.dumps(
                {"input_ids": [(i * 31 + t) % 32000 for t in range(200)], "sampling_params": {"max_new_tokens": 1}}
            )
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/generate", body.encode(), {"Content-Type": "application/json"}
            )
            urllib.request.urlopen(req, timeout=30).read()

        threads = [threading.Thread(target=lambda k=k: [send(k * 6 + j) for j in range(6)]) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    stats = json.loads((tmp_path / "dumps" / "rank0" / "stats.json").read_text())
    assert stats["standin"] is True and stats["capture_steps"] == stats["files"] == 24 and stats["capture_steps_us"] > 0
    lines = sglanglog.parse_lines(logf.read_text())
    steps = sglanglog.prefill_steps(lines)
    assert steps.lines == 24 and steps.tokens == 24 * 200 and steps.standin and steps.timed == 23
    assert steps.busy >= 8  # with 4 clients, requests wait for the one simulated GPU
    assert steps.busy_s / steps.busy >= 0.02  # each step holds its 20 ms of simulated GPU time
    cost = dumpercost.dumper_cost(dumpercost.parse_stats(f"==> x/rank0/stats.json\n{json.dumps(stats)}\n"), lines)
    assert cost.standin and cost.basis == "busy" and 0 < cost.share < 1 and cost.notes == []


# --------------------------------------------------------------------------- lab: a deployed stand-in


@pytest.mark.docker
def test_dumps_stats_and_regenerate_s_server_figure_on_a_deployed_standin(lab, sglang_remote, deployed, tmp_path):
    from remote_ops.workflows import extract

    host = lab.host(deployed.name)
    for d in ("extract", "regenerate"):
        subprocess.run(["rm", "-rf", str(host.paths.logs_dir / d)], check=True, timeout=30)
    ds = tmp_path / "ds.jsonl"
    ds.write_text(
        "".join(
            json.dumps({"id": f"s{i}", "input_ids": [(i * 977 + t) % 32000 for t in range(64 + i)]}) + "\n"
            for i in range(16)
        )
    )
    extract.start(sglang_remote, deployed, str(ds), concurrency=4, dump_grace=5)
    st = extract.wait_finished(sglang_remote, deployed, 120)
    assert st.summary.done == 16
    env = {
        **os.environ,
        "REMOTE_OPS_INVENTORY": str(lab.inventory_dir),
        "REMOTE_OPS_STATE_DIR": str(tmp_path / "state"),
    }

    p = subprocess.run(
        [sys.executable, "-m", "remote_ops", "dumps", "stats", "--host", deployed.name, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["standin"] is True and doc["ranks"][0]["steps"] == 16 and doc["prefill"]["lines"] == 16
    assert doc["prefill"]["timed"] == 15 and doc["share"] is not None and doc["share"] > 0
    assert "STAND-IN" in p.stderr and "dumper overhead" in p.stderr

    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        "".join(
            json.dumps({"id": i, "messages": [{"role": "user", "content": f"q{i} " * 20}]}) + "\n" for i in range(6)
        )
    )
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "remote_ops",
            "dataset",
            "regenerate",
            "--host",
            deployed.name,
            "--dataset",
            str(chats),
            "--max-tokens",
            "48",
            "--concurrency",
            "3",
            "--wait",
            "120",
            "--json",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
    )
    assert p.returncode == 0, p.stderr
    regen = json.loads(p.stdout)
    figure = regen["hosts"][deployed.name]
    assert regen["written"] == 6 and figure["client_tokens_s"] > 0
    assert (
        figure["server"]["standin"] is True and figure["server"]["lines"] >= 5 and figure["server"]["mean_tokens_s"] > 0
    )
    assert "STAND-IN (mean of" in p.stderr
