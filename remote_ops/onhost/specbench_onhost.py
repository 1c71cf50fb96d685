#!/usr/bin/env python3
"""Speculative-decoding bench client: runs ON the host (stdlib only), beside the server.

Sent on stdin (`python3 - --url ... --prompts FILE`). Reads the server's
`/server_info` (SGLang flattens its server args there: `speculative_algorithm`,
`speculative_num_draft_tokens`, ...), then sends each prompt of the fixed set to
`/generate` one at a time (batch 1: acceptance and speed of one stream, no
batching effects), after `--warmup` unrecorded requests. Per request it keeps
what SGLang 0.5.9 puts in `meta_info` of a finished request
(`completion_tokens`, `spec_verify_ct`, `spec_accept_length`, `spec_accept_rate`,
`spec_accept_histogram`, `e2e_latency`) and its own wall time. One JSON document on stdout.

With `--serving vllm --model NAME` it talks to vLLM's OpenAI server instead: `/metrics` is read
after the warm-up and again after the prompt set (the text as served, at most `METRICS_CAP`
bytes: vLLM's spec-decode counters are in it), and each prompt goes to `/v1/completions`
(`max_tokens`, temperature 0, `ignore_eos`, `return_token_ids`).  Per request it keeps
`usage.completion_tokens`, the output token ids and its wall time.
"""

import argparse
import json
import sys
import time
import urllib.request

META_KEYS = (
    "prompt_tokens",
    "completion_tokens",
    "spec_verify_ct",
    "spec_accept_length",
    "spec_accept_rate",
    "spec_accept_token_num",
    "spec_draft_token_num",
    "spec_accept_histogram",
    "e2e_latency",
    "standin",
    "standin_acceptance_model",
)


METRICS_CAP = 1024 * 1024


def get_text(url, timeout, cap=METRICS_CAP):
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        data = resp.read(cap + 1)
    if len(data) > cap:
        raise ValueError("%s answered more than %d bytes" % (url, cap))
    return data.decode("utf-8", "replace")


def post(url, doc, timeout):
    req = urllib.request.Request(url, data=json.dumps(doc).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def get(url, timeout):
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def request_body(prompt, max_new):
    body = {"sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    if "input_ids" in prompt:
        body["input_ids"] = prompt["input_ids"]
    else:
        body["text"] = prompt["text"]
    return body


def one(url, prompt, max_new, timeout):
    t0 = time.monotonic()
    out = post(url + "/generate", request_body(prompt, max_new), timeout)
    wall = time.monotonic() - t0
    meta = out.get("meta_info", {})
    row = {k: meta[k] for k in META_KEYS if k in meta}
    row["client_s"] = wall
    return row


def completion_body(prompt, max_new, model):
    body = {"model": model, "max_tokens": max_new, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    body["prompt"] = prompt["input_ids"] if "input_ids" in prompt else prompt["text"]
    return body


def one_vllm(url, prompt, max_new, model, timeout):
    t0 = time.monotonic()
    out = post(url + "/v1/completions", completion_body(prompt, max_new, model), timeout)
    wall = time.monotonic() - t0
    choice = (out.get("choices") or [{}])[0]
    usage = out.get("usage") or {}
    row = {
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "output_ids": choice.get("token_ids"),
        "client_s": wall,
    }
    if out.get("kv_transfer_params"):
        row["kv_transfer_params"] = out["kv_transfer_params"]
    return row


def main_vllm(args, prompts):
    if not args.model:
        print(json.dumps({"error": "--serving vllm needs --model (the served model name)"}))
        return 2
    try:
        for p in prompts[: args.warmup]:
            one_vllm(args.url, p, min(args.max_new_tokens, 16), args.model, args.timeout)
        before = get_text(args.url + "/metrics", args.timeout)
        rows = []
        for i, p in enumerate(prompts):
            row = one_vllm(args.url, p, args.max_new_tokens, args.model, args.timeout)
            row["prompt"] = i
            rows.append(row)
        after = get_text(args.url + "/metrics", args.timeout)
        version = get(args.url + "/version", args.timeout).get("version")
    except (OSError, ValueError) as exc:
        print(json.dumps({"error": "%s: %s" % (type(exc).__name__, exc)}))
        return 2
    doc = {"server": {"engine": "vllm", "version": version, "model": args.model}, "results": rows}
    doc["metrics_before"], doc["metrics_after"] = before, after
    print(json.dumps(doc))
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(prog="specbench_onhost.py")
    ap.add_argument("--url", required=True)
    ap.add_argument("--prompts", required=True, help='JSONL: {"text": ...} or {"input_ids": [...]}')
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--serving", choices=("sglang", "vllm"), default="sglang")
    ap.add_argument("--model", default=None, help="vllm: the served model name")
    args = ap.parse_args(argv)
    with open(args.prompts) as fh:
        prompts = [json.loads(l) for l in fh if l.strip()]
    if args.serving == "vllm":
        return main_vllm(args, prompts)
    try:
        info = get(args.url + "/server_info", args.timeout)
        for p in prompts[: args.warmup]:
            one(args.url, p, min(args.max_new_tokens, 16), args.timeout)
        rows = []
        for i, p in enumerate(prompts):
            row = one(args.url, p, args.max_new_tokens, args.timeout)
            row["prompt"] = i
            rows.append(row)
    except (OSError, ValueError) as exc:
        print(json.dumps({"error": "%s: %s" % (type(exc).__name__, exc)}))
        return 2
    keys = (
        "speculative_algorithm",
        "speculative_draft_model_path",
        "speculative_num_steps",
        "speculative_eagle_topk",
        "speculative_num_draft_tokens",
        "version",
        "standin",
        "model_path",
    )
    print(json.dumps({"server": {k: info.get(k) for k in keys}, "results": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
