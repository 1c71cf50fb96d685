#!/usr/bin/env python3
"""Regeneration client: runs ON the GPU host (stdlib only, Python 3.8+), beside the server, so that
the deployed target writes a chat dataset's assistant turns (as SpecForge's
`scripts/regenerate_train_data.py` does, against the server the host already serves).

Its dataset is a shard written by `remote-ops dataset regenerate`: one JSON line per chat,
`{"id", "key", "messages": [{"role", "content"}]}`, checked and keyed on the laptop
(`remote_ops.core.regenplan`: the key hashes the prompt turns and the sampling parameters).  For
every chat it walks the turns in order, as SpecForge's script does: system turns are kept, the
source's assistant turns are dropped, and after each user turn the conversation so far (with the
replies regenerated so far) goes to the server's `/v1/chat/completions`, so the server renders it
with the model's own chat template; the answer becomes the next assistant turn (with its
`reasoning_content` when the server's reasoning parser returns one).  Sampling: `--temperature`,
`--top-p` (sent only when given), `--max-tokens`; N chats in flight (`--concurrency`).

- `<workdir>/regenerated.jsonl`: one O_APPEND line per regenerated chat,
  `{"id", "source_key", "messages", "regenerated": {...}}`, written BEFORE the chat's `ok` line
  in `<workdir>/manifest.jsonl` (the extraction client's manifest: id, key, status, attempts,
  tokens = the chat's completion tokens), so every `ok` line has its record.
- Done-ness is by key: a restarted run skips the chats whose key has an `ok` line (a killed run
  loses only the chats in flight, which are sent again).
- `count` and `done-keys` are the extraction client's (the same work dir files);
  `records --workdir W` prints the output lines of the keys given on stdin, one a line (what
  the laptop pulls and merges).
- Progress log lines as the extraction client's (`started`, `progress`, `error`, `failed`,
  `finished` / `stopped`; `tokens` = completion tokens), read by
  `remote_ops.core.logparse.parse_extraction`.
- Transient errors (connection refused/reset, timeouts, HTTP 5xx/429) are retried with
  exponential backoff and jitter; others fail the chat (a `failed` manifest line, no record).

The log, manifest, HTTP and count helpers are `extract_onhost.py`'s, shipped beside this file
(imported from this file's folder).  Stop it with SIGTERM: the chats in flight finish, then it
logs `stopped` (exit 3).
"""

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from queue import Empty, Queue

try:  # imported as remote_ops.onhost.regenerate_onhost (tests, the laptop)
    from . import extract_onhost as ex
except ImportError:  # run as a script on the host: the helper is beside it (sys.path[0])
    import extract_onhost as ex  # type: ignore[import-not-found,no-redef]

OUTPUT_NAME = "regenerated.jsonl"
CHAT_PATH = "/v1/chat/completions"


class Chat:
    """One shard line: the source id, the content key, the source turns."""

    __slots__ = ("id", "key", "messages")

    def __init__(self, sid, key, messages):
        self.id, self.key, self.messages = sid, key, messages


def read_shard(path):
    """[Chat] of a shard; a line the laptop would not have written raises ex.DatasetError."""
    chats = []
    with open(path, "rb") as fh:
        for index, raw in enumerate(fh):
            if not raw.strip():
                continue
            try:
                doc = json.loads(raw.decode("utf-8"))
            except ValueError as exc:
                raise ex.DatasetError(path, index + 1, "not JSON: %s" % (exc,)) from None
            reason = shard_problem(doc)
            if reason:
                raise ex.DatasetError(path, index + 1, reason)
            chats.append(Chat(doc.get("id", index), doc["key"], doc["messages"]))
    return chats


def shard_problem(doc):
    if not isinstance(doc, dict) or not isinstance(doc.get("key"), str) or not doc["key"]:
        return "not a shard line ({id, key, messages}: written by remote-ops dataset regenerate)"
    turns = doc.get("messages")
    if not isinstance(turns, list) or not turns:
        return "messages must be a non-empty list"
    for turn in turns:
        if not isinstance(turn, dict) or turn.get("role") not in ("system", "user", "assistant"):
            return "each turn needs a role: system, user or assistant"
        if not isinstance(turn.get("content"), str):
            return "each turn's content is a string"
    return None


def sampling_of(args):
    """The request's sampling fields (top_p only when given, as SpecForge's script)."""
    out = {"temperature": args.temperature, "max_tokens": args.max_tokens}
    if args.top_p is not None:
        out["top_p"] = args.top_p
    return out


def reply_of(answer):
    """(assistant turn, finish_reason, completion tokens, prompt tokens, model) of a chat answer;
    ValueError when it has no choices[0].message."""
    try:
        choice = answer["choices"][0]
        message = choice["message"]
    except (KeyError, IndexError, TypeError):
        raise ValueError("the answer has no choices[0].message: %s" % (json.dumps(answer)[:200],)) from None
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise ValueError("choices[0].message.content is not text")
    turn = {"role": "assistant", "content": content or ""}
    if isinstance(message.get("reasoning_content"), str):
        turn["reasoning_content"] = message["reasoning_content"]
    usage = answer.get("usage") if isinstance(answer.get("usage"), dict) else {}
    return (
        turn,
        choice.get("finish_reason"),
        int(usage.get("completion_tokens") or 0),
        int(usage.get("prompt_tokens") or 0),
        answer.get("model"),
    )


def regenerate(messages, ask):
    """The chat with every assistant turn written by `ask(conversation so far)` (SpecForge's walk:
    system turns kept, source replies dropped, one request after each user turn); returns
    (messages, meta)."""
    out, reasons, completion, prompt, model, standin = [], [], 0, 0, None, False
    for turn in messages:
        if turn["role"] == "assistant":
            continue
        out.append({"role": turn["role"], "content": turn["content"]})
        if turn["role"] != "user":
            continue
        answer = ask(out)
        reply, reason, c_tokens, p_tokens, model = reply_of(answer)
        standin = standin or answer.get("standin") is True
        out.append(reply)
        reasons.append(reason)
        completion, prompt = completion + c_tokens, prompt + p_tokens
    meta = {"finish_reasons": reasons, "completion_tokens": completion, "prompt_tokens": prompt, "model": model}
    if standin:
        meta["standin"] = True  # the sandbox's stand-in server wrote these turns, not a model
    return out, meta


def with_retries(call, args, stop, on_transient):
    """call() until it answers; Transient errors retried (backoff doubling, jitter) at most
    --retries times.  Returns (answer, attempts); raises ValueError / ex.Transient when it gives up."""
    attempt, delay = 0, args.backoff
    while True:
        attempt += 1
        try:
            return call(), attempt
        except ex.Transient as exc:
            on_transient(attempt, str(exc))
            if attempt > args.retries or stop.is_set():
                raise
        stop.wait(min(delay, args.max_backoff) * (0.5 + random.random()))
        delay *= 2


class Run:
    """One regeneration session: a queue of pending chats, N workers, counters."""

    def __init__(self, args, chats, records, dataset_id):
        self.args, self.dataset_id = args, dataset_id
        self.url = args.server.rstrip("/") + CHAT_PATH
        self.manifest = os.path.join(args.workdir, "manifest.jsonl")
        self.output = args.output or os.path.join(args.workdir, OUTPUT_NAME)
        self.log = ex.Log(args.log)
        self.stop = threading.Event()
        self.lock, self.wlock = threading.Lock(), threading.Lock()
        done = ex.done_keys(records)
        earlier = {}
        for rec in records:
            if rec.get("status") == "ok":
                earlier[str(rec.get("key"))] = int(rec.get("tokens") or 0)
        pending = [c for c in chats if c.key not in done]
        self.total = len(chats)
        self.done = self.total - len(pending)
        self.tokens = sum(earlier.get(c.key, 0) for c in chats if c.key in done)
        self.errors = self.failed = self.session_done = self.session_tokens = self.prompt_tokens = 0
        self.queue = Queue()
        for chat in pending:
            self.queue.put(chat)
        self.started = time.time()

    def counters(self):
        return dict(
            done=self.done,
            total=self.total,
            tokens=self.tokens,
            errors=self.errors,
            failed=self.failed,
            session_done=self.session_done,
            session_tokens=self.session_tokens,
            prompt_tokens=self.prompt_tokens,
            elapsed=round(time.time() - self.started, 3),
        )

    def worker(self):
        while not self.stop.is_set():
            try:
                chat = self.queue.get_nowait()
            except Empty:
                return
            self.one(chat)

    def ask(self, conversation, attempts):
        body = dict(sampling_of(self.args), messages=conversation, stream=False)
        answer, n = with_retries(
            lambda: ex.post_json(self.url, body, self.args.request_timeout), self.args, self.stop, self.transient
        )
        attempts.append(n)
        return answer

    def transient(self, attempt, error):
        with self.lock:
            self.errors += 1
        self.log.event("error", attempt=attempt, error=error[:200])

    def one(self, chat):
        """Regenerate one chat; its record, then its manifest line (an interrupted chat: neither)."""
        attempts = []
        try:
            messages, meta = regenerate(chat.messages, lambda conv: self.ask(conv, attempts))
        except (ValueError, ex.Transient) as exc:
            if self.stop.is_set():
                return  # interrupted: sent again by the next run
            return self.record(chat, "failed", sum(attempts) + 1, 0, str(exc))
        meta["sampling"] = sampling_of(self.args)
        rec = {"id": chat.id, "source_key": chat.key, "messages": messages, "regenerated": meta}
        ex.append_line(self.output, rec, self.wlock)
        with self.lock:
            self.prompt_tokens += meta["prompt_tokens"]
        self.record(chat, "ok", sum(attempts), meta["completion_tokens"])

    def record(self, chat, status, attempts, tokens, error=None):
        rec = {
            "id": str(chat.id),
            "key": chat.key,
            "tokens": tokens,
            "status": status,
            "attempts": attempts,
            "dataset": self.dataset_id,
            "time": round(time.time(), 3),
        }
        if error:
            rec["error"] = error[:300]
        ex.append_line(self.manifest, rec, self.wlock)
        with self.lock:
            if status == "ok":
                self.done += 1
                self.tokens += tokens
                self.session_done += 1
                self.session_tokens += tokens
            else:
                self.failed += 1
        if status == "failed":
            self.log.event("failed", id=chat.id, key=chat.key, error=(error or "")[:200])


def progress_loop(run):
    while not run.stop.wait(run.args.progress_every):
        run.log.event("progress", **run.counters())


def records(workdir, wanted, out):
    """Write the output lines of the `wanted` keys (the last line of each) to `out`."""
    path = os.path.join(workdir, OUTPUT_NAME)
    found = {}
    if os.path.exists(path):
        with open(path, "rb") as fh:
            for raw in fh:
                try:
                    key = json.loads(raw.decode("utf-8")).get("source_key")
                except (ValueError, AttributeError):
                    continue  # a torn last line (a kill mid-write)
                if key in wanted:
                    found[key] = raw.rstrip(b"\n")
    for line in found.values():
        out.write(line + b"\n")
    return len(found)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="regenerate_onhost", description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", required=True, help="shard JSONL: {id, key, messages}")
    ap.add_argument("--server", default="http://127.0.0.1:30000")
    ap.add_argument("--workdir", required=True, help="manifest.jsonl, regenerated.jsonl, client.pid")
    ap.add_argument("--log", required=True, help="progress log (appended)")
    ap.add_argument("--output", default=None, help="default <workdir>/" + OUTPUT_NAME)
    ap.add_argument("--concurrency", type=int, default=64, help="chats in flight")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--max-tokens", type=int, default=4096, help="per assistant turn")
    ap.add_argument("--retries", type=int, default=5)
    ap.add_argument("--backoff", type=float, default=0.5, help="first retry delay (doubles)")
    ap.add_argument("--max-backoff", type=float, default=30.0)
    ap.add_argument("--request-timeout", type=float, default=3600.0)
    ap.add_argument("--progress-every", type=float, default=5.0)
    return ap.parse_args(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["count"], ["done-keys"]):
        return ex.main(argv)
    if argv[:1] == ["records"]:
        ap = argparse.ArgumentParser(prog="regenerate_onhost records")
        ap.add_argument("--workdir", required=True)
        wanted = {line.strip() for line in sys.stdin if line.strip()}
        records(ap.parse_args(argv[1:]).workdir, wanted, sys.stdout.buffer)
        return 0
    args = parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    with open(os.path.join(args.workdir, "client.pid"), "w") as fh:
        fh.write("%d\n" % os.getpid())
    try:
        chats = read_shard(args.dataset)
    except ex.DatasetError as exc:
        sys.stderr.write("dataset error: %s\n" % exc)
        return 2
    except OSError as exc:
        sys.stderr.write("dataset error: %s: %s\n" % (args.dataset, exc.strerror or exc))
        return 2
    dataset_id = ex.file_sha256(args.dataset)[:16]
    ex.write_run(args.workdir, args.dataset, [c.key for c in chats], dataset_id)
    run = Run(args, chats, ex.manifest_records(os.path.join(args.workdir, "manifest.jsonl")), dataset_id)
    signal.signal(signal.SIGTERM, lambda *_: run.stop.set())
    signal.signal(signal.SIGINT, lambda *_: run.stop.set())
    run.log.event(
        "started",
        pending=run.queue.qsize(),
        concurrency=args.concurrency,
        pid=os.getpid(),
        dataset=dataset_id,
        sampling=json.dumps(sampling_of(args), sort_keys=True),
        **run.counters(),
    )
    threading.Thread(target=progress_loop, args=(run,), daemon=True).start()
    workers = [threading.Thread(target=run.worker) for _ in range(max(1, args.concurrency))]
    for w in workers:
        w.start()
    for w in workers:
        while w.is_alive():
            w.join(0.5)
    stopped = run.stop.is_set()
    run.stop.set()
    if stopped:
        run.log.event("stopped", **run.counters())
        return 3
    run.log.event("finished", **run.counters())
    return 0 if not run.failed else 1


if __name__ == "__main__":
    sys.exit(main())
