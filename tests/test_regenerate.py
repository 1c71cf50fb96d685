"""`dataset regenerate`: the deployed target writes a chat dataset's assistant turns.

Pure: the chat rules (FILE:LINE, exit 3 before any connection), the content key (prompt turns +
sampling, never the id or the source replies), the merge (every chat once, in the dataset's
order), SpecForge's walk over the turns (one request per user turn, the conversation so far).
The stand-in's chat endpoint (a process on this machine): its STAND-IN template and greedy
tokens.  Lab: 24 chats on one host through the real client and the stand-in's
/v1/chat/completions; a rerun is a no-op; over a 3-host group every chat is written once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import clear_server_port, stop_process

from remote_ops.core import datasetcheck, regenplan
from remote_ops.hostlab._proc import free_port
from remote_ops.onhost import regenerate_onhost

REPO = Path(__file__).resolve().parents[1]
STANDIN = REPO / "docker" / "standin" / "sglang_standin_server.py"
SAMPLING = regenplan.Sampling(temperature=0.7, top_p=None, max_tokens=12)


# --------------------------------------------------------------------------- the chat rules

GOOD = [
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    {"id": 7, "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
    {"conversations": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"text": "b"}]}]},
]
BAD = [
    (b"not json\n", "not JSON"),
    (b'{"id": 1}\n', "no messages (or conversations) list"),
    (b'{"messages": []}\n', "messages is empty"),
    (b'{"messages": {"role": "user"}}\n', "messages must be a list of turns, not an object"),
    (b'{"messages": [{"role": "assistant", "content": "x"}]}\n', "first turn after the system turns must be a user"),
    (b'{"messages": [{"role": "tool", "content": "x"}]}\n', "role 'tool' cannot be regenerated"),
    (b'{"messages": [{"role": "user", "content": 3}]}\n', "content must be text"),
    (b'{"messages": [{"role": "user", "content": "x"}], "id": [1]}\n', "id must be a string or an integer"),
    (b'{"messages": [{"content": "x"}]}\n', "has no role (or from) string"),
    (b'{"id": 1, "id": 2, "messages": []}\n', "duplicate key 'id'"),
    (b"\xff\n", "not UTF-8"),
]


def test_chat_rules_take_openai_and_sharegpt_and_name_each_bad_line():
    for doc in GOOD:
        chat, reason = datasetcheck.chat_record(json.dumps(doc).encode())
        assert reason is None and chat is not None, (doc, reason)
        assert {t["role"] for t in chat["messages"]} <= {"system", "user", "assistant"}
    assert datasetcheck.chat_record(json.dumps(GOOD[3]).encode())[0]["messages"][0]["content"] == "ab"
    for raw, want in BAD:
        chat, reason = datasetcheck.chat_record(raw)
        assert chat is None and reason and want in reason, (raw, reason)
    lines = [json.dumps(GOOD[0]).encode() + b"\n", BAD[2][0], b"\n", BAD[4][0]]
    assert [(p.line, p.reason) for p in datasetcheck.check_chat_lines(lines)] == [
        (2, "messages is empty"),
        (4, "messages: the first turn after the system turns must be a user turn, not assistant"),
    ]


def test_a_bad_chat_line_is_exit_3_naming_file_and_line_before_any_connection(tmp_path):
    chats = tmp_path / "chats.jsonl"
    chats.write_bytes(json.dumps(GOOD[0]).encode() + b"\n" + BAD[5][0])
    env = {**os.environ, "REMOTE_OPS_INVENTORY": str(tmp_path / "inv"), "REMOTE_OPS_STATE_DIR": str(tmp_path / "s")}
    (tmp_path / "inv").mkdir()
    # an ad-hoc host on a closed loopback port: a connection attempt would be exit 4, not 3
    p = subprocess.run(
        [sys.executable, "-m", "remote_ops", "dataset", "regenerate", "--host", "127.0.0.1:1", "--dataset", str(chats)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert p.returncode == 3, p.stderr
    assert f"{chats}:2" in p.stderr and "cannot be regenerated" in p.stderr


# --------------------------------------------------------------------------- keys, merge, the walk


def test_the_key_is_the_prompt_turns_and_the_sampling_never_the_id_or_the_replies():
    base = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    other_reply = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "something else"}]
    key = regenplan.chat_key(base, SAMPLING)
    assert key.endswith("-c") and len(key) == 34
    assert regenplan.chat_key(other_reply, SAMPLING) == key
    assert regenplan.chat_key(base[:1], SAMPLING) == key
    assert regenplan.chat_key([{"role": "user", "content": "hi!"}], SAMPLING) != key
    assert regenplan.chat_key(base, regenplan.Sampling(0.0, None, 12)) != key
    assert regenplan.chat_key(base, regenplan.Sampling(0.7, 0.9, 12)) != key
    assert regenplan.chat_key(base, regenplan.Sampling(0.7, None, 13)) != key
    assert regenplan.Sampling().to_dict() == {"temperature": 0.7, "max_tokens": 4096}  # SpecForge's defaults


def _chats(path: Path, n: int, dup_every: int = 0) -> list[str]:
    """n chats (some multi-turn, some with a system turn); every `dup_every`-th repeats chat 0's
    prompts under its own id.  Returns the ids in order."""
    ids = []
    with open(path, "w") as fh:
        for i in range(n):
            j = 0 if dup_every and i and i % dup_every == 0 else i
            turns = [{"role": "user", "content": f"question {j}: what is {j} + {j}?"}]
            turns.append({"role": "assistant", "content": f"an old answer {i}"})
            if j % 3 == 1:
                turns += [{"role": "user", "content": f"and {j} * 2?"}, {"role": "assistant", "content": "old"}]
            if j % 4 == 2:
                turns.insert(0, {"role": "system", "content": "answer briefly"})
            fh.write(json.dumps({"id": f"c{i}", "messages": turns}) + "\n")
            ids.append(f"c{i}")
    return ids


def test_merge_writes_every_chat_once_in_the_dataset_order_sharing_a_key_s_turns(tmp_path):
    _chats(tmp_path / "c.jsonl", 10, dup_every=4)
    samples = regenplan.read_chats(tmp_path / "c.jsonl", SAMPLING)
    sent = regenplan.one_per_key(samples)
    assert len(samples) == 10 and len(sent) == 8  # c4 and c8 repeat c0's prompts
    have = {s.key: {"source_key": s.key, "id": s.id, "messages": [{"role": "user", "content": s.id}]} for s in sent}
    del have[sent[3].key]
    merged = regenplan.merge(samples, have)
    assert [r["id"] for r in merged] == [s.id for s in samples if s.key != sent[3].key]
    by_id = {r["id"]: r for r in merged}
    assert by_id["c4"]["messages"] == by_id["c0"]["messages"] and by_id["c4"]["source_key"] == samples[0].key
    again = regenplan.parse_records(regenplan.output_bytes(merged))
    assert set(again) == set(have)


def test_the_walk_is_specforge_s_one_request_per_user_turn_with_the_conversation_so_far():
    asked = []

    def ask(conversation):
        asked.append([dict(t) for t in conversation])
        n = len(asked)
        return {
            "choices": [{"message": {"role": "assistant", "content": f"r{n}"}, "finish_reason": "length"}],
            "usage": {"completion_tokens": 5, "prompt_tokens": 10 * n},
            "model": "m",
        }

    source = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "old1"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "old2"},
        {"role": "user", "content": "u3"},
    ]
    messages, meta = regenerate_onhost.regenerate(source, ask)
    assert [t["content"] for t in messages] == ["s", "u1", "r1", "u2", "r2", "u3", "r3"]
    assert [[t["content"] for t in a] for a in asked] == [
        ["s", "u1"],
        ["s", "u1", "r1", "u2"],
        ["s", "u1", "r1", "u2", "r2", "u3"],
    ]
    assert meta == {"finish_reasons": ["length"] * 3, "completion_tokens": 15, "prompt_tokens": 60, "model": "m"}
    with pytest.raises(ValueError, match="no choices"):
        regenerate_onhost.regenerate(source, lambda c: {"error": "x"})


# --------------------------------------------------------------------------- the stand-in's chat endpoint


def _start_standin(port: int, model_dir: Path, tmp_path: Path, name: str, dump_dir: Path | None = None):
    pkg = tmp_path / "pkgs"
    pkg.mkdir(exist_ok=True)
    if not (pkg / "remote_ops_dump").exists():
        (pkg / "remote_ops_dump").symlink_to(REPO / "remote_ops" / "dumper")
    env = {**os.environ, "PYTHONPATH": str(pkg), "STANDIN_LOAD_SECONDS": "0"}
    env.pop("SGLANG_HS_DUMP_DIR", None)
    if dump_dir is not None:
        env["SGLANG_HS_DUMP_DIR"] = str(dump_dir)
    logf = tmp_path / f"standin-{name}.log"
    proc = subprocess.Popen(
        [sys.executable, str(STANDIN), "--port", str(port), "--model-path", str(model_dir)],
        env=env,
        stdout=open(logf, "wb"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 20
    while b"listening" not in logf.read_bytes():
        assert proc.poll() is None and time.monotonic() < deadline, logf.read_text()
        time.sleep(0.1)
    return proc, logf


def _stop(proc):
    stop_process(proc)


def _post(url: str, doc: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(doc).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def test_the_standin_chat_endpoint_renders_its_template_and_answers_the_network_s_greedy_tokens(tmp_path):
    from remote_ops.workflows import sandbox

    sandbox.write_model_config(tmp_path / "model")
    port = free_port()
    proc, logf = _start_standin(port, tmp_path / "model", tmp_path, "chat")
    try:
        turns = [{"role": "system", "content": "s"}, {"role": "user", "content": "hello"}]
        chat = _post(f"http://127.0.0.1:{port}/v1/chat/completions", {"messages": turns, "max_tokens": 9})
        gen = _post(
            f"http://127.0.0.1:{port}/generate",
            {"text": "<|system|>s<|user|>hello<|assistant|>", "sampling_params": {"max_new_tokens": 9}},
        )
        assert chat["standin"] is True and chat["object"] == "chat.completion"
        assert chat["standin_output_ids"] == gen["output_ids"]
        assert chat["choices"][0]["message"]["content"] == "".join(chr(32 + i % 95) for i in gen["output_ids"])
        assert chat["usage"] == {"prompt_tokens": 37, "completion_tokens": 9, "total_tokens": 46}
        with pytest.raises(urllib.error.HTTPError) as bad:
            _post(f"http://127.0.0.1:{port}/v1/chat/completions", {"messages": "hi"})
        assert bad.value.code == 400
        _client_resumes_by_key_and_gives_back_the_records_asked(port, tmp_path)
    finally:
        _stop(proc)
    log = logf.read_text()
    assert "STAND-IN] Prefill batch, #new-seq: 1, #new-token: 37," in log


def _client_resumes_by_key_and_gives_back_the_records_asked(port: int, tmp_path: Path) -> None:
    """The client run as a script (its helper beside it, as shipped): a second run sends nothing;
    `records` prints the lines of the keys on its stdin."""
    _chats(tmp_path / "c.jsonl", 4)
    shard = tmp_path / "shard.jsonl"
    shard.write_text("".join(s.line + "\n" for s in regenplan.read_chats(tmp_path / "c.jsonl", SAMPLING)))
    client = REPO / "remote_ops" / "onhost" / regenplan.CLIENT_NAME
    work, log = tmp_path / "work", tmp_path / "work" / "regen.log"
    argv = [sys.executable, str(client), "--dataset", str(shard), "--server", f"http://127.0.0.1:{port}"]
    argv += ["--workdir", str(work), "--log", str(log), "--max-tokens", "5", "--concurrency", "2"]
    for _ in range(2):
        assert subprocess.run(argv, timeout=60, capture_output=True).returncode == 0
    started = [line for line in log.read_text().splitlines() if " started " in line]
    assert "pending=4" in started[0] and "pending=0" in started[1] and "done=4" in started[1]
    records = [json.loads(line) for line in (work / "regenerated.jsonl").read_text().splitlines()]
    assert len(records) == 4 and {len(r["messages"][-1]["content"]) for r in records} == {5}
    wanted = records[2]["source_key"] + "\nnot-a-key\n"
    out = subprocess.run(
        [sys.executable, str(client), "records", "--workdir", str(work)],
        input=wanted.encode(),
        capture_output=True,
        timeout=30,
    )
    assert [json.loads(line)["id"] for line in out.stdout.decode().splitlines()] == [records[2]["id"]]
    counted = subprocess.run(
        [sys.executable, str(client), "count", "--workdir", str(work)], capture_output=True, timeout=30
    )
    assert json.loads(counted.stdout)["done"] == json.loads(counted.stdout)["total"] == 4


# --------------------------------------------------------------------------- lab hosts


@pytest.fixture
def standins(lab, host, spare_host, tmp_path):
    """A stand-in server (no dumps) on each of lab1..lab3's server ports; fresh regenerate work dirs."""
    hosts = [host, lab.host("lab2"), spare_host]
    procs = []
    for h in hosts:
        subprocess.run(["rm", "-rf", str(h.paths.logs_dir / "regenerate")], check=True, timeout=30)
        h.paths.logs_dir.mkdir(parents=True, exist_ok=True)
        clear_server_port(lab, h)
        procs.append(_start_standin(h.server_port, h.paths.model_dir, tmp_path, h.name)[0])
    yield hosts
    for p in procs:
        _stop(p)


def cli(env, *args, timeout=240):
    p = subprocess.run(
        [sys.executable, "-m", "remote_ops", *args, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    return p.returncode, (json.loads(p.stdout) if p.stdout.strip() else None), p.stderr


def _manifest_ok(host) -> list[str]:
    path = host.paths.logs_dir / "regenerate" / "manifest.jsonl"
    if not path.exists():
        return []
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["key"] for r in recs if r["status"] == "ok"]


def _regen(env, hosts: str, chats: Path, out: Path, *extra):
    return cli(
        env,
        "dataset",
        "regenerate",
        "--host",
        hosts,
        "--dataset",
        str(chats),
        "--out",
        str(out),
        "--max-tokens",
        "12",
        "--concurrency",
        "4",
        *extra,
    )


def test_24_chats_are_regenerated_once_and_a_rerun_is_a_no_op(standins, lab_env, tmp_path):
    lab1 = standins[0]
    ids = _chats(tmp_path / "chats.jsonl", 24)
    out = tmp_path / "regenerated.jsonl"
    rc, doc, err = _regen(lab_env, "lab1", tmp_path / "chats.jsonl", out, "--wait", "120")
    assert rc == 0, err
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == ids and doc["written"] == 24 and doc["started"] == ["lab1"]
    samples = regenplan.read_chats(tmp_path / "chats.jsonl", regenplan.Sampling(0.7, None, 12))
    assert [r["source_key"] for r in records] == [s.key for s in samples]
    for rec, line in zip(records, (tmp_path / "chats.jsonl").read_text().splitlines()):
        source = json.loads(line)["messages"]
        users = [t["content"] for t in source if t["role"] == "user"]
        assert [t["content"] for t in rec["messages"] if t["role"] == "user"] == users
        replies = [t for t in rec["messages"] if t["role"] == "assistant"]
        assert len(replies) == len(users) and all(len(t["content"]) == 12 for t in replies)  # 12 stand-in tokens
        assert not any(t["content"].startswith("an old answer") for t in replies)
        assert rec["regenerated"]["standin"] is True and rec["regenerated"]["sampling"]["max_tokens"] == 12
    host = doc["hosts"]["lab1"]
    assert host["chats_done"] == 24 and host["client_tokens_s"] > 0 and host["completion_tokens"] > 24 * 11
    assert sorted(_manifest_ok(lab1)) == sorted(s.key for s in samples)
    prepared = subprocess.run(  # what `dataset prepare` reads: every record has the messages it takes
        [sys.executable, "-c", "import json,sys; [json.loads(l)['messages'] for l in open(sys.argv[1])]", str(out)],
        timeout=30,
    )
    assert prepared.returncode == 0

    log = lab1.paths.logs_dir / "regenerate" / "regenerate.log"
    before = (out.read_bytes(), out.stat().st_mtime_ns, log.read_text(), _manifest_ok(lab1))
    rc, again, err = _regen(lab_env, "lab1", tmp_path / "chats.jsonl", out, "--wait", "120")
    assert rc == 0, err
    assert again["shards"] == {} and again["pulled"] == 0 and again["written"] == 24 and "started" not in again
    assert "nothing to do" in err
    assert (out.read_bytes(), out.stat().st_mtime_ns, log.read_text(), _manifest_ok(lab1)) == before


def test_over_a_3_host_group_every_chat_is_written_exactly_once(standins, lab_env, tmp_path):
    ids = _chats(tmp_path / "chats.jsonl", 30, dup_every=10)
    out = tmp_path / "regenerated.jsonl"
    rc, dry, err = _regen(lab_env, "lab1,lab2,lab3", tmp_path / "chats.jsonl", out, "--dry-run")
    assert rc == 0 and sum(dry["shards"].values()) == 28 and len(dry["shards"]) == 3, err
    assert not out.exists() and not _manifest_ok(standins[0])
    rc, doc, err = _regen(lab_env, "lab1,lab2,lab3", tmp_path / "chats.jsonl", out, "--wait", "180")
    assert rc == 0, err
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == ids  # every chat once, in the dataset's order
    by_host = [_manifest_ok(h) for h in standins]
    assert all(len(keys) == len(set(keys)) for keys in by_host)  # no key twice on a host
    assert sum(len(k) for k in by_host) == 28 and len(set().union(*map(set, by_host))) == 28  # none on two
    assert set(doc["started"]) == {"lab1", "lab2", "lab3"}
    assert records[10]["messages"] == records[0]["messages"] == records[20]["messages"]  # one key, its turns
