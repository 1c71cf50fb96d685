#!/usr/bin/env python3
"""Dump audit: runs ON the host (stdlib, Python 3.8+; numpy when the python has it, never torch).

Shipped on stdin like `dumper/dumpfile.py`; nothing is installed and the dumps never travel.

`audit` runs in the served image's python (a throwaway container of the image the
server runs, the dump dir, model dir, extraction work dir and dataset mounted read-only,
no network).  For N sampled dumps of the extraction run (seeded, stratified over the
run in the client manifest's order: the run cut into N equal strata, one sample drawn
in each) it checks:

- shape: 3 aux states plus the final state, hidden size = the model's config.json,
  tokens = the sample's tokens (dataset, client manifest and dump manifest agree);
- finite: NaN and Inf counts per tensor (SpecForge skips such samples silently);
- alignment: the dump's token ids are the dataset's for its key, and the dataset line's
  loss_mask (what `dumps export` joins by key) has the same length; a line without one is
  a warning naming --mask-all (a property of the dataset, not of the capture);
- token: argmax(lm_head . hidden_states[last]) = the `generated_token` the server
  answered (temperature 0) on the client's `ok` line; `lm_head.weight` (or the tied
  embedding) is read alone through the safetensors index, in row blocks, once for all
  samples.  The same logits are taken of the final state with the model's final
  RMSNorm applied: a dump that matches only then holds PRE-norm finals;
- the layer ids each file records (judged on the laptop, against the drafter config
  and the serving SGLang release's convention).

A dump in FP8 storage (`dump.storage: fp8_e4m3`: e4m3 values, a float32 scale per token and
layer, metadata `storage = fp8_e4m3_rowscale`; FORMAT.md "FP8 storage (version 2)") is decoded
to its model dtype first, by the decoder `dumps export` uses (`dumper/fp8read.py`, bundled
before this program as `rops_fp8`), and every check runs on the decoded values: what SpecForge
will read.  Its scales must be F32 [n, 1] / [n, 3] (vLLM: [S, L]).  The token check allows it
the rounding: the server's token also matches when its logit is within FP8_SIGMAS standard
deviations of what e4m3 rounding of the stored final state alone moves the gap to the argmax
(`fp8_allowance`, reported per sample); the norm verdict is judged the same way.

A vLLM file (`token_ids` int64 [S], `hidden_states` [S, L, H], metadata `layer_ids`, format
`vllm-hidden-states/1`, moved to `rank0/<key>.safetensors` by the extraction client) gets the
same checks: L must be 4 (the 3 aux layers, then the final state); a file one layer short is
named as vLLM's N-1 bug (DeepSeek-V2 models, fixed by vllm-project/vllm PR #46973); its ids
must be the dataset's; its last layer at the last position is the final state of the token
check (vLLM's final state is asked as layer id L: the check says pre- or post-norm; vLLM's model files append layer L before the final RMSNorm, so
pre-norm is what they hold, reported as expected, not as a fault).  Its aux
ids are recorded as layers_to_capture (the state entering layer i, SGLang's numbering).

`contract` runs with the host's own python3 (headers only): the recorded contract
(layers, eagle ids, hidden size, aux states, dtype, norm label) of a few dumps spread
over the manifest; `train start` and `spec deploy` compare a drafter with it.

`norm-check` is `audit` over 8 samples by default: `dumps export` reads its norm
verdict before it converts pre-norm finals or refuses them.

Every file it opens is checked first and read with a cap: inside the dump dir (`Rel`) no
component is followed and only a regular file is opened (O_NONBLOCK|O_NOFOLLOW, then fstat),
so a FIFO, a device or a symlink named like a dump fails THAT sample ("not a regular file (a
FIFO)"); a header nested too deeply, data_offsets that are negative, not whole numbers or past
the file's end fail it too: nothing is allocated beyond the file's own size, and one bad dump
never ends the run.  Files outside it (model, work dir, dataset) may be reached through
symlinks but must be regular files.  `--deadline S` ends the program after S seconds (and on
SIGTERM) with an error document and exit 3, whatever it is blocked in: as a container's PID 1
it has no default action for those signals.

Each prints one JSON document on stdout (`{"error": ...}` and exit 2 when it cannot run).
"""

import argparse
import hashlib
import json
import math
import os
import random
import signal
import stat
import struct
import sys
import time
from array import array

SUFFIX = ".safetensors"
PACKED_SUFFIX = ".hsz"  # a compacted dump file (packed.py; FORMAT.md "Packed files")
INDEX = "model.safetensors.index.json"
AUX_STATES = 3
VLLM_FORMAT = "vllm-hidden-states/1"  # vLLM's per-request file as the project's connector writes it
VLLM_FORMAT_FP8 = "vllm-hidden-states/2"  # the same in FP8 storage (e4m3 hidden_states + hidden_states_scale [S, L])
TENSORS = ("hidden_states", "aux_hidden_states", "input_ids", "positions")
FP8_STORAGE = "fp8_e4m3_rowscale"  # metadata `storage` of FP8 storage (FORMAT.md "FP8 storage (version 2)")
FP8_DTYPE = "F8_E4M3"
FLOAT_SIZE = {"BF16": 2, "F16": 2, "F32": 4}
LM_HEAD_BLOCK = 8192  # lm_head rows decoded at a time (bounded memory: 8192 x H floats)
NEAR_TIE = 1e-2  # relative: the server's token within this of the max logit still matches
# FP8 storage: the server's token also matches when the logit gap is within FP8_SIGMAS standard
# deviations of what e4m3 rounding of the stored final state alone moves it (`fp8_allowance`): a
# near tie that 3 mantissa bits cannot resolve is no evidence against the capture, while a state
# from another position or layer misses by many times that
FP8_SIGMAS = 4.0


class AuditError(Exception):
    """The audit cannot run at all (no manifest, no config.json, no lm_head); the message says why."""


# --------------------------------------------------------------------------- small readers


def dump_key(ids, prefix_len=0):
    """The dump contract's key: sha256 of int32 LE ids, 32 hex chars, `-p<prefix>`."""
    return "%s-p%d" % (hashlib.sha256(struct.pack("<%di" % len(ids), *ids)).hexdigest()[:32], prefix_len)


class NotRegular(ValueError):
    """A path the audit will not read: not a regular file (a FIFO, a device, a symlink inside the
    dump dir); the message says what it is."""


class Rel:
    """`name` inside the dump dir `root` (already resolved on the host): opened component by
    component, none of them followed (a symlinked entry is not a regular file)."""

    def __init__(self, root, name):
        self.root, self.name = root, name

    def __str__(self):
        return self.name


KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
    stat.S_IFLNK: "a symlink: entries of the dump dir are never followed",
}
JSON_CAP = 64 << 20  # config.json, the safetensors index, run.json
LINE_CAP = 64 << 20  # one line of a manifest or the dataset (longer lines are skipped)
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def not_regular(mode, where=None):
    what = KINDS.get(stat.S_IFMT(mode), "not a regular file")
    if where:
        return NotRegular("not a regular file (%s is %s)" % (where, what))
    return NotRegular("not a regular file (%s)" % what)


def open_regular(path):
    """(binary file object, size) of a regular file, checked before it is opened and again after:
    never blocks on a FIFO, never opens a device.  A `Rel` is opened inside its dump dir with no
    component followed; a plain path may pass symlinks (a model dir in a Hugging Face cache) but
    must end at a regular file.  The caller reads at most `size` bytes."""
    if isinstance(path, Rel):
        fh, size = _open_inside(path.root, path.name)
        return _decoded(fh, size) if str(path.name).endswith(PACKED_SUFFIX) else (fh, size)
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise not_regular(st.st_mode)
    return _checked(os.open(path, os.O_RDONLY | os.O_NONBLOCK | O_CLOEXEC))


packed = sys.modules.get("rops_packed")  # the packed-dump codec, bundled before this program (onhost.with_codec)


def _fp8_codec():
    """The FP8-storage decoder (`dumper/fp8read.py`, the one `dumps export` decodes with): bundled
    before this program (`onhost.with_codec`, module `rops_fp8`), else, run from a checkout, the
    file itself; None without either (an FP8 dump then fails its own sample, saying so)."""
    mod = sys.modules.get("rops_fp8")
    here = globals().get("__file__")
    path = here and os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(here))), "dumper", "fp8read.py")
    if mod is None and path and os.path.isfile(path):
        import importlib.util

        spec = importlib.util.spec_from_file_location("rops_fp8", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules["rops_fp8"] = mod
    return mod


fp8read = _fp8_codec()


def _decoded(fh, size):
    """A compacted dump file (`<key>.hsz`, opened and checked regular) read as its original bytes:
    (a file object over the decoded bytes, their size); every block is CRC-checked as it is read."""
    if packed is None:
        fh.close()
        raise ValueError("a packed dump file, and this auditor has no packed-dump codec")
    pf = packed.PackedFile(fh)  # closes fh when it raises
    return pf, pf.source_bytes


def _checked(fd):
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise not_regular(st.st_mode)
        return os.fdopen(fd, "rb"), st.st_size
    except BaseException:
        os.close(fd)
        raise


def _open_inside(root, name):
    parts = str(name).split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise NotRegular("not a name inside the dump dir")
    fd = os.open(root, os.O_RDONLY | O_DIRECTORY | O_CLOEXEC)
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            st = os.stat(part, dir_fd=fd, follow_symlinks=False)
            if last and not stat.S_ISREG(st.st_mode):
                raise not_regular(st.st_mode)
            if not last and not stat.S_ISDIR(st.st_mode):
                raise not_regular(st.st_mode, "/".join(parts[: i + 1]))
            flags = os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC | (os.O_NONBLOCK if last else O_DIRECTORY)
            try:
                nfd = os.open(part, flags, dir_fd=fd)
            except OSError as exc:  # swapped for a symlink since the stat (ELOOP)
                raise NotRegular("not a regular file (%s)" % exc.strerror) from None
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return _checked(fd)


def read_bytes(path, cap):
    """A regular file's bytes, at most `cap` (more is a ValueError naming both sizes)."""
    fh, size = open_regular(path)
    with fh:
        if size > cap:
            raise ValueError("%d bytes, more than the %d the audit reads" % (size, cap))
        return fh.read(size)


def loads(raw):
    """json.loads, a document nested too deeply being a ValueError like any other non-JSON."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("not JSON the audit reads: nested too deeply") from None


def read_json(path, cap=JSON_CAP):
    return loads(read_bytes(path, cap).decode("utf-8"))


def read_lines(path):
    """The lines of a regular file, each at most LINE_CAP bytes (a longer one is read past and
    given as None, so line numbers stay the file's)."""
    fh, size = open_regular(path)
    with fh:
        left = size
        while left > 0:
            raw = fh.readline(min(LINE_CAP + 1, left))
            if not raw:
                return
            left -= len(raw)
            if len(raw) > LINE_CAP:
                while raw and not raw.endswith(b"\n") and left > 0:  # the rest of the long line
                    raw = fh.readline(min(LINE_CAP, left))
                    left -= len(raw)
                yield None
                continue
            yield raw


def jsonl(path):
    """Readable JSON-object lines of a file, in order (torn or foreign lines skipped; no file:
    none).  A path that is not a regular file is a NotRegular error."""
    out = []
    try:
        lines = list(read_lines(path))
    except FileNotFoundError:
        return out
    for raw in lines:
        if raw is None:
            continue
        try:
            rec = loads(raw.decode("utf-8"))
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def read_header(path):
    """(data start, {name: entry}, metadata) of a safetensors file (a regular file; its header
    at most 100 MB and inside the file)."""
    fh, size = open_regular(path)
    with fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError("shorter than 8 bytes")
        (length,) = struct.unpack("<Q", head)
        if length > 100 << 20:
            raise ValueError("header length %d is implausible" % length)
        if 8 + length > size:
            raise ValueError("header length %d is past the end of the file (%d bytes)" % (length, size))
        try:
            header = json.loads(fh.read(length))
        except RecursionError:
            raise ValueError("the header is nested too deeply to be a safetensors header") from None
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise ValueError("__metadata__ is not a JSON object")
    return 8 + length, header, meta


def span(entry, start, size):
    """(first, last) byte of a tensor's data in its file, checked: two whole numbers, not
    negative, in order, inside the file of `size` bytes."""
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if not isinstance(offsets, list) or len(offsets) != 2:
        raise ValueError("data_offsets %s: not two offsets" % json.dumps(offsets))
    said = json.dumps(offsets)
    if not all(type(x) is int for x in offsets):
        raise ValueError("data_offsets %s: not whole numbers" % said)
    a, b = offsets
    if a < 0 or b < 0:
        raise ValueError("data_offsets %s: negative" % said)
    if b < a:
        raise ValueError("data_offsets %s: ends before it starts" % said)
    if start + b > size:
        raise ValueError("data_offsets %s: past the end of the file (%d bytes)" % (said, size))
    return start + a, start + b


def read_range(path, start, entry):
    """One tensor's bytes: never more than the file holds (its offsets are checked first)."""
    fh, size = open_regular(path)
    with fh:
        first, last = span(entry, start, size)
        fh.seek(first)
        data = fh.read(last - first)
    if len(data) != last - first:
        raise ValueError("file shorter than its header says")
    return data


def shape_of(entry, dims):
    """A tensor's shape: `dims` whole non-negative numbers, or a ValueError."""
    shape = entry.get("shape") if isinstance(entry, dict) else None
    if not isinstance(shape, list) or len(shape) != dims or not all(type(x) is int and x >= 0 for x in shape):
        raise ValueError("shape %s is not %d whole numbers" % (json.dumps(shape), dims))
    return shape


def meta_list(meta, name):
    try:
        value = json.loads(meta.get(name, "null"))
    except ValueError:
        return None
    return [int(i) for i in value] if isinstance(value, list) else None


# --------------------------------------------------------------------------- floats (numpy or stdlib)


class Floats:
    """Decoding and counting of float tensors: numpy when importable (and not refused), else stdlib."""

    def __init__(self, use_numpy=True):
        self.np = None
        if use_numpy:
            try:
                import numpy

                self.np = numpy
            except ImportError:
                pass

    def decode(self, data, dtype):
        """Float values of raw little-endian bytes: a numpy float32 array, or an array('f') / list."""
        np = self.np
        if np is not None:
            if dtype == "BF16":
                return (np.frombuffer(data, "<u2").astype(np.uint32) << 16).view(np.float32)
            return np.frombuffer(data, "<f2" if dtype == "F16" else "<f4").astype(np.float32)
        if dtype == "BF16":
            out = bytearray(2 * len(data))
            out[2::4], out[3::4] = data[0::2], data[1::2]
            return array("f", bytes(out))
        if dtype == "F16":
            return list(struct.unpack("<%de" % (len(data) // 2), data))
        return array("f", data)

    def nonfinite(self, data, dtype, width):
        """(NaN count, Inf count, first affected row) of raw float bytes with rows of `width`."""
        np = self.np
        if np is not None:
            values = self.decode(data, dtype)
            nan, inf = np.isnan(values), np.isinf(values)
            n_nan, n_inf = int(nan.sum()), int(inf.sum())
            first = int(np.argmax(nan | inf)) // width if n_nan or n_inf else None
            return n_nan, n_inf, first
        if dtype in ("BF16", "F16"):
            return _nonfinite_half(data, dtype, width)
        values = self.decode(data, dtype)
        bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
        n_nan = sum(1 for i in bad if math.isnan(values[i]))
        return n_nan, len(bad) - n_nan, (bad[0] // width if bad else None)


def _nonfinite_half(data, dtype, width):
    """NaN/Inf of 16-bit floats at C speed (bytes.translate): the exponent bits all ones is
    NaN or Inf; a zero mantissa besides is Inf.  BF16: the high byte holds 7 exponent bits,
    the low byte the eighth and the mantissa; F16: 5 exponent bits in the high byte."""
    lo, hi = data[0::2], data[1::2]
    if dtype == "BF16":
        exp_hi = hi.translate(bytes(1 if b & 0x7F == 0x7F else 0 for b in range(256)))
        exp_lo = lo.translate(bytes(1 if b & 0x80 else 0 for b in range(256)))
        zero_man = lo.translate(bytes(1 if b & 0x7F == 0 else 0 for b in range(256)))
        man_hi = None
    else:
        exp_hi = hi.translate(bytes(1 if b & 0x7C == 0x7C else 0 for b in range(256)))
        exp_lo = None
        zero_man = lo.translate(bytes(1 if b == 0 else 0 for b in range(256)))
        man_hi = hi.translate(bytes(1 if b & 0x03 == 0 else 0 for b in range(256)))
    big = int.from_bytes(exp_hi, "little")
    if exp_lo is not None:
        big &= int.from_bytes(exp_lo, "little")
    inf_mask = big & int.from_bytes(zero_man, "little")
    if man_hi is not None:
        inf_mask &= int.from_bytes(man_hi, "little")
    n_bad, n_inf = bin(big).count("1"), bin(inf_mask).count("1")
    first = None
    if big:
        first = ((big & -big).bit_length() - 1) // 8 // width
    return n_bad - n_inf, n_inf, first


# --------------------------------------------------------------------------- the model: config, lm_head, norm


def model_config(model_dir):
    """The fields the audit needs from config.json (a `text_config` inside a wrapper counts)."""
    cfg = read_json(os.path.join(model_dir, "config.json"))
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}

    def get(name, default=None):
        return cfg.get(name, text.get(name, default))

    return {
        "architectures": cfg.get("architectures") or [],
        "hidden_size": get("hidden_size"),
        "num_hidden_layers": get("num_hidden_layers"),
        "vocab_size": get("vocab_size"),
        "rms_norm_eps": float(get("rms_norm_eps", 1e-6) or 1e-6),
        "tie_word_embeddings": bool(get("tie_word_embeddings", False)),
        "standin": bool(cfg.get("standin")),
    }


def weight_map(model_dir):
    """{tensor name: shard file} from the index, or every tensor of a lone model.safetensors."""
    index = os.path.join(model_dir, INDEX)
    if os.path.isfile(index):
        return read_json(index)["weight_map"]
    single = os.path.join(model_dir, "model" + SUFFIX)
    if os.path.isfile(single):
        return {name: "model" + SUFFIX for name in read_header(single)[1]}
    raise AuditError("%s has neither %s nor model.safetensors" % (model_dir, INDEX))


def _shortest(names, suffix, exclude=".layers."):
    hits = sorted((n for n in names if n.endswith(suffix) and exclude not in n), key=len)
    return hits[0] if hits else None


def head_and_norm(wmap, tied):
    """(the lm_head tensor's name, whether it is the tied embedding, the final norm's name)."""
    head = None if tied else _shortest(wmap, "lm_head.weight")
    is_tied = head is None
    if is_tied:
        head = _shortest(wmap, "embed_tokens.weight")
    if head is None:
        raise AuditError("no lm_head.weight (nor a tied embed_tokens.weight) in the weight map")
    return head, is_tied, _shortest(wmap, "model.norm.weight")


def tensor_where(model_dir, wmap, name):
    """(shard path, data start, header entry) of one weight (its shard's header only is read)."""
    path = os.path.join(model_dir, wmap[name])
    start, header, _ = read_header(path)
    return path, start, header[name]


def normed_err(row, err, weight, eps):
    """The e4m3 rounding bounds of a final state carried through the final RMSNorm: each scaled as
    its value is (1/rms(row) * weight_i; the rms itself moves far less than any one value)."""
    scale = 1.0 / math.sqrt(math.fsum(v * v for v in row) / max(len(row), 1) + eps)
    return [e * scale * abs(w) for e, w in zip(err, weight)]


def rms_norm(fl, row, weight, eps):
    """The model's final RMSNorm of one row (float64 when numpy, Python floats otherwise)."""
    np = fl.np
    if np is not None:
        x = np.asarray(row, dtype=np.float64)
        return x / np.sqrt(np.mean(x * x) + eps) * np.asarray(weight, dtype=np.float64)
    scale = 1.0 / math.sqrt(sum(v * v for v in row) / len(row) + eps)
    return [v * scale * w for v, w in zip(row, weight)]


class Logits:
    """Per query row: the max logit, its token, and the logit of a wanted token, over lm_head."""

    def __init__(self, n, keep=None):
        self.best = [-math.inf] * n
        self.arg = [-1] * n
        self.at = [None] * n
        # for the rows in `keep`: the lm_head rows of the argmax and of the wanted token (floats),
        # which the FP8 allowance of the token check weighs the rounding with
        self.keep = keep or [False] * n
        self.best_w = [None] * n
        self.at_w = [None] * n


def lm_head_logits(fl, path, start, entry, rows, wanted, keep=None):
    """Stream lm_head [V, H] in blocks of rows; for each query row, argmax and the logit of its
    wanted token (None: no token); for the query rows `keep` marks, those two lm_head rows too.
    Returns (Logits, bytes read)."""
    v, h = shape_of(entry, 2)
    dtype, size = entry.get("dtype"), FLOAT_SIZE.get(entry.get("dtype"))
    if size is None:
        raise AuditError("lm_head dtype %s is not a float type the audit reads" % dtype)
    out, read = Logits(len(rows), keep), 0
    np = fl.np
    exact = np is not None and h <= 1024  # small models in float64; big ones in float32 (bounded memory)
    kind = np.float64 if exact else (np.float32 if np is not None else None)
    queries = np.asarray(rows, dtype=kind).T if np is not None and rows else None  # [H, S]
    fh, file_size = open_regular(path)
    with fh:
        begin, end = span(entry, start, file_size)
        if end - begin != v * h * size:
            raise AuditError("lm_head %s %s holds %d bytes, not %d" % (dtype, [v, h], end - begin, v * h * size))
        fh.seek(begin)
        for first in range(0, v, LM_HEAD_BLOCK):
            count = min(LM_HEAD_BLOCK, v - first)
            data = fh.read(count * h * size)
            if len(data) != count * h * size:
                raise AuditError("lm_head is shorter than its shard's header says")
            read += len(data)
            if np is not None:
                weights = fl.decode(data, dtype).reshape(count, h).astype(kind)
                _take_numpy(np, out, weights @ queries, first, wanted, weights)  # [count, S]
            else:
                _take_stdlib(out, fl.decode(data, dtype), h, count, first, rows, wanted)
    return out, read


def _take_numpy(np, out, block, first, wanted, weights):
    arg = np.argmax(block, axis=0)
    for s in range(block.shape[1]):
        value = float(block[arg[s], s])
        if value > out.best[s]:
            out.best[s], out.arg[s] = value, first + int(arg[s])
            if out.keep[s]:
                out.best_w[s] = weights[arg[s]].tolist()
        t = wanted[s]
        if t is not None and first <= t < first + block.shape[0]:
            out.at[s] = float(block[t - first, s])
            if out.keep[s]:
                out.at_w[s] = weights[t - first].tolist()


def _take_stdlib(out, values, h, count, first, rows, wanted):
    for r in range(count):
        w = values[r * h : (r + 1) * h]
        for s, q in enumerate(rows):
            value = math.fsum(a * b for a, b in zip(w, q))
            if value > out.best[s]:
                out.best[s], out.arg[s] = value, first + r
                if out.keep[s]:
                    out.best_w[s] = list(w)
            if wanted[s] == first + r:
                out.at[s] = value
                if out.keep[s]:
                    out.at_w[s] = list(w)


def token_verdict(generated, best, arg, at, allowance=0.0):
    """'match' (argmax = the server's token, or a near tie, or, FP8 storage, a gap within
    `allowance`: what e4m3 rounding alone may move it), else 'mismatch'; the logit gap."""
    if at is None:
        return "mismatch", None
    gap = best - at
    tie = arg == generated or gap <= max(NEAR_TIE * max(abs(best), 1.0), allowance)
    return ("match" if tie else "mismatch"), gap


def fp8_allowance(w_best, w_gen, err):
    """How far e4m3 rounding alone may have moved the logit gap between the argmax and the server's
    token: FP8_SIGMAS standard deviations of sum_i (w_best - w_gen)_i * e_i, each rounding error e_i
    taken uniform in +-err_i (half its code step, times its scale: variance err_i^2 / 3) and
    independent of the others.  0 without the rows (argmax = the server's token)."""
    if w_best is None or w_gen is None or err is None:
        return 0.0
    var = math.fsum(((a - b) * e) ** 2 for a, b, e in zip(w_best, w_gen, err)) / 3.0
    return FP8_SIGMAS * math.sqrt(var)


# --------------------------------------------------------------------------- the run: who to sample


def dump_manifest(dump_dir):
    """key -> last manifest record over every rank dir (rank0 first)."""
    out = {}
    ranks = sorted(
        (d for d in os.listdir(dump_dir) if d.startswith("rank") and d[4:].isdigit()), key=lambda d: int(d[4:])
    )
    for rank in reversed(ranks):  # rank0's records win
        name = rank + "/manifest.jsonl"
        try:
            records = jsonl(Rel(dump_dir, name))
        except NotRegular as exc:
            raise AuditError("%s: %s" % (name, exc)) from None
        for rec in records:
            if "key" in rec and isinstance(rec.get("file"), str):
                out[str(rec["key"])] = rec
    return out


def population(workdir):
    """[(key, client record with the token)] of the current run, in the manifest's order of each
    key's first `ok` line.  The run's keys are dataset.keys (all `ok` keys when it is absent)."""
    records = jsonl(os.path.join(workdir, "manifest.jsonl"))
    if not records:
        raise AuditError("no extraction manifest at %s (run `extract start` first)" % workdir)
    keys = keys_of_run(workdir)
    current = None if keys is None else set(keys)
    order, best = [], {}
    for rec in records:
        key = rec.get("key")
        if rec.get("status") != "ok" or not key or (current is not None and key not in current):
            continue
        if key not in best:
            order.append(key)
            best[key] = rec
        elif "generated_token" in rec and "generated_token" not in best[key]:
            best[key] = rec
    return [(k, best[k]) for k in order]


def keys_of_run(workdir):
    """dataset.keys (the run's keys in the dataset's sample order), or None when there is none."""
    try:
        lines = read_lines(os.path.join(workdir, "dataset.keys"))
        return [k for k in (raw.decode("utf-8", "replace").strip() for raw in lines if raw) if k]
    except FileNotFoundError:
        return None


def stratified(n_total, n_samples, seed):
    """Positions 0..n_total-1: one drawn in each of `n_samples` equal strata (all when fewer)."""
    if n_samples >= n_total:
        return list(range(n_total))
    rng = random.Random(seed)
    return [
        rng.randrange(i * n_total // n_samples, max((i + 1) * n_total // n_samples, i * n_total // n_samples + 1))
        for i in range(n_samples)
    ]


def dataset_lines(dataset, workdir, keys):
    """{key: (line number, record)} of the dataset lines holding `keys`.  dataset.keys lists the
    run's keys in the dataset's sample order, so only those lines are parsed; without it every
    line is."""
    want = set(keys)
    by_sample = keys_of_run(workdir)
    out, sample = {}, -1
    for number, raw in enumerate(read_lines(dataset), 1):
        if raw is not None and not raw.strip():
            continue
        sample += 1
        if raw is None or by_sample is not None and (sample >= len(by_sample) or by_sample[sample] not in want):
            continue
        try:
            rec = loads(raw.decode("utf-8"))
            ids = rec.get("input_ids", rec.get("token_ids"))
            key = dump_key(ids)
        except (ValueError, TypeError, AttributeError, struct.error, OverflowError):
            continue
        if by_sample is not None and by_sample[sample] != key:
            out[by_sample[sample]] = (number, {"_changed": key})
        elif key in want:
            out[key] = (number, rec)
    return out


# --------------------------------------------------------------------------- spans (chunked prefill)


def find_spans(ids, manifest):
    """The dump records covering `ids` in token order: the whole prompt (`-p0`), or the spans
    chunked prefill cut it into (`-p0`, `-p<c1>`, ...), matched by key; None when none covers it."""
    whole = manifest.get(dump_key(ids, 0))
    if whole is not None and int(whole.get("tokens", -1)) == len(ids):
        return [whole]
    raw = struct.pack("<%di" % len(ids), *ids)
    chain, offset = [], 0
    while offset < len(ids) and len(chain) < 64:
        h, found = hashlib.sha256(), None
        for end in range(offset + 1, len(ids) + 1):
            h.update(raw[4 * (end - 1) : 4 * end])
            rec = manifest.get("%s-p%d" % (h.copy().hexdigest()[:32], offset))
            if rec is not None:
                found = (rec, end)
        if found is None:
            return [whole] if whole is not None else None
        chain.append(found[0])
        offset = found[1]
    return chain if offset == len(ids) else None


# --------------------------------------------------------------------------- one sample


class Sample:
    """What the audit found for one sampled key."""

    def __init__(self, position, key, client):
        self.position, self.key, self.client = position, key, client
        self.doc = {"key": key, "id": client.get("id"), "position": position, "tokens": client.get("tokens")}
        self.problems = {}
        self.warnings = {}
        self.last_row = None  # the final state at the last position (floats), for the token check
        self.last_err = None  # FP8 storage: how far e4m3 rounding may have moved each of its values
        self.dtype = None
        self.vllm = False  # a vLLM file: its final state is layer L, captured before the final norm

    def fail(self, check, message):
        self.problems.setdefault(check, message)

    def warn(self, check, message):
        """A finding about the sample that is not a fault of its capture (a dataset without loss_mask)."""
        self.warnings.setdefault(check, message)


def check_sample(s, dump_dir, manifest, dataset_rec, cfg, fl):
    """shape, finite, alignment (and the last row kept for the token check) of one sample."""
    hidden = cfg["hidden_size"]
    line, rec = dataset_rec if dataset_rec else (None, None)
    s.doc["line"] = line
    ids = None
    if rec is None:
        s.fail("alignment", "the dataset has no line with this key's token ids")
    elif "_changed" in rec:
        s.fail("alignment", "dataset line %d now holds other token ids (key %s)" % (line, rec["_changed"]))
    else:
        ids = rec.get("input_ids", rec.get("token_ids"))
        mask = rec.get("loss_mask")
        if mask is None:  # a property of the dataset, not of the capture: the ids are still checked
            s.warn(
                "alignment",
                "dataset line %d has no loss_mask: `dumps export` needs --mask-all (its token ids were checked)" % line,
            )
        elif not isinstance(mask, list):
            s.fail("alignment", "dataset line %d: loss_mask is not a list" % line)
        elif len(mask) != len(ids):
            s.fail("alignment", "loss_mask has %d entries, the sample %d tokens" % (len(mask), len(ids)))
    spans = find_spans(ids, manifest) if ids is not None else _spans_by_key(s.key, manifest)
    if not spans:
        s.fail("shape", "no dump file in the dump manifest for this key")
        return
    s.doc["files"] = [r["file"] for r in spans]
    got_ids, n_total, layers = [], 0, []
    for rec in spans:
        path = Rel(dump_dir, rec["file"])
        try:
            start, header, meta = read_header(path)
        except NotRegular as exc:
            s.fail("shape", "%s: %s" % (rec["file"], exc))
            return
        except (OSError, ValueError) as exc:
            s.fail("shape", "%s: cannot read its header: %s" % (rec["file"], exc))
            return
        if is_vllm_file(header, meta):
            n = _vllm_file(s, rec, path, start, header, meta, cfg, fl, got_ids, layers)
            if n is None:
                return
            n_total += n
            continue
        layers.append((meta_list(meta, "layers_to_capture"), meta_list(meta, "eagle_aux_hidden_state_layer_ids")))
        s.doc.setdefault("sglang_version", meta.get("sglang_version"))
        n = _check_shapes(s, rec, header, hidden, meta)
        if n is None:
            return
        n_total += n
        try:
            states = float_states(path, start, header, meta, fl)
            _check_finite(s, rec["file"], states, header, fl)
            got_ids += list(struct.unpack("<%di" % n, read_range(path, start, header["input_ids"])))
            if rec is spans[-1]:
                data, s.dtype = states["hidden_states"]
                h = header["hidden_states"]["shape"][1]
                s.last_row = list(fl.decode(data[(n - 1) * h * FLOAT_SIZE[s.dtype] :], s.dtype))
                if "scales" in states and n:
                    q, scales = states["scales"]
                    s.last_err = fp8read.half_ulps(
                        q[(n - 1) * h : n * h], struct.unpack_from("<f", scales, 4 * (n - 1))[0]
                    )
        except (OSError, ValueError, KeyError, struct.error) as exc:
            s.fail("shape", "%s: cannot read its tensors: %s" % (rec["file"], exc))
            return
    s.doc["layers_to_capture"], s.doc["eagle_aux_hidden_state_layer_ids"] = layers[0]
    want = s.client.get("tokens")
    if ids is not None and n_total != len(ids):
        s.fail("shape", "the dump holds %d tokens, the dataset sample %d" % (n_total, len(ids)))
    elif want is not None and n_total != int(want):
        s.fail("shape", "the dump holds %d tokens, the extraction sent %d" % (n_total, int(want)))
    if ids is not None and got_ids != list(ids) and n_total == len(ids):
        first = next(i for i, (a, b) in enumerate(zip(got_ids, ids)) if a != b)
        s.fail("alignment", "token %d: the dump has id %d, the dataset %d" % (first, got_ids[first], ids[first]))


def is_vllm_file(header, meta):
    """A file vLLM's hidden-state connector wrote (`token_ids` [S], `hidden_states` [S, L, H])."""
    return meta.get("format") in (VLLM_FORMAT, VLLM_FORMAT_FP8) or ("token_ids" in header and "input_ids" not in header)


def vllm_layers(layer_ids, num_layers):
    """(layers_to_capture, eagle ids) of a vLLM file's `layer_ids`: the aux ids are the state
    entering layer i (SGLang's layers_to_capture numbering), the last id is the final state."""
    if not layer_ids:
        return None, None
    aux = [i for i in layer_ids if num_layers is None or i < num_layers]
    return aux, [i - 1 for i in aux]


def vllm_layer_problem(name, shape, layer_ids, num_layers):
    """Why a vLLM file does not hold what an EAGLE-3 drafter needs (3 aux states + the final
    state), or None.  One layer short is vLLM's N-1 bug (DeepSeek-V2 models before PR #46973)."""
    n, count, h = shape
    need = AUX_STATES + 1
    if count < need:
        told = "" if layer_ids is None else "; its metadata layer_ids %s" % layer_ids
        return (
            "%s: hidden_states [%d, %d, %d] holds %d captured layers, the drafter needs %d (%d aux states + the "
            "final state): a layer was dropped%s (vLLM's N-1 bug on DeepSeek-V2-architecture models, "
            "vllm-project/vllm PR #46973: upgrade vLLM and extract again)"
            % (name, n, count, h, count, need, AUX_STATES, told)
        )
    if count > need:
        return "%s: hidden_states holds %d captured layers, the drafter needs %d (%d aux + final)" % (
            name,
            count,
            need,
            AUX_STATES,
        )
    if layer_ids is not None and len(layer_ids) != count:
        return "%s: metadata layer_ids %s names %d layers, hidden_states holds %d" % (
            name,
            layer_ids,
            len(layer_ids),
            count,
        )
    if layer_ids is not None and num_layers and layer_ids[-1] != num_layers:
        return "%s: the last captured layer id is %d, not %d (the model's layer count): no final state" % (
            name,
            layer_ids[-1],
            num_layers,
        )
    return None


def _vllm_file(s, rec, path, start, header, meta, cfg, fl, got_ids, layers):
    """shape, layer count, finiteness and token ids of one vLLM file (the last row of its final
    state kept for the token check); its tokens, or None after naming the problem.  FP8 storage
    (`hidden_states_scale` [S, L]) is decoded to the model dtype first."""
    name = rec["file"]
    hs, ids = header.get("hidden_states"), header.get("token_ids")
    fp8 = fp8_storage(header, meta)
    if hs is None or ids is None or (fp8 and "hidden_states_scale" not in header):
        s.fail(
            "shape",
            "%s has no %s"
            % (name, "hidden_states" if hs is None else "token_ids" if ids is None else "hidden_states_scale"),
        )
        return None
    try:
        shape_of(hs, 3), shape_of(ids, 1)
    except ValueError as exc:
        s.fail("shape", "%s: %s" % (name, exc))
        return None
    if (not fp8 and hs.get("dtype") not in FLOAT_SIZE) or ids.get("dtype") != "I64" or not hs["shape"][2]:
        s.fail("shape", "%s: hidden_states %s %s, token_ids %s" % (name, hs["dtype"], hs["shape"], ids["dtype"]))
        return None
    n, count, h = hs["shape"]
    if fp8 and fp8_problem(s, name, header, meta, {"hidden_states_scale": count}):
        return None
    layer_ids = meta_list(meta, "layer_ids")
    s.doc.setdefault("vllm_version", meta.get("vllm_version"))
    s.doc["captured_layers"] = count
    s.vllm = True
    layers.append(vllm_layers(layer_ids, cfg.get("num_hidden_layers")))
    if ids["shape"] != [n]:
        s.fail("shape", "%s: token_ids is %s for %d tokens" % (name, ids["shape"], n))
        return None
    if cfg["hidden_size"] and h != cfg["hidden_size"]:
        s.fail("shape", "%s: hidden size %d, the model's config.json says %d" % (name, h, cfg["hidden_size"]))
    problem = vllm_layer_problem(name, hs["shape"], layer_ids, cfg.get("num_hidden_layers"))
    if problem:
        s.fail("shape", problem)
    try:
        data, dtype = read_range(path, start, hs), hs["dtype"]
        if fp8:
            q, scales = data, read_range(path, start, header["hidden_states_scale"])
            dtype = fp8read.model_dtype(meta)
            data = fp8read.decode_fp8(q, scales, count, count * h, dtype, fl.np)
        nan, inf, row = fl.nonfinite(data, dtype, count * h)
        if nan or inf:
            c = s.doc.setdefault("nonfinite", {}).setdefault("hidden_states", {"nan": 0, "inf": 0})
            c["nan"] += nan
            c["inf"] += inf
            s.fail("finite", "%s: %d NaN, %d Inf in hidden_states (first at token %d)" % (name, nan, inf, row))
        got_ids += list(struct.unpack("<%dq" % n, read_range(path, start, ids)))
        if rec is not None and count >= AUX_STATES + 1 and n:
            size, at = FLOAT_SIZE[dtype], (n - 1) * count + count - 1  # the last token's last layer
            s.dtype = dtype
            s.last_row = list(fl.decode(data[at * h * size : (at + 1) * h * size], dtype))
            if fp8:
                s.last_err = fp8read.half_ulps(q[at * h : (at + 1) * h], struct.unpack_from("<f", scales, 4 * at)[0])
    except (OSError, ValueError, struct.error) as exc:
        s.fail("shape", "%s: cannot read its tensors: %s" % (name, exc))
        return None
    return n


def _spans_by_key(key, manifest):
    rec = manifest.get(key)
    return [rec] if rec is not None else None


def _check_shapes(s, rec, header, hidden, meta=None):
    """Tokens of one file, or None after naming the problem.  FP8 storage (FORMAT.md "FP8 storage"):
    e4m3 states, their float32 scales [n, 1] / [n, 3] and a model dtype to decode to."""
    fp8 = fp8_storage(header, meta or {})
    missing = [t for t in TENSORS + (FP8_SCALES if fp8 else ()) if t not in header]
    if missing:
        s.fail("shape", "%s has no %s" % (rec["file"], ", ".join(missing)))
        return None
    try:
        for tensor, dims in (("hidden_states", 2), ("aux_hidden_states", 2), ("input_ids", 1), ("positions", 1)):
            shape_of(header[tensor], dims)
        if not header["hidden_states"]["shape"][1]:
            raise ValueError("hidden size 0")
    except ValueError as exc:
        s.fail("shape", "%s: %s: %s" % (rec["file"], tensor, exc))
        return None
    hs, aux = header["hidden_states"], header["aux_hidden_states"]
    if fp8:
        if fp8_problem(
            s, rec["file"], header, meta or {}, {"hidden_states_scale": 1, "aux_hidden_states_scale": AUX_STATES}
        ):
            return None
    elif hs.get("dtype") not in FLOAT_SIZE or aux.get("dtype") != hs.get("dtype"):
        s.fail("shape", "%s: dtypes %s / %s" % (rec["file"], hs["dtype"], aux["dtype"]))
        return None
    n, h = hs["shape"]
    if hidden and h != hidden:
        s.fail(
            "shape", "hidden_states is [%d, %d]: hidden size %d, the model's config.json says %d" % (n, h, h, hidden)
        )
    if aux["shape"][0] != n or aux["shape"][1] % h:
        s.fail("shape", "aux_hidden_states is %s for hidden_states [%d, %d]" % (aux["shape"], n, h))
    elif aux["shape"][1] // h != AUX_STATES:
        s.fail(
            "shape",
            "aux_hidden_states holds %d aux states ([%d, %d]), not %d: an aux layer was dropped"
            % (aux["shape"][1] // h, n, aux["shape"][1], AUX_STATES)
            if aux["shape"][1] // h < AUX_STATES
            else "aux_hidden_states holds %d aux states, not %d" % (aux["shape"][1] // h, AUX_STATES),
        )
    if header["input_ids"]["shape"] != [n]:
        s.fail("shape", "input_ids is %s for %d tokens" % (header["input_ids"]["shape"], n))
        return None
    return n


FP8_SCALES = ("hidden_states_scale", "aux_hidden_states_scale")


def fp8_storage(header, meta):
    """A dump (or vLLM file) in FP8 storage: e4m3 values with a float32 scale per token and layer."""
    hs = header.get("hidden_states")
    return meta.get("storage") == FP8_STORAGE or (isinstance(hs, dict) and hs.get("dtype") == FP8_DTYPE)


def fp8_problem(s, name, header, meta, scales):
    """What keeps a file in FP8 storage from being decoded (named as its sample's shape problem, True),
    or None: e4m3 states, each scale tensor F32 [n, columns] (`scales`: name -> columns; n the
    states' rows), a model dtype in the metadata, and the decoder at hand."""
    if fp8read is None:
        s.fail("shape", "%s: FP8 storage, and this auditor has no FP8-storage decoder (rops_fp8)" % name)
        return True
    states = [t for t in ("hidden_states", "aux_hidden_states") if t in header]
    bad = [t for t in states if header[t].get("dtype") != FP8_DTYPE]
    if bad:
        s.fail("shape", "%s: FP8 storage with %s %s, want %s" % (name, bad[0], header[bad[0]].get("dtype"), FP8_DTYPE))
        return True
    n = header["hidden_states"]["shape"][0]
    for tensor, columns in scales.items():
        entry = header[tensor] if isinstance(header[tensor], dict) else {}
        if entry.get("dtype") != "F32" or entry.get("shape") != [n, columns]:
            s.fail(
                "shape",
                "%s: FP8 storage with %s %s %s, want F32 [%d, %d]"
                % (name, tensor, entry.get("dtype"), json.dumps(entry.get("shape")), n, columns),
            )
            return True
    if fp8read.model_dtype(meta) is None:
        s.fail(
            "shape",
            "%s: FP8 storage with metadata dtype %r: not a model dtype to decode to" % (name, meta.get("dtype")),
        )
        return True
    s.doc["storage"] = FP8_STORAGE
    return None


def float_states(path, start, header, meta, fl):
    """{"hidden_states": (bytes, dtype), "aux_hidden_states": (...)} of a dump file, the checks' input.
    FP8 storage is decoded to the model dtype first (`fp8read.decode_fp8`, the bytes `dumps export`
    gives SpecForge), and "scales" holds the final state's (e4m3 bytes, float32 scales)."""
    out = {}
    fp8 = fp8_storage(header, meta)
    for tensor, segments in (("hidden_states", 1), ("aux_hidden_states", AUX_STATES)):
        entry = header[tensor]
        data = read_range(path, start, entry)
        if fp8:
            scales = read_range(path, start, header[tensor + "_scale"])
            if tensor == "hidden_states":
                out["scales"] = (data, scales)
            dtype = fp8read.model_dtype(meta)
            data = fp8read.decode_fp8(data, scales, segments, entry["shape"][1], dtype, fl.np)
            out[tensor] = (data, dtype)
        else:
            out[tensor] = (data, entry["dtype"])
    return out


def _check_finite(s, name, states, header, fl):
    """NaN and Inf counts of the two float tensors (`float_states`: FP8 storage decoded, so a NaN
    code or a non-finite scale counts as what the reader gets)."""
    counts = s.doc.setdefault("nonfinite", {})
    for tensor in ("hidden_states", "aux_hidden_states"):
        data, dtype = states[tensor]
        nan, inf, row = fl.nonfinite(data, dtype, header[tensor]["shape"][1])
        if nan or inf:
            c = counts.setdefault(tensor, {"nan": 0, "inf": 0})
            c["nan"] += nan
            c["inf"] += inf
            s.fail("finite", "%s: %d NaN, %d Inf in %s (first at token %d)" % (name, nan, inf, tensor, row))


# --------------------------------------------------------------------------- the token check


def check_tokens(samples, model_dir, cfg, fl):
    """For every sample with a final row and a generated token: the stored final state's argmax,
    and the argmax after the model's final RMSNorm; the verdict on which the dumps hold."""
    wmap = weight_map(model_dir)
    head, tied, norm_name = head_and_norm(wmap, cfg["tie_word_embeddings"])
    info = {"lm_head": head, "tied": tied, "norm": norm_name, "bytes_read": 0}
    asked = [s for s in samples if s.last_row is not None and "finite" not in s.problems]
    for s in samples:
        if s.last_row is not None and s.client.get("generated_token") is None:
            s.doc["token"] = {"status": "no_token"}
    asked = [s for s in asked if s.client.get("generated_token") is not None]
    if not asked:
        return info
    norm_w = None
    if norm_name is not None:
        path, start, entry = tensor_where(model_dir, wmap, norm_name)
        norm_w = list(fl.decode(read_range(path, start, entry), entry["dtype"]))
    rows, wanted, errs = [], [], []
    for s in asked:
        rows.append(list(s.last_row))
        wanted.append(int(s.client["generated_token"]))
        errs.append(s.last_err)
        if norm_w is not None:
            rows.append(list(rms_norm(fl, s.last_row, norm_w, cfg["rms_norm_eps"])))
            wanted.append(int(s.client["generated_token"]))
            errs.append(None if s.last_err is None else normed_err(s.last_row, s.last_err, norm_w, cfg["rms_norm_eps"]))
    path, start, entry = tensor_where(model_dir, wmap, head)
    info["shape"] = entry["shape"]
    if entry["shape"][1] != len(rows[0]):
        raise AuditError("%s is %s; the dumps' hidden size is %d" % (head, entry["shape"], len(rows[0])))
    keep = [e is not None for e in errs]
    logits, info["bytes_read"] = lm_head_logits(fl, path, start, entry, rows, wanted, keep)

    def verdict(i):
        allowance = fp8_allowance(logits.best_w[i], logits.at_w[i], errs[i]) if keep[i] else None
        status, gap = token_verdict(wanted[i], logits.best[i], logits.arg[i], logits.at[i], allowance or 0.0)
        return status, gap, allowance

    step = 2 if norm_w is not None else 1
    for k, s in enumerate(asked):
        gen = wanted[k * step]
        status, gap, allowance = verdict(k * step)
        doc = {"generated": gen, "argmax": logits.arg[k * step], "gap": gap, "status": status}
        if allowance is not None:  # FP8 storage: the gap e4m3 rounding alone may explain
            doc["fp8_allowance"] = allowance
        if norm_w is not None:
            j = k * step + 1
            normed, _, _ = verdict(j)
            doc["argmax_after_final_norm"] = logits.arg[j]
            if status == "mismatch" and normed == "match":
                doc["status"] = "prenorm"
            doc["tells_norm"] = status != normed  # both give the token: says nothing about the norm
        s.doc["token"] = doc
        if doc["status"] == "prenorm" and s.vllm:
            doc["expected"] = "vLLM's layer L is the state before the final RMSNorm (its model files append it first)"
        elif doc["status"] == "prenorm":
            s.fail(
                "token",
                "the final state gives token %d, the server answered %d; after the final RMSNorm it gives %d: "
                "a PRE-norm final state" % (doc["argmax"], gen, doc["argmax_after_final_norm"]),
            )
        elif doc["status"] != "match":
            s.fail("token", "the final state gives token %d, the server answered %d" % (doc["argmax"], gen))
    return info


def norm_verdict(samples):
    """What the dumps' final states are, from the token check: post-norm, pre-norm, mixed,
    indistinct or unknown.

    A final state whose argmax is the server's token both as stored and after the final RMSNorm
    (`ambiguous`) is a good sample but no evidence either way: on a pre-norm dump it happens
    whenever the norm does not move the argmax, so pre-norm is judged on the other samples.  When
    every checked sample is ambiguous (a final norm whose weights are all equal only scales the
    state) the verdict is `indistinct`, never post-norm."""
    counts = {"match": 0, "prenorm": 0, "mismatch": 0, "no_token": 0, "ambiguous": 0}
    for s in samples:
        token = s.doc.get("token") or {}
        status = token.get("status")
        if status in counts:
            counts[status] += 1
        if status == "match" and token.get("tells_norm") is False:
            counts["ambiguous"] += 1
    checked = counts["match"] + counts["prenorm"] + counts["mismatch"]
    telling = checked - counts["ambiguous"]
    if not checked:
        verdict = "unknown"
    elif counts["match"] == checked:
        verdict = "post-norm" if telling else "indistinct"
    elif counts["prenorm"] * 2 > telling:
        verdict = "pre-norm"
    else:
        verdict = "mixed"
    out = dict(counts, checked=checked, verdict=verdict)
    vllm = sum(
        1 for s in samples if s.vllm and (s.doc.get("token") or {}).get("status") in ("match", "prenorm", "mismatch")
    )
    if vllm:  # checked samples from vLLM files, whose pre-norm final state is by design
        out["vllm"] = vllm
    return out


# --------------------------------------------------------------------------- commands


def named(what, fn, *args):
    """fn(*args); a file it may not read (a FIFO, a device) is an AuditError naming `what`."""
    try:
        return fn(*args)
    except NotRegular as exc:
        raise AuditError("%s: %s" % (what, exc)) from None


def audit(args):
    t0 = time.monotonic()
    fl = Floats(use_numpy=not args.no_numpy)
    cfg = named(args.model_dir + "/config.json", model_config, args.model_dir)
    runs = named(args.workdir + "/manifest.jsonl", population, args.workdir)
    dataset = args.dataset
    if not dataset:
        run = named(args.workdir + "/run.json", read_json, os.path.join(args.workdir, "run.json"))
        dataset = run.get("dataset") if isinstance(run, dict) and isinstance(run.get("dataset"), str) else None
    positions = stratified(len(runs), args.samples, args.seed)
    chosen = [Sample(p, runs[p][0], runs[p][1]) for p in positions]
    manifest = dump_manifest(args.dump_dir)
    keys = [s.key for s in chosen]
    lines = named("the dataset " + str(dataset), dataset_lines, dataset, args.workdir, keys) if dataset else {}
    for s in chosen:
        try:
            check_sample(s, args.dump_dir, manifest, lines.get(s.key), cfg, fl)
        except Exception as exc:  # one bad dump fails its own sample (RecursionError, MemoryError too)
            s.fail("shape", "cannot read this sample's dump: %s: %s" % (type(exc).__name__, exc))
            s.last_row = None
    head = check_tokens(chosen, args.model_dir, cfg, fl)
    for s in chosen:
        s.doc["problems"] = s.problems
        if s.warnings:
            s.doc["warnings"] = s.warnings
    layers = {}
    for s in chosen:
        k = json.dumps([s.doc.get("layers_to_capture"), s.doc.get("eagle_aux_hidden_state_layer_ids")])
        layers[k] = layers.get(k, 0) + 1
    doc = {
        "event": "audit",
        "dump_dir": args.dump_dir,
        "model": dict(cfg, lm_head=head),
        "dataset": dataset,
        "population": len(runs),
        "sampled": len(chosen),
        "seed": args.seed,
        "numpy": fl.np is not None,
        "samples": [s.doc for s in chosen],
        "layers": [
            {"layers_to_capture": json.loads(k)[0], "eagle_aux_hidden_state_layer_ids": json.loads(k)[1], "samples": n}
            for k, n in sorted(layers.items())
        ],
        "sglang_versions": sorted({str(s.doc.get("sglang_version")) for s in chosen if s.doc.get("sglang_version")}),
        "vllm_versions": sorted({str(s.doc.get("vllm_version")) for s in chosen if s.doc.get("vllm_version")}),
        "norm": norm_verdict(chosen),
        "seconds": round(time.monotonic() - t0, 3),
    }
    sys.stdout.write(json.dumps(doc, sort_keys=True) + "\n")
    return 0


def contract(args):
    """The recorded contract of up to `--files` dumps spread over the manifest (headers only); a
    dump dir that does not exist holds no files."""
    manifest = dump_manifest(args.dump_dir) if os.path.isdir(args.dump_dir) else {}
    records = sorted(manifest.values(), key=lambda r: (r.get("time", 0), r["file"]))
    n, k = len(records), max(args.files, 1)
    picks = list(range(n)) if n <= k else sorted({round(i * (n - 1) / max(k - 1, 1)) for i in range(k)})
    seen, problems = {}, []
    for i in picks:
        rec = records[i]
        try:
            _, header, meta = read_header(Rel(args.dump_dir, rec["file"]))
            if is_vllm_file(header, meta):
                entry = vllm_contract(header, meta)
            else:
                n_tok, h = header["hidden_states"]["shape"]
                aux = header["aux_hidden_states"]["shape"][1]
                entry = None
        except Exception as exc:  # one bad dump is one named problem (RecursionError, MemoryError too)
            problems.append("%s: %s" % (rec["file"], exc))
            continue
        entry = entry or {
            "layers_to_capture": meta_list(meta, "layers_to_capture"),
            "eagle_aux_hidden_state_layer_ids": meta_list(meta, "eagle_aux_hidden_state_layer_ids"),
            "hidden_size": h,
            "aux_states": aux // h if h else None,
            "dtype": header["hidden_states"]["dtype"],
            "hidden_states_norm": meta.get("hidden_states_norm"),
            "num_hidden_layers": int(meta["num_hidden_layers"])
            if str(meta.get("num_hidden_layers", "")).isdigit()
            else None,
            "sglang_version": meta.get("sglang_version"),
            "model_arch": meta.get("model_arch"),
        }
        if fp8_storage(header, meta):  # e4m3 values (`dtype`) that decode to the model dtype
            entry["storage"], entry["decodes_to"] = meta.get("storage"), meta.get("dtype")
        key = json.dumps(entry, sort_keys=True)
        seen.setdefault(key, dict(entry, files=0, example=rec["file"]))["files"] += 1
    doc = {
        "event": "contract",
        "files": n,
        "checked": len(picks),
        "contracts": list(seen.values()),
        "problems": problems,
    }
    sys.stdout.write(json.dumps(doc, sort_keys=True) + "\n")
    return 0


def vllm_contract(header, meta):
    """The recorded contract of a vLLM file (headers only): its aux layers and the final state."""
    n_tok, count, h = header["hidden_states"]["shape"]
    layer_ids = meta_list(meta, "layer_ids")
    layers = str(meta.get("num_hidden_layers", ""))
    num_layers = int(layers) if layers.isdigit() else (layer_ids[-1] if layer_ids else None)
    aux, eagle = vllm_layers(layer_ids, num_layers)
    return {
        "layers_to_capture": aux,
        "eagle_aux_hidden_state_layer_ids": eagle,
        "hidden_size": h,
        "aux_states": count - 1,
        "dtype": header["hidden_states"]["dtype"],
        "hidden_states_norm": meta.get("hidden_states_norm"),
        "num_hidden_layers": num_layers,
        "vllm_version": meta.get("vllm_version"),
        "model_arch": meta.get("model_arch"),
    }


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="audit_onhost.py", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="action", required=True)
    for name in ("audit", "norm-check"):
        a = sub.add_parser(name)
        a.add_argument("--dump-dir", required=True)
        a.add_argument("--model-dir", required=True)
        a.add_argument("--workdir", required=True, help="the extraction work dir (client manifest, run.json)")
        a.add_argument("--dataset", default=None, help="default: the one run.json names")
        a.add_argument("--samples", type=int, default=64 if name == "audit" else 8)
        a.add_argument("--seed", type=int, default=0)
        a.add_argument("--no-numpy", action="store_true", help="stdlib only (tests: the fallback)")
    c = sub.add_parser("contract")
    c.add_argument("--dump-dir", required=True)
    c.add_argument("--files", type=int, default=8)
    for p in (c, *(sub.choices[n] for n in ("audit", "norm-check"))):
        p.add_argument("--deadline", type=float, default=0, help="seconds: then exit 3 with an error document")
    return ap.parse_args(argv)


DEADLINE_EXIT = 3


def ends_at(seconds):
    """The auditor ends itself `seconds` from now (SIGALRM), and on SIGTERM, with one error
    document and exit 3, whatever it is blocked in.  As a container's first process (PID 1) it
    gets no default action for these signals: the handlers are what end it."""

    def stop(signum, _frame):
        why = (
            "ran past its deadline of %gs" % seconds
            if signum == signal.SIGALRM
            else "was ended by signal %d (the host's `timeout` enforces its deadline too)" % signum
        )
        doc = {"event": "error", "error": "the audit %s" % why, "reason": "deadline"}
        os.write(1, (json.dumps(doc) + "\n").encode())
        os._exit(DEADLINE_EXIT)

    signal.signal(signal.SIGTERM, stop)
    if seconds > 0:
        signal.signal(signal.SIGALRM, stop)
        signal.setitimer(signal.ITIMER_REAL, seconds)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    ends_at(args.deadline)
    try:
        return contract(args) if args.action == "contract" else audit(args)
    except Exception as exc:  # the audit cannot run at all: one error document, never a traceback
        sys.stdout.write(json.dumps({"event": "error", "error": "%s: %s" % (type(exc).__name__, exc)}) + "\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
