"""The hidden-state dump format: safetensors files, a JSONL manifest, a stats file.

Stdlib only (no torch, no safetensors package) so that the same file serves
three places: the dumper inside the SGLang image (`remote_ops_dump.dumpfile`),
the SGLang stand-in server (which writes contract-conformant dumps without
torch), and a bare host where `python3 dumpfile.py verify DIR` checks what was
written.  Keep it importable by Python 3.8.

Layout (see FORMAT.md): `<dir>/rank<R>/<key>.safetensors`, `<dir>/rank<R>/manifest.jsonl`,
`<dir>/rank<R>/stats.json`; temp files are `.tmp-*` and never in the manifest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import stat
import struct
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple


def _load_codec():
    """The packed-dump codec (`packed.py`, FORMAT.md "Packed files"): this package's, the one a
    bundled program carries (`rops_packed`), or the file beside this one; None if none is found."""
    if __package__:
        from . import packed  # type: ignore[attr-defined]

        return packed
    mod = sys.modules.get("rops_packed")
    here = globals().get("__file__")
    if mod is None and here and os.path.isfile(os.path.join(os.path.dirname(os.path.abspath(here)), "packed.py")):
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "rops_packed", os.path.join(os.path.dirname(os.path.abspath(here)), "packed.py")
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules["rops_packed"] = mod
        spec.loader.exec_module(mod)
    return mod


packed = _load_codec()
PACKED_SUFFIX = ".hsz"  # a compacted dump file: `<key>.hsz` (packed.SUFFIX)

FORMAT_NAME = "remote-ops-hs-dump"
FORMAT_VERSION = "1"
# Version 2 = version 1 plus one storage form, FP8 (FORMAT.md "FP8 storage"): a file in it says
# format_version 2 and storage=fp8_e4m3_rowscale.  A file in the default storage is still version 1,
# byte for byte; a version-2 reader reads both.
FORMAT_VERSION_FP8 = "2"
STORAGE_FP8 = "fp8_e4m3_rowscale"  # = fp8.STORAGE (fp8.py needs torch; this file must not)
FP8_DTYPE = "F8_E4M3"
MANIFEST_NAME = "manifest.jsonl"
STATS_NAME = "stats.json"
TMP_PREFIX = ".tmp-"
SUFFIX = ".safetensors"
KEY_HASH_CHARS = 32
NUM_VECTORS = 4  # 3 aux hidden states + the final hidden state
KIMI_K25_HIDDEN_SIZE = 7168

# Data section order in every dump file (big float tensors first).
TENSOR_ORDER = ("hidden_states", "aux_hidden_states", "input_ids", "positions")
ID_DTYPE = "I32"
# FP8 storage: the scales, F32, after the four (`x = q * scale` per token row and layer segment).
SCALE_TENSORS = ("hidden_states_scale", "aux_hidden_states_scale")
SCALE_DTYPE = "F32"
FP8_TENSOR_ORDER = TENSOR_ORDER + SCALE_TENSORS

DTYPE_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
FLOAT_DTYPES = ("BF16", "F16", "F32")
MODEL_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}  # metadata `dtype` -> safetensors


def fp8_float_bytes(hidden_size: int) -> int:
    """Float bytes per token in FP8 storage: 4 states of H e4m3 values, 4 float32 scales (28,688 at 7168)."""
    return NUM_VECTORS * hidden_size + NUM_VECTORS * 4


WRITE_CHUNK = 16 << 20  # bytes per write() call: bounded syscalls, writeback started per chunk

# A tensor to write: (safetensors dtype string, shape, bytes-like of exactly that size).
# Raw tensor bytes: anything memoryview() takes (bytes, bytearray, mmap, numpy array).
BytesLike = Any
TensorBytes = Tuple[str, Sequence[int], BytesLike]


# --------------------------------------------------------------------------- keys, names


def token_ids_bytes(token_ids: Iterable[int]) -> bytes:
    """Token ids as int32 little-endian: the bytes the dump key is hashed from."""
    ids = list(token_ids)
    return struct.pack("<%di" % len(ids), *ids)


def dump_key(ids_int32_le: BytesLike, prefix_len: int) -> str:
    """`sha256(token ids as int32 LE).hexdigest()[:32] + "-p<prefix_len>"` (the contract key)."""
    digest = hashlib.sha256(bytes(memoryview(ids_int32_le).cast("B"))).hexdigest()
    return "%s-p%d" % (digest[:KEY_HASH_CHARS], int(prefix_len))


def rank_dir_name(rank: int) -> str:
    """Folder of one writer rank inside the dump dir."""
    return "rank%d" % int(rank)


def dump_file_name(key: str) -> str:
    return key + SUFFIX


# --------------------------------------------------------------------------- header


@dataclass
class TensorInfo:
    """One tensor entry of a safetensors header; offsets are relative to the data section."""

    dtype: str
    shape: List[int]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass
class SafetensorsHeader:
    """A parsed safetensors header: where each tensor's bytes lie in the file."""

    header_len: int
    tensors: Dict[str, TensorInfo]
    metadata: Dict[str, str]

    @property
    def data_start(self) -> int:
        return 8 + self.header_len

    @property
    def data_len(self) -> int:
        return max((t.end for t in self.tensors.values()), default=0)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for dim in shape:
        n *= int(dim)
    return n


def build_header(tensors: Mapping[str, TensorBytes], metadata: Mapping[str, str], order: Sequence[str] = ()) -> bytes:
    """The 8-byte length + JSON header (space-padded to 8 bytes) for tensors laid out in `order`."""
    names = [n for n in order if n in tensors] + [n for n in tensors if n not in order]
    head: Dict[str, object] = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}}
    offset = 0
    for name in names:
        dtype, shape, _ = tensors[name]
        size = _numel(shape) * DTYPE_SIZES[dtype]
        head[name] = {"dtype": dtype, "shape": [int(d) for d in shape], "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(head, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def parse_header(raw: bytes) -> SafetensorsHeader:
    """Parse the JSON part of a safetensors header (without the 8-byte length)."""
    head = json.loads(raw.decode("utf-8"))
    metadata = head.pop("__metadata__", None) or {}
    tensors = {
        name: TensorInfo(
            str(e["dtype"]), [int(d) for d in e["shape"]], int(e["data_offsets"][0]), int(e["data_offsets"][1])
        )
        for name, e in head.items()
    }
    return SafetensorsHeader(len(raw), tensors, {str(k): str(v) for k, v in metadata.items()})


def open_dump(path: str):
    """A dump file opened for reading its original bytes: a packed one (`.hsz`) decoded."""
    if path.endswith(PACKED_SUFFIX):
        if packed is None:
            raise ValueError("a packed dump file, and no packed-dump codec (packed.py) here")
        return packed.PackedFile(path)
    return open(path, "rb")


def read_header(path: str, max_header: int = 100 << 20) -> SafetensorsHeader:
    """Read and parse the header of a safetensors file (a packed one decoded); ValueError if it is not one."""
    with open_dump(path) as fh:
        first = fh.read(8)
        if len(first) < 8:
            raise ValueError("shorter than 8 bytes")
        (length,) = struct.unpack("<Q", first)
        if length > max_header:
            raise ValueError("header length %d is implausible" % length)
        raw = fh.read(length)
    if len(raw) != length:
        raise ValueError("header truncated (%d of %d bytes)" % (len(raw), length))
    return parse_header(raw)


def read_tensor_bytes(path: str, header: SafetensorsHeader, name: str) -> bytes:
    """The raw bytes of one tensor of a file (e.g. input_ids to recompute the key)."""
    info = header.tensors[name]
    with open_dump(path) as fh:
        fh.seek(header.data_start + info.start)
        return fh.read(info.nbytes)


# --------------------------------------------------------------------------- writing


@dataclass
class WrittenFile:
    """What `write_dump_file` wrote: final path, size and digests (whole file, data section)."""

    path: str
    bytes: int
    sha256: str
    payload_sha256: Optional[str] = None  # only with write_dump_file(..., payload_digest=True)


def _check_tensor_sizes(tensors: Mapping[str, TensorBytes]) -> None:
    """Refuse before writing when a tensor's bytes do not match its dtype and shape."""
    for name, (dtype, shape, data) in tensors.items():
        if dtype not in DTYPE_SIZES:
            raise ValueError("tensor %s: unknown dtype %r" % (name, dtype))
        want = _numel(shape) * DTYPE_SIZES[dtype]
        got = memoryview(data).nbytes
        if got != want:
            raise ValueError("tensor %s: %d bytes for %s%s (want %d)" % (name, got, dtype, list(shape), want))


def _write_all(fd: int, data: BytesLike, hashers: Sequence, offset: int = 0) -> int:
    """Write a bytes-like fully, in bounded chunks, feeding the running digests; returns the new offset.

    After each chunk the kernel is asked to start writing it back (see
    `start_writeback`), so the disk works while this thread hashes the next one.
    """
    view = memoryview(data).cast("B")
    for pos in range(0, view.nbytes, WRITE_CHUNK):
        chunk = view[pos : pos + WRITE_CHUNK]
        for h in hashers:
            h.update(chunk)
        size = chunk.nbytes
        while chunk.nbytes:
            chunk = chunk[os.write(fd, chunk) :]
        start_writeback(fd, offset, size)
        offset += size
    return offset


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start asynchronous writeback of a just-written range (Linux: fadvise DONTNEED does that).

    Without it nothing reaches the disk before fsync (dirty limits are GBs on
    big hosts) and the disk idles while writer threads hash; it also keeps the
    dump out of the page cache once written.  No-op where unsupported.
    """
    if _FADVISE is not None:
        try:
            _FADVISE(fd, offset, length, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


_FADVISE = getattr(os, "posix_fadvise", None) if sys.platform.startswith("linux") else None


def fsync_dir(path: str) -> None:
    """fsync a directory so a rename inside it survives a crash (best effort on odd filesystems)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_dump_file(
    path: str,
    tensors: Mapping[str, TensorBytes],
    metadata: Mapping[str, str],
    fsync: bool = True,
    payload_digest: bool = False,
) -> WrittenFile:
    """Write one safetensors file crash-safely: hidden temp name, fsync, rename, dir fsync.

    `tensors` maps name -> (dtype string e.g. "BF16", shape, bytes-like); the data
    section follows FP8_TENSOR_ORDER (TENSOR_ORDER, then FP8 storage's scales).  Nobody ever sees a partial file under `path`.
    The whole-file sha256 is computed while writing; a second digest of the data
    section alone costs another pass of the CPU and is off unless asked for.
    """
    _check_tensor_sizes(tensors)
    header = build_header(tensors, metadata, FP8_TENSOR_ORDER)
    order = [n for n in FP8_TENSOR_ORDER if n in tensors] + [n for n in tensors if n not in FP8_TENSOR_ORDER]
    folder, base = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, "%s%s.%d.%d" % (TMP_PREFIX, base, os.getpid(), threading.get_ident()))
    whole = hashlib.sha256()
    payload = hashlib.sha256() if payload_digest else None
    data_hashers = [whole, payload] if payload is not None else [whole]
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        offset = _write_all(fd, header, [whole])
        for name in order:
            offset = _write_all(fd, tensors[name][2], data_hashers, offset)
        if fsync:
            os.fsync(fd)
        size = os.fstat(fd).st_size
    except BaseException:
        os.close(fd)
        _unlink_quietly(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    if fsync:
        fsync_dir(folder)
    return WrittenFile(path, size, whole.hexdigest(), payload.hexdigest() if payload is not None else None)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def write_json_atomic(path: str, obj: object) -> None:
    """Replace a small JSON file atomically (used for stats.json)."""
    folder, base = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, "%s%s.%d.%d" % (TMP_PREFIX, base, os.getpid(), threading.get_ident()))
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1, sort_keys=True)
        fh.write("\n")
    os.replace(tmp, path)


# --------------------------------------------------------------------------- manifest

_MANIFEST_LOCK = threading.Lock()


def append_manifest(manifest_path: str, record: Mapping[str, object], fsync: bool = True) -> None:
    """Append one JSON line (one write, O_APPEND) after the file it names was renamed in place."""
    line = (json.dumps(dict(record), sort_keys=True, separators=(",", ":")) + "\n").encode("utf-8")
    with _MANIFEST_LOCK:
        fd = os.open(manifest_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)


@dataclass
class ManifestRead:
    """Manifest records in file order, plus lines that were not valid JSON (e.g. torn by a crash)."""

    records: List[dict] = field(default_factory=list)
    bad_lines: List[int] = field(default_factory=list)

    def latest_by_key(self) -> Dict[str, dict]:
        """The last record of each key (a repeated prompt rewrites the same file)."""
        return {r["key"]: r for r in self.records if "key" in r}


def read_manifest(manifest_path: str) -> ManifestRead:
    """Read a manifest tolerantly: a torn or garbled line is reported, not fatal."""
    out = ManifestRead()
    if not os.path.exists(manifest_path):
        return out
    with open(manifest_path, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            try:
                rec = json.loads(raw.decode("utf-8")) if raw.endswith(b"\n") else None
            except ValueError:
                rec = None
            if isinstance(rec, dict):
                out.records.append(rec)
            elif raw.strip():
                out.bad_lines.append(number)
    return out


# --------------------------------------------------------------------------- spans (writer + stand-in)


def span_metadata(base: Mapping[str, str], key: str, tokens: int, prefix_len: int, rank: int) -> Dict[str, str]:
    """File metadata for one span: the run-wide fields plus the span's own."""
    meta = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION}
    meta.update({str(k): str(v) for k, v in base.items()})
    meta.update(
        {
            "key": key,
            "tokens": str(tokens),
            "prefix_len": str(prefix_len),
            "partial": "true" if prefix_len > 0 else "false",
            "rank": str(rank),
        }
    )
    return meta


def manifest_record(
    root: str, written: WrittenFile, key: str, tokens: int, prefix_len: int, rank: int, hidden_size: int, dtype: str
) -> Dict[str, object]:
    """The manifest line for one written span file."""
    return {
        "key": key,
        "file": os.path.relpath(written.path, root).replace(os.sep, "/"),
        "tokens": int(tokens),
        "bytes": written.bytes,
        "sha256": written.sha256,
        "prefix_len": int(prefix_len),
        "partial": prefix_len > 0,
        "rank": int(rank),
        "hidden_size": int(hidden_size),
        "dtype": dtype,
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "time": round(time.time(), 3),
    }


def write_span(
    root: str,
    rank: int,
    ids_int32_le: BytesLike,
    positions_int32_le: BytesLike,
    hidden: BytesLike,
    aux: BytesLike,
    hidden_size: int,
    dtype: str = "BF16",
    prefix_len: int = 0,
    metadata: Optional[Mapping[str, str]] = None,
    fsync: bool = True,
    scales: Optional[Tuple[BytesLike, BytesLike]] = None,
) -> Dict[str, object]:
    """Write one request span as a contract-conformant file and append its manifest line.

    `hidden` holds n*H values and `aux` n*3H (row-major, layer order), all as raw
    bytes of `dtype`; ids and positions are int32 LE.  Returns the manifest record.
    FP8 storage: `dtype` is "F8_E4M3" and `scales` (hidden [n, 1], aux [n, 3]) float32 LE bytes;
    the file and its line say format_version 2 and storage=fp8_e4m3_rowscale, and the metadata's
    `dtype` stays the model dtype the values decode to.
    """
    if (scales is not None) != (dtype == FP8_DTYPE):
        raise ValueError(
            "dtype %s with%s scales: FP8 storage has both, other storage neither" % (dtype, "" if scales else "out")
        )
    ids = memoryview(ids_int32_le).cast("B")
    tokens = ids.nbytes // 4
    key = dump_key(ids, prefix_len)
    folder = os.path.join(root, rank_dir_name(rank))
    os.makedirs(folder, exist_ok=True)
    tensors = {
        "hidden_states": (dtype, [tokens, hidden_size], hidden),
        "aux_hidden_states": (dtype, [tokens, 3 * hidden_size], aux),
        "input_ids": (ID_DTYPE, [tokens], ids),
        "positions": (ID_DTYPE, [tokens], positions_int32_le),
    }
    meta = span_metadata(metadata or {}, key, tokens, prefix_len, rank)
    if scales is not None:
        tensors["hidden_states_scale"] = (SCALE_DTYPE, [tokens, 1], scales[0])
        tensors["aux_hidden_states_scale"] = (SCALE_DTYPE, [tokens, 3], scales[1])
        meta.update(format_version=FORMAT_VERSION_FP8, storage=STORAGE_FP8)
    written = write_dump_file(os.path.join(folder, dump_file_name(key)), tensors, meta, fsync)
    record = manifest_record(root, written, key, tokens, prefix_len, rank, hidden_size, dtype)
    if scales is not None:
        record.update(format_version=FORMAT_VERSION_FP8, storage=STORAGE_FP8)
    append_manifest(os.path.join(folder, MANIFEST_NAME), record, fsync)
    return record


# --------------------------------------------------------------------------- verification


@dataclass
class Problem:
    """One finding of the verifier; `level` is "error" or "warning"."""

    level: str
    where: str
    message: str


@dataclass
class VerifyReport:
    """Outcome of `verify_dir`: counts, per-rank summary and every problem found."""

    root: str
    ok: bool = True
    files: int = 0
    tokens: int = 0
    bytes: int = 0
    hidden_size: Optional[int] = None
    bytes_per_token: Optional[int] = None
    ranks: Dict[str, dict] = field(default_factory=dict)
    problems: List[Problem] = field(default_factory=list)

    def add(self, level: str, where: str, message: str) -> None:
        self.problems.append(Problem(level, where, message))
        if level == "error":
            self.ok = False

    def to_dict(self) -> dict:
        return asdict(self)


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(WRITE_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def check_layout(
    header: SafetensorsHeader, file_size: int, tokens: int, hidden_size: Optional[int]
) -> Tuple[List[str], int, int]:
    """Check names, dtypes, shapes and offsets of a dump file's header.

    Returns (errors, hidden size found, float bytes per token).  Pure: no I/O.
    """
    errs: List[str] = []
    t = header.tensors
    fp8 = is_fp8(header)
    names = FP8_TENSOR_ORDER if fp8 else TENSOR_ORDER
    if sorted(t) != sorted(names):
        return ["tensors are %s, want %s" % (sorted(t), sorted(names))], 0, 0
    hid, aux = t["hidden_states"], t["aux_hidden_states"]
    h = hid.shape[1] if len(hid.shape) == 2 else 0
    want_shapes = {
        "hidden_states": [tokens, h],
        "aux_hidden_states": [tokens, 3 * h],
        "input_ids": [tokens],
        "positions": [tokens],
    }
    if fp8:
        want_shapes.update(hidden_states_scale=[tokens, 1], aux_hidden_states_scale=[tokens, 3])
    for name, want in want_shapes.items():
        if t[name].shape != want:
            errs.append("%s shape %s, want %s" % (name, t[name].shape, want))
    if fp8:
        errs.extend(_fp8_errors(header))
    elif hid.dtype not in FLOAT_DTYPES or aux.dtype != hid.dtype:
        errs.append("float dtypes %s/%s (want one of %s, equal)" % (hid.dtype, aux.dtype, FLOAT_DTYPES))
    for name in ("input_ids", "positions"):
        if t[name].dtype != ID_DTYPE:
            errs.append("%s dtype %s, want %s" % (name, t[name].dtype, ID_DTYPE))
    if hidden_size is not None and h != hidden_size:
        errs.append("hidden size %d, want %d" % (h, hidden_size))
    errs.extend(_offset_errors(header, file_size))
    floats = sum(t[name].nbytes for name in names if name not in ("input_ids", "positions"))
    per_token = floats // tokens if tokens else 0
    if fp8:
        if tokens and floats != tokens * fp8_float_bytes(h):
            errs.append("float bytes per token %d, want 4*H + 4*4 = %d (FP8 storage)" % (per_token, fp8_float_bytes(h)))
        return errs, h, per_token
    esize = DTYPE_SIZES.get(hid.dtype, 0)
    if tokens and floats != tokens * NUM_VECTORS * h * esize:
        errs.append("float bytes per token %d, want 4*H*%d = %d" % (per_token, esize, NUM_VECTORS * h * esize))
    return errs, h, per_token


def is_fp8(header: SafetensorsHeader) -> bool:
    """A file in FP8 storage (format version 2): its metadata says so, or its float tensors are e4m3."""
    hid = header.tensors.get("hidden_states")
    return header.metadata.get("storage") == STORAGE_FP8 or (hid is not None and hid.dtype == FP8_DTYPE)


def _fp8_errors(header: SafetensorsHeader) -> List[str]:
    """What FP8 storage asks beyond the shapes: e4m3 values, F32 scales, the storage and version
    metadata, and a model dtype (`dtype`) the values decode to."""
    t, meta, errs = header.tensors, header.metadata, []
    for name in ("hidden_states", "aux_hidden_states"):
        if t[name].dtype != FP8_DTYPE:
            errs.append("%s dtype %s, want %s (FP8 storage)" % (name, t[name].dtype, FP8_DTYPE))
    for name in SCALE_TENSORS:
        if t[name].dtype != SCALE_DTYPE:
            errs.append("%s dtype %s, want %s" % (name, t[name].dtype, SCALE_DTYPE))
    if meta.get("storage") != STORAGE_FP8 or meta.get("format_version") != FORMAT_VERSION_FP8:
        errs.append(
            "metadata storage=%r format_version=%r, want %r and %r"
            % (meta.get("storage"), meta.get("format_version"), STORAGE_FP8, FORMAT_VERSION_FP8)
        )
    return errs + _model_dtype_errors(meta)


def _model_dtype_errors(meta: Mapping[str, str]) -> List[str]:
    """An FP8 file's `dtype` must name the model dtype its values decode to."""
    if meta.get("dtype") in MODEL_DTYPES:
        return []
    return [
        "metadata dtype %r: not a model dtype the values decode to (%s)" % (meta.get("dtype"), "|".join(MODEL_DTYPES))
    ]


VLLM_FORMAT = "vllm-hidden-states/1"  # vLLM's per-request file, adopted into this layout by the extraction client
VLLM_FORMAT_FP8 = "vllm-hidden-states/2"  # the same in FP8 storage: e4m3 hidden_states + hidden_states_scale [S, L]
VLLM_TENSORS = ["hidden_states", "token_ids"]
VLLM_FP8_TENSORS = ["hidden_states", "hidden_states_scale", "token_ids"]


def is_vllm(header: SafetensorsHeader) -> bool:
    """A vLLM hidden-state file (`token_ids` I64 [S], `hidden_states` [S, L, H]; docs/vllm.md), in
    either storage."""
    return header.metadata.get("format") in (VLLM_FORMAT, VLLM_FORMAT_FP8) or sorted(header.tensors) in (
        VLLM_TENSORS,
        VLLM_FP8_TENSORS,
    )


def check_vllm_layout(
    path: str, header: SafetensorsHeader, file_size: int, rec: Mapping[str, Any], hidden_size: Optional[int]
) -> Tuple[List[str], int, int]:
    """`check_layout` and the identity checks for a vLLM file: 3 aux layers + the final state
    (one fewer is vLLM's N-1 bug, PR #46973), the key recomputed from `token_ids`."""
    t, tokens = header.tensors, int(rec.get("tokens", -1))
    fp8 = header.metadata.get("storage") == STORAGE_FP8 or "hidden_states_scale" in t
    want = VLLM_FP8_TENSORS if fp8 else VLLM_TENSORS
    if sorted(t) != want:
        return ["tensors are %s, want %s (vLLM)" % (sorted(t), want)], 0, 0
    hid, ids = t["hidden_states"], t["token_ids"]
    if fp8:
        errs = _vllm_fp8_errors(header)
        if errs:
            return errs, 0, 0
    elif len(hid.shape) != 3 or hid.dtype not in FLOAT_DTYPES or ids.dtype != "I64" or ids.shape != [tokens]:
        return (
            [
                "hidden_states %s %s, token_ids %s %s for %d tokens"
                % (hid.dtype, hid.shape, ids.dtype, ids.shape, tokens)
            ],
            0,
            0,
        )
    n, count, h = hid.shape
    errs = [] if n == tokens else ["hidden_states holds %d tokens, the manifest %d" % (n, tokens)]
    if count != NUM_VECTORS:
        errs.append(
            "hidden_states holds %d captured layers, want %d (3 aux + the final state)%s"
            % (count, NUM_VECTORS, ": a layer was dropped (vLLM's N-1 bug, PR #46973)" if count < NUM_VECTORS else "")
        )
    if hidden_size is not None and h != hidden_size:
        errs.append("hidden size %d, want %d" % (h, hidden_size))
    errs.extend(_offset_errors(header, file_size))
    key = str(rec.get("key"))
    if os.path.basename(path) not in (dump_file_name(key), key + PACKED_SUFFIX):
        errs.append("file name does not match key %s" % key)
    if not errs:
        raw = read_tensor_bytes(path, header, "token_ids")
        got = dump_key(token_ids_bytes(struct.unpack("<%dq" % (len(raw) // 8), raw)), int(rec.get("prefix_len", 0)))
        if got != key:
            errs.append("key recomputed from token_ids is %s" % got)
    floats = hid.nbytes + (t["hidden_states_scale"].nbytes if fp8 else 0)
    return errs, h, (floats // tokens if tokens > 0 else 0)


def _vllm_fp8_errors(header: SafetensorsHeader) -> List[str]:
    """A vLLM file in FP8 storage: hidden_states e4m3 [S, L, H], hidden_states_scale F32 [S, L],
    token_ids I64 [S], format version 2, the storage and a model dtype in the metadata."""
    t, meta = header.tensors, header.metadata
    hid, scale, ids = t["hidden_states"], t["hidden_states_scale"], t["token_ids"]
    errs = []
    if len(hid.shape) != 3 or hid.dtype != FP8_DTYPE or ids.dtype != "I64" or ids.shape != hid.shape[:1]:
        errs.append(
            "hidden_states %s %s, token_ids %s %s (vLLM, FP8 storage)" % (hid.dtype, hid.shape, ids.dtype, ids.shape)
        )
    elif scale.dtype != SCALE_DTYPE or scale.shape != hid.shape[:2]:
        errs.append("hidden_states_scale %s %s, want %s %s" % (scale.dtype, scale.shape, SCALE_DTYPE, hid.shape[:2]))
    if meta.get("format") != VLLM_FORMAT_FP8 or meta.get("storage") != STORAGE_FP8:
        errs.append(
            "metadata format=%r storage=%r, want %r and %r"
            % (meta.get("format"), meta.get("storage"), VLLM_FORMAT_FP8, STORAGE_FP8)
        )
    return errs + _model_dtype_errors(meta)


def _offset_errors(header: SafetensorsHeader, file_size: int) -> List[str]:
    """Offsets must tile the data section exactly, match dtype*shape, and end at the file end."""
    errs, pos = [], 0
    for name, info in sorted(header.tensors.items(), key=lambda kv: kv[1].start):
        if info.start != pos:
            errs.append("%s starts at %d, want %d (gap or overlap)" % (name, info.start, pos))
        if info.nbytes != _numel(info.shape) * DTYPE_SIZES.get(info.dtype, 0):
            errs.append("%s holds %d bytes, dtype*shape says otherwise" % (name, info.nbytes))
        pos = info.end
    if header.data_start + pos != file_size:
        errs.append("file is %d bytes, header says %d" % (file_size, header.data_start + pos))
    return errs


def verify_record(
    root: str, rec: Mapping[str, Any], hidden_size: Optional[int], check_sha: bool, report: VerifyReport
) -> None:
    """Verify one manifest record against its file; findings go into `report`."""
    where = str(rec.get("file"))
    path = os.path.join(root, where)
    try:
        st = os.lstat(path)  # entries of the dump dir are never followed
    except OSError:
        return report.add("error", where, "listed in the manifest but missing")
    if not stat.S_ISREG(st.st_mode):
        return report.add("error", where, not_regular(st.st_mode))
    size = st.st_size
    if size != rec.get("bytes"):
        return report.add("error", where, "size %d, manifest says %s" % (size, rec.get("bytes")))
    packed_info = rec.get("packed") if where.endswith(PACKED_SUFFIX) else None
    if where.endswith(PACKED_SUFFIX) and not isinstance(packed_info, dict):
        return report.add("error", where, "a packed file whose manifest line has no 'packed' record")
    try:
        header = read_header(path)
        if packed_info is not None:
            with open_dump(path) as pf:
                if pf.source_bytes != packed_info.get("source_bytes") or pf.source_sha256 != packed_info.get(
                    "source_sha256"
                ):
                    return report.add("error", where, "packed index differs from its manifest line")
            size = int(packed_info["source_bytes"])
    except (ValueError, OSError) as exc:
        return report.add("error", where, "bad safetensors header: %s" % exc)
    if is_vllm(header):
        errs, h, per_token = check_vllm_layout(path, header, size, rec, hidden_size)
    else:
        errs, h, per_token = check_layout(header, size, int(rec.get("tokens", -1)), hidden_size)
        errs.extend(_identity_errors(path, header, rec))
    if check_sha and not errs and _sha256_file(path) != rec.get("sha256"):
        errs.append("sha256 differs from the manifest")
    if check_sha and not errs and packed_info is not None:
        try:
            decoded, _n = packed.decoded_sha256(path)
        except (ValueError, OSError) as exc:
            decoded = "undecodable: %s" % exc
        if decoded != packed_info.get("source_sha256"):
            errs.append("decoded sha256 differs from the manifest's source_sha256 (%s)" % decoded[:40])
    for e in errs:
        report.add("error", where, e)
    _account(report, rec, h, per_token, st.st_size)


def _identity_errors(path: str, header: SafetensorsHeader, rec: Mapping[str, Any]) -> List[str]:
    """Key, prefix length and partial flag must agree between file name, metadata, manifest and ids."""
    errs, meta = [], header.metadata
    key = str(rec.get("key"))
    if os.path.basename(path) not in (dump_file_name(key), key + PACKED_SUFFIX):
        errs.append("file name does not match key %s" % key)
    if meta.get("key") != key or meta.get("prefix_len") != str(rec.get("prefix_len")):
        errs.append("metadata key/prefix_len differ from the manifest")
    if meta.get("partial") != ("true" if rec.get("partial") else "false"):
        errs.append("metadata partial flag differs from the manifest")
    if meta.get("format") != FORMAT_NAME:
        errs.append("metadata format is %r, want %r" % (meta.get("format"), FORMAT_NAME))
    if "input_ids" in header.tensors:
        got = dump_key(read_tensor_bytes(path, header, "input_ids"), int(rec.get("prefix_len", 0)))
        if got != key:
            errs.append("key recomputed from input_ids is %s" % got)
    return errs


def _account(report: VerifyReport, rec: Mapping[str, Any], h: int, per_token: int, size: int) -> None:
    """Add a verified file to the totals and the per-rank summary."""
    report.files += 1
    report.tokens += int(rec.get("tokens", 0))
    report.bytes += size
    if h:
        if report.hidden_size not in (None, h):
            report.add(
                "error", str(rec.get("file")), "hidden size %d differs from other files (%d)" % (h, report.hidden_size)
            )
        report.hidden_size, report.bytes_per_token = h, per_token
    rank = report.ranks.setdefault(str(rec.get("rank")), {"files": 0, "tokens": 0, "bytes": 0, "partial": 0})
    rank["files"] += 1
    rank["tokens"] += int(rec.get("tokens", 0))
    rank["bytes"] += size
    rank["partial"] += 1 if rec.get("partial") else 0


NOT_REGULAR = {
    stat.S_IFLNK: "a symlink: entries of the dump dir are never followed",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
}


def not_regular(mode: int) -> str:
    """`not a regular file (a FIFO)`: the words `dumps status` uses for the same entry."""
    return "not a regular file (%s)" % NOT_REGULAR.get(stat.S_IFMT(mode), "not a regular file")


def rank_dirs(root: str) -> List[str]:
    """The `rank<R>` folders of a dump dir, in rank order (a symlinked one is never followed)."""
    names = [
        n
        for n in os.listdir(root)
        if n.startswith("rank")
        and n[4:].isdigit()
        and os.path.isdir(os.path.join(root, n))
        and not os.path.islink(os.path.join(root, n))
    ]
    return sorted(names, key=lambda n: int(n[4:]))


def verify_rank_dir(root: str, name: str, hidden_size: Optional[int], check_sha: bool, report: VerifyReport) -> None:
    """Verify every manifest record of one rank dir and flag unlisted files and temp leftovers."""
    folder = os.path.join(root, name)
    manifest = read_manifest(os.path.join(folder, MANIFEST_NAME))
    for number in manifest.bad_lines:
        report.add("warning", "%s/%s:%d" % (name, MANIFEST_NAME, number), "unreadable manifest line (torn write?)")
    latest = manifest.latest_by_key()
    for rec in latest.values():
        verify_record(root, rec, hidden_size, check_sha, report)
    listed = {os.path.basename(str(r.get("file"))) for r in latest.values()}
    for entry in sorted(os.listdir(folder)):
        if entry.startswith(TMP_PREFIX):
            report.add("warning", "%s/%s" % (name, entry), "temp file left by an interrupted write")
        elif (entry.endswith(SUFFIX) or entry.endswith(PACKED_SUFFIX)) and entry not in listed:
            report.add(
                "warning", "%s/%s" % (name, entry), "complete file not in the manifest (crash before the append?)"
            )


def verify_dir(root: str, hidden_size: Optional[int] = None, check_sha: bool = True) -> VerifyReport:
    """Verify a dump dir (or a single rank dir) against its manifests; needs no GPU and no torch."""
    report = VerifyReport(root=root)
    if os.path.isfile(os.path.join(root, MANIFEST_NAME)):
        parent, name = os.path.split(os.path.abspath(root))
        report.root = parent
        verify_rank_dir(parent, name, hidden_size, check_sha, report)
        return report
    names = rank_dirs(root) if os.path.isdir(root) else []
    if not names:
        report.add("error", root, "no rank<R> folder with a manifest")
    for name in names:
        verify_rank_dir(root, name, hidden_size, check_sha, report)
    return report


def payload_sha256(path: str) -> str:
    """sha256 of a file's data section (everything after the header): equal across TP ranks."""
    header = read_header(path)
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        fh.seek(header.data_start)
        for chunk in iter(lambda: fh.read(WRITE_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def compare_ranks(root: str) -> dict:
    """For keys written by several ranks (SGLANG_HS_DUMP_ALL_RANKS=1), compare the data sections.

    TP ranks must produce bit-identical tensors; a difference points at the
    all-reduce-fusion hazard (per-rank partial sums) or another broken capture.
    Only keys present on two or more ranks are read.
    """
    by_key: Dict[str, Dict[str, str]] = {}
    for name in rank_dirs(root):
        for key, rec in read_manifest(os.path.join(root, name, MANIFEST_NAME)).latest_by_key().items():
            by_key.setdefault(key, {})[name] = os.path.join(root, str(rec.get("file")))
    shared = {k: v for k, v in by_key.items() if len(v) > 1}
    differing = sorted(k for k, files in shared.items() if len({payload_sha256(p) for p in files.values()}) > 1)
    return {
        "root": root,
        "keys": len(by_key),
        "compared": len(shared),
        "identical": len(shared) - len(differing),
        "differing": differing,
        "ok": bool(shared) and not differing,
    }


# --------------------------------------------------------------------------- command line


def _print_report(report: VerifyReport) -> None:
    """Human summary of a verify run on stdout."""
    print(
        "%s: %s, %d files, %d tokens, %d bytes, H=%s, float bytes/token=%s"
        % (
            report.root,
            "OK" if report.ok else "FAILED",
            report.files,
            report.tokens,
            report.bytes,
            report.hidden_size,
            report.bytes_per_token,
        )
    )
    for rank, s in sorted(report.ranks.items()):
        print(
            "  rank %s: %d files (%d partial), %d tokens, %d bytes"
            % (rank, s["files"], s["partial"], s["tokens"], s["bytes"])
        )
    for p in report.problems:
        print("  %s: %s: %s" % (p.level, p.where, p.message))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`dumpfile.py verify DIR [--hidden-size H] [--json] [--no-sha]`, `compare DIR`, `header FILE`."""
    parser = argparse.ArgumentParser(prog="dumpfile.py", description="Check hidden-state dumps.")
    sub = parser.add_subparsers(dest="cmd")
    v = sub.add_parser("verify", help="verify files against the manifests")
    v.add_argument("dir")
    v.add_argument("--hidden-size", type=int, default=None)
    v.add_argument("--no-sha", action="store_true", help="skip whole-file sha256 (faster)")
    v.add_argument("--json", action="store_true")
    c = sub.add_parser("compare", help="compare ranks' payload digests (all-ranks validation)")
    c.add_argument("dir")
    c.add_argument("--json", action="store_true")
    hd = sub.add_parser("header", help="print one file's header as JSON")
    hd.add_argument("file")
    args = parser.parse_args(argv)
    if args.cmd == "verify":
        report = verify_dir(args.dir, args.hidden_size, not args.no_sha)
        print(json.dumps(report.to_dict(), indent=1)) if args.json else _print_report(report)
        return 0 if report.ok else 1
    if args.cmd == "compare":
        result = compare_ranks(args.dir)
        print(
            json.dumps(result, indent=1)
            if args.json
            else "%(compared)d keys on several ranks, %(identical)d identical, differing: %(differing)s" % result
        )
        return 0 if result["ok"] else 1
    if args.cmd == "header":
        print(json.dumps(asdict(read_header(args.file)), indent=1))
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
