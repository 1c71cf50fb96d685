#!/usr/bin/env python3
"""Extraction client: runs ON the GPU host (stdlib only, Python 3.8+), beside the server.

For every sample of a JSONL dataset (`{"id": ..., "input_ids": [...]}`, or
`token_ids`) it sends the token ids to the server's `/generate` with
`sampling_params.max_new_tokens = 1` (prefill-only: the patched model dumps the
hidden states of the prompt), keeping N requests in flight.

- Its own manifest (`<workdir>/manifest.jsonl`, one O_APPEND line per sample)
  maps the sample id to the dump key (`sha256(int32-LE token ids)[:32] + "-p0"`,
  the dump contract's key) and names the dataset (sha256 of the file, 16 hex).
- Done-ness is decided by that key, i.e. by content, never by the sample id: on
  restart a sample is skipped only when an `ok` line carries its key, so the run
  resumes where it stopped (a killed run loses at most the requests in flight,
  which are simply sent again), and a new dataset that reuses earlier ids with
  other token ids gets its own requests and dumps (`started` says how many ids
  were reused, `reused_ids=N`).  A sample whose key was done under another id
  gets an `ok` line for its own id (`"reused_dump": true`), without a request.
- `<workdir>/run.json` and `<workdir>/dataset.keys` describe the current
  dataset; `extract_onhost.py count --workdir W` prints its done/total (what
  `remote-ops extract status` shows), and counts always relate to it.
- `extract_onhost.py done-keys --workdir W` prints every dump key with an `ok`
  line (any dataset), one a line: what a sharded start on a group unions.
- Transient errors (connection refused/reset, timeouts, HTTP 5xx/429) are
  retried with exponential backoff and jitter; others fail the sample.
- Progress goes to the log as `<UTC time> <event> key=value ...` lines, parsed
  by `remote_ops.core.logparse.parse_extraction`:
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


def manifest_records(path):
    """Every readable record of the client manifest, in order; torn lines (a kill mid-write) skipped."""
    records = []
    if not os.path.exists(path):
        return records
    with open(path, "rb") as fh:
        for raw in fh:
            try:
                rec = json.loads(raw.decode("utf-8"))
            except ValueError:
                continue
            if isinstance(rec, dict) and "id" in rec:
                records.append(rec)
    return records


def read_manifest(path):
    """{sample id: last record} (across every dataset the work dir has seen)."""
    return {str(rec["id"]): rec for rec in manifest_records(path)}


def done_keys(records):
    """{dump key: sample ids with an `ok` line for it}: what is done, by content."""
    done = {}
    for rec in records:
        if rec.get("status") == "ok" and rec.get("key"):
            done.setdefault(str(rec["key"]), set()).add(str(rec["id"]))
    return done


def plan_samples(samples, records):
    """Split the dataset by dump key (pure): (pending, done, reused_ids, adopt).

    `pending`: (id, ids, key) still to send; `done`: (id, ids, key) whose key has an
    `ok` line; `reused_ids`: ids of this dataset that an earlier `ok` line gave
    other token ids; `adopt`: done samples whose own id has no `ok` line for the key.
    """
    done_by_key = done_keys(records)
    ok_key_of = {}
    for rec in records:
        if rec.get("status") == "ok":
            ok_key_of.setdefault(str(rec["id"]), set()).add(str(rec.get("key")))
    pending, done, reused, adopt = [], [], set(), []
    for sid, ids in samples:
        key = dump_key(ids)
        if ok_key_of.get(sid, set()) - {key}:
            reused.add(sid)
        if key in done_by_key:
            done.append((sid, ids, key))
            if sid not in done_by_key[key]:
                adopt.append((sid, ids, key))
        else:
            pending.append((sid, ids, key))
    return pending, done, sorted(reused), adopt


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
    body = json.dumps({"input_ids": token_ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).encode()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:200].decode("utf-8", "replace")
        if exc.code in RETRY_HTTP:
            raise Transient("HTTP %d %s" % (exc.code, detail)) from None
        raise ValueError("HTTP %d %s" % (exc.code, detail)) from None
    except (urllib.error.URLError, socket.timeout, ConnectionError, TimeoutError) as exc:
        raise Transient("%s: %s" % (type(exc).__name__, getattr(exc, "reason", exc))) from None


class Run:
    """One extraction session: a queue of pending samples, N workers, counters."""

    def __init__(self, args, samples, records, dataset_id="-"):
        self.args = args
        self.url = args.server.rstrip("/") + "/generate"
        self.manifest = os.path.join(args.workdir, "manifest.jsonl")
        self.log = Log(args.log)
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.mlock = threading.Lock()
        self.dataset_id = dataset_id
        pending, done, self.reused_ids, adopt = plan_samples(samples, records)
        self.total = len(samples)
        self.done = len(done)  # of THIS dataset, by dump key
        self.tokens = sum(len(ids) for _, ids, _ in done)
        self.done_keys = [key for _, _, key in done]
        self.errors = self.failed = self.session_done = self.session_tokens = 0
        for sid, ids, key in adopt:  # same content under a new id: no request needed
            self._append(sid, key, ids, "ok", 0, reused_dump=True)
        self.queue = Queue()
        for item in pending:
            self.queue.put(item)
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
            elapsed=round(time.time() - self.started, 3),
        )

    def worker(self):
        while not self.stop.is_set():
            try:
                sid, ids, key = self.queue.get_nowait()
            except Empty:
                return
            self.one(sid, ids, key)

    def one(self, sid, ids, key):
        """Send one sample with retries; record the outcome in the manifest."""
        attempt, delay = 0, self.args.backoff
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
                    return self.record(
                        sid, key, ids, "failed" if not self.stop.is_set() else "interrupted", attempt, str(exc)
                    )
                self.stop.wait(min(delay, self.args.max_backoff) * (0.5 + random.random()))
                delay *= 2
            except ValueError as exc:
                return self.record(sid, key, ids, "failed", attempt, str(exc))

    def _append(self, sid, key, ids, status, attempts, error=None, reused_dump=False):
        rec = {
            "id": sid,
            "key": key,
            "tokens": len(ids),
            "status": status,
            "attempts": attempts,
            "dataset": self.dataset_id,
            "time": round(time.time(), 3),
        }
        if error:
            rec["error"] = error[:300]
        if reused_dump:
            rec["reused_dump"] = True
        append_line(self.manifest, rec, self.mlock)

    def record(self, sid, key, ids, status, attempts, error=None):
        if status == "interrupted":
            return  # not recorded: the next run sends it again
        self._append(sid, key, ids, status, attempts, error)
        with self.lock:
            if status == "ok":
                self.done_keys.append(key)
                self.done += 1
                self.tokens += len(ids)
                self.session_done += 1
                self.session_tokens += len(ids)
            else:
                self.failed += 1
        if status == "failed":
            self.log.event("failed", id=sid, key=key, attempts=attempts, error=(error or "")[:200])


def missing_dumps(args, workdir, samples, keys_done):
    """Done samples of this dataset whose dump file is absent, after up to --dump-grace seconds."""
    if not args.dump_dir:
        return None
    done = set(keys_done)
    wanted = {}
    for sid, ids in samples:
        key = dump_key(ids)
        if key in done:
            wanted.setdefault(key, sid)
    deadline = time.time() + args.dump_grace
    while True:
        present = {
            os.path.basename(p)[: -len(".safetensors")]
            for p in glob.glob(os.path.join(args.dump_dir, "rank*", "*.safetensors"))
        }
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
    ap = argparse.ArgumentParser(prog="extract_onhost", description=__doc__.split("\n")[0])
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


def file_sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_atomic(path, text):
    with open(path + ".tmp", "w") as fh:
        fh.write(text)
    os.replace(path + ".tmp", path)


def describe_run(args, samples, dataset_id):
    """run.json + dataset.keys: what the current run is, for `count` and `extract status`."""
    write_atomic(os.path.join(args.workdir, "dataset.keys"), "".join(dump_key(ids) + "\n" for _, ids in samples))
    write_atomic(
        os.path.join(args.workdir, "run.json"),
        json.dumps(
            {
                "dataset": os.path.abspath(args.dataset),
                "dataset_id": dataset_id,
                "total": len(samples),
                "limit": args.limit,
                "started": utc_now(),
                "pid": os.getpid(),
            },
            sort_keys=True,
        )
        + "\n",
    )
    try:
        os.unlink(os.path.join(args.workdir, "missing.jsonl"))  # it described an earlier run
    except FileNotFoundError:
        pass


def count(workdir):
    """{"done", "total", "dataset_id"} of the current dataset (by dump key), from the files only."""
    try:
        with open(os.path.join(workdir, "dataset.keys")) as fh:
            keys = [line.strip() for line in fh if line.strip()]
        with open(os.path.join(workdir, "run.json")) as fh:
            run = json.load(fh)
    except (OSError, ValueError):
        return {"done": 0, "total": 0, "dataset_id": None}
    done = done_keys(manifest_records(os.path.join(workdir, "manifest.jsonl")))
    return {"done": sum(1 for k in keys if k in done), "total": len(keys), "dataset_id": run.get("dataset_id")}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["done-keys"]:
        ap = argparse.ArgumentParser(prog="extract_onhost done-keys")
        ap.add_argument("--workdir", required=True)
        keys = done_keys(manifest_records(os.path.join(ap.parse_args(argv[1:]).workdir, "manifest.jsonl")))
        sys.stdout.write("".join(k + "\n" for k in sorted(keys)))
        return 0
    if argv[:1] == ["count"]:
        ap = argparse.ArgumentParser(prog="extract_onhost count")
        ap.add_argument("--workdir", required=True)
        print(json.dumps(count(ap.parse_args(argv[1:]).workdir), sort_keys=True))
        return 0
    args = parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    with open(os.path.join(args.workdir, "client.pid"), "w") as fh:
        fh.write("%d\n" % os.getpid())
    samples = read_dataset(args.dataset)[: args.limit]
    dataset_id = file_sha256(args.dataset)[:16]
    describe_run(args, samples, dataset_id)
    run = Run(args, samples, manifest_records(os.path.join(args.workdir, "manifest.jsonl")), dataset_id)
    signal.signal(signal.SIGTERM, lambda *_: run.stop.set())
    signal.signal(signal.SIGINT, lambda *_: run.stop.set())
    run.log.event(
        "started",
        pending=run.queue.qsize(),
        concurrency=args.concurrency,
        pid=os.getpid(),
        dataset=dataset_id,
        reused_ids=len(run.reused_ids),
        **run.counters(),
    )
    if run.reused_ids:
        run.log.event(
            "note",
            reused_ids=len(run.reused_ids),
            first=run.reused_ids[0],
            meaning="ids done earlier with other token ids: sent again as new samples",
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
    missing = missing_dumps(args, args.workdir, samples, run.done_keys)
    run.log.event("finished", missing_dumps="-" if missing is None else missing, **run.counters())
    return 0 if not run.failed and not missing else 1


if __name__ == "__main__":
    sys.exit(main())
