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


def main(argv=None):
    ap = argparse.ArgumentParser(prog="specbench_onhost.py")
    ap.add_argument("--url", required=True)
    ap.add_argument("--prompts", required=True, help='JSONL: {"text": ...} or {"input_ids": [...]}')
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args(argv)
    with open(args.prompts) as fh:
        prompts = [json.loads(l) for l in fh if l.strip()]
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
