"""The on-host client skeleton: runs ON the GPU host (stdlib only, Python 3.8+), shipped beside
every client built on it (`extract_onhost.py`, `regenerate_onhost.py`), which imports it from its
own folder.  A client is a subclass of `Run` that says what one item of its dataset is and how it
is sent; the rest is the same for every client:

- The work dir: `client.pid`; `run.json` + `dataset.keys`, the current dataset (`write_run`);
  `manifest.jsonl`, one O_APPEND line per item (`append_line`: a kill leaves at most one torn
  last line, which readers skip): id, key, tokens, status, attempts, dataset (sha256 of the
  file, 16 hex), time.  `count --workdir W` prints the current dataset's done/total,
  `done-keys --workdir W` every key with an `ok` line (any dataset), one a line.
- Resume by key: an item is done when an `ok` line carries its content key, never by its id
  (`Run.plan`): a killed run loses at most the items in flight, which the next run sends again.
- A queue of pending items and `--concurrency` workers.  A transient error (connection
  refused/reset, timeouts, HTTP 5xx/429: `post_json`) is retried up to `--retries` times with
  exponential backoff and jitter (`Run.attempt`); any other fails the item.
- A fatal cause (`Run.watch`, e.g. the extraction's dump dir gone: no retry can mend it),
  asked after every failed attempt and at every progress tick, stops the run: logged once as
  `fatal cause=.. says=".."`, nothing more is sent, the last line is `stopped cause=..` (exit 4).
- The progress log, `<UTC time> <event> key=value ...` lines (`Log`, read by
  `remote_ops.core.logparse.parse_extraction`): `started`, `progress` (every --progress-every
  seconds), `error` (a retried attempt), `failed` (gave up), `fatal`, and last `finished` (exit
  0, or 1 when items failed) or `stopped` (SIGTERM: the requests in flight finish; exit 3).
- A bad dataset line ends the client at start with one line on stderr, `dataset error:
  FILE:LINE: reason`, exit 2 (`decode_line`: every dataset's JSON-line rule, the laptop's too).
"""

import argparse
import hashlib
import json
import os
import random
import signal
import socket
import sys
import threading
import time
from queue import Empty, Queue

MANIFEST = "manifest.jsonl"
RETRY_HTTP = (429, 500, 502, 503, 504)


def utc_now():
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class Log:
    """Appends `<time> <event> k=v ...` lines to the progress log (one write per line)."""

    def __init__(self, path):
        self.path = path
        self.lock = threading.Lock()

    def event(self, event, **fields):
        parts = ["%s=%s" % (k, _word(v)) for k, v in fields.items()]
        append_bytes(self.path, ("%s %s %s\n" % (utc_now(), event, " ".join(parts))).encode("utf-8"), self.lock)


def _word(value):
    text = str(value)
    return json.dumps(text) if (not text or any(c.isspace() or c == '"' for c in text)) else text


class DatasetError(ValueError):
    """A dataset line the client cannot send: `path:line: reason` (line numbers from 1)."""

    def __init__(self, path, line, reason):
        ValueError.__init__(self, "%s:%d: %s" % (path, line, reason))
        self.line, self.reason = line, reason


class _Duplicate(ValueError):
    pass


def _no_duplicates(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise _Duplicate("duplicate key %r" % (key,))
        seen[key] = value
    return seen


def json_type(value):
    """`value`'s JSON type, as an operator reads it: a string, an object, true/false..."""
    if isinstance(value, bool):
        return "true/false"
    names = {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number"}
    return names.get(type(value), "null")


def decode_line(raw):
    """One line as a JSON object (UTF-8, no duplicate key): (object, None), (None, reason), or
    (None, None) for a blank line."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, "not UTF-8 (byte 0x%02x at column %d)" % (raw[exc.start], exc.start + 1)
    if not text.strip():
        return None, None
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicates)
    except _Duplicate as exc:
        return None, str(exc)
    except json.JSONDecodeError as exc:
        return None, "not JSON: %s (column %d)" % (exc.msg, exc.colno)
    except (ValueError, RecursionError) as exc:
        return None, "not JSON: %s" % (exc,)
    if not isinstance(doc, dict):
        return None, "not a JSON object (each line is one {...} record), but %s" % json_type(doc)
    return doc, None


def read_lines(path, problem):
    """[(record, 0-based index among the file's lines)] of a JSONL dataset, blank lines skipped;
    the first line `decode_line` or `problem(record)` names raises DatasetError."""
    out = []
    with open(path, "rb") as fh:
        for index, raw in enumerate(fh):
            doc, reason = decode_line(raw)
            reason = reason or (problem(doc) if doc is not None else None)
            if reason:
                raise DatasetError(path, index + 1, reason)
            if doc is not None:
                out.append((doc, index))
    return out


def json_lines(path):
    """(raw line, object) of every readable JSON object line of a file the client appends to (none
    when it does not exist); torn lines (a kill mid-write) skipped."""
    if not os.path.exists(path):
        return
    with open(path, "rb") as fh:
        for raw in fh:
            try:
                rec = json.loads(raw.decode("utf-8"))
            except ValueError:
                continue
            if isinstance(rec, dict):
                yield raw, rec


def manifest_records(path):
    """Every readable record of the client manifest, in order."""
    return [rec for _raw, rec in json_lines(path) if "id" in rec]


def read_manifest(path):
    """{item id: last record} (across every dataset the work dir has seen)."""
    return {str(rec["id"]): rec for rec in manifest_records(path)}


def done_keys(records):
    """{key: item ids with an `ok` line for it}: what is done, by content."""
    done = {}
    for rec in records:
        if rec.get("status") == "ok" and rec.get("key"):
            done.setdefault(str(rec["key"]), set()).add(str(rec["id"]))
    return done


def append_line(path, record, lock):
    """One O_APPEND write per record: a kill leaves at most one torn last line."""
    append_bytes(path, (json.dumps(record, sort_keys=True) + "\n").encode("utf-8"), lock)


def append_bytes(path, data, lock):
    with lock:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)


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


def write_run(workdir, dataset, keys, dataset_id, limit=None):
    """`<workdir>/dataset.keys` (the current run's content keys) and `run.json`; an earlier run's
    missing.jsonl goes.  What `count` reads."""
    write_atomic(os.path.join(workdir, "dataset.keys"), "".join(key + "\n" for key in keys))
    run = {"dataset": os.path.abspath(dataset), "dataset_id": dataset_id, "total": len(keys), "limit": limit}
    run.update(started=utc_now(), pid=os.getpid())
    write_atomic(os.path.join(workdir, "run.json"), json.dumps(run, sort_keys=True) + "\n")
    try:
        os.unlink(os.path.join(workdir, "missing.jsonl"))  # it described an earlier run
    except FileNotFoundError:
        pass


def count(workdir):
    """{"done", "total", "dataset_id"} of the current dataset (by key), from the files only."""
    try:
        with open(os.path.join(workdir, "dataset.keys")) as fh:
            keys = [line.strip() for line in fh if line.strip()]
        with open(os.path.join(workdir, "run.json")) as fh:
            run = json.load(fh)
    except (OSError, ValueError):
        return {"done": 0, "total": 0, "dataset_id": None}
    done = done_keys(manifest_records(os.path.join(workdir, MANIFEST)))
    return {"done": sum(1 for k in keys if k in done), "total": len(keys), "dataset_id": run.get("dataset_id")}


def print_done_keys(workdir):
    keys = done_keys(manifest_records(os.path.join(workdir, MANIFEST)))
    sys.stdout.write("".join(k + "\n" for k in sorted(keys)))


class Transient(Exception):
    """An error worth retrying (server restarting, overloaded, link hiccup)."""


def post_json(url, doc, timeout):
    """POST `doc` as JSON; return the decoded answer.  Raise Transient for what is worth retrying
    (connection refused/reset, timeouts, HTTP 429/5xx), ValueError for any other HTTP error."""
    import urllib.error
    import urllib.request

    body = json.dumps(doc).encode()
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


class GaveUp(Exception):
    """`Run.attempt` gave up on an item: the last `error`, the `attempts` made, and whether it was
    `interrupted` (SIGTERM or a fatal cause: not the item's fault; it is not recorded, and the
    next run sends it again)."""

    def __init__(self, error, attempts, interrupted):
        Exception.__init__(self, error)
        self.error, self.attempts, self.interrupted = error, attempts, interrupted


class Run:
    """One session of a client: a queue of pending items, N workers, counters, the manifest.

    A subclass says what an item is and how it is sent: the classmethod `read(args)` (the
    dataset's items; a bad line raises DatasetError), the staticmethod `key_of(item)` (its
    content key) and `one(item)` (sends it, usually through `attempt`, and ends with `record`).
    It may add options and defaults (`add_arguments`, `usage_problem`), counters (`counter_names`), `started`
    fields and `note` lines, a fatal cause (`watch`), a wait for room (`room`), work dir
    commands and its own end (`finish`)."""

    prog, description = "client", "an on-host client"  # its command line's name and first line
    #: what names a fatal cause: `.problem()` -> (cause, sentence) or None; `.fields` go on the `fatal` line
    watch = None
    #: what waits for room after a failed attempt: `.wait(tokens)` -> True when it waited
    room = None
    #: what `counters` logs (then `elapsed`)
    counter_names: "tuple[str, ...]" = ("done", "total", "tokens", "errors", "failed", "session_done", "session_tokens")

    def __init__(self, args, items, records, dataset_id="-"):
        self.args, self.dataset_id = args, dataset_id
        self.manifest = os.path.join(args.workdir, MANIFEST)
        self.log = Log(args.log)
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.mlock = threading.Lock()
        self.fatal = None  # (cause, sentence) once the run stopped on a cause no retry can mend
        self.errors = self.failed = self.session_done = self.session_tokens = 0
        pending, done_tokens = self.plan(items, records)
        self.total, self.done, self.tokens = len(items), len(done_tokens), sum(done_tokens)
        self.queue = Queue()
        for item in pending:
            self.queue.put(item)
        self.started = time.time()

    @classmethod
    def add_arguments(cls, ap):
        pass

    @classmethod
    def usage_problem(cls, args):
        return None

    @classmethod
    def workdir_commands(cls):
        """`CLIENT NAME --workdir W`, commands that read the work dir only: {name: function(workdir)}."""
        return {"count": lambda w: print(json.dumps(count(w), sort_keys=True)), "done-keys": print_done_keys}

    def plan(self, items, records):
        """(the items to send, the tokens of each done one): an item is done when an `ok` line
        carries its key (its tokens are that line's)."""
        ok = {}
        for rec in records:
            if rec.get("status") == "ok" and rec.get("key"):
                ok[str(rec["key"])] = int(rec.get("tokens") or 0)
        keys = [self.key_of(item) for item in items]
        return [item for item, key in zip(items, keys) if key not in ok], [ok[k] for k in keys if k in ok]

    def started_fields(self):
        return {}

    def notes(self):  # the fields of each `note` line logged after `started`
        return []

    def counted(self, key, tokens):  # an `ok` item was counted (under self.lock)
        pass

    def finish(self):
        """The run ended by itself: log `finished`; the exit code."""
        self.log.event("finished", **self.counters())
        return 0 if not self.failed else 1

    def counters(self):
        return dict([(name, getattr(self, name)) for name in self.counter_names], elapsed=self.elapsed())

    def elapsed(self):
        return round(time.time() - self.started, 3)

    def fatal_cause(self):
        """Stop the run (logged once) on a fatal cause; True when there is one."""
        problem = self.watch.problem() if self.watch else None
        if problem is None:
            return False
        cause, says = problem
        with self.lock:
            first, self.fatal = self.fatal is None, self.fatal or (cause, says)
        if first:
            self.log.event("fatal", cause=cause, **dict(self.watch.fields, says=says))
        self.stop.set()
        return True

    def worker(self):
        while not self.stop.is_set():
            try:
                item = self.queue.get_nowait()
            except Empty:
                return
            self.one(item)

    def attempt(self, send, item_id, tokens=0):
        """send() until it answers: (answer, attempts).  A Transient error is logged (`error`) and
        retried with backoff (from --backoff, doubling up to --max-backoff, with jitter) at most
        --retries times; a ValueError is not retried.  After each failed attempt a fatal cause
        stops the run, and a full disk (`room`) is waited out without spending a retry.
        Raises GaveUp."""
        attempt, delay = 0, self.args.backoff
        while True:
            attempt += 1
            try:
                return send(), attempt
            except Transient as exc:
                error, transient = str(exc), True
            except ValueError as exc:
                error, transient = str(exc), False
            if transient:
                with self.lock:
                    self.errors += 1
                self.log.event("error", id=item_id, attempt=attempt, error=error[:200])
            if self.fatal_cause():  # not the item's fault: it is sent again by the next run
                raise GaveUp(error, attempt, True)
            if self.room and self.room.wait(tokens):
                attempt -= 1
                if self.stop.is_set():
                    raise GaveUp(error, attempt, True)
                continue
            if not transient:
                raise GaveUp(error, attempt, False)
            if attempt > self.args.retries or self.stop.is_set():
                raise GaveUp(error, attempt, self.stop.is_set())
            self.stop.wait(min(delay, self.args.max_backoff) * (0.5 + random.random()))
            delay *= 2

    def append(self, item_id, key, tokens, status, attempts, error=None, **extra):
        """One manifest line (extra fields that are None are left out)."""
        rec = {"id": str(item_id), "key": key, "tokens": tokens, "status": status, "attempts": attempts}
        rec.update(dataset=self.dataset_id, time=round(time.time(), 3))
        if error:
            rec["error"] = error[:300]
        rec.update((k, v) for k, v in extra.items() if v is not None)
        append_line(self.manifest, rec, self.mlock)

    def record(self, item_id, key, tokens, status, attempts, error=None, **extra):
        """An item's outcome: its manifest line, the counters, a `failed` log line.  An
        `interrupted` item is not recorded: the next run sends it again."""
        if status == "interrupted":
            return
        self.append(item_id, key, tokens, status, attempts, error, **extra)
        with self.lock:
            if status == "ok":
                self.done += 1
                self.tokens += tokens
                self.session_done += 1
                self.session_tokens += tokens
                self.counted(key, tokens)
            else:
                self.failed += 1
        if status == "failed":
            self.log.event("failed", id=item_id, key=key, attempts=attempts, error=(error or "")[:200])

    def progress(self):
        while not self.stop.wait(self.args.progress_every):
            self.log.event("progress", **self.counters())
            self.fatal_cause()  # also when every request succeeds (a dumper may fail without failing them)

    def run(self):
        """Send every pending item with N workers; the exit code (0, 1, 3 stopped, 4 fatal)."""
        signal.signal(signal.SIGTERM, lambda *_: self.stop.set())
        signal.signal(signal.SIGINT, lambda *_: self.stop.set())
        started = dict(pending=self.queue.qsize(), concurrency=self.args.concurrency, pid=os.getpid())
        started.update(dataset=self.dataset_id, **self.started_fields())
        self.log.event("started", **dict(started, **self.counters()))
        for note in self.notes():
            self.log.event("note", **note)
        self.fatal_cause()  # a cause before the first request: nothing is sent
        threading.Thread(target=self.progress, daemon=True).start()
        workers = [threading.Thread(target=self.worker) for _ in range(max(1, self.args.concurrency))]
        for w in workers:
            w.start()
        for w in workers:
            while w.is_alive():
                w.join(0.5)
        stopped = self.stop.is_set()
        self.stop.set()
        if self.fatal:
            self.log.event("stopped", cause=self.fatal[0], **self.counters())
            return 4
        if stopped:
            self.log.event("stopped", **self.counters())
            return 3
        return self.finish()

    @classmethod
    def parse_args(cls, argv=None):
        ap = argparse.ArgumentParser(prog=cls.prog, description=cls.description)
        ap.add_argument("--dataset", required=True, help="JSONL, one item a line")
        ap.add_argument("--server", default="http://127.0.0.1:30000")
        ap.add_argument("--workdir", required=True, help="manifest.jsonl, run.json, client.pid, ...")
        ap.add_argument("--log", required=True, help="progress log (appended)")
        ap.add_argument("--concurrency", type=int, default=8, help="items in flight")
        ap.add_argument("--retries", type=int, default=5)
        ap.add_argument("--backoff", type=float, default=0.5, help="first retry delay (doubles)")
        ap.add_argument("--max-backoff", type=float, default=30.0)
        ap.add_argument("--request-timeout", type=float, default=600.0)
        ap.add_argument("--progress-every", type=float, default=5.0)
        cls.add_arguments(ap)
        return ap.parse_args(argv)

    @classmethod
    def main(cls, argv=None):
        """The client's command line: a work dir command, or a run over `--dataset`."""
        argv = sys.argv[1:] if argv is None else argv
        commands = cls.workdir_commands()
        if argv[:1] and argv[0] in commands:
            ap = argparse.ArgumentParser(prog="%s %s" % (cls.prog, argv[0]))
            ap.add_argument("--workdir", required=True)
            commands[argv[0]](ap.parse_args(argv[1:]).workdir)
            return 0
        args = cls.parse_args(argv)
        problem = cls.usage_problem(args)
        if problem:
            sys.stderr.write("usage error: %s\n" % problem)
            return 2
        os.makedirs(args.workdir, exist_ok=True)
        with open(os.path.join(args.workdir, "client.pid"), "w") as fh:
            fh.write("%d\n" % os.getpid())
        try:
            items = cls.read(args)
        except DatasetError as exc:
            sys.stderr.write("dataset error: %s\n" % exc)
            return 2
        except OSError as exc:
            sys.stderr.write("dataset error: %s: %s\n" % (args.dataset, exc.strerror or exc))
            return 2
        dataset_id = file_sha256(args.dataset)[:16]
        write_run(args.workdir, args.dataset, [cls.key_of(i) for i in items], dataset_id, getattr(args, "limit", None))
        return cls(args, items, manifest_records(os.path.join(args.workdir, MANIFEST)), dataset_id).run()
