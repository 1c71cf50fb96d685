#!/usr/bin/env python3
"""Lossless dump compaction (`dumps compact`, dumper/FORMAT.md "Packed files"), side by side in one run.

Real activations written as dump files by the dump contract's writer (`dumpfile.write_span`):
- `learned`: the learned tiny target (docker/vllm/learned-target/, a 4-layer Llama, H=128), a bf16
  forward on CPU torch with `output_hidden_states` over split.json's prompts: aux = layers 1-3's
  outputs, final = the post-norm last state;
- `standin`: the computing stand-in's network (docker/standin/standin_model.py, H=64) over the same
  token ids (mod its vocabulary), captured at layers [2, 4, 5], rounded to bf16 as its server does.

Per source, in one process: the entropy of each bf16 field (sign, exponent, mantissa; the exponent
given its channel; the exponent's lowest bit given its other bits; the empirical conditional
entropies and, as the floor an adaptive context coder would reach, an adaptive KT estimate); bytes
kept by the packed form (`packed.pack_file`, v2, and the v1 form for comparison), by zstd -1/-3 (the
`zstd` CLI, when present) and zlib -1 on the whole files, and by zstd -1 on the byte-grouped planes;
MB/s on one core packing (with its sha256 and the decode check `dumps compact` makes) and decoding;
the export's rate (`onhost/specforge_export.py`, run as the host runs it: python3 on stdin, one job)
from the packed files against the plain ones; and MB/s of both versions on one file at Kimi-K2.5's
width (`--wide-tokens`, the learned target's rows tiled across 7168 channels).  The sync at
bench/sync.py's shaped link (compressed at rest against `--compress zstd`) is bench/sync.py's
`sync-packed` method; a forward at Kimi-K2.5's width on the H200 is not measured here.

    .venv/bin/python bench/compress.py [--prompts 40] [--max-tokens 1024] [--wide-tokens 1400] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "docker" / "standin"))

from remote_ops import onhost  # noqa: E402
from remote_ops.dumper import dumpfile, packed  # noqa: E402

TARGET = REPO / "docker" / "vllm" / "learned-target"


def learned_states(prompts: int, max_tokens: int):
    """[(ids, final bf16 bytes, aux bf16 bytes, H)] from the learned target on CPU torch."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TARGET)
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.bfloat16).eval()
    texts = [p["text"] for p in json.loads((TARGET / "split.json").read_text())["prompts"]][:prompts]
    out = []
    with torch.no_grad():
        for text in texts:
            ids = tok(text, return_tensors="pt").input_ids[:, :max_tokens]
            hs = model(ids, output_hidden_states=True).hidden_states
            aux = torch.cat([hs[1], hs[2], hs[3]], -1)[0].contiguous()
            final = hs[-1][0].contiguous()
            out.append(
                (
                    ids[0].tolist(),
                    final.view(torch.int16).numpy().tobytes(),
                    aux.view(torch.int16).numpy().tobytes(),
                    final.shape[1],
                )
            )
    return out


def standin_states(id_lists):
    import numpy as np
    import standin_model as sm

    with tempfile.TemporaryDirectory() as tmp:
        net, _ = sm.Network.load(tmp)  # the seeded weights
    out = []
    for ids in id_lists:
        ids = [i % net.vocab for i in ids]
        states, _pre, post, _ = net.forward(ids, (2, 4, 5))
        final = sm.round_bf16(np, post)
        aux = sm.round_bf16(np, np.concatenate([states[k] for k in (2, 4, 5)], axis=1))
        out.append((ids, final.astype(np.uint16).tobytes(), aux.astype(np.uint16).tobytes(), net.hidden))
    return out


def write_dumps(root: Path, states) -> list[dict]:
    recs = []
    for ids, final, aux, h in states:
        n = len(ids)
        ids_le = dumpfile.token_ids_bytes(ids)
        recs.append(
            dumpfile.write_span(str(root), 0, ids_le, dumpfile.token_ids_bytes(range(n)), final, aux, h, fsync=False)
        )
    return recs


def zstd(data: bytes, level: int) -> int | None:
    if not shutil.which("zstd"):
        return None
    return len(subprocess.run(["zstd", f"-{level}", "-c", "-q"], input=data, capture_output=True, check=True).stdout)


def grouped(data: bytes, header_len: int) -> bytes:
    body = data[8 + header_len :]
    return data[: 8 + header_len] + body[1::2] + body[0::2]


def _entropy(x, ctx=None) -> float:
    """Empirical H(x | ctx) in bits (numpy arrays of small non-negative ints)."""
    import numpy as np

    g = np.zeros(x.size, np.int64) if ctx is None else np.broadcast_to(ctx, x.shape).ravel().astype(np.int64)
    x = x.ravel().astype(np.int64)
    n = x.size
    _, cj = np.unique(g * 65536 + x, return_counts=True)
    _, cg = np.unique(g, return_counts=True)
    return float(-(cj / n * np.log2(cj / n)).sum() + (cg / n * np.log2(cg / n)).sum())


def _adaptive(x, ctx, alphabet: int) -> float:
    """Bits per symbol of an adaptive (KT, 1/2) coder with a context per `ctx` value: the
    learning cost included, what an arithmetic coder with these contexts would pay."""
    import numpy as np

    g = np.broadcast_to(ctx, x.shape).ravel().astype(np.int64)
    x = x.ravel().astype(np.int64)
    n = x.size

    def seen_before(k):  # how often each key came before this position
        order = np.argsort(k, kind="stable")
        ks = k[order]
        start = np.r_[0, np.flatnonzero(ks[1:] != ks[:-1]) + 1]
        out = np.empty(n, np.int64)
        out[order] = np.arange(n) - np.repeat(start, np.diff(np.r_[start, n]))
        return out

    return float((np.log2(seen_before(g) + alphabet / 2) - np.log2(seen_before(g * 65536 + x) + 0.5)).sum() / n)


def fields(states) -> dict:
    """Bits per value of each bf16 field, per tensor (all files of the source together)."""
    import numpy as np

    out = {}
    h = states[0][3]
    for tname, idx, w in (("final", 1, h), ("aux", 2, 3 * h)):
        arr = np.concatenate([np.frombuffer(s[idx], np.uint16).reshape(-1, w) for s in states]).astype(np.int64)
        sign, exp, man = arr >> 15, (arr >> 7) & 0xFF, arr & 0x7F
        ch = np.arange(w)[None, :]
        r = {
            "sign": _entropy(sign),
            "sign_given_channel": _entropy(sign, ch),
            "exponent": _entropy(exp),
            "exponent_given_channel": _entropy(exp, ch),
            "exponent_given_channel_adaptive": _adaptive(exp, ch, 64),
            "exponent_low_bit": _entropy(exp & 1),
            "exponent_low_bit_given_other_bits": _entropy(exp & 1, exp >> 1),
            "mantissa": _entropy(man),
            "mantissa_given_exponent": _entropy(man, exp),
            "high_byte": _entropy(arr >> 8),
            "low_byte": _entropy(arr & 0xFF),
        }
        r["floor_bits_per_value"] = (
            _adaptive(sign, ch, 2) + r["exponent_given_channel_adaptive"] + _adaptive(man, exp, 128)
        )
        if tname == "aux":  # the next captured layer's exponent given the one before (same token, channel)
            e3 = exp.reshape(-1, 3, h)
            r["exponent_given_previous_layer_adaptive"] = [_adaptive(e3[:, k + 1], e3[:, k], 64) for k in range(2)]
        out[tname] = {k: (round(v, 3) if isinstance(v, float) else [round(x, 3) for x in v]) for k, v in r.items()}
        out[tname]["values"] = int(arr.size)
    n = sum(v["values"] for v in out.values())
    out["float_floor_kept"] = round(sum(v["values"] * v["floor_bits_per_value"] for v in out.values()) / n / 16, 4)
    return out


def float_kept(paths) -> float:
    """Stored over source bytes of the float tensors' blocks (the header, ids, positions, index left out)."""
    src = kept = 0
    for p in paths:
        with packed.PackedFile(str(p)) as pf:
            for b in pf.blocks:
                if b[2] in ("e2", "g2"):
                    src += b[1]
                    kept += sum(s for _c, s in b[3])
    return round(kept / src, 4) if src else 0.0


def measure(name: str, states, work: Path) -> dict:
    plain, packed_dir = work / f"{name}-plain", work / f"{name}-packed"
    recs = write_dumps(plain, states)
    shutil.copytree(plain, packed_dir)
    files = [plain / r["file"] for r in recs]
    raw = [f.read_bytes() for f in files]
    total = sum(map(len, raw))
    # packing as `dumps compact` does per file: pack (+ sha256) then decode from disk (+ sha256)
    t0 = time.process_time()
    infos = []
    for f in files:
        infos.append(packed.pack_file(str(f), str(f) + ".tmp", fsync=False))
    t_pack = time.process_time() - t0
    t0 = time.process_time()
    for f in files:
        packed.decoded_sha256(str(f) + ".tmp")
    t_decode = time.process_time() - t0
    floats_v2 = float_kept([str(f) + ".tmp" for f in files])
    t0 = time.process_time()
    infos_v1 = [packed.pack_file(str(f), str(f) + ".tmp", fsync=False, version=1) for f in files]
    t_pack_v1 = time.process_time() - t0
    t0 = time.process_time()
    for f in files:
        packed.decoded_sha256(str(f) + ".tmp")
    t_decode_v1 = time.process_time() - t0
    floats_v1 = float_kept([str(f) + ".tmp" for f in files])
    for f in files:
        os.unlink(str(f) + ".tmp")
    p = subprocess.run(
        ["python3", "-", "compact", str(packed_dir), "--jobs", "1", "--no-fsync"],
        input=onhost.bundled("compact_onhost.py"),
        capture_output=True,
        check=True,
    )
    compact = json.loads(p.stdout.decode().splitlines()[-1])
    kept = sum(i["packed_bytes"] for i in infos)
    hlens = [dumpfile.read_header(str(f)).header_len for f in files]
    z1 = sum(len(zlib.compress(b, 1)) for b in raw)
    zs1 = [zstd(b, 1) for b in raw]
    zs3 = [zstd(b, 3) for b in raw]
    zsg = [zstd(grouped(b, h), 1) for b, h in zip(raw, hlens)]
    have_zstd = None not in zs1
    export = {
        k: export_rate(d, states, work / f"{name}-{k}-out") for k, d in (("plain", plain), ("packed", packed_dir))
    }
    return {
        "source": name,
        "files": len(files),
        "tokens": sum(len(s[0]) for s in states),
        "hidden": states[0][3],
        "bytes": total,
        "fields_bits_per_value": fields(states),
        "kept": {
            "packed_hsz": round(kept / total, 4),
            "packed_hsz_v1": round(sum(i["packed_bytes"] for i in infos_v1) / total, 4),
            "packed_hsz_float_tensors": floats_v2,
            "packed_hsz_v1_float_tensors": floats_v1,
            "zlib1_plain": round(z1 / total, 4),
            "zstd1_plain": round(sum(zs1) / total, 4) if have_zstd else None,
            "zstd3_plain": round(sum(zs3) / total, 4) if have_zstd else None,
            "zstd1_grouped": round(sum(zsg) / total, 4) if have_zstd else None,
        },
        "mb_per_s_one_core": {
            "pack_with_sha256": round(total / t_pack / 1e6, 1),
            "decode_with_sha256": round(total / t_decode / 1e6, 1),
            "pack_then_decode_check": round(total / (t_pack + t_decode) / 1e6, 1),
            "v1_pack_with_sha256": round(total / t_pack_v1 / 1e6, 1),
            "v1_decode_with_sha256": round(total / t_decode_v1 / 1e6, 1),
            "compact_pass_wall": compact.get("mb_per_s"),
        },
        "compact_pass": {k: compact[k] for k in ("counts", "bytes_before", "bytes_after", "seconds", "ok")},
        "export": export,
        "export_packed_vs_plain": round(export["packed"]["mb_per_s"] / export["plain"]["mb_per_s"], 3)
        if export["plain"]["mb_per_s"]
        else None,
    }


def wide_speed(states, tokens: int, work: Path) -> dict:
    """MB/s on one core of v2 and v1 on one file at Kimi-K2.5's width (H = 7168): the learned
    target's rows tiled 56 times across the channels (a speed figure: tiled rows say nothing new
    about the ratio)."""
    import numpy as np

    h = states[0][3]
    reps = 7168 // h
    fin = np.concatenate([np.frombuffer(s[1], np.uint16).reshape(-1, h) for s in states])[:tokens]
    aux = np.concatenate([np.frombuffer(s[2], np.uint16).reshape(-1, 3 * h) for s in states])[:tokens]
    n = len(fin)
    hidden = np.tile(fin, (1, reps))
    aux = np.concatenate([np.tile(aux[:, k * h : (k + 1) * h], (1, reps)) for k in range(3)], 1)
    ids = dumpfile.token_ids_bytes(range(n))
    rec = dumpfile.write_span(str(work / "wide"), 0, ids, ids, hidden.tobytes(), aux.tobytes(), h * reps, fsync=False)
    src = str(work / "wide" / rec["file"])
    out: dict = {"hidden": h * reps, "tokens": n, "bytes": int(rec["bytes"])}
    for version in (2, 1):
        t0 = time.process_time()
        info = packed.pack_file(src, src + ".hsz", fsync=False, version=version)
        t_pack = time.process_time() - t0
        t0 = time.process_time()
        packed.decoded_sha256(src + ".hsz")
        t_dec = time.process_time() - t0
        out[f"v{version}"] = {
            "pack_with_sha256": round(info["source_bytes"] / t_pack / 1e6, 1),
            "decode_with_sha256": round(info["source_bytes"] / t_dec / 1e6, 1),
        }
    os.unlink(src + ".hsz")
    return out


def export_rate(dump_dir: Path, states, out: Path) -> dict:
    ds = out.parent / (out.name + ".jsonl")
    ds.write_text(
        "".join(
            json.dumps({"id": f"s{i}", "input_ids": s[0], "loss_mask": [1] * len(s[0])}) + "\n"
            for i, s in enumerate(states)
        )
    )
    argv = ["python3", "-", "export", "--dump-dir", str(dump_dir), "--dataset", str(ds), "--out", str(out)]
    argv += ["--jobs", "1", "--probe-mb", "0", "--no-fsync"]
    p = subprocess.run(argv, input=onhost.bundled("specforge_export.py"), capture_output=True, check=True)
    doc = json.loads(p.stdout.decode().splitlines()[-1])
    digests = sorted(
        (str(f.relative_to(out)), __import__("hashlib").sha256(f.read_bytes()).hexdigest()) for f in out.rglob("*.ckpt")
    )
    return {"exported": doc["exported"], "seconds": doc["seconds"], "mb_per_s": doc["mb_per_s"], "ckpts": digests}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--sources", default="learned,standin")
    ap.add_argument("--wide-tokens", type=int, default=1400, help="tokens of the H=7168 speed file (0: none)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    learned = learned_states(args.prompts, args.max_tokens)
    sets = {"learned": learned}
    if "standin" in args.sources:
        sets["standin"] = standin_states([s[0] for s in learned])
    results = []
    with tempfile.TemporaryDirectory(prefix="compress-bench-") as tmp:
        for name in args.sources.split(","):
            r = measure(name, sets[name], Path(tmp))
            same = r["export"]["plain"]["ckpts"] == r["export"]["packed"]["ckpts"]
            for k in ("plain", "packed"):
                r["export"][k]["ckpts"] = len(r["export"][k]["ckpts"])
            r["export_bit_equal"] = same
            results.append(r)
        wide = wide_speed(learned, args.wide_tokens, Path(tmp)) if args.wide_tokens else None
    doc = {
        "results": results,
        "wide_one_core": wide,
        "goal": {"kept_at_most": 0.65},
        "format_version": packed.VERSION,
        "python": sys.version.split()[0],
    }
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if all(r["export_bit_equal"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
