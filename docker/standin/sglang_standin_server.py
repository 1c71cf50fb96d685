#!/usr/bin/env python3
"""SGLang STAND-IN server: speaks SGLang's HTTP API and computes a tiny real network on the CPU.

This is NOT SGLang and NOT the served model.  It exists so the sandbox and the tests can run
remote-ops' real code path (build, start, health, extract, dumps, logs, audit) on a machine without
GPUs.  Every answer carries `"standin": true`; every dump file's metadata says `standin: true`.
Standard library plus numpy (Debian's python3-numpy in the stand-in image).

The network (`standin_model.py` beside this file, STAND-IN): embedding, `num_hidden_layers` residual
blocks (RMSNorm -> causal running mean -> projection, RMSNorm -> SwiGLU MLP), final RMSNorm and
`lm_head`, float64, with the bf16 weights of the model dir (`config.json`, two safetensors shards and
`model.safetensors.index.json`, written by `remote-ops sandbox up`), or, when the model dir has no
index, the same weights made from the config's seed in memory (said in the banner and /model_info).

It accepts SGLang's `launch_server` arguments (unknown ones are ignored) and serves:
- GET  /health, /health_generate        200 (cheap here; in SGLang 0.5.x /health generates)
- GET  /model_info, /get_model_info     model path, architectures, hidden size, vocab size, weights
- GET  /server_info, /get_server_info   `version` = the SGLang version of the installed tree
- GET  /v1/models                       the served model name
- POST /generate                        `input_ids` (list or list of lists) or `text` (UTF-8 bytes as
                                        ids: the stand-in has no tokenizer), `sampling_params.
                                        max_new_tokens` (default 16).  Answers SGLang's shape:
                                        `output_ids` = the network's greedy tokens (argmax: every
                                        temperature is treated as 0), `text`, `meta_info`.  Ids >=
                                        vocab_size are refused with HTTP 400, as SGLang does.
- POST /v1/chat/completions             OpenAI chat: `messages` (role, content), `max_tokens` (or
                                        `max_completion_tokens`, default 128); `temperature` and
                                        `top_p` accepted and ignored (greedy).  STAND-IN chat template
                                        and detokenizer, as the stand-in has no tokenizer: the prompt
                                        is "<|role|>content" per turn then "<|assistant|>", its UTF-8
                                        bytes taken as token ids; the reply's text is one printable
                                        ASCII character per generated id (chr(32 + id % 95)).  Answers
                                        OpenAI's chat.completion shape with `usage` and `"standin": true`.
With SGLANG_HS_DUMP_DIR set, each request's prefill writes one dump file through the dump contract's
writer (remote_ops_dump.dumpfile): `aux_hidden_states` = the network's residual stream entering each
layer of `layers_to_capture` (SGLANG_HS_DUMP_LAYERS, default [2, L//2, L-3]) and `hidden_states` =
the post-norm final state, rounded to bf16.  The server's first generated token is
argmax(lm_head . hidden_states[last]) of that very file.  Every rank dir also gets a `stats.json`
with the real dumper's fields (remote_ops/dumper/FORMAT.md) and `"standin": true`: its capture
time (`capture_steps_us`) is the time of the stand-in's synchronous dump write.

Scheduler lines (STAND-IN figures in SGLang 0.5.9's format, `[time STAND-IN] ...` on stdout, what
`dumps stats` and `dataset regenerate` read from the container's log): prefills run one at a time
(one simulated GPU), and each ends with a `Prefill batch, #new-seq: 1, #new-token: N, ...,
#queue-req: Q, input throughput (token/s): X, cuda graph: False` line, X computed as SGLang does
(the previous prefill's tokens over the time since the previous line); every 40 decode tokens
(SGLang's --decode-log-interval) a `Decode batch, ..., gen throughput (token/s): X, #queue-req: 0`
line.  Dumps are written inside the prefill, as the real dumper captures inside the forward.

Faults, for testing a dump audit (each is also named in /server_info `standin_faults`, in the banner
and in the dump metadata `standin_fault`; the tensors' norm labels are left as a real dumper would
write them, so only the data shows the fault):
- STANDIN_FINAL_NORM=pre      `hidden_states` holds the final state BEFORE the final norm (default
                              `post`); the answer's token still comes from the post-norm state.
- STANDIN_DROP_AUX=1          the last layer of `layers_to_capture` is dropped from
                              `aux_hidden_states` ([n, 2H]; the metadata still lists 3 layers), like
                              vllm-project/vllm#46973's lost final aux state.
- STANDIN_NAN_KEYS=K1,K2      the dumps of these keys (full dump keys, or prefixes of 8+ hex
                              characters) have NaN in token 0's row of both tensors (a capture
                              fault: the network and the answer are untouched).  Chosen by key, not
                              by request order, so that it is deterministic under concurrency.

Bounds, as SGLang's (a real server never grows without limit on one request): the context
length is `--context-length` (SGLang's flag), else the config's `max_position_embeddings`, else
32768 tokens; a prompt of that many tokens or more is refused with HTTP 400 and SGLang 0.5.9's
own words (tokenizer_manager `_validate_one_request`): "The input (N tokens) is longer than the
model's context length (M tokens).", as `{"error": {"message": ...}}` on /generate and as an
OpenAI error object on /v1/chat/completions, before any compute.  A request body over
STANDIN_MAX_BODY_BYTES (default 32 MiB) is refused with HTTP 413 unread.

Environment, otherwise: STANDIN_LOAD_SECONDS (simulated model load before listening, default 1),
STANDIN_REQUIRE_PATCH=1 (refuse to start unless verify_patch.py passes),
STANDIN_GPU_MS_PER_1K_TOKENS (simulated prefill time per request, a sleep inside the prefill,
which runs one at a time like one GPU; default 0: benchmarks of several stand-in hosts on one machine set it, so that
what they measure is the tool and not the machine's shared CPU).  numpy runs single-threaded
(OPENBLAS_NUM_THREADS / OMP_NUM_THREADS default to 1): requests are small and run side by side.
"""

import argparse
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

DEFAULT_CONTEXT_LENGTH = 32768
MAX_BODY_BYTES = int(os.environ.get("STANDIN_MAX_BODY_BYTES", str(32 << 20)))


class TooLong(ValueError):
    """A prompt at or over the context length: SGLang's ValueError, HTTP 400."""


def context_error(n_tokens, context_len):
    """SGLang 0.5.9's refusal (tokenizer_manager._validate_one_request), word for word."""
    return TooLong(
        "The input (%d tokens) is longer than the model's context length (%d tokens)." % (n_tokens, context_len)
    )


STANDIN = "sglang-standin"


# -- facts about the installed SGLang tree (never imported: it needs torch) ---------------------
def sglang_dir():
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def sglang_version(tree):
    """The version in sglang/_version.py (or version.py), read as text."""
    for name in ("_version.py", "version.py"):
        path = os.path.join(tree or "", name)
        if tree and os.path.isfile(path):
            with open(path) as fh:
                m = re.search(r"""__version__\s*(?::\s*str\s*)?=\s*(?:version\s*=\s*)?["']([^"']+)["']""", fh.read())
            if m:
                return m.group(1)
    return "unknown"


def patch_marker(tree):
    """True when the installed patch target (named by the image's patch-spec.json) mentions the
    dumper (a cheap patched signal)."""
    try:
        with open(os.path.join(os.environ.get("REMOTE_OPS_TOOL_DIR", "/opt/remote-ops"), "patch-spec.json")) as fh:
            target = json.load(fh)["target"].split("sglang/", 1)[1]
    except (OSError, ValueError, KeyError, IndexError):
        return False
    path = os.path.join(tree or "", *target.split("/"))
    if not tree or not os.path.isfile(path):
        return False
    with open(path) as fh:
        return "remote_ops_dump" in fh.read()


def verify_patch_or_exit():
    """With STANDIN_REQUIRE_PATCH=1, refuse to start unless the image's verifier passes."""
    tool = os.path.join(os.environ.get("REMOTE_OPS_TOOL_DIR", "/opt/remote-ops"), "verify_patch.py")
    if os.environ.get("STANDIN_REQUIRE_PATCH") != "1":
        return
    proc = subprocess.run([sys.executable, tool], stdout=subprocess.PIPE, universal_newlines=True, timeout=120)
    if proc.returncode != 0:
        sys.stderr.write("%s: patch verification failed, refusing to start: %s\n" % (STANDIN, proc.stdout.strip()))
        sys.exit(3)


def load_model_module():
    """standin_model.py, the STAND-IN network, from this file's folder (also when imported by path)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "standin_model.py")
    spec = importlib.util.spec_from_file_location("standin_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def simulated_prefill(n_tokens):
    """Sleep for the GPU time a prefill of `n_tokens` would take, if STANDIN_GPU_MS_PER_1K_TOKENS
    is set (default 0): real prefill time is GPU time, not host CPU, so benchmarks of several
    stand-in hosts on one machine measure the tool, not the shared CPU.  Called inside the
    scheduler's prefill (one at a time)."""
    ms = float(os.environ.get("STANDIN_GPU_MS_PER_1K_TOKENS") or 0)
    if ms > 0 and n_tokens:
        time.sleep(ms * n_tokens / 1e6)


def sched_log(message):
    """One scheduler line as SGLang's logger writes it, with the prefix STAND-IN."""
    print("[%s STAND-IN] %s" % (time.strftime("%Y-%m-%d %H:%M:%S"), message), flush=True)


class Scheduler:
    """STAND-IN of SGLang's scheduler: prefills one at a time (one GPU), its log lines and figures.

    The figures are computed as scheduler_metrics_mixin.py (0.5.9) computes them: a prefill line's
    input throughput is the previous prefill's tokens over the time since the previous prefill
    line; a decode line's gen throughput, the tokens decoded since the last decode line over the
    time since it."""

    DECODE_LOG_INTERVAL = 40

    def __init__(self):
        self.gpu = threading.Lock()
        self.meta = threading.Lock()
        self.waiting = self.decoding = 0
        self.last_prefill_tic = self.last_decode_tic = time.perf_counter()
        self.last_prefill_tokens = self.decoded_tokens = 0

    def prefill(self, n_tokens, run):
        """run() under the GPU lock; then the prefill line (the batch's result is processed)."""
        with self.meta:
            self.waiting += 1
        with self.gpu:
            with self.meta:
                self.waiting -= 1
            result = run()
            now = time.perf_counter()
            gap, self.last_prefill_tic = now - self.last_prefill_tic, now
            throughput = self.last_prefill_tokens / gap if gap > 0 else 0.0
            self.last_prefill_tokens = n_tokens
            with self.meta:
                waiting, running = self.waiting, self.decoding
            sched_log(
                "Prefill batch, #new-seq: 1, #new-token: %d, #cached-token: 0, token usage: 0.00, "
                "#running-req: %d, #queue-req: %d, input throughput (token/s): %.2f, cuda graph: False"
                % (n_tokens, running, waiting, throughput)
            )
        return result

    def decoding_started(self, delta):
        with self.meta:
            self.decoding += delta

    def decoded(self, n_tokens=1):
        """Count decoded tokens; every DECODE_LOG_INTERVAL of them, a decode line."""
        with self.meta:
            self.decoded_tokens += n_tokens
            if self.decoded_tokens < self.DECODE_LOG_INTERVAL:
                return
            now = time.perf_counter()
            gap, self.last_decode_tic = now - self.last_decode_tic, now
            tokens, self.decoded_tokens = self.decoded_tokens, 0
            running = self.decoding
        sched_log(
            "Decode batch, #running-req: %d, #token: %d, token usage: 0.00, cuda graph: False, "
            "gen throughput (token/s): %.2f, #queue-req: 0" % (running, tokens, tokens / gap if gap > 0 else 0.0)
        )


def chat_prompt_ids(messages, context_len=None):
    """STAND-IN chat template: "<|role|>content" per turn, then "<|assistant|>", as UTF-8 bytes
    taken as token ids (the stand-in has no tokenizer).  ValueError for a malformed turn,
    `TooLong` (before the ids are made) for a prompt of `context_len` tokens or more."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    text = ""
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError("each message needs a role")
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str):
            raise ValueError("message content must be text")
        text += "<|%s|>%s" % (m["role"], content)
    raw = (text + "<|assistant|>").encode("utf-8")
    if context_len is not None and len(raw) >= context_len:
        raise context_error(len(raw), context_len)
    return list(raw)


def standin_detokenize(ids):
    """STAND-IN detokenizer: one printable ASCII character per id (chr(32 + id % 95))."""
    return "".join(chr(32 + i % 95) for i in ids)


def capture_layers(num_layers):
    """SGLang's layers_to_capture: SGLANG_HS_DUMP_LAYERS, else [2, L//2, L-3]."""
    env = os.environ.get("SGLANG_HS_DUMP_LAYERS", "")
    layers = [int(x) for x in env.split(",") if x.strip()] if env.strip() else [2, num_layers // 2, num_layers - 3]
    bad = [l for l in layers if not 0 <= l < num_layers]
    if bad or len(layers) != 3:
        raise SystemExit(
            "%s: layers_to_capture %s: want 3 layers in 0..%d (the residual stream entering each)"
            % (STANDIN, layers, num_layers - 1)
        )
    return layers


class Faults:
    """The STANDIN_* fault switches (see the module docstring)."""

    def __init__(self, env):
        self.final_norm = (env.get("STANDIN_FINAL_NORM") or "post").strip().lower()
        if self.final_norm not in ("pre", "post"):
            raise SystemExit("%s: STANDIN_FINAL_NORM=%r: want pre or post" % (STANDIN, self.final_norm))
        self.drop_aux = (env.get("STANDIN_DROP_AUX") or "").strip().lower() in ("1", "true", "yes", "on")
        self.nan_keys = [k.strip() for k in (env.get("STANDIN_NAN_KEYS") or "").split(",") if k.strip()]
        short = [k for k in self.nan_keys if len(k) < 8]
        if short:
            raise SystemExit("%s: STANDIN_NAN_KEYS: %s: want dump keys or prefixes of 8+ characters" % (STANDIN, short))

    def nan(self, key):
        return any(key.startswith(k) for k in self.nan_keys)

    def names(self):
        """The faults that are on, as words (empty when none)."""
        out = []
        if self.final_norm == "pre":
            out.append("final_norm=pre")
        if self.drop_aux:
            out.append("drop_aux=last")
        if self.nan_keys:
            out.append("nan_keys=" + "|".join(self.nan_keys))
        return out


class Dumper:
    """Writes one dump file per request under $SGLANG_HS_DUMP_DIR via remote_ops_dump.dumpfile."""

    def __init__(self, directory, config, tp, faults, version="unknown"):
        import remote_ops_dump.dumpfile as dumpfile  # the dumper's stdlib-only format module (dump contract)

        self.dumpfile, self.dir, self.tp, self.faults = dumpfile, directory, tp, faults
        self.hidden, self.num_layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
        self.version, self.arch = version, config["architectures"][0]
        self.layers = capture_layers(self.num_layers)
        all_ranks = os.environ.get("SGLANG_HS_DUMP_ALL_RANKS") == "1"
        self.ranks = list(range(tp)) if all_ranks else [0]
        self.lock = threading.Lock()
        self.started = round(time.time(), 3)
        self.counts = dict.fromkeys(
            ("files", "spans", "tokens", "bytes", "batches", "errors", "capture_calls", "capture_us")
            + ("capture_steps", "capture_steps_us", "dropped_batches", "dropped_spans", "dropped_tokens"),
            0,
        )
        for rank in self.ranks:
            self.write_stats(rank)

    def write_stats(self, rank):
        """stats.json as the real dumper writes it (FORMAT.md), marked STAND-IN."""
        folder = os.path.join(self.dir, self.dumpfile.rank_dir_name(rank))
        os.makedirs(folder, exist_ok=True)
        doc = dict(self.counts)
        doc.update(
            state="running",
            reason=None,
            skipped={},
            rank=rank,
            writer=True,
            writer_mode="standin (synchronous write in the request thread)",
            hidden_size=self.hidden,
            layers_to_capture=self.layers,
            metadata=self.metadata(),
            pid=os.getpid(),
            started=self.started,
            updated=round(time.time(), 3),
            standin=True,
        )
        self.dumpfile.write_json_atomic(os.path.join(folder, self.dumpfile.STATS_NAME), doc)

    def dump(self, np, model, ids, states, pre, post):
        """One span per request (prefill only, prefix 0), on rank 0 or on every rank: the captured
        residual stream and the final state, as bf16, with the switched-on faults applied; timed
        as the dumper's capture() (stats.json `capture_steps_us`)."""
        t0 = time.perf_counter()
        written = self.write(np, model, ids, states, pre, post)
        us = int((time.perf_counter() - t0) * 1e6)
        with self.lock:
            c = self.counts
            c["files"], c["spans"], c["tokens"] = c["files"] + len(written), c["spans"] + 1, c["tokens"] + len(ids)
            c["bytes"] += sum(int(r.get("bytes") or 0) for r in written)
            c["batches"], c["capture_calls"], c["capture_steps"] = (
                c["batches"] + 1,
                c["capture_calls"] + 1,
                c["capture_steps"] + 1,
            )
            c["capture_us"], c["capture_steps_us"] = c["capture_us"] + us, c["capture_steps_us"] + us
            for rank in self.ranks:
                self.write_stats(rank)

    def write(self, np, model, ids, states, pre, post):
        """The dump files of one request; their manifest records."""
        dumpfile, n = self.dumpfile, len(ids)
        ids_le = dumpfile.token_ids_bytes(ids)
        key = dumpfile.dump_key(ids_le, 0)
        layers = self.layers[:-1] if self.faults.drop_aux else self.layers
        final = model.round_bf16(np, pre if self.faults.final_norm == "pre" else post)
        aux = model.round_bf16(np, np.concatenate([states[l] for l in layers], axis=1))
        if self.faults.nan(key):
            final[0, :] = aux[0, :] = 0x7FC0  # bf16 NaN
        positions = dumpfile.token_ids_bytes(range(n))
        meta = self.metadata()
        written = []
        for rank in self.ranks:
            with self.lock:
                if len(layers) == 3:
                    rec = dumpfile.write_span(
                        self.dir,
                        rank,
                        ids_le,
                        positions,
                        final.tobytes(),
                        aux.tobytes(),
                        self.hidden,
                        metadata=meta,
                        fsync=False,
                    )
                else:
                    rec = self.write_short_aux(rank, key, ids_le, positions, final, aux, meta)
            written.append(rec)
        return written

    def write_short_aux(self, rank, key, ids_le, positions, final, aux, meta):
        """write_span's steps with an aux tensor of fewer than 3 layers (STANDIN_DROP_AUX), which
        write_span's fixed [n, 3H] shape cannot carry."""
        dumpfile, n = self.dumpfile, len(ids_le) // 4
        folder = os.path.join(self.dir, dumpfile.rank_dir_name(rank))
        os.makedirs(folder, exist_ok=True)
        tensors = {
            "hidden_states": ("BF16", [n, self.hidden], final.tobytes()),
            "aux_hidden_states": ("BF16", [n, aux.shape[1]], aux.tobytes()),
            "input_ids": ("I32", [n], ids_le),
            "positions": ("I32", [n], positions),
        }
        written = dumpfile.write_dump_file(
            os.path.join(folder, dumpfile.dump_file_name(key)),
            tensors,
            dumpfile.span_metadata(meta, key, n, 0, rank),
            False,
        )
        record = dumpfile.manifest_record(self.dir, written, key, n, 0, rank, self.hidden, "BF16")
        dumpfile.append_manifest(os.path.join(folder, dumpfile.MANIFEST_NAME), record, False)
        return record

    def metadata(self):
        """Run-wide file metadata (dump contract), marked as stand-in data."""
        meta = {
            "standin": "true",
            "sglang_version": self.version,
            "hidden_size": str(self.hidden),
            "num_hidden_layers": str(self.num_layers),
            "dtype": "bfloat16",
            "layers_to_capture": json.dumps(self.layers),
            "eagle_aux_hidden_state_layer_ids": json.dumps([l - 1 for l in self.layers]),
            "hidden_states_norm": "post-norm",
            "aux_hidden_states_norm": "pre-norm",
            "allreduce_fusion": "n/a (standin)",
            "tp_size": str(self.tp),
            "model_arch": self.arch,
        }
        if self.faults.names():
            meta["standin_fault"] = ",".join(self.faults.names())
        return meta


# -- speculative decoding (STAND-IN acceptance and timing model) ----------------------------------
# With --speculative-algorithm the stand-in reports SGLang 0.5.9's per-request spec fields
# (tokenizer_manager._calculate_spec_decoding_metrics: spec_verify_ct, spec_accept_length =
# completion_tokens / spec_verify_ct, spec_accept_rate, spec_accept_token_num, spec_draft_token_num,
# spec_accept_histogram) from a DETERMINISTIC acceptance model, not from any drafter: draft
# position k of a verify step is accepted with probability STANDIN_SPEC_ACCEPT_P (default 0.7)
# while all before it were, decided by a sha256 stream of the prompt.  Time is simulated too:
# STANDIN_STEP_MS per target forward (default 1 ms), plus STANDIN_DRAFT_MS per draft step.
# Nothing here measures a drafter; every answer says `"standin": true` and names the model.
def add_speculative_args(ap):
    ap.add_argument("--speculative-algorithm", default=None)
    ap.add_argument("--speculative-draft-model-path", default=None)
    ap.add_argument("--speculative-num-steps", type=int, default=3)
    ap.add_argument("--speculative-eagle-topk", type=int, default=1)
    ap.add_argument("--speculative-num-draft-tokens", type=int, default=4)


def speculative_info(args):
    return {
        "speculative_algorithm": args.speculative_algorithm,
        "speculative_draft_model_path": args.speculative_draft_model_path,
        "speculative_num_steps": args.speculative_num_steps,
        "speculative_eagle_topk": args.speculative_eagle_topk,
        "speculative_num_draft_tokens": args.speculative_num_draft_tokens,
    }


def accepted_in_step(seed, step, guesses, p):
    """Leading draft tokens accepted in one verify step (deterministic in seed and step)."""
    block = hashlib.sha256(b"%s:%d" % (seed.encode(), step)).digest()
    n = 0
    while n < guesses and block[n] / 256.0 < p:
        n += 1
    return n


def speculative_meta(args, ids, max_new):
    """The spec fields for one finished request, and the simulated decode time (slept here)."""
    step_s = float(os.environ.get("STANDIN_STEP_MS", "1")) / 1000.0
    if not args.speculative_algorithm:
        time.sleep(step_s * max_new)
        return {}
    p = float(os.environ.get("STANDIN_SPEC_ACCEPT_P", "0.7"))
    guesses = max(args.speculative_num_draft_tokens - 1, 0)
    seed = hashlib.sha256(json.dumps(ids).encode()).hexdigest()
    made = steps = accepted = 0
    histogram = [0] * (guesses + 1)
    while made < max_new:
        a = min(accepted_in_step(seed, steps, guesses, p), max_new - made - 1)
        histogram[a] += 1
        made, steps, accepted = made + a + 1, steps + 1, accepted + a
    draft_s = float(os.environ.get("STANDIN_DRAFT_MS", "0.2")) / 1000.0 * args.speculative_num_steps
    time.sleep(steps * (step_s + draft_s))
    return {
        "spec_verify_ct": steps,
        "spec_accept_length": max_new / steps,
        "spec_accept_rate": accepted / (steps * guesses) if guesses else 0.0,
        "spec_accept_token_num": accepted,
        "spec_draft_token_num": steps * guesses,
        "spec_accept_histogram": histogram,
        "standin_acceptance_model": {"p": p, "step_ms": step_s * 1000, "note": "stand-in: no drafter ran"},
    }


# -- HTTP ---------------------------------------------------------------------------------------
class State:
    def __init__(self, args):
        import numpy

        self.args = args
        self.tree = sglang_dir()
        self.version = sglang_version(self.tree)
        self.np, self.model = numpy, load_model_module()
        self.network, self.weights = self.model.Network.load(args.model_path)
        self.config = self.network.cfg
        self.context_len = int(
            args.context_length or self.config.get("max_position_embeddings") or DEFAULT_CONTEXT_LENGTH
        )
        self.faults = Faults(os.environ)
        self.started = time.time()
        self.requests = 0
        self.scheduler = Scheduler()
        d = os.environ.get("SGLANG_HS_DUMP_DIR")
        self.dumper = Dumper(d, self.config, args.tp, self.faults, self.version) if d else None

    def model_info(self):
        return {
            "model_path": self.args.model_path,
            "tokenizer_path": self.args.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "architectures": self.config["architectures"],
            "model_type": self.config["model_type"],
            "context_length": self.context_len,
            "hidden_size": self.config["hidden_size"],
            "num_hidden_layers": self.config["num_hidden_layers"],
            "vocab_size": self.config["vocab_size"],
            "standin": True,
            "standin_weights": self.weights,
        }

    def server_info(self):
        a = self.args
        return {
            "version": self.version,
            "standin": True,
            "server": STANDIN,
            "model_path": a.model_path,
            "served_model_name": a.served_model_name,
            "tp_size": a.tp,
            "port": a.port,
            "disable_radix_cache": a.disable_radix_cache,
            "chunked_prefill_size": a.chunked_prefill_size,
            "patched": patch_marker(self.tree),
            "dump_dir": os.environ.get("SGLANG_HS_DUMP_DIR"),
            "uptime_s": round(time.time() - self.started, 3),
            "requests": self.requests,
            "internal_states": [{"standin": True}],
            "standin_faults": self.faults.names(),
            **speculative_info(a),
        }

    def check_ids(self, ids):
        """SGLang's refusals (tokenizer_manager): a prompt at or over the context length
        (`TooLong`), ids outside the vocabulary (ValueError)."""
        vocab = self.network.vocab
        if not ids:
            raise ValueError("input_ids is empty")
        if len(ids) >= self.context_len:
            raise context_error(len(ids), self.context_len)
        if any(i < 0 or i >= vocab for i in ids):
            raise ValueError("The input_ids %s contains values greater than the vocab size (%d)." % (ids, vocab))

    def generate_ids(self, ids, max_new):
        """Prefill (one at a time, dumped when dumps are on, logged) and greedy decoding through the
        STAND-IN network (Network.generate's steps, with the scheduler's counts)."""
        self.requests += 1
        net, capture = self.network, (self.dumper.layers if self.dumper is not None else ())

        def prefill():
            simulated_prefill(len(ids))
            states, pre, post, cache = net.forward(ids, capture)
            if self.dumper is not None:
                self.dumper.dump(self.np, self.model, ids, states, pre, post)
            return post[-1], cache

        row, cache = self.scheduler.prefill(len(ids), prefill)
        out = []
        self.scheduler.decoding_started(1)
        try:
            for _ in range(max_new):
                out.append(net.next_token(row))
                if len(out) < max_new:
                    _, _, step, cache = net.forward([out[-1]], (), cache)
                    row = step[-1]
                    self.scheduler.decoded(1)
        finally:
            self.scheduler.decoding_started(-1)
        return out

    def generate_one(self, ids, max_new):
        """/generate's answer for one prompt."""
        out_ids = self.generate_ids(ids, max_new)
        started = time.time()
        meta = {
            "id": uuid.uuid4().hex,
            "prompt_tokens": len(ids),
            "completion_tokens": max_new,
            "finish_reason": {"type": "length", "length": max_new},
            "standin": True,
        }
        meta.update(speculative_meta(self.args, ids, max_new))
        meta["e2e_latency"] = time.time() - started
        return {"text": "".join(" standin:%d" % t for t in out_ids), "output_ids": out_ids, "meta_info": meta}

    def chat(self, body):
        """/v1/chat/completions: the STAND-IN chat template, greedy tokens, the STAND-IN detokenizer."""
        ids = chat_prompt_ids(body.get("messages"), self.context_len)
        self.check_ids(ids)
        max_new = body.get("max_completion_tokens") or body.get("max_tokens") or 128
        if type(max_new) is not int or max_new < 1:
            raise ValueError("max_tokens must be a positive integer")
        out_ids = self.generate_ids(ids, max_new)
        return {
            "id": "chatcmpl-" + uuid.uuid4().hex,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.args.served_model_name or self.args.model_path,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": standin_detokenize(out_ids), "reasoning_content": None},
                    "finish_reason": "length",
                    "matched_stop": None,
                }
            ],
            "usage": {
                "prompt_tokens": len(ids),
                "completion_tokens": len(out_ids),
                "total_tokens": len(ids) + len(out_ids),
            },
            "standin": True,
            "standin_output_ids": out_ids,
        }


def _prompts(body):
    """[(token ids)] and whether the request was a batch, from `input_ids` or `text`."""
    if body.get("input_ids") is not None:
        ids = body["input_ids"]
        batch = bool(ids) and isinstance(ids[0], list)
        return ([list(map(int, x)) for x in ids] if batch else [list(map(int, ids))]), batch
    text = body.get("text")
    if text is None:
        raise ValueError("need input_ids or text")
    batch = isinstance(text, list)
    return [list(t.encode("utf-8")) for t in (text if batch else [text])], batch


class Handler(BaseHTTPRequestHandler):
    server_version = STANDIN
    state = None  # set in main

    def _send(self, code, doc):
        body = (json.dumps(doc) if not isinstance(doc, str) else doc).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json" if not isinstance(doc, str) else "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        path = self.path.split("?", 1)[0]
        st = self.state
        routes = {
            "/health": lambda: "",
            "/health_generate": lambda: "",
            "/model_info": st.model_info,
            "/get_model_info": st.model_info,
            "/server_info": st.server_info,
            "/get_server_info": st.server_info,
            "/v1/models": lambda: {
                "object": "list",
                "data": [
                    {
                        "id": st.args.served_model_name or st.args.model_path,
                        "object": "model",
                        "owned_by": "sglang",
                        "root": st.args.model_path,
                        "standin": True,
                    }
                ],
            },
        }
        if path not in routes:
            return self._send(404, {"error": "not found", "standin": True})
        self._send(200, routes[path]())

    def _body(self):
        """The request body, or None when it was refused (413, unread: over MAX_BODY_BYTES)."""
        try:
            size = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            size = -1
        if size < 0 or size > MAX_BODY_BYTES:
            self.close_connection = True
            self._send(
                413,
                {
                    "error": {
                        "message": "request body of %s bytes is over the stand-in's cap of %d bytes"
                        % (self.headers.get("Content-Length"), MAX_BODY_BYTES)
                    },
                    "standin": True,
                },
            )
            return None
        return self.rfile.read(size)

    def do_POST(self):
        path = self.path.split("?", 1)[0]
        if path not in ("/v1/chat/completions", "/generate"):
            return self._send(404, {"error": "not found", "standin": True})
        raw = self._body()
        if raw is None:
            return None
        if path == "/v1/chat/completions":
            return self.chat(raw)
        try:
            body = json.loads(raw or b"{}")
            prompts, batch = _prompts(body)
            max_new = int((body.get("sampling_params") or {}).get("max_new_tokens", 16))
            for ids in prompts:
                self.state.check_ids(ids)
        except TooLong as exc:  # SGLang's shape: http_server._create_error_response
            return self._send(400, {"error": {"message": str(exc)}, "standin": True})
        except (ValueError, TypeError, KeyError) as exc:
            return self._send(400, {"error": str(exc), "standin": True})
        results = [self.state.generate_one(ids, max_new) for ids in prompts]
        self._send(200, results if batch else results[0])

    def chat(self, raw):
        try:
            body = json.loads(raw or b"{}")
            if not isinstance(body, dict):
                raise ValueError("the request is not a JSON object")
            if body.get("stream"):
                raise ValueError("stream is not supported by the stand-in")
            answer = self.state.chat(body)
        except (ValueError, TypeError, KeyError) as exc:  # SGLang's OpenAI error object
            return self._send(
                400,
                {
                    "object": "error",
                    "message": str(exc),
                    "type": "BadRequestError",
                    "param": None,
                    "code": 400,
                    "standin": True,
                },
            )
        self._send(200, answer)

    def log_message(self, fmt, *args):
        sys.stderr.write("%s %s - %s\n" % (time.strftime("%Y-%m-%d %H:%M:%S"), STANDIN, fmt % args))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog=STANDIN, description="SGLang stand-in (a tiny CPU network, no GPU)")
    ap.add_argument("--model-path", default="/models/standin")
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--tp", "--tp-size", dest="tp", type=int, default=1)
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--chunked-prefill-size", type=int, default=8192)
    ap.add_argument("--context-length", type=int, default=None, help="default: max_position_embeddings, else 32768")
    ap.add_argument("--disable-radix-cache", action="store_true")
    add_speculative_args(ap)
    args, unknown = ap.parse_known_args(argv)
    args.ignored = unknown
    return args


def main(argv=None):
    args = parse_args(argv)
    verify_patch_or_exit()
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, "1")  # before numpy loads: small requests, run side by side
    Handler.state = st = State(args)
    print(
        "%s: NOT SGLang; stand-in for sglang %s, model %s, tp %d, ignoring %s"
        % (STANDIN, st.version, args.model_path, args.tp, args.ignored),
        flush=True,
    )
    print(
        "%s: STAND-IN network (%d layers, hidden %d, vocab %d), weights: %s; faults: %s"
        % (
            STANDIN,
            st.config["num_hidden_layers"],
            st.config["hidden_size"],
            st.config["vocab_size"],
            st.weights,
            ", ".join(st.faults.names()) or "none",
        ),
        flush=True,
    )
    time.sleep(float(os.environ.get("STANDIN_LOAD_SECONDS", "1")))  # a "model load"
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print("%s: listening on %s:%d" % (STANDIN, args.host, args.port), flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
