#!/usr/bin/env python3
"""Extraction client: runs ON the GPU host (stdlib only, Python 3.8+), beside the server.

For every sample of a JSONL dataset (`{"id": ..., "input_ids": [...]}`, or
`token_ids`) it sends the token ids to the server's `/generate` with
`sampling_params.max_new_tokens = 1` (prefill-only: the patched model dumps the
hidden states of the prompt), keeping N requests in flight.

- Its own manifest (`<workdir>/manifest.jsonl`, one O_APPEND line per sample)
  maps the dump key (`sha256(int32-LE token ids)[:32] + "-p0"`, the dump
  contract's key) to the sample id.  On restart, samples with an `ok` line are
  skipped: the run resumes where it stopped (a killed run loses at most the
  requests in flight, which are simply sent again).
- Transient errors (connection refused/reset, timeouts, HTTP 5xx/429) are
  retried with exponential backoff and jitter; others fail the sample.
- Progress goes to the log as `<UTC time> <event> key=value ...` lines, parsed
  by `remote_ops.logs.parse_extraction`:
  `started`, `progress` (every few seconds), `error` (a retried attempt),
  `failed` (gave up), `finished`/`stopped` (last line).
- At the end it checks that each sample's dump file exists
  (`<dump-dir>/rank*/<key>.safetensors`, waiting up to --dump-grace seconds for
  the dumper's writer), and lists the samples without one in `missing.jsonl`.

Stop it with SIGTERM (it finishes the requests in flight and logs `stopped`).
"""
import argparse
import glob
import hashlib
import json
import os
import random
import signal
import socket
import struct
import sys
import threading
import time
import urllib.error
import urllib.request
from queue import Empty, Queue

KEY_HASH_CHARS = 32
RETRY_HTTP = (429, 500, 502, 503, 504)


def dump_key(token_ids, prefix_len=0):
    """The dump contract's key of a prompt: sha256 of int32 LE ids, 32 hex chars, `-p<prefix>`."""
    raw = struct.pack("<%di" % len(token_ids), *token_ids)
    return "%s-p%d" % (hashlib.sha256(raw).hexdigest()[:KEY_HASH_CHARS], prefix_len)


def utc_now():
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class Log:
    """Appends `<time> <event> k=v ...` lines to the extraction log (one write per line)."""

    def __init__(self, path):
        self.path = path
        self.lock = threading.Lock()

    def event(self, event, **fields):
        parts = ["%s=%s" % (k, _word(v)) for k, v in fields.items()]
        line = "%s %s %s\n" % (utc_now(), event, " ".join(parts))
        with self.lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode("utf-8"))
            finally:
                os.close(fd)


def _word(value):
    text = str(value)
    return json.dumps(text) if (not text or any(c.isspace() or c == '"' for c in text)) else text


def read_dataset(path):
    """[(sample id, token ids)] from JSONL; the id defaults to the line number."""
    samples = []
    with open(path) as fh:
        for number, line in enumerate(fh):
            if not line.strip():
                continue
            doc = json.loads(line)
            ids = doc.get("input_ids", doc.get("token_ids"))
            if not isinstance(ids, list) or not ids:
                raise ValueError("line %d: no input_ids/token_ids list" % (number + 1))
            samples.append((str(doc.get("id", number)), [int(x) for x in ids]))
    return samples


def read_manifest(path):
    """{sample id: last record}; torn lines (a kill mid-write) are skipped."""
    done = {}
    if not os.path.exists(path):
        return done
    with open(path, "rb") as fh:
        for raw in fh:
            try:
                rec = json.loads(raw.decode("utf-8"))
            except ValueError:
                continue
            if isinstance(rec, dict) and "id" in rec:
                done[str(rec["id"])] = rec
    return done


def append_line(path, record, lock):
    """One O_APPEND write per record: a kill leaves at most one torn last line."""
    data = (json.dumps(record, sort_keys=True) + "\n").encode("utf-8")
    with lock:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)


class Transient(Exception):
    """An error worth retrying (server restarting, overloaded, link hiccup)."""


def generate(url, token_ids, timeout):
    """POST one prompt to /generate with max_new_tokens=1; raise Transient or ValueError."""
    body = json.dumps({"input_ids": token_ids,
                       "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).encode()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:200].decode("utf-8", "replace")
        if exc.code in RETRY_HTTP:
            raise Transient("HTTP %d %s" % (exc.code, detail))
        raise ValueError("HTTP %d %s" % (exc.code, detail))
    except (urllib.error.URLError, socket.timeout, ConnectionError, TimeoutError) as exc:
        raise Transient("%s: %s" % (type(exc).__name__, getattr(exc, "reason", exc)))


class Run:
    """One extraction session: a queue of pending samples, N workers, counters."""

    def __init__(self, args, samples, done):
        self.args = args
        self.url = args.server.rstrip("/") + "/generate"
        self.manifest = os.path.join(args.workdir, "manifest.jsonl")
        self.log = Log(args.log)
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.mlock = threading.Lock()
        self.total = len(samples)
        ok = {i for i, r in done.items() if r.get("status") == "ok"}
        self.done = len(ok)
        self.tokens = sum(int(done[i].get("tokens", 0)) for i in ok)
        self.errors = self.failed = self.session_done = self.session_tokens = 0
        self.queue = Queue()
        for sid, ids in samples:
            if sid not in ok:
                self.queue.put((sid, ids))
        self.started = time.time()

    def counters(self):
        return dict(done=self.done, total=self.total, tokens=self.tokens, errors=self.errors,
                    failed=self.failed, session_done=self.session_done,
                    session_tokens=self.session_tokens, elapsed=round(time.time() - self.started, 3))

    def worker(self):
        while not self.stop.is_set():
            try:
                sid, ids = self.queue.get_nowait()
            except Empty:
                return
            self.one(sid, ids)

    def one(self, sid, ids):
        """Send one sample with retries; record the outcome in the manifest."""
        key, attempt, delay = dump_key(ids), 0, self.args.backoff
        while True:
            attempt += 1
            try:
                generate(self.url, ids, self.args.request_timeout)
                return self.record(sid, key, ids, "ok", attempt)
            except Transient as exc:
                with self.lock:
                    self.errors += 1
                self.log.event("error", id=sid, attempt=attempt, error=str(exc)[:200])
                if attempt > self.args.retries or self.stop.is_set():
                    return self.record(sid, key, ids, "failed" if not self.stop.is_set() else "interrupted",
                                       attempt, str(exc))
                self.stop.wait(min(delay, self.args.max_backoff) * (0.5 + random.random()))
                delay *= 2
            except ValueError as exc:
                return self.record(sid, key, ids, "failed", attempt, str(exc))

    def record(self, sid, key, ids, status, attempts, error=None):
        if status == "interrupted":
            return                      # not recorded: the next run sends it again
        rec = {"id": sid, "key": key, "tokens": len(ids), "status": status, "attempts": attempts,
               "time": round(time.time(), 3)}
        if error:
            rec["error"] = error[:300]
        append_line(self.manifest, rec, self.mlock)
        with self.lock:
            if status == "ok":
                self.done += 1
                self.tokens += len(ids)
                self.session_done += 1
                self.session_tokens += len(ids)
            else:
                self.failed += 1
        if status == "failed":
            self.log.event("failed", id=sid, key=key, attempts=attempts, error=(error or "")[:200])


def missing_dumps(args, workdir):
    """Samples whose dump file is absent, after waiting up to --dump-grace seconds for writers."""
    if not args.dump_dir:
        return None
    wanted = {r["key"]: r["id"] for r in read_manifest(os.path.join(workdir, "manifest.jsonl")).values()
              if r.get("status") == "ok"}
    deadline = time.time() + args.dump_grace
    while True:
        present = {os.path.basename(p)[:-len(".safetensors")]
                   for p in glob.glob(os.path.join(args.dump_dir, "rank*", "*.safetensors"))}
        missing = {k: i for k, i in wanted.items() if k not in present}
        if not missing or time.time() >= deadline:
            break
        time.sleep(min(1.0, max(deadline - time.time(), 0)))
    path = os.path.join(workdir, "missing.jsonl")
    with open(path + ".tmp", "w") as fh:
        for key, sid in sorted(missing.items(), key=lambda kv: kv[1]):
            fh.write(json.dumps({"id": sid, "key": key}) + "\n")
    os.replace(path + ".tmp", path)
    return len(missing)


def progress_loop(run):
    while not run.stop.wait(run.args.progress_every):
        run.log.event("progress", **run.counters())


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="extract_client", description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", required=True, help="JSONL: {id, input_ids}")
    ap.add_argument("--server", default="http://127.0.0.1:30000")
    ap.add_argument("--workdir", required=True, help="manifest.jsonl, missing.jsonl, client.pid")
    ap.add_argument("--log", required=True, help="progress log (appended)")
    ap.add_argument("--dump-dir", default=None, help="check each sample's dump file at the end")
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    ap.add_argument("--retries", type=int, default=5)
    ap.add_argument("--backoff", type=float, default=0.5, help="first retry delay (doubles)")
    ap.add_argument("--max-backoff", type=float, default=30.0)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--progress-every", type=float, default=5.0)
    ap.add_argument("--dump-grace", type=float, default=30.0, help="seconds to wait for late dump files")
    ap.add_argument("--limit", type=int, default=None, help="only the first N samples")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    with open(os.path.join(args.workdir, "client.pid"), "w") as fh:
        fh.write("%d\n" % os.getpid())
    samples = read_dataset(args.dataset)[:args.limit]
    run = Run(args, samples, read_manifest(os.path.join(args.workdir, "manifest.jsonl")))
    signal.signal(signal.SIGTERM, lambda *_: run.stop.set())
    signal.signal(signal.SIGINT, lambda *_: run.stop.set())
    run.log.event("started", pending=run.queue.qsize(), concurrency=args.concurrency, pid=os.getpid(),
                  **run.counters())
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
    missing = missing_dumps(args, args.workdir)
    run.log.event("finished", missing_dumps="-" if missing is None else missing, **run.counters())
    return 0 if not run.failed and not missing else 1


if __name__ == "__main__":
    sys.exit(main())
