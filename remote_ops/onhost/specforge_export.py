#!/usr/bin/env python3
"""Dumps -> SpecForge 0.2 offline EAGLE-3 feature files. Runs ON the host, stdlib only (Python 3.8+).

Shipped on stdin (`python3 - export ...`) like `dumper/dumpfile.py`: no torch, nothing
installed, the 924 GB never travel.

What SpecForge 0.2.0 reads (read from the 0.2.0 wheel: `specforge/runtime/data_plane/
offline_reader.py`, `feature_store.load_feature_file`, `data/preprocessing.py`
`process_offline_eagle3_sample`, and `scripts/prepare_hidden_states.py`, which writes them):

- every `*.ckpt` under the directory (sorted walk); the writer's naming is
  `rows_<g>-<g+2000>/data_<idx>.ckpt`, idx = the sample's index in the dataset;
- a file is `torch.save(dict)` (zip format, loaded with `torch.load(mmap=True)`);
- keys `input_ids` int64 `[n]`, `loss_mask` int64 `[n]`, `hidden_state` `[1, n, H]`,
  `aux_hidden_state` `[1, n, 3H]` in the model dtype (bf16);
- `hidden_state` is the target's final hidden state that SpecForge's `TargetHead`
  turns into logits with `lm_head` alone (`self.fc(hidden_states)`, no norm): the
  **post-norm** state. The dump's `hidden_states` is exactly that (metadata
  `hidden_states_norm = post-norm`); a file saying otherwise is refused.
  `aux_hidden_state` = the dump's `aux_hidden_states` (3 aux layers concatenated).
  A vLLM file (`token_ids` int64 [S], `hidden_states` [S, 4, H]: the 3 aux layers, then the
  final state, docs/vllm.md) is split per token: its first 3 layers become
  `aux_hidden_state`, its last `hidden_state`; a file with fewer layers is refused.
  With `--convert-prenorm MODEL_DIR` (dumps whose finals a dump audit found pre-norm)
  each `hidden_state` row is passed through the model's final RMSNorm
  (`x / sqrt(mean(x^2) + eps) * weight`, the weight read alone through the model's
  safetensors index, eps from its config.json; float64 with numpy when importable,
  else Python floats) and rounded back to the dump's dtype (nearest even, as torch).
  A dump in FP8 storage (metadata `storage = fp8_e4m3_rowscale`: e4m3 values and a float32
  scale per token row and layer, FORMAT.md "FP8 storage"; a vLLM file the same with
  `hidden_states_scale` [S, L]) is decoded to its metadata `dtype` (bf16) first, as the
  dumper's `fp8.decode_rows` does (`q * scale` in float32, rounded to nearest even), so
  SpecForge reads bf16 records either way; the sha256 check is of the FP8 bytes read.

The torch zip container is written here without torch: stored (uncompressed)
zip entries, each record's data aligned to 64 bytes as torch's own writer does
(so `mmap=True` maps them in place), and a protocol-2 pickle of
`{name: torch._utils._rebuild_tensor_v2(storage, 0, size, stride, False, OrderedDict())}`.

Per source file, in one sequential read: the bytes are hashed while they are
converted and the output is published (fsync, rename, dir fsync, then a line in
`<out>/export.jsonl`) only if the sha256 equals the dump manifest's. So no file
is ever converted from bytes that failed verification, with one read pass
instead of two. Re-running skips samples already in `export.jsonl` whose file is
present at the recorded size (resume). Progress and the final report are JSON lines on stdout.

Throughput is reported against the disk's copy bandwidth measured in the same
run: the same number of parallel streams copy a sample of source files (page
cache dropped for them first with `posix_fadvise(DONTNEED)`, output fsynced,
copy deleted), once before and once after the export, which reads and writes
under the same conditions; the faster probe is the anchor (a conservative ratio).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import struct
import sys
import threading
import time
import zipfile
from array import array
from concurrent.futures import ThreadPoolExecutor

CHUNK = 8 << 20
ALIGN = 64
GROUP = 2000
STORAGE = {"BF16": "BFloat16Storage", "F16": "HalfStorage", "F32": "FloatStorage", "I64": "LongStorage"}
DTYPE_SIZE = {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8}
EXPORT_MANIFEST = "export.jsonl"


AUX_STATES = 3


class ExportError(Exception):
    """A sample that cannot be exported; the message says why."""


# --------------------------------------------------------------------------- FP8 storage (pure)


def _fp8_codec():
    """The FP8-storage decoder (`dumper/fp8read.py`): the one bundled before this program
    (`onhost.with_codec`, module `rops_fp8`), else, run from a checkout, the file itself."""
    mod = sys.modules.get("rops_fp8")
    here = globals().get("__file__")
    if mod is None and here:
        import importlib.util

        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(here))), "dumper", "fp8read.py")
        spec = importlib.util.spec_from_file_location("rops_fp8", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules["rops_fp8"] = mod
    if mod is None:
        raise ImportError("no FP8-storage decoder (rops_fp8) in this program")
    return mod


fp8read = _fp8_codec()
STORAGE_FP8 = fp8read.STORAGE_FP8  # metadata `storage` of a dump in FP8 storage (dumper/fp8.py's STORAGE)
MODEL_DTYPES = fp8read.MODEL_DTYPES
E4M3 = fp8read.E4M3
encode_floats = fp8read.encode_floats


def fp8_out_dtype(meta):
    """The safetensors dtype FP8 values of a file decode to: its metadata `dtype` (the model's)."""
    out = fp8read.model_dtype(meta)
    if out is None:
        raise ExportError("FP8 storage with metadata dtype %r: not a model dtype to decode to" % meta.get("dtype"))
    return out


def decode_fp8(q, scales, segments, width, dtype, np=None):
    """`fp8read.decode_fp8` (the readers' one decoder), its refusal an ExportError."""
    try:
        return fp8read.decode_fp8(q, scales, segments, width, dtype, np)
    except ValueError as exc:
        raise ExportError(str(exc)) from None


def numpy_or_none():
    try:
        import numpy

        return numpy
    except ImportError:
        return None


def is_fp8_source(header, meta):
    """A dump (or vLLM file) in FP8 storage."""
    return fp8read.is_fp8(header, meta)


def decoded_states(data, header, meta, np=None):
    """(hidden [n, H], aux [n, 3H]) bytes in the model dtype, and that dtype, from the data section of a
    dump file in FP8 storage."""
    out = fp8_out_dtype(meta)
    states = []
    for name, segments in (("hidden_states", 1), ("aux_hidden_states", AUX_STATES)):
        a, b = header[name]["data_offsets"]
        sa, sb = header[name + "_scale"]["data_offsets"]
        states.append(decode_fp8(data[a:b], data[sa:sb], segments, header[name]["shape"][1], out, np))
    return states[0], states[1], out


# --------------------------------------------------------------------------- packed (compacted) dumps

PACKED_SUFFIX = ".hsz"


packed = sys.modules.get("rops_packed")  # the packed-dump codec, bundled before this program (onhost.with_codec)


def open_source(path):
    """A dump file for reading its original bytes: a compacted one (`<key>.hsz`) decoded on the fly."""
    if not path.endswith(PACKED_SUFFIX):
        return open(path, "rb", buffering=0)
    if packed is None:
        raise ExportError("%s is packed and this exporter has no packed-dump codec" % os.path.basename(path))
    return packed.PackedFile(path)


def source_sha256(rec):
    """The sha256 of a dump's original bytes: a packed file's `packed.source_sha256`, else its own."""
    info = rec.get("packed")
    return (
        info.get("source_sha256")
        if isinstance(info, dict) and str(rec.get("file", "")).endswith(PACKED_SUFFIX)
        else rec["sha256"]
    )


def original_name(path):
    """The name a dump file had before compaction (`<key>.hsz` -> `<key>.safetensors`)."""
    return path[: -len(PACKED_SUFFIX)] + ".safetensors" if path.endswith(PACKED_SUFFIX) else path


# --------------------------------------------------------------------------- keys, names (pure)


def dump_key(token_ids, prefix_len=0):
    """The dump contract's key: sha256 of int32 LE ids, 32 hex chars, `-p<prefix>`."""
    raw = struct.pack("<%di" % len(token_ids), *token_ids)
    return "%s-p%d" % (hashlib.sha256(raw).hexdigest()[:32], prefix_len)


def out_name(index, group=GROUP):
    """SpecForge's naming: rows_<g>-<g+group>/data_<index>.ckpt."""
    g = (index // group) * group
    return "rows_%d-%d/data_%d.ckpt" % (g, g + group, index)


# --------------------------------------------------------------------------- torch pickle (pure)


def _int(v):
    if 0 <= v < 2**31:
        return b"J" + struct.pack("<i", v)
    raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def _str(s):
    b = s.encode("utf-8")
    return b"X" + struct.pack("<I", len(b)) + b


def _tuple(items):
    return b"(" + b"".join(items) + b"t"


def _tensor(record_key, dtype, shape):
    """Pickle ops for one tensor: _rebuild_tensor_v2(persistent storage, 0, size, stride, False, OrderedDict())."""
    numel = 1
    for d in shape:
        numel *= d
    stride, acc = [], 1
    for d in reversed(shape):
        stride.insert(0, acc)
        acc *= d
    storage = (
        _tuple([_str("storage"), b"ctorch\n%s\n" % STORAGE[dtype].encode(), _str(record_key), _str("cpu"), _int(numel)])
        + b"Q"
    )
    args = _tuple(
        [
            storage,
            _int(0),
            _tuple([_int(d) for d in shape]),
            _tuple([_int(s) for s in stride]),
            b"\x89",
            b"ccollections\nOrderedDict\n)R",
        ]
    )
    return b"ctorch._utils\n_rebuild_tensor_v2\n" + args + b"R"


def pickle_dict(tensors):
    """Protocol-2 pickle of {name: tensor} as torch.save writes it; tensors = [(name, record, dtype, shape)]."""
    body = b"".join(_str(name) + _tensor(rec, dtype, shape) for name, rec, dtype, shape in tensors)
    return b"\x80\x02}(" + body + b"u."


# --------------------------------------------------------------------------- torch zip writer


class TorchZip:
    """A torch.save-compatible zip written record by record, data aligned to 64 bytes."""

    def __init__(self, fileobj, prefix="archive"):
        self.zf = zipfile.ZipFile(fileobj, "w", compression=zipfile.ZIP_STORED, allowZip64=True)
        self.fp = fileobj
        self.prefix = prefix

    def open(self, name, size):
        info = zipfile.ZipInfo("%s/%s" % (self.prefix, name), date_time=(1980, 1, 1, 0, 0, 0))
        info.compress_type = zipfile.ZIP_STORED
        info.file_size = size
        zip64 = size * 1.05 > zipfile.ZIP64_LIMIT
        fixed = 30 + len(info.filename.encode()) + (20 if zip64 else 0) + 4
        pad = (-(self.fp.tell() + fixed)) % ALIGN
        info.extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # 'FB' padding field, as torch
        return self.zf.open(info, "w", force_zip64=zip64)

    def write(self, name, data):
        with self.open(name, len(data)) as fh:
            fh.write(data)

    def close(self):
        self.zf.close()


# --------------------------------------------------------------------------- safetensors header


def read_header(fh):
    """(header_len, {name: {dtype, shape, data_offsets}}, metadata) of an open dump file."""
    n = struct.unpack("<Q", fh.read(8))[0]
    header = json.loads(fh.read(n))
    meta = header.pop("__metadata__", {}) or {}
    return n, header, meta


def check_source(header, meta, tokens, prenorm_ok=False):
    """The dump file must hold the four tensors of the contract (in FP8 storage with their two scales),
    post-norm final state (or, when it is being converted, a pre-norm one), n tokens."""
    names = {"hidden_states", "aux_hidden_states", "input_ids", "positions"}
    fp8 = is_fp8_source(header, meta)
    if fp8:
        names |= {"hidden_states_scale", "aux_hidden_states_scale"}
    if set(header) != names:
        raise ExportError("tensors %s, expected %s" % (sorted(header), sorted(names)))
    if meta.get("hidden_states_norm", "post-norm") not in (("post-norm", "pre-norm") if prenorm_ok else ("post-norm",)):
        raise ExportError(
            "hidden_states is %s; SpecForge's TargetHead needs the post-norm final state"
            % meta.get("hidden_states_norm")
        )
    n, h = header["hidden_states"]["shape"]
    if n != tokens or header["aux_hidden_states"]["shape"] != [n, 3 * h] or header["input_ids"]["dtype"] != "I32":
        raise ExportError(
            "shapes %s / %s do not match %d dataset tokens"
            % (header["hidden_states"]["shape"], header["aux_hidden_states"]["shape"], tokens)
        )
    if fp8:
        if header["hidden_states_scale"]["shape"] != [n, 1] or header["aux_hidden_states_scale"]["shape"] != [n, 3]:
            raise ExportError(
                "FP8 scales %s / %s, want [n, 1] / [n, 3]"
                % (header["hidden_states_scale"]["shape"], header["aux_hidden_states_scale"]["shape"])
            )
        return n, h, fp8_out_dtype(meta)
    if header["hidden_states"]["dtype"] not in STORAGE:
        raise ExportError("dtype %s not supported" % header["hidden_states"]["dtype"])
    return n, h, header["hidden_states"]["dtype"]


# --------------------------------------------------------------------------- pre-norm -> post-norm


def _shortest(names, suffix):
    hits = sorted((n for n in names if n.endswith(suffix) and ".layers." not in n), key=len)
    return hits[0] if hits else None


def load_final_norm(model_dir):
    """(weight as floats, eps, tensor name) of the model's final RMSNorm: config.json's
    `rms_norm_eps` (a wrapper's `text_config` counts) and `*model.norm.weight`, read alone
    through `model.safetensors.index.json` (or a lone model.safetensors)."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as fh:
        cfg = json.load(fh)
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    eps = float(cfg.get("rms_norm_eps", text.get("rms_norm_eps", 1e-6)) or 1e-6)
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as fh:
            wmap = json.load(fh)["weight_map"]
    else:
        with open(os.path.join(model_dir, "model.safetensors"), "rb") as fh:
            wmap = {n: "model.safetensors" for n in read_header(fh)[1]}
    name = _shortest(wmap, "model.norm.weight")
    if name is None:
        raise ExportError("no final norm weight (*model.norm.weight) in %s's weight map" % model_dir)
    with open(os.path.join(model_dir, wmap[name]), "rb") as fh:
        hlen, header, _ = read_header(fh)
        entry = header[name]
        start, end = entry["data_offsets"]
        fh.seek(8 + hlen + start)
        data = _read_exact(fh, end - start)
    return decode_floats(data, entry["dtype"]), eps, name


def decode_floats(data, dtype):
    """Little-endian BF16/F16/F32 bytes -> Python floats."""
    if dtype == "BF16":
        wide = bytearray(2 * len(data))
        wide[2::4], wide[3::4] = data[0::2], data[1::2]
        return array("f", bytes(wide)).tolist()
    if dtype == "F16":
        return list(struct.unpack("<%de" % (len(data) // 2), data))
    if dtype == "F32":
        return array("f", data).tolist()
    raise ExportError("dtype %s not supported" % dtype)


class FinalNorm:
    """The model's final RMSNorm applied to raw rows of a final hidden state (same dtype out)."""

    def __init__(self, model_dir):
        self.weight, self.eps, self.name = load_final_norm(model_dir)
        try:
            import numpy

            self.np = numpy
        except ImportError:
            self.np = None

    def apply(self, data, dtype, h):
        if len(self.weight) != h:
            raise ExportError("the final norm weight has %d values, the hidden states %d" % (len(self.weight), h))
        np = self.np
        if np is not None and dtype in ("BF16", "F16", "F32"):
            return self._numpy(np, data, dtype, h)
        values, out = decode_floats(data, dtype), []
        for r in range(0, len(values), h):
            row = values[r : r + h]
            scale = 1.0 / math.sqrt(math.fsum(v * v for v in row) / h + self.eps)
            out.extend(v * scale * w for v, w in zip(row, self.weight))
        return encode_floats(out, dtype)

    def _numpy(self, np, data, dtype, h):
        if dtype == "BF16":
            x = (np.frombuffer(data, "<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            x = np.frombuffer(data, "<f2" if dtype == "F16" else "<f4")
        x = x.astype(np.float64).reshape(-1, h)
        y = x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + self.eps) * np.asarray(self.weight, dtype=np.float64)
        if dtype == "F16":
            return y.astype("<f2").tobytes()
        f = np.ascontiguousarray(y, dtype=np.float32)
        if dtype == "F32":
            return f.astype("<f4").tobytes()
        bits = f.view(np.uint32).astype(np.uint64)
        out = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        out[np.isnan(f).reshape(out.shape)] = 0x7FC0
        return out.astype("<u2").tobytes()


# --------------------------------------------------------------------------- cache and fsync helpers


def drop_cache(fd):
    """Best effort: evict a file's clean pages, so reads measure the disk, not RAM."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


VLLM_FORMAT = "vllm-hidden-states/1"
VLLM_FORMAT_FP8 = "vllm-hidden-states/2"  # the same in FP8 storage (hidden_states e4m3 + hidden_states_scale)


def is_vllm_source(header, meta):
    """A file vLLM's hidden-state connector wrote: `token_ids` I64 [S], `hidden_states` [S, L, H]."""
    return meta.get("format") in (VLLM_FORMAT, VLLM_FORMAT_FP8) or ("token_ids" in header and "input_ids" not in header)


def check_vllm_source(header, tokens, meta=None):
    """(n, L, h, dtype) of a vLLM file that holds the 3 aux states and the final state for `tokens`
    (FP8 storage: `hidden_states_scale` [S, L] besides, dtype the one the values decode to)."""
    fp8 = is_fp8_source(header, meta or {})
    want = {"token_ids", "hidden_states", "hidden_states_scale"} if fp8 else {"token_ids", "hidden_states"}
    if set(header) != want:
        raise ExportError("tensors %s, expected %s (vLLM)" % (sorted(header), sorted(want)))
    hs, ids = header["hidden_states"], header["token_ids"]
    if len(hs["shape"]) != 3 or ids["dtype"] != "I64" or ids["shape"] != [hs["shape"][0]]:
        raise ExportError("vLLM file: hidden_states %s, token_ids %s %s" % (hs["shape"], ids["dtype"], ids["shape"]))
    n, count, h = hs["shape"]
    if count != AUX_STATES + 1:
        raise ExportError(
            "hidden_states holds %d captured layers, the drafter needs %d (3 aux + the final state)%s"
            % (
                count,
                AUX_STATES + 1,
                ": a layer was dropped (vLLM's N-1 bug, PR #46973)" if count == AUX_STATES else "",
            )
        )
    if n != tokens:
        raise ExportError("hidden_states %s does not match %d dataset tokens" % (hs["shape"], tokens))
    if fp8:
        if header["hidden_states_scale"]["shape"] != [n, count]:
            raise ExportError(
                "hidden_states_scale %s, want [%d, %d]" % (header["hidden_states_scale"]["shape"], n, count)
            )
        return n, count, h, fp8_out_dtype(meta or {})
    if hs["dtype"] not in STORAGE:
        raise ExportError("dtype %s not supported" % hs["dtype"])
    return n, count, h, hs["dtype"]


def split_layers(data, n, count, h, size):
    """[S, L, H] bytes -> (aux [S, (L-1)H], final [S, H]) bytes: the first L-1 layers of each token
    are its aux states in the order asked, the last its final state."""
    row, aux_len = count * h * size, (count - 1) * h * size
    view = memoryview(data)
    aux = b"".join(view[t * row : t * row + aux_len] for t in range(n))
    final = b"".join(view[t * row + aux_len : (t + 1) * row] for t in range(n))
    return aux, final


def _convert_vllm(fin, fout, digest, header, ids, mask, norm, raw, meta=None):
    """One vLLM file -> one SpecForge record set: hidden_state = the last captured layer (through the
    final RMSNorm with `norm`), aux_hidden_state = the aux layers concatenated; token ids checked.
    FP8 storage: the layers decoded to the model dtype first."""
    n, count, h, dtype = check_vllm_source(header, len(ids), meta)
    end = max(e["data_offsets"][1] for e in header.values())
    data = _read_exact(fin, end)
    digest.update(data)
    a, b = header["token_ids"]["data_offsets"]
    if data[a:b] != struct.pack("<%dq" % len(ids), *ids):
        raise ExportError("token ids in the dump differ from the dataset sample")
    a, b = header["hidden_states"]["data_offsets"]
    rows = data[a:b]
    if is_fp8_source(header, meta or {}):
        sa, sb = header["hidden_states_scale"]["data_offsets"]
        rows = decode_fp8(rows, data[sa:sb], count, count * h, dtype, numpy_or_none())
    aux, final = split_layers(rows, n, count, h, DTYPE_SIZE[dtype])
    _write_states(fout, (n, h, dtype), ids, mask, final, aux, norm, raw)
    return end


# --------------------------------------------------------------------------- one sample


def convert(sources, dest, ids, mask, fsync=True, norm=None):
    """Stream the dump file(s) of one sample into one SpecForge .ckpt; publish only if every sha256 matches.

    `sources` = [(path, manifest sha256)] in token order: one file for a whole
    prompt, several for a prompt that chunked prefill split into spans (`-p0`,
    `-p<c1>`, ...). One file is hashed while it is converted (one read); split
    prompts are hashed first, then converted (two reads, a minority of samples).
    With `norm` (a FinalNorm) each hidden_state row goes through the model's final RMSNorm.
    Returns (source bytes read, output bytes). Raises ExportError (temp file removed).
    """
    tmp = os.path.join(os.path.dirname(dest), ".tmp-" + os.path.basename(dest))
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    try:
        with open(tmp, "wb") as fout:
            read = (
                _one_source(sources[0], fout, ids, mask, norm)
                if len(sources) == 1
                else _many_sources(sources, fout, ids, mask, norm)
            )
            fout.flush()
            if fsync:
                os.fsync(fout.fileno())
            out_bytes = fout.tell()
        os.replace(tmp, dest)
        if fsync:
            fsync_dir(os.path.dirname(dest))
        return read, out_bytes
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _one_source(source, fout, ids, mask, norm=None):
    path, expected = source
    digest = hashlib.sha256()
    with open_source(path) as fin:
        drop_cache(fin.fileno())
        read = _convert_stream(fin, fout, digest, ids, mask, norm)
    if digest.hexdigest() != expected:
        raise ExportError("sha256 of the dump file differs from its manifest line")
    return read


def _many_sources(sources, fout, ids, mask, norm=None):
    """Verify every part, then write one sample from their spans in token order."""
    read, parts, offset = 0, [], 0
    for path, expected in sources:
        read += _verify_sha(path, expected)
        with open_source(path) as fh:
            hlen, header, meta = read_header(fh)
        n = header["input_ids"]["shape"][0]
        check_source(header, meta, n, norm is not None)
        parts.append((path, hlen, header, ids[offset : offset + n], meta if is_fp8_source(header, meta) else None))
        offset += n
    if offset != len(ids):
        raise ExportError("the spans cover %d tokens, the sample has %d" % (offset, len(ids)))
    return read + _write_parts(parts, fout, ids, mask, norm)


def _verify_sha(path, expected):
    digest, size = hashlib.sha256(), 0
    with open_source(path) as fin:
        drop_cache(fin.fileno())
        for chunk in iter(lambda: fin.read(CHUNK), b""):
            digest.update(chunk)
            size += len(chunk)
    if digest.hexdigest() != expected:
        raise ExportError("sha256 of %s differs from its manifest line" % os.path.basename(path))
    return size


def _write_parts(parts, fout, ids, mask, norm=None):
    h = parts[0][2]["hidden_states"]["shape"][1]
    dtype = parts[0][2]["hidden_states"]["dtype"]
    if any(p[2]["hidden_states"]["shape"][1] != h or p[2]["hidden_states"]["dtype"] != dtype for p in parts):
        raise ExportError("the spans of this sample differ in hidden size or dtype")
    if parts[0][4] is not None:
        return _write_fp8_parts(parts, fout, ids, mask, norm)
    n = len(ids)
    z = _begin(fout, n, h, dtype, ids, mask)
    read = 0
    for name, record in (("hidden_states", "data/2"), ("aux_hidden_states", "data/3")):
        total = sum(p[2][name]["data_offsets"][1] - p[2][name]["data_offsets"][0] for p in parts)
        with z.open(record, total) as dst:
            for path, hlen, header, _part_ids, _meta in parts:
                if norm is not None and name == "hidden_states":
                    a, b = header[name]["data_offsets"]
                    with open_source(path) as fin:
                        fin.seek(8 + hlen + a)
                        dst.write(norm.apply(_read_exact(fin, b - a), dtype, h))
                    read += b - a
                else:
                    read += _copy_range(path, 8 + hlen, header[name]["data_offsets"], dst)
    _check_part_ids(parts)
    _finish(z, hashlib.sha256(json.dumps([original_name(p[0]) for p in parts]).encode()).hexdigest())
    return read


def _write_fp8_parts(parts, fout, ids, mask, norm=None):
    """Spans in FP8 storage: each span's data section read, its states decoded to the model dtype."""
    decoded, read = [], 0
    for path, hlen, header, _part_ids, meta in parts:
        end = max(e["data_offsets"][1] for e in header.values())
        with open_source(path) as fin:
            fin.seek(8 + hlen)
            data = _read_exact(fin, end)
        read += end
        decoded.append(decoded_states(data, header, meta, numpy_or_none()))
    dtype = decoded[0][2]
    if any(d[2] != dtype for d in decoded):
        raise ExportError("the spans of this sample decode to different dtypes")
    h = parts[0][2]["hidden_states"]["shape"][1]
    hidden = b"".join(d[0] for d in decoded)
    if norm is not None:
        hidden = norm.apply(hidden, dtype, h)
    z = _begin(fout, len(ids), h, dtype, ids, mask)
    for record, part in (("data/2", hidden), ("data/3", b"".join(d[1] for d in decoded))):
        with z.open(record, len(part)) as dst:
            dst.write(part)
    _check_part_ids(parts)
    _finish(z, hashlib.sha256(json.dumps([original_name(p[0]) for p in parts]).encode()).hexdigest())
    return read


def _check_part_ids(parts):
    """Each span's input_ids are the dataset's tokens at its place."""
    for path, hlen, header, part_ids, _meta in parts:
        start, end = header["input_ids"]["data_offsets"]
        with open_source(path) as fh:
            fh.seek(8 + hlen + start)
            if _read_exact(fh, end - start) != struct.pack("<%di" % len(part_ids), *part_ids):
                raise ExportError("token ids in %s differ from the dataset sample" % os.path.basename(path))


def _copy_range(path, base, offsets, dst):
    with open_source(path) as fin:
        fin.seek(base + offsets[0])
        return _pump(fin, dst, None, offsets[1] - offsets[0])


def _begin(fout, n, h, dtype, ids, mask):
    """The zip up to the float records: pickle, small records, ids and mask."""
    z = TorchZip(fout)
    z.write(
        "data.pkl",
        pickle_dict(
            [
                ("input_ids", "0", "I64", [n]),
                ("loss_mask", "1", "I64", [n]),
                ("hidden_state", "2", dtype, [1, n, h]),
                ("aux_hidden_state", "3", dtype, [1, n, 3 * h]),
            ]
        ),
    )
    for name, data in ((".format_version", b"1"), (".storage_alignment", b"64"), ("byteorder", b"little")):
        z.write(name, data)
    z.write("data/0", array("q", ids).tobytes())
    z.write("data/1", array("q", mask).tobytes())
    return z


def _finish(z, serialization_id):
    z.write("version", b"3\n")
    z.write(".data/serialization_id", serialization_id[:20].encode())
    z.close()


def _convert_stream(fin, fout, digest, ids, mask, norm=None):
    head = fin.read(8)
    digest.update(head)
    hlen = struct.unpack("<Q", head)[0]
    raw = fin.read(hlen)
    digest.update(raw)
    header = json.loads(raw)
    meta = header.pop("__metadata__", {}) or {}
    if is_vllm_source(header, meta):
        return 8 + hlen + _convert_vllm(fin, fout, digest, header, ids, mask, norm, raw, meta)
    n, h, dtype = check_source(header, meta, len(ids), norm is not None)
    if is_fp8_source(header, meta):
        return 8 + hlen + _convert_fp8(fin, fout, digest, header, meta, ids, mask, norm, raw)
    z = _begin(fout, n, h, dtype, ids, mask)
    read = 8 + hlen + _copy_tensors(fin, z, digest, header, ids, norm)
    _finish(z, hashlib.sha256(raw).hexdigest())
    return read


def _convert_fp8(fin, fout, digest, header, meta, ids, mask, norm, raw):
    """A dump in FP8 storage: the data section read whole (hashed), ids checked, both states decoded
    to the model dtype (the final one then through `norm`), written as the bf16 records."""
    end = max(e["data_offsets"][1] for e in header.values())
    data = _read_exact(fin, end)
    digest.update(data)
    a, b = header["input_ids"]["data_offsets"]
    if data[a:b] != struct.pack("<%di" % len(ids), *ids):
        raise ExportError("token ids in the dump differ from the dataset sample")
    n, h = header["hidden_states"]["shape"]
    hidden, aux, dtype = decoded_states(data, header, meta, numpy_or_none())
    _write_states(fout, (n, h, dtype), ids, mask, hidden, aux, norm, raw)
    return end


def _write_states(fout, shape, ids, mask, final, aux, norm, raw):
    """One sample's record: the final state (through `norm` when given) and the aux states, in
    SpecForge's order, then the record's closing with the source's sha256."""
    n, h, dtype = shape
    if norm is not None:
        final = norm.apply(final, dtype, h)
    z = _begin(fout, n, h, dtype, ids, mask)
    for record, part in (("data/2", final), ("data/3", aux)):
        with z.open(record, len(part)) as dst:
            dst.write(part)
    _finish(z, hashlib.sha256(raw).hexdigest())


def _copy_tensors(fin, z, digest, header, ids, norm=None):
    """Read the data section in file order; floats go straight into records 2 and 3 (with `norm`,
    the final state through the model's final RMSNorm first)."""
    records = {"hidden_states": "data/2", "aux_hidden_states": "data/3"}
    total = 0
    for name in sorted(header, key=lambda k: header[k]["data_offsets"][0]):
        start, end = header[name]["data_offsets"]
        if name == "hidden_states" and norm is not None:
            data = _read_exact(fin, end - start)
            digest.update(data)
            total += len(data)
            hs = header[name]
            with z.open(records[name], end - start) as dst:
                dst.write(norm.apply(data, hs["dtype"], hs["shape"][1]))
        elif name in records:
            with z.open(records[name], end - start) as dst:
                total += _pump(fin, dst, digest, end - start)
        else:
            data = _read_exact(fin, end - start)
            digest.update(data)
            total += len(data)
            if name == "input_ids" and data != struct.pack("<%di" % len(ids), *ids):
                raise ExportError("token ids in the dump differ from the dataset sample")
    return total


def _pump(fin, dst, digest, size):
    left = size
    while left:
        chunk = fin.read(min(CHUNK, left))
        if not chunk:
            raise ExportError("dump file is shorter than its header says")
        if digest is not None:
            digest.update(chunk)
        dst.write(chunk)
        left -= len(chunk)
    return size


def _read_exact(fin, size):
    data = fin.read(size)
    if len(data) != size:
        raise ExportError("dump file is shorter than its header says")
    return data


# --------------------------------------------------------------------------- bandwidth probe


def copy_probe(sources, out_dir, jobs, fsync=True):
    """Copy `sources` (parallel, page cache dropped, fsynced, then deleted): bytes and seconds."""

    def one(i_src):
        i, src = i_src
        tmp = os.path.join(out_dir, ".tmp-probe-%d" % i)
        try:
            with open(src, "rb", buffering=0) as fin, open(tmp, "wb") as fout:
                drop_cache(fin.fileno())
                n = 0
                while True:
                    chunk = fin.read(CHUNK)
                    if not chunk:
                        break
                    fout.write(chunk)
                    n += len(chunk)
                fout.flush()
                if fsync:
                    os.fsync(fout.fileno())
            return n
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        total = sum(pool.map(one, enumerate(sources)))
    return total, time.monotonic() - t0


def probe_sample(paths, budget):
    """The first files whose sizes add up to `budget` bytes (at least one)."""
    chosen, acc = [], 0
    for p in paths:
        if acc >= budget and chosen:
            break
        chosen.append(p)
        acc += os.path.getsize(p)
    return chosen


# --------------------------------------------------------------------------- plan


def latest_manifest(dump_dir, rank=0):
    """key -> last manifest record of `rank<R>/manifest.jsonl`."""
    latest = {}
    for rec in _json_lines(os.path.join(dump_dir, "rank%d" % rank, "manifest.jsonl")):
        if isinstance(rec, dict) and "key" in rec:
            latest[rec["key"]] = rec
    return latest


def _json_lines(path):
    """Each line of the JSONL file at `path` that parses (a torn or garbled line is passed over)."""
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                yield json.loads(line)
            except ValueError:
                continue


def read_done(out_dir):
    """index -> export record, for records whose output file is present at the recorded size."""
    done, path = {}, os.path.join(out_dir, EXPORT_MANIFEST)
    if not os.path.exists(path):
        return done
    for rec in _json_lines(path):
        f = os.path.join(out_dir, rec.get("file", ""))
        if os.path.isfile(f) and os.path.getsize(f) == rec.get("bytes"):
            done[rec["index"]] = rec
    return done


def span_lengths(manifest):
    """prefix_len -> token counts (descending) of the spans dumped at that offset."""
    lengths = {}
    for rec in manifest.values():
        lengths.setdefault(int(rec.get("prefix_len", 0)), set()).add(int(rec["tokens"]))
    return {p: sorted(v, reverse=True) for p, v in lengths.items()}


def find_spans(ids, manifest, lengths):
    """The dump records that cover `ids` in token order: the whole prompt (`-p0`), or the spans chunked
    prefill made of it (`-p0`, `-p<c1>`, ...), matched by key; None when no chain covers the prompt."""
    whole = manifest.get(dump_key(ids, 0))
    if whole is not None:
        return [whole]
    raw = struct.pack("<%di" % len(ids), *ids)
    return _chain(raw, 0, len(ids), manifest, lengths, depth=0)


def _chain(raw, offset, n, manifest, lengths, depth):
    if offset == n:
        return []
    if depth > 64:
        return None
    for rec in _matches_at(raw, offset, n, manifest, lengths.get(offset, ())):
        rest = _chain(raw, offset + int(rec["tokens"]), n, manifest, lengths, depth + 1)
        if rest is not None:
            return [rec] + rest
    return None


def _matches_at(raw, offset, n, manifest, candidates):
    """Records whose key is the span ids[offset:offset+t] at prefix `offset`, longest first.

    One incremental sha256 over the ids (copied at each candidate length) keeps this O(n + candidates).
    """
    cuts = sorted(t for t in candidates if 0 < t <= n - offset)
    h, pos, found = hashlib.sha256(), offset, []
    for t in cuts:
        h.update(raw[4 * pos : 4 * (offset + t)])
        pos = offset + t
        rec = manifest.get("%s-p%d" % (h.copy().hexdigest()[:32], offset))
        if rec is not None:
            found.append(rec)
    return found[::-1]


def plan(dataset, manifest, done, mask_all=False):
    """(todo [(index, sample, [records])], missing [{index,id,reason}], skipped count)."""
    todo, missing, skipped = [], [], 0
    lengths = span_lengths(manifest)
    with open(dataset, encoding="utf-8") as fh:
        for index, line in enumerate(fh):
            if not line.strip():
                continue
            sample = json.loads(line)
            ids = sample.get("input_ids") or sample.get("token_ids")
            sid = sample.get("id", index)
            if "loss_mask" not in sample and not mask_all:
                raise ExportError(
                    "sample %s (line %d) has no loss_mask: run `remote-ops dataset prepare`, "
                    "or pass --mask-all" % (sid, index + 1)
                )
            if index in done:
                skipped += 1
                continue
            recs = find_spans(ids, manifest, lengths)
            if recs is None:
                missing.append({"index": index, "id": sid, "reason": "no dump (whole or in spans) for these token ids"})
                continue
            mask = sample.get("loss_mask") or [1] * len(ids)
            todo.append((index, {"id": sid, "ids": ids, "mask": mask}, recs))
    return todo, missing, skipped


# --------------------------------------------------------------------------- the run


class Run:
    """Counters shared by the worker threads, and the JSON-lines output."""

    def __init__(self, out_dir, total):
        self.lock = threading.Lock()
        self.out_dir, self.total = out_dir, total
        self.files = self.read = self.written = 0
        self.failed = []
        self.t0 = time.monotonic()
        self.last = 0.0

    def emit(self, **doc):
        with self.lock:
            sys.stdout.write(json.dumps(doc, sort_keys=True) + "\n")
            sys.stdout.flush()

    def ok(self, index, sample, recs, read, out_bytes, fsync, final_norm="as dumped"):
        line = (
            json.dumps(
                {
                    "final_norm": final_norm,
                    "index": index,
                    "id": sample["id"],
                    "keys": [r["key"] for r in recs],
                    "file": out_name(index),
                    "bytes": out_bytes,
                    "tokens": len(sample["ids"]),
                    "sources": [r["file"] for r in recs],
                    "source_sha256": [source_sha256(r) for r in recs],
                },
                sort_keys=True,
            )
            + "\n"
        )
        with self.lock:
            fd = os.open(os.path.join(self.out_dir, EXPORT_MANIFEST), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            self.files += 1
            self.read += read
            self.written += out_bytes
        self.progress()

    def progress(self, force=False):
        now = time.monotonic()
        if force or now - self.last >= 2.0:
            self.last = now
            self.emit(
                event="progress",
                files=self.files,
                total=self.total,
                bytes_read=self.read,
                seconds=round(now - self.t0, 3),
            )


def export(args):
    manifest = latest_manifest(args.dump_dir, args.rank)
    done = read_done(args.out) if os.path.isdir(args.out) else {}
    todo, missing, skipped = plan(args.dataset, manifest, done, args.mask_all)
    if args.limit is not None:
        todo = todo[: args.limit]
    if args.plan_only:
        return emit_plan(todo, missing, skipped, args)
    os.makedirs(args.out, exist_ok=True)
    fsync = not args.no_fsync
    sources = [os.path.join(args.dump_dir, recs[0]["file"]) for _, _, recs in todo]
    sample = probe_sample(sources, args.probe_mb << 20) if sources and args.probe_mb > 0 else []
    probes = [copy_probe(sample, args.out, args.jobs, fsync)] if sample else []
    norm = FinalNorm(args.convert_prenorm) if args.convert_prenorm else None
    said = "as dumped" if norm is None else "converted from pre-norm with %s (eps %g)" % (norm.name, norm.eps)
    run = Run(args.out, len(todo))
    run.emit(event="started", todo=len(todo), skipped=skipped, missing=len(missing), final_norm=said)

    def one(item):
        index, sample, recs = item
        try:
            sources = [(os.path.join(args.dump_dir, r["file"]), source_sha256(r)) for r in recs]
            read, out_bytes = convert(
                sources, os.path.join(args.out, out_name(index)), sample["ids"], sample["mask"], fsync, norm
            )
            run.ok(index, sample, recs, read, out_bytes, fsync, said)
        except (ExportError, OSError, ValueError, KeyError) as exc:
            with run.lock:
                run.failed.append(
                    {
                        "index": index,
                        "id": sample["id"],
                        "file": " + ".join(r["file"] for r in recs),
                        "reason": str(exc),
                    }
                )

    run.t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(one, todo))
    seconds = time.monotonic() - run.t0
    probes += [copy_probe(sample, args.out, args.jobs, fsync)] if sample else []
    run.progress(force=True)
    run.emit(
        **report(run, seconds, probes, skipped, missing, args),
        split_samples=sum(1 for _, _, recs in todo if len(recs) > 1),
        final_norm=said,
    )
    return 1 if run.failed else 0


def emit_plan(todo, missing, skipped, args):
    """--plan-only: what a run would do; nothing is written."""
    doc = {
        "event": "plan",
        "out": args.out,
        "todo": len(todo),
        "skipped_done": skipped,
        "missing": missing[:50],
        "missing_count": len(missing),
        "bytes_to_read": sum(int(r.get("bytes", 0)) for _, _, recs in todo for r in recs),
        "split_samples": sum(1 for _, _, recs in todo if len(recs) > 1),
        "tokens": sum(len(sample["ids"]) for _, sample, _ in todo),
    }
    sys.stdout.write(json.dumps(doc, sort_keys=True) + "\n")
    return 0


def report(run, seconds, probes, skipped, missing, args):
    """The final document; the disk anchor is the faster of the probes before and after the export."""
    mbps = run.read / seconds / 1e6 if seconds > 0 and run.read else None
    rates = [b / t / 1e6 for b, t in probes if t > 0]
    probe_mbps = max(rates) if rates else None
    probe = max(probes, key=lambda p: p[0] / p[1] if p[1] > 0 else 0) if probes else (0, 0.0)
    return {
        "event": "done",
        "out": args.out,
        "exported": run.files,
        "skipped_done": skipped,
        "missing": missing[:50],
        "missing_count": len(missing),
        "failed": run.failed,
        "bytes_read": run.read,
        "bytes_written": run.written,
        "seconds": round(seconds, 3),
        "mb_per_s": round(mbps, 1) if mbps else None,
        "jobs": args.jobs,
        "fsync": not args.no_fsync,
        "disk_copy_probe": {
            "bytes": probe[0],
            "seconds": round(probe[1], 3),
            "mb_per_s": round(probe_mbps, 1) if probe_mbps else None,
            "runs_mb_per_s": [round(r, 1) for r in rates],
        },
        "ratio_to_disk": round(mbps / probe_mbps, 3) if mbps and probe_mbps else None,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(prog="specforge_export.py")
    ap.add_argument("action", choices=["export"])
    ap.add_argument("--dump-dir", required=True)
    ap.add_argument("--dataset", required=True, help="the prepared JSONL the extraction used")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--probe-mb", type=int, default=1024, help="bytes of source files copied to measure the disk")
    ap.add_argument("--mask-all", action="store_true", help="no loss_mask in the dataset: mask every token")
    ap.add_argument("--no-fsync", action="store_true", help="tests only: skip fsyncs")
    ap.add_argument("--plan-only", action="store_true", help="report what would be exported; write nothing")
    ap.add_argument(
        "--convert-prenorm",
        default=None,
        metavar="MODEL_DIR",
        help="apply this model's final RMSNorm to each hidden_state (the dumps hold pre-norm finals)",
    )
    args = ap.parse_args(argv)
    try:
        return export(args)
    except (ExportError, OSError, ValueError) as exc:
        sys.stdout.write(json.dumps({"event": "error", "error": str(exc)}) + "\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
