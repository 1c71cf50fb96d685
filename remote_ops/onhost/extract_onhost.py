#!/usr/bin/env python3
"""Extraction client: runs ON the GPU host (stdlib only, Python 3.8+), beside the server.

For every sample of a JSONL dataset (`{"id": ..., "input_ids": [...]}`, or
`token_ids`) it sends the token ids to the server's `/generate` with
`sampling_params = {"max_new_tokens": 1, "temperature": 0}` (prefill-only: the
patched model dumps the hidden states of the prompt; greedy, so the one token
generated is the argmax of the logits of the prompt's last position), keeping N
requests in flight.

With `--serving vllm` (a vLLM server started with the `extract_hidden_states` method and the
project's connector, docs/vllm.md) it sends the same token ids to `/v1/completions`
(`max_tokens=1`, `temperature=0`, `return_token_ids`), reads the file vLLM wrote from
`kv_transfer_params.hidden_states_path`, waits for it (up to --dump-grace: vLLM writes it
after answering), checks that its `token_ids` are the ids sent, moves it
to `<dump-dir>/rank0/<key>.safetensors` and appends its line to `rank0/manifest.jsonl` (the
dump contract's layout); the client's `ok` line names the file (`file`, `vllm_path`) and the
token (`choices[0].token_ids[0]`).  Keys, resume and retries are the same in both modes.

- Its own manifest (`<workdir>/manifest.jsonl`, one O_APPEND line per sample)
  maps the sample id to the dump key (`sha256(int32-LE token ids)[:32] + "-p0"`,
  the dump contract's key) and names the dataset (sha256 of the file, 16 hex).
  An `ok` line of a sample that was sent carries `generated_token`, the server's
  `output_ids[0]` (absent when the answer had none): a dump audit on the host
  compares it with argmax(lm_head . the dump's final state at the last position).
  An `ok` line with `"reused_dump": true` sent nothing and has none: the token
  is on the earlier `ok` line of the same key.
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
- When a request fails and the dump dir's filesystem has less free space than
  the sample's dumps need (bytes per token measured on its own recent dump
  files, else `--dump-bytes-per-token`), it logs `nospace dir=.. free_bytes=..
  needed_bytes=.. says="no space left on DIR: N GB free, M needed"` (needed: for
  every sample still to do), waits without spending the sample's retries, and
  logs `space` when there is room again (polled every few seconds; SIGTERM ends
  the wait).
- A dump dir that is gone ends the run: missing, not a directory, not writable,
  or removed and made again since the client started (a running server keeps
  writing into the removed one).  It is checked after every failed attempt and
  at every progress tick (`DumpDirWatch`); the client then logs `fatal
  cause=dump_dir_missing dir=.. says=".."` (the cause never retried: every
  later sample would fail the same way), sends nothing more, and ends with
  `stopped cause=..` (exit 4).  The samples in flight are not recorded, so a
  re-run sends them again.
- A bad dataset line ends it at start with one line on stderr,
  `dataset error: FILE:LINE: reason`, exit 2 (rules: `read_dataset`).
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
import stat
import struct
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from queue import Empty, Queue

KEY_HASH_CHARS = 32
RETRY_HTTP = (429, 500, 502, 503, 504)
SPACE_MARGIN = 1 << 20  # a failed request with less than a sample's dumps + this free: the disk is full
SPACE_POLL_S = 2.0
NOSPACE_REPEAT_S = 60.0  # while waiting, the `nospace` line is logged again this often


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


class DatasetError(ValueError):
    """A dataset line the client cannot send: `path:line: reason` (line numbers from 1)."""

    def __init__(self, path, line, reason):
        ValueError.__init__(self, "%s:%d: %s" % (path, line, reason))
        self.line, self.reason = line, reason


def read_dataset(path):
    """[(sample id, token ids)] from JSONL; the id defaults to the line's 0-based index.

    The rules are `remote_ops/core/datasetcheck.py`'s (this file is shipped alone,
    so it keeps its own copy): one UTF-8 JSON object per line, no duplicate key,
    `input_ids` (or `token_ids`) a non-empty list of int32 token ids, `loss_mask`
    0/1 per id, `id` a string or an integer.  A bad line raises DatasetError."""
    samples = []
    with open(path, "rb") as fh:
        for index, raw in enumerate(fh):
            doc, reason = parse_record(raw)
            if reason:
                raise DatasetError(path, index + 1, reason)
            if doc is not None:
                ids = doc["input_ids"] if "input_ids" in doc else doc["token_ids"]
                samples.append((str(doc.get("id", index)), ids))
    return samples


# --- the dataset rules: a copy of remote_ops/core/datasetcheck.py (Python 3.8, stdlib) -------------
MAX_TOKEN_ID = 2**31 - 1


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
    if isinstance(value, bool):
        return "true/false"
    names = {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number"}
    return names.get(type(value), "null")


def parse_record(raw):
    """(record, None) for a good line, (None, reason) for a bad one, (None, None) for a blank one."""
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
    reason = record_problem(doc)
    return (None, reason) if reason else (doc, None)


def record_problem(doc):
    name = "input_ids" if "input_ids" in doc else "token_ids"
    ids = doc.get(name)
    if name not in doc:
        return "no input_ids (or token_ids) list"
    if not isinstance(ids, list):
        return "%s must be a list of token ids, not %s" % (name, json_type(ids))
    if not ids:
        return "%s is empty" % name
    if not set(map(type, ids)) <= {int} or min(ids) < 0 or max(ids) > MAX_TOKEN_ID:
        return _bad_id(name, ids)
    if "loss_mask" in doc:
        mask = doc["loss_mask"]
        if (
            not isinstance(mask, list)
            or len(mask) != len(ids)
            or not set(map(type, mask)) <= {int}
            or set(mask) - {0, 1}
        ):
            return "loss_mask must be a list of 0/1, one per token id (%d)" % len(ids)
    if "id" in doc and (isinstance(doc["id"], bool) or not isinstance(doc["id"], (str, int))):
        return "id must be a string or an integer, not %s" % json_type(doc["id"])
    return None


def _bad_id(name, ids):
    for k, x in enumerate(ids):
        if type(x) is not int:
            return "%s[%d] is %s: token ids are integers" % (name, k, json_type(x))
        if not 0 <= x <= MAX_TOKEN_ID:
            return "%s[%d] = %d is out of range: token ids are 0 to %d" % (name, k, x, MAX_TOKEN_ID)
    return "%s is not a list of token ids" % name


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


GENERATE_SAMPLING = {"max_new_tokens": 1, "temperature": 0}  # greedy: the recorded token is the argmax


def generate(url, token_ids, timeout):
    """POST one prompt to /generate (GENERATE_SAMPLING); return the answer; raise Transient or ValueError."""
    return post_json(url, {"input_ids": token_ids, "sampling_params": GENERATE_SAMPLING}, timeout)


def post_json(url, doc, timeout):
    """POST `doc` as JSON; return the decoded answer.  Raise Transient for what is worth retrying
    (connection refused/reset, timeouts, HTTP 429/5xx), ValueError for any other HTTP error."""
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


COMPLETION_FIELDS = {"max_tokens": 1, "temperature": 0, "return_token_ids": True}  # vLLM: greedy, one token
VLLM_FORMAT = "vllm-hidden-states/1"


def complete(url, model, token_ids, timeout):
    """POST one prompt (token ids) to vLLM's /v1/completions with `max_tokens=1`; return the answer."""
    return post_json(url, dict(COMPLETION_FIELDS, model=model, prompt=list(token_ids)), timeout)


def completion_result(answer):
    """(hidden-states file path, generated token) of a vLLM completion answer (pure).

    The path is `kv_transfer_params.hidden_states_path` (top level, or on the choice); the token
    is `choices[0].token_ids[0]` (asked with `return_token_ids`), None when absent.  A missing
    path is a ValueError: the server was not started with the extraction connector."""
    if not isinstance(answer, dict):
        raise ValueError("the completion answer is not a JSON object")
    choices = answer.get("choices") if isinstance(answer.get("choices"), list) else []
    choice = choices[0] if choices and isinstance(choices[0], dict) else {}
    params = answer.get("kv_transfer_params") or choice.get("kv_transfer_params") or {}
    path = params.get("hidden_states_path") if isinstance(params, dict) else None
    if not isinstance(path, str) or not path:
        raise ValueError("the answer has no kv_transfer_params.hidden_states_path (is the extraction connector on?)")
    ids = choice.get("token_ids")
    token = ids[0] if isinstance(ids, list) and ids and type(ids[0]) is int else None
    return path, token


def _safetensors_header(fh):
    (size,) = struct.unpack("<Q", fh.read(8))
    if size > 100 << 20:
        raise ValueError("header length %d is implausible" % size)
    header = json.loads(fh.read(size))
    return 8 + size, header, header.pop("__metadata__", None) or {}


def wait_for_file(path, timeout, stop=None):
    """True once `path` exists (the connector writes after the answer: temp + rename), polled
    every 50 ms until `timeout` seconds; False at the deadline (or when `stop` is set)."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() >= deadline or (stop is not None and stop.is_set()):
            return False
        time.sleep(0.05)
    return True


def adopt_vllm_file(path, dump_dir, key, token_ids, lock, rank=0):
    """Move vLLM's per-request file to `<dump_dir>/rank<R>/<key>.safetensors` and append its dump
    manifest line (the dump contract's layout, so status, pull, verify, audit and export read it).

    The file's `token_ids` must be the ids sent (else ValueError: it is another request's file).
    Returns the manifest record."""
    with open(path, "rb") as fh:
        start, header, meta = _safetensors_header(fh)
        entry, hs = header.get("token_ids"), header.get("hidden_states")
        if entry is None or hs is None or entry.get("dtype") != "I64" or len(hs.get("shape", ())) != 3:
            raise ValueError("%s is not a vLLM hidden-states file (token_ids I64, hidden_states [S, L, H])" % path)
        a, b = entry["data_offsets"]
        fh.seek(start + a)
        got = fh.read(b - a)
    if got != struct.pack("<%dq" % len(token_ids), *token_ids):
        raise ValueError("%s holds other token ids than the prompt sent" % path)
    rank_dir = os.path.join(dump_dir, "rank%d" % rank)
    os.makedirs(rank_dir, exist_ok=True)
    name = "rank%d/%s.safetensors" % (rank, key)
    dest = os.path.join(dump_dir, name)
    if os.path.abspath(path) != os.path.abspath(dest):
        os.replace(path, dest)
    n, layers, hidden = hs["shape"]
    rec = {
        "bytes": os.path.getsize(dest),
        "dtype": hs["dtype"],
        "engine": "vllm",
        "file": name,
        "format": meta.get("format", VLLM_FORMAT),
        "hidden_size": hidden,
        "key": key,
        "layers": layers,
        "partial": False,
        "prefix_len": 0,
        "rank": rank,
        "sha256": file_sha256(dest),
        "time": round(time.time(), 3),
        "tokens": n,
    }
    append_line(os.path.join(rank_dir, "manifest.jsonl"), rec, lock)
    return rec


def generated_token(answer):
    """The token the server generated (SGLang's `output_ids[0]`), or None if the answer has none."""
    ids = answer.get("output_ids") if isinstance(answer, dict) else None
    if isinstance(ids, list) and ids and type(ids[0]) is int:
        return ids[0]
    return None


def human_bytes(n):
    """Decimal units, one decimal (as remote_ops.core.logparse.human_bytes): 1.0 KB, 5.0 GB."""
    value = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000:
            return "%.0f B" % value if unit == "B" else "%.1f %s" % (value, unit)
        value /= 1000
    return "%.1f TB" % value


def free_bytes(path):
    """Free space for an unprivileged writer on `path`'s filesystem, or None if it cannot be read."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class SpaceWatch:
    """Is the dump disk full?  Asked after a failed request; names it in the log and waits for room."""

    def __init__(self, run, dump_dir, bytes_per_token):
        self.run, self.dir, self.fallback = run, dump_dir, bytes_per_token or 0
        self.lock = threading.Lock()
        self.waiting = 0  # workers waiting for space
        self.logged = 0.0

    def bytes_per_token(self):
        """Measured on the recent dumps of this run (every rank's file of a key), else the fallback."""
        sizes = tokens = 0
        for key, n in list(self.run.recent):
            for path in glob.glob(os.path.join(self.dir, "rank*", key + ".safetensors")):
                try:
                    sizes, tokens = sizes + os.path.getsize(path), tokens + n
                except OSError:
                    pass
        return sizes / tokens if tokens else self.fallback

    def short(self, sample_tokens):
        """(free, bytes per token) when the dump dir cannot hold this sample's dumps, else None."""
        free = free_bytes(self.dir) if self.dir else None
        if free is None:
            return None
        per_token = self.bytes_per_token()
        return (free, per_token) if free < sample_tokens * per_token + SPACE_MARGIN else None

    def wait(self, sample_tokens):
        """Log `nospace` and wait until there is room (True), or return False at once if there is."""
        short = self.short(sample_tokens)
        if short is None:
            return False
        with self.lock:
            self.waiting += 1
        try:
            while short is not None and not self.run.stop.is_set():
                self._log(short, sample_tokens)
                self.run.stop.wait(SPACE_POLL_S)
                short = self.short(sample_tokens)
        finally:
            with self.lock:
                self.waiting -= 1
                if not self.waiting and self.logged:
                    self.logged = 0.0
                    self.run.log.event("space", dir=self.dir, free_bytes=free_bytes(self.dir))
        return True

    def _log(self, short, sample_tokens):
        with self.lock:
            if self.logged and time.time() - self.logged < NOSPACE_REPEAT_S:
                return
            self.logged = time.time()
        free, per_token = short
        needed = int(self.run.tokens_left() * per_token)
        self.run.log.event(
            "nospace",
            dir=self.dir,
            free_bytes=free,
            needed_bytes=needed,
            sample_bytes=int(sample_tokens * per_token),
            pending=self.run.total - self.run.done,
            says="no space left on %s: %s free, %s needed" % (self.dir, human_bytes(free), human_bytes(needed)),
        )


class DumpDirWatch:
    """Is the dump dir (resolved once by the laptop: `--dump-dir` is its realpath) still there,
    a writable directory, and the very one the run started with?  The client keeps it open
    from the start: a removed directory then has no links left (and its inode cannot be reused
    by one made again at the same path)."""

    def __init__(self, path):
        self.path, self.fd = path, None
        if path:
            try:
                self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
            except OSError:
                pass

    def problem(self):
        """(cause, sentence) when the server cannot write its dumps there, else None."""
        if not self.path:
            return None
        removed = self.fd is not None and os.fstat(self.fd).st_nlink == 0
        try:
            st = os.stat(self.path)
        except OSError:
            return "dump_dir_missing", "dump dir %s does not exist (removed?): the server cannot write its dumps" % (
                self.path
            )
        if not stat.S_ISDIR(st.st_mode):
            return "dump_dir_not_a_directory", "dump dir %s is not a directory" % self.path
        if removed:
            return "dump_dir_replaced", (
                "dump dir %s was removed and made again during the run: the running server still writes "
                "into the removed one (restart the server)" % self.path
            )
        if not os.access(self.path, os.W_OK):
            return "dump_dir_not_writable", "dump dir %s is not writable (uid %d)" % (self.path, os.getuid())
        return None


class Run:
    """One extraction session: a queue of pending samples, N workers, counters."""

    def __init__(self, args, samples, records, dataset_id="-"):
        self.args = args
        self.vllm = getattr(args, "serving", "sglang") == "vllm"
        self.url = args.server.rstrip("/") + ("/v1/completions" if self.vllm else "/generate")
        self.dlock = threading.Lock()
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
        self.all_tokens = sum(len(ids) for _, ids in samples)
        self.recent = deque(maxlen=20)  # (key, tokens) of this session's last ok samples
        self.space = SpaceWatch(self, args.dump_dir, args.dump_bytes_per_token)
        self.dumpdir = DumpDirWatch(args.dump_dir)
        self.fatal = None  # (cause, sentence) once the run stopped on a cause no retry can mend
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

    def tokens_left(self):
        with self.lock:
            return max(self.all_tokens - self.tokens, 0)

    def fatal_cause(self):
        """Stop the run (logged once) when the dump dir is gone; True when it is."""
        problem = self.dumpdir.problem()
        if problem is None:
            return False
        with self.lock:
            first, self.fatal = self.fatal is None, self.fatal or problem
        if first:
            self.log.event("fatal", cause=problem[0], dir=self.args.dump_dir, says=problem[1])
        self.stop.set()
        return True

    def worker(self):
        while not self.stop.is_set():
            try:
                sid, ids, key = self.queue.get_nowait()
            except Empty:
                return
            self.one(sid, ids, key)

    def one(self, sid, ids, key):
        """Send one sample with retries; record the outcome in the manifest.

        A failure while the dump disk is full is not the sample's: the attempt is
        not counted, and the sample is sent again once there is room."""
        attempt, delay = 0, self.args.backoff
        while True:
            attempt += 1
            try:
                if self.vllm:
                    return self.one_vllm(sid, ids, key, attempt)
                answer = generate(self.url, ids, self.args.request_timeout)
                return self.record(sid, key, ids, "ok", attempt, token=generated_token(answer))
            except Transient as exc:
                error, transient = str(exc), True
            except ValueError as exc:
                error, transient = str(exc), False
            if transient:
                with self.lock:
                    self.errors += 1
                self.log.event("error", id=sid, attempt=attempt, error=error[:200])
            if self.fatal_cause():  # not the sample's fault: it is sent again by the next run
                return self.record(sid, key, ids, "interrupted", attempt, error)
            if self.space.wait(len(ids)):
                attempt -= 1
                if self.stop.is_set():
                    return self.record(sid, key, ids, "interrupted", attempt, error)
                continue
            if not transient:
                return self.record(sid, key, ids, "failed", attempt, error)
            if attempt > self.args.retries or self.stop.is_set():
                return self.record(sid, key, ids, "failed" if not self.stop.is_set() else "interrupted", attempt, error)
            self.stop.wait(min(delay, self.args.max_backoff) * (0.5 + random.random()))
            delay *= 2

    def one_vllm(self, sid, ids, key, attempt):
        """One /v1/completions request; vLLM's file moves to the dump layout under the key."""
        answer = complete(self.url, self.args.model, ids, self.args.request_timeout)
        path, token = completion_result(answer)
        if not wait_for_file(path, self.args.dump_grace, self.stop):
            raise ValueError("hidden-states file %s did not appear within %gs" % (path, self.args.dump_grace))
        try:
            rec = adopt_vllm_file(path, self.args.dump_dir, key, ids, self.dlock)
        except (OSError, ValueError, KeyError, struct.error) as exc:
            raise ValueError("hidden-states file %s: %s" % (path, exc)) from None
        return self.record(sid, key, ids, "ok", attempt, token=token, dump={"file": rec["file"], "vllm_path": path})

    def _append(self, sid, key, ids, status, attempts, error=None, reused_dump=False, token=None, dump=None):
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
        if token is not None:
            rec["generated_token"] = token
        if dump:
            rec.update(dump)
        append_line(self.manifest, rec, self.mlock)

    def record(self, sid, key, ids, status, attempts, error=None, token=None, dump=None):
        if status == "interrupted":
            return  # not recorded: the next run sends it again
        self._append(sid, key, ids, status, attempts, error, token=token, dump=dump)
        with self.lock:
            if status == "ok":
                self.recent.append((key, len(ids)))
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
        present = {  # regular files in real rank dirs only: entries inside the dump dir are never followed
            os.path.basename(p)[: -len(".safetensors")]
            for p in glob.glob(os.path.join(args.dump_dir, "rank*", "*.safetensors"))
            if not os.path.islink(p) and not os.path.islink(os.path.dirname(p)) and os.path.isfile(p)
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
        run.fatal_cause()  # also when every request succeeds: a dumper may fail without failing them


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
    ap.add_argument(
        "--serving",
        choices=("sglang", "vllm"),
        default="sglang",
        help="sglang: /generate; vllm: /v1/completions, each file moved to the dump layout by key",
    )
    ap.add_argument("--model", default=None, help="vllm: the served model name")
    ap.add_argument(
        "--dump-bytes-per-token",
        type=int,
        default=None,
        help="dump size per token until this run has dump files to measure (names a full dump disk)",
    )
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
    write_run(args.workdir, args.dataset, [dump_key(ids) for _, ids in samples], dataset_id, args.limit)


def write_run(workdir, dataset, keys, dataset_id, limit=None):
    """`<workdir>/dataset.keys` (the current run's content keys) and `run.json`; an earlier run's
    missing.jsonl goes.  What `count` reads (also for regenerate_onhost.py's work dir)."""
    write_atomic(os.path.join(workdir, "dataset.keys"), "".join(key + "\n" for key in keys))
    write_atomic(
        os.path.join(workdir, "run.json"),
        json.dumps(
            {
                "dataset": os.path.abspath(dataset),
                "dataset_id": dataset_id,
                "total": len(keys),
                "limit": limit,
                "started": utc_now(),
                "pid": os.getpid(),
            },
            sort_keys=True,
        )
        + "\n",
    )
    try:
        os.unlink(os.path.join(workdir, "missing.jsonl"))  # it described an earlier run
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
    if args.serving == "vllm" and not (args.dump_dir and args.model):
        sys.stderr.write("usage error: --serving vllm needs --dump-dir and --model\n")
        return 2
    os.makedirs(args.workdir, exist_ok=True)
    with open(os.path.join(args.workdir, "client.pid"), "w") as fh:
        fh.write("%d\n" % os.getpid())
    try:
        samples = read_dataset(args.dataset)[: args.limit]
    except DatasetError as exc:
        sys.stderr.write("dataset error: %s\n" % exc)
        return 2
    except OSError as exc:
        sys.stderr.write("dataset error: %s: %s\n" % (args.dataset, exc.strerror or exc))
        return 2
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
    run.fatal_cause()  # a dump dir gone before the first request: nothing is sent
    threading.Thread(target=progress_loop, args=(run,), daemon=True).start()
    workers = [threading.Thread(target=run.worker) for _ in range(max(1, args.concurrency))]
    for w in workers:
        w.start()
    for w in workers:
        while w.is_alive():
            w.join(0.5)
    stopped = run.stop.is_set()
    run.stop.set()
    if run.fatal:
        run.log.event("stopped", cause=run.fatal[0], **run.counters())
        return 4
    if stopped:
        run.log.event("stopped", **run.counters())
        return 3
    missing = missing_dumps(args, args.workdir, samples, run.done_keys)
    run.log.event("finished", missing_dumps="-" if missing is None else missing, **run.counters())
    return 0 if not run.failed and not missing else 1


if __name__ == "__main__":
    sys.exit(main())
