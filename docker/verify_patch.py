#!/usr/bin/env python3
"""Verify, inside an image or a running container, that SGLang's patch target file is patched.

Runs with the image's own python3, standard library only.  The target (e.g.
python/sglang/srt/models/llama.py) is the one the shipped patch spec names.
It finds the installed sglang with importlib.util.find_spec (importing sglang
would need torch and a GPU), hashes that file, runs the standalone tree-anchor
verifier shipped beside it (`anchors.py verify --spec patch-spec.json FILE`)
and prints one JSON line: {"ok", "file", "sha256", "expected_sha256", "verify", "reason"}.
Exit status 0 only when the anchors verify and the sha matches --expect-sha256.
"""

import argparse
import hashlib
import importlib.util
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def spec_target(spec_path):
    """The spec's target inside the sglang package: python/sglang/srt/models/x.py -> srt/models/x.py."""
    with open(spec_path) as fh:
        target = json.load(fh)["target"]
    return target.split("sglang/", 1)[1] if "sglang/" in target else target


def installed_target(relative):
    """Path of the installed sglang's copy of `relative`, found without importing sglang."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(list(spec.submodule_search_locations)[0], *relative.split("/"))


def sha256_of(path):
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def anchor_verify(path, spec, timeout=120):
    """(exit status, decoded JSON or {"raw": text}) of the standalone anchor verifier."""
    argv = [sys.executable, os.path.join(HERE, "anchors.py"), "verify", "--spec", spec, path]
    proc = subprocess.run(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout, universal_newlines=True
    )
    try:
        return proc.returncode, json.loads(proc.stdout)
    except ValueError:
        return proc.returncode, {"raw": (proc.stdout + proc.stderr)[-2000:]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--expect-sha256", default=None)
    ap.add_argument("--spec", default=os.path.join(HERE, "patch-spec.json"))
    args = ap.parse_args(argv)
    relative = spec_target(args.spec)
    out = {
        "ok": False,
        "file": installed_target(relative),
        "sha256": None,
        "expected_sha256": args.expect_sha256,
        "verify": {},
        "reason": "",
    }
    if not out["file"] or not os.path.isfile(out["file"]):
        out["reason"] = "sglang is not installed in this image (find_spec found no %s)" % relative
    else:
        out["sha256"] = sha256_of(out["file"])
        status, out["verify"] = anchor_verify(out["file"], args.spec)
        if status != 0:
            out["reason"] = "anchor verification failed (exit %d)" % status
        elif args.expect_sha256 and out["sha256"] != args.expect_sha256:
            out["reason"] = "%s sha256 %s != label %s" % (relative, out["sha256"][:12], args.expect_sha256[:12])
        else:
            out["ok"] = True
    print(json.dumps(out, sort_keys=True))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
