#!/usr/bin/env python3
"""Extraction client: runs ON the GPU host (stdlib only, Python 3.8+), beside the server.  A
subclass of the on-host client skeleton (`client.py`, shipped beside it: queue, retries,
counters, progress log, manifest, resume by key, fatal causes, `count` / `done-keys`).

For every sample of a JSONL dataset (`{"id": ..., "input_ids": [...]}`, or `token_ids`; rules:
`read_dataset`) it sends the token ids to the server's `/generate` with `sampling_params =
{"max_new_tokens": 1, "temperature": 0}` (prefill-only: the patched model dumps the hidden
states of the prompt; greedy, so the one token generated is the argmax of the logits of the
prompt's last position).  With `--serving vllm` (a vLLM server with the `extract_hidden_states`
method and the project's connector, docs/vllm.md) it sends them to `/v1/completions`
(`max_tokens=1`, `temperature=0`, `return_token_ids`), waits (up to --dump-grace: vLLM writes
it after answering) for the file named by `kv_transfer_params.hidden_states_path`, checks that
its `token_ids` are the ids sent, moves it to `<dump-dir>/rank0/<key>.safetensors` and appends
its line to `rank0/manifest.jsonl` (the dump contract's layout); the `ok` line names the file
(`file`, `vllm_path`).  Keys, resume and retries are the same in both modes.

- The key is the dump key (`sha256(int32-LE token ids)[:32] + "-p0"`).  An `ok` line of a sent
  sample carries `generated_token` (SGLang's `output_ids[0]`, vLLM's `choices[0].token_ids[0]`;
  absent when the answer had none): a dump audit compares it with argmax(lm_head . the dump's
  final state at the last position).  A sample whose key was done under another id gets an `ok`
  line for its own id with `"reused_dump": true` and no request (its token is on the earlier
  line); ids done earlier with other token ids are new samples (`started ... reused_ids=N`).
- When a request fails and the dump dir's filesystem has less free space than the sample's
  dumps need (bytes per token measured on its own recent dump files, else
  `--dump-bytes-per-token`), it logs `nospace dir=.. free_bytes=.. needed_bytes=.. says="no
  space left on DIR: N GB free, M needed"` (needed: for every sample still to do), waits
  without spending the sample's retries, and logs `space` when there is room again (polled
  every few seconds; SIGTERM ends the wait).
- Its fatal cause is a dump dir gone (`DumpDirWatch`): missing, not a directory, not writable,
  or removed and made again since the client started (a running server keeps writing into the
  removed one): `fatal cause=dump_dir_missing dir=.. says=".."`, then `stopped cause=..` (exit 4).
- At the end it checks that each sample's dump file exists (`<dump-dir>/rank*/<key>.safetensors`,
  waiting up to --dump-grace seconds for the dumper's writer), lists the samples without one in
  `missing.jsonl`, and counts them on its `finished` line (exit 1 when any).
"""

import glob
import hashlib
import json
import os
import stat
import struct
import sys
import threading
import time
from collections import deque

try:  # imported as remote_ops.onhost.extract_onhost (the laptop, tests)
    from . import client as base
except ImportError:  # run as a script on the host (or loaded from its file): the skeleton is beside it
    sys.path.append(os.path.dirname(os.path.abspath(__file__)))
    import client as base  # type: ignore[import-not-found,no-redef]

DatasetError, read_manifest = base.DatasetError, base.read_manifest  # read from this module too (the laptop, tests)
done_keys, manifest_records = base.done_keys, base.manifest_records

KEY_HASH_CHARS = 32
SPACE_MARGIN = 1 << 20  # a failed request with less than a sample's dumps + this free: the disk is full
SPACE_POLL_S = 2.0
NOSPACE_REPEAT_S = 60.0  # while waiting, the `nospace` line is logged again this often
MAX_TOKEN_ID = 2**31 - 1
DESCRIPTION = __doc__.split("\n")[0]


def dump_key(token_ids, prefix_len=0):
    """The dump contract's key of a prompt: sha256 of int32 LE ids, 32 hex chars, `-p<prefix>`."""
    raw = struct.pack("<%di" % len(token_ids), *token_ids)
    return "%s-p%d" % (hashlib.sha256(raw).hexdigest()[:KEY_HASH_CHARS], prefix_len)


def read_dataset(path):
    """[(sample id, token ids)] from JSONL; the id defaults to the line's 0-based index.

    The rules (`record_problem`, after the skeleton's `decode_line`; the laptop's
    `remote_ops/core/datasetcheck.py` checks with the same functions): one UTF-8 JSON object per
    line, no duplicate key, `input_ids` (or `token_ids`) a non-empty list of int32 token ids,
    `loss_mask` 0/1 per id, `id` a string or an integer.  A bad line raises DatasetError."""
    return [
        (str(doc.get("id", index)), doc["input_ids"] if "input_ids" in doc else doc["token_ids"])
        for doc, index in base.read_lines(path, record_problem)
    ]


def record_problem(doc):
    """Why a decoded record cannot be sent, or None."""
    name = "input_ids" if "input_ids" in doc else "token_ids"
    ids = doc.get(name)
    if name not in doc:
        return "no input_ids (or token_ids) list"
    if not isinstance(ids, list):
        return "%s must be a list of token ids, not %s" % (name, base.json_type(ids))
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
        return "id must be a string or an integer, not %s" % base.json_type(doc["id"])
    return None


def _bad_id(name, ids):
    for k, x in enumerate(ids):
        if type(x) is not int:
            return "%s[%d] is %s: token ids are integers" % (name, k, base.json_type(x))
        if not 0 <= x <= MAX_TOKEN_ID:
            return "%s[%d] = %d is out of range: token ids are 0 to %d" % (name, k, x, MAX_TOKEN_ID)
    return "%s is not a list of token ids" % name


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


GENERATE_SAMPLING = {"max_new_tokens": 1, "temperature": 0}  # greedy: the recorded token is the argmax


def generate(url, token_ids, timeout):
    """POST one prompt to /generate (GENERATE_SAMPLING); return the answer; raise Transient or ValueError."""
    return base.post_json(url, {"input_ids": token_ids, "sampling_params": GENERATE_SAMPLING}, timeout)


COMPLETION_FIELDS = {"max_tokens": 1, "temperature": 0, "return_token_ids": True}  # vLLM: greedy, one token
VLLM_FORMAT = "vllm-hidden-states/1"


def complete(url, model, token_ids, timeout):
    """POST one prompt (token ids) to vLLM's /v1/completions with `max_tokens=1`; return the answer."""
    return base.post_json(url, dict(COMPLETION_FIELDS, model=model, prompt=list(token_ids)), timeout)


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
        "sha256": base.file_sha256(dest),
        "time": round(time.time(), 3),
        "tokens": n,
    }
    base.append_line(os.path.join(rank_dir, "manifest.jsonl"), rec, lock)
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
        self.path, self.fd, self.fields = path, None, {"dir": path}
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


class Run(base.Run):
    """One extraction session: the skeleton's run over the samples (id, token ids) of a dataset."""

    prog, description = "extract_onhost", DESCRIPTION

    def __init__(self, args, samples, records, dataset_id="-"):
        self.vllm = getattr(args, "serving", "sglang") == "vllm"
        self.url = args.server.rstrip("/") + ("/v1/completions" if self.vllm else "/generate")
        self.dlock = threading.Lock()
        self.samples = samples
        self.all_tokens = sum(len(ids) for _, ids in samples)
        self.recent = deque(maxlen=20)  # (key, tokens) of this session's last ok samples
        self.room = SpaceWatch(self, args.dump_dir, args.dump_bytes_per_token)
        self.watch = DumpDirWatch(args.dump_dir)  # the fatal cause: the dump dir gone
        base.Run.__init__(self, args, samples, records, dataset_id)

    @classmethod
    def read(cls, args):
        return read_dataset(args.dataset)[: args.limit]

    @staticmethod
    def key_of(sample):
        return dump_key(sample[1])

    def plan(self, samples, records):
        pending, done, self.reused_ids, adopt = plan_samples(samples, records)
        self.done_keys = [key for _, _, key in done]
        for sid, ids, key in adopt:  # same content under a new id: no request needed
            self.append(sid, key, len(ids), "ok", 0, reused_dump=True)
        return pending, [len(ids) for _, ids, _ in done]

    def started_fields(self):
        return {"reused_ids": len(self.reused_ids)}

    def notes(self):
        if not self.reused_ids:
            return []
        meaning = "ids done earlier with other token ids: sent again as new samples"
        return [{"reused_ids": len(self.reused_ids), "first": self.reused_ids[0], "meaning": meaning}]

    def tokens_left(self):
        with self.lock:
            return max(self.all_tokens - self.tokens, 0)

    def counted(self, key, tokens):
        self.recent.append((key, tokens))
        self.done_keys.append(key)

    def one(self, sample):
        """Send one sample with retries (a failure while the dump disk is full is not the
        sample's: the attempt is not counted, and it is sent again once there is room)."""
        sid, ids, key = sample
        try:
            fields, attempts = self.attempt(lambda: self.send(ids, key), sid, len(ids))
        except base.GaveUp as exc:
            return self.record(
                sid, key, len(ids), "interrupted" if exc.interrupted else "failed", exc.attempts, exc.error
            )
        self.record(sid, key, len(ids), "ok", attempts, **fields)

    def send(self, ids, key):
        """One request; the `ok` line's fields (the generated token, vLLM's file)."""
        if not self.vllm:
            return {"generated_token": generated_token(generate(self.url, ids, self.args.request_timeout))}
        path, token = completion_result(complete(self.url, self.args.model, ids, self.args.request_timeout))
        if not wait_for_file(path, self.args.dump_grace, self.stop):
            raise ValueError("hidden-states file %s did not appear within %gs" % (path, self.args.dump_grace))
        try:
            rec = adopt_vllm_file(path, self.args.dump_dir, key, ids, self.dlock)
        except (OSError, ValueError, KeyError, struct.error) as exc:
            raise ValueError("hidden-states file %s: %s" % (path, exc)) from None
        return {"generated_token": token, "file": rec["file"], "vllm_path": path}

    def finish(self):
        missing = missing_dumps(self.args, self.args.workdir, self.samples, self.done_keys)
        self.log.event("finished", missing_dumps="-" if missing is None else missing, **self.counters())
        return 0 if not self.failed and not missing else 1

    @classmethod
    def add_arguments(cls, ap):
        ap.add_argument("--dump-dir", default=None, help="check each sample's dump file at the end")
        ap.add_argument("--dump-grace", type=float, default=30.0, help="seconds to wait for late dump files")
        ap.add_argument("--limit", type=int, default=None, help="only the first N samples")
        ap.add_argument(
            "--serving", choices=("sglang", "vllm"), default="sglang", help="sglang: /generate; vllm: /v1/completions"
        )
        ap.add_argument("--model", default=None, help="vllm: the served model name")
        ap.add_argument("--dump-bytes-per-token", type=int, default=None, help="a dump's size per token until measured")

    @classmethod
    def usage_problem(cls, args):
        if args.serving == "vllm" and not (args.dump_dir and args.model):
            return "--serving vllm needs --dump-dir and --model"
        return None


def missing_dumps(args, workdir, samples, keys_done):
    """Done samples of this dataset whose dump file is absent, after up to --dump-grace seconds."""
    if not args.dump_dir:
        return None
    done, wanted = set(keys_done), {}
    for sid, ids in samples:
        if dump_key(ids) in done:
            wanted.setdefault(dump_key(ids), sid)
    deadline = time.time() + args.dump_grace
    while True:
        present = {  # regular files in real rank dirs only: entries inside the dump dir are never followed
            os.path.basename(p).rsplit(".", 1)[0]  # <key>.safetensors, or <key>.hsz once compacted
            for suffix in ("*.safetensors", "*.hsz")
            for p in glob.glob(os.path.join(args.dump_dir, "rank*", suffix))
            if not os.path.islink(p) and not os.path.islink(os.path.dirname(p)) and os.path.isfile(p)
        }
        missing = {k: i for k, i in wanted.items() if k not in present}
        if not missing or time.time() >= deadline:
            break
        time.sleep(min(1.0, max(deadline - time.time(), 0)))
    lines = [json.dumps({"id": sid, "key": key}) + "\n" for key, sid in sorted(missing.items(), key=lambda kv: kv[1])]
    base.write_atomic(os.path.join(workdir, "missing.jsonl"), "".join(lines))
    return len(missing)


main = Run.main

if __name__ == "__main__":
    sys.exit(main())
