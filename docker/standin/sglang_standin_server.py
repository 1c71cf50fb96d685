#!/usr/bin/env python3
"""SGLang STAND-IN server: speaks SGLang's HTTP API, runs no model, needs no GPU.

This is NOT SGLang.  It exists so the sandbox and the tests can run remote-ops'
real code path (build, start, health, dumps, logs) on a machine without GPUs.
Every answer carries `"standin": true`.  Standard library only.

It accepts SGLang's `launch_server` arguments (unknown ones are ignored) and serves:
- GET  /health, /health_generate        200 (cheap here; in SGLang 0.5.x /health generates)
- GET  /model_info, /get_model_info     model path, architectures, hidden size
- GET  /server_info, /get_server_info   `version` = the SGLang version of the installed tree
- GET  /v1/models                       the served model name
- POST /generate                        `input_ids` (list or list of lists) or `text`,
                                        `sampling_params.max_new_tokens`
With SGLANG_HS_DUMP_DIR set, each request writes a dump file in the format of
the dump contract (remote_ops_dump.dumpfile), with deterministic pseudo-random
bf16 "hidden states" of a small hidden size (model config.json's hidden_size,
default 64), so the logs/dumps tooling can be exercised end to end.

Environment: STANDIN_LOAD_SECONDS (simulated model load before listening, default 1),
STANDIN_REQUIRE_PATCH=1 (refuse to start unless verify_patch.py passes),
STANDIN_GPU_MS_PER_1K_TOKENS (simulated prefill time per request, a sleep, one request at a time
like one GPU; default 0: benchmarks of several stand-in hosts on one machine set it, so that
what they measure is the tool and not the machine's shared CPU).
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


def model_config(model_path):
    """hidden_size / num_hidden_layers / architectures from the model's config.json, if any."""
    cfg = {
        "hidden_size": 64,
        "num_hidden_layers": 8,
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
    }
    path = os.path.join(model_path or "", "config.json")
    if model_path and os.path.isfile(path):
        with open(path) as fh:
            loaded = json.load(fh)
        cfg.update({k: loaded[k] for k in cfg if k in loaded})
    return cfg


# -- fake hidden states and dumps -----------------------------------------------------------------
_LOW = bytes(b & 0x7F for b in range(256))  # mantissa bits, exponent LSB clear
_HIGH = bytes(0x3F if b & 1 else 0xBF for b in range(256))  # sign, exponent near 1.0


def pseudo_bf16(seed, count):
    """`count` deterministic bf16 values (finite, |x| < 2) as bytes, from a SHAKE-256 stream
    (C speed: a stand-in's CPU must not stand for the GPU's work)."""
    raw = hashlib.shake_256(seed.encode()).digest(2 * count)
    out = bytearray(2 * count)
    out[0::2] = raw[0::2].translate(_LOW)
    out[1::2] = raw[1::2].translate(_HIGH)
    return bytes(out)


GPU = threading.Lock()  # one simulated GPU per server: prefills run one at a time


def simulated_prefill(n_tokens):
    """Sleep for the GPU time a prefill of `n_tokens` would take, if STANDIN_GPU_MS_PER_1K_TOKENS
    is set (default 0): real prefill time is GPU time, not host CPU, so benchmarks of several
    stand-in hosts on one machine measure the tool, not the shared CPU."""
    ms = float(os.environ.get("STANDIN_GPU_MS_PER_1K_TOKENS") or 0)
    if ms > 0 and n_tokens:
        with GPU:
            time.sleep(ms * n_tokens / 1e6)


def capture_layers(num_layers):
    env = os.environ.get("SGLANG_HS_DUMP_LAYERS", "")
    if env.strip():
        return [int(x) for x in env.split(",") if x.strip()]
    return [2, num_layers // 2, num_layers - 3]


class Dumper:
    """Writes one dump file per request under $SGLANG_HS_DUMP_DIR via remote_ops_dump.dumpfile."""

    def __init__(self, directory, hidden_size, num_layers, tp, version="unknown", arch="DeepseekV3ForCausalLM"):
        import remote_ops_dump.dumpfile as dumpfile  # the dumper's stdlib-only format module (dump contract)

        self.dumpfile, self.dir, self.hidden, self.tp = dumpfile, directory, hidden_size, tp
        self.version, self.arch = version, arch
        self.layers = capture_layers(num_layers)
        all_ranks = os.environ.get("SGLANG_HS_DUMP_ALL_RANKS") == "1"
        self.ranks = list(range(tp)) if all_ranks else [0]
        self.lock = threading.Lock()
        self.num_layers = num_layers

    def dump(self, ids):
        """One span per request (prefill only, prefix 0), on rank 0 or on every rank."""
        dumpfile, n = self.dumpfile, len(ids)
        ids_le = dumpfile.token_ids_bytes(ids)
        key = dumpfile.dump_key(ids_le, 0)
        hidden = pseudo_bf16(key + ":final", n * self.hidden)
        aux = pseudo_bf16(key + ":aux", n * 3 * self.hidden)
        positions = dumpfile.token_ids_bytes(range(n))
        for rank in self.ranks:
            with self.lock:
                dumpfile.write_span(
                    self.dir, rank, ids_le, positions, hidden, aux, self.hidden, metadata=self.metadata(), fsync=False
                )

    def metadata(self):
        """Run-wide file metadata (dump contract), marked as stand-in data."""
        return {
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
        self.args = args
        self.tree = sglang_dir()
        self.version = sglang_version(self.tree)
        self.config = model_config(args.model_path)
        self.started = time.time()
        self.requests = 0
        d = os.environ.get("SGLANG_HS_DUMP_DIR")
        self.dumper = (
            Dumper(
                d,
                int(self.config["hidden_size"]),
                int(self.config["num_hidden_layers"]),
                args.tp,
                self.version,
                self.config["architectures"][0],
            )
            if d
            else None
        )

    def model_info(self):
        return {
            "model_path": self.args.model_path,
            "tokenizer_path": self.args.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "architectures": self.config["architectures"],
            "model_type": self.config["model_type"],
            "hidden_size": self.config["hidden_size"],
            "num_hidden_layers": self.config["num_hidden_layers"],
            "standin": True,
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
            **speculative_info(a),
        }

    def generate_one(self, ids, max_new):
        self.requests += 1
        simulated_prefill(len(ids))
        if self.dumper is not None and ids:
            self.dumper.dump(ids)
        out_ids = [(sum(ids) + i) % 32000 for i in range(max_new)]
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
        return {"text": " standin" * max_new, "output_ids": out_ids, "meta_info": meta}


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

    def do_POST(self):
        if self.path.split("?", 1)[0] != "/generate":
            return self._send(404, {"error": "not found", "standin": True})
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            prompts, batch = _prompts(body)
            max_new = int((body.get("sampling_params") or {}).get("max_new_tokens", 16))
        except (ValueError, TypeError, KeyError) as exc:
            return self._send(400, {"error": str(exc), "standin": True})
        results = [self.state.generate_one(ids, max_new) for ids in prompts]
        self._send(200, results if batch else results[0])

    def log_message(self, fmt, *args):
        sys.stderr.write("%s %s - %s\n" % (time.strftime("%Y-%m-%d %H:%M:%S"), STANDIN, fmt % args))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog=STANDIN, description="SGLang stand-in (no model, no GPU)")
    ap.add_argument("--model-path", default="/models/standin")
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--tp", "--tp-size", dest="tp", type=int, default=1)
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--chunked-prefill-size", type=int, default=8192)
    ap.add_argument("--disable-radix-cache", action="store_true")
    add_speculative_args(ap)
    args, unknown = ap.parse_known_args(argv)
    args.ignored = unknown
    return args


def main(argv=None):
    args = parse_args(argv)
    verify_patch_or_exit()
    Handler.state = State(args)
    print(
        "%s: NOT SGLang; stand-in for sglang %s, model %s, tp %d, ignoring %s"
        % (STANDIN, Handler.state.version, args.model_path, args.tp, args.ignored),
        flush=True,
    )
    time.sleep(float(os.environ.get("STANDIN_LOAD_SECONDS", "1")))  # a "model load"
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print("%s: listening on %s:%d" % (STANDIN, args.host, args.port), flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
