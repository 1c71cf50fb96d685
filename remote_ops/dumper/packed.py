"""The packed form of a finished dump file (`remote-ops-hs-packed`, version 2): lossless, stdlib only.

A dump file (`<key>.safetensors`, FORMAT.md) is packed into `<key>.hsz`: the same bytes,
bit for bit, once decoded.  Each tensor is cut into blocks.  Version 2 (written here) splits
every BF16 value of a block into its 8 exponent bits, coded as the difference from its channel's
median exponent (the channel is the last dimension; the medians, one byte per channel from 32 of
the tensor's rows spread evenly over it, are stored in the index), and its sign + 7 mantissa
bits; the exponent plane is raw-deflated with Huffman coding only (`zlib`, `Z_HUFFMAN_ONLY`),
the sign+mantissa plane stored as it is (close to random: deflate keeps 97 % or more of it).
Other floats are byte-grouped (F16: high bytes then low bytes; F32: four planes) and
Huffman-coded; int tensors byte-grouped and deflated; the header deflated.  Version 1 (still read; `pack_file(version=1)` writes it) grouped
BF16 as high byte (sign, exponent bits 7-1) and low byte (exponent bit 0, mantissa), without the
channel medians.  Measured on bf16 activations (bench/compress.py, bench/README.md): zstd -19 on
the exponent plane saves 0.05 bits a value over Huffman-only deflate (0.3 % of the file), lzma and
bz2 none, so a reader needs nothing past the standard library (a bare host's python3, a served
image, a laptop).

File layout (all integers little-endian):

    MAGIC (8 bytes, b"RZHSPK\\x00\\x01")
    block bodies, in source order; a body is its planes' stored bytes one after the other
    index: UTF-8 JSON (below)
    u64 index length
    TRAILER (8 bytes, b"RZHSIDX1")

    index = {"format": "remote-ops-hs-packed", "version": 2,
             "source_bytes": N, "source_sha256": "<hex of the decoded file>",
             "channels": [[width, "<base64 of the raw-deflated medians, one byte per channel>"], ...],
             "blocks": [[source offset, source length, transform, [[codec, stored length], ...], crc32
                         (, channel table, phase: e2 blocks only)], ...]}

`transform` is `raw` (one plane: the bytes), `g2` / `g4` / `g8` (plane k = byte n-1-k of every
n-byte element), or `e2` (BF16, v2: plane 0 = (exponent - median of the value's channel) mod 256,
plane 1 = sign << 7 | mantissa; value 0 of the block is channel `phase` of table `channel table`);
`codec` is `raw` or `deflate` (a raw deflate stream, `wbits=-15`).  Version 1 has no `channels`,
no `e2` and no `g8`.  `crc32` is zlib's CRC-32 of the block's decoded bytes.  Blocks tile [0, N)
in order; a block decodes to at most `MAX_BLOCK` bytes, and the index is at most `MAX_INDEX`
bytes: a reader's memory is bounded whatever the file says.

Keep it importable by Python 3.8 with nothing but the standard library: on-host programs
get it on stdin beside themselves (`remote_ops.onhost.bundled`) as the module `rops_packed`.
"""

import base64
import binascii
import bisect
import hashlib
import io
import json
import os
import struct
import sys
import zlib

FORMAT = "remote-ops-hs-packed"
VERSION = 2  # what `pack_file` writes
READS = (1, 2)  # what `PackedFile` reads
SUFFIX = ".hsz"
SOURCE_SUFFIX = ".safetensors"
MAGIC = b"RZHSPK\x00\x01"
TRAILER = b"RZHSIDX1"
BLOCK_BYTES = 4 << 20  # source bytes per block (a float tensor's rows cut at this size)
MAX_BLOCK = 64 << 20  # no block of a valid file decodes to more
MAX_INDEX = 64 << 20
MAX_HEADER = 100 << 20
PROBE = 64 << 10  # bytes of a plane tried first: a plane whose probe does not shrink is stored raw
KEEP = 0.97  # a plane is stored deflated only below this share of its bytes
GROUPS = {"BF16": 2, "F16": 2, "F32": 4}
INT_GROUPS = {"I32": 4, "U32": 4, "I64": 8}  # v2: int tensors byte-grouped too (then deflated)
TRANSFORMS = {"raw": 1, "g2": 2, "g4": 4, "g8": 8, "e2": 2}
V1_TRANSFORMS = ("raw", "g2", "g4")
MEDIAN_ROWS = 32  # v2: a BF16 tensor's channel medians come from this many rows, spread over it
MAX_WIDTH = 1 << 24  # no channel table of a valid file is wider
CACHE_BYTES = 16 << 20  # e2's cached masks and median lanes: for at most this many bytes of planes


class PackError(ValueError):
    """A packed file that cannot be decoded (bad magic, index, block, CRC) or a source that cannot be packed."""


def packed_name(key):
    return key + SUFFIX


def is_packed_name(name):
    return str(name).endswith(SUFFIX)


def key_of_name(name):
    """The dump key of `<key>.safetensors` or `<key>.hsz` (a base name or a path), else None."""
    base = os.path.basename(str(name))
    for suffix in (SOURCE_SUFFIX, SUFFIX):
        if base.endswith(suffix):
            return base[: -len(suffix)]
    return None


# --------------------------------------------------------------------------- encoding


def _huffman(data):
    c = zlib.compressobj(1, zlib.DEFLATED, -15, 9, zlib.Z_HUFFMAN_ONLY)
    return c.compress(data) + c.flush()


def _deflate(data):
    c = zlib.compressobj(6, zlib.DEFLATED, -15, 9)
    return c.compress(data) + c.flush()


def _store_plane(plane, coder):
    """(codec, stored bytes): deflated when that keeps under KEEP of the bytes, else raw."""
    if len(plane) > 2 * PROBE and len(coder(plane[:PROBE])) >= KEEP * PROBE:
        return "raw", plane
    packed = coder(plane)
    return ("deflate", packed) if len(packed) < KEEP * len(plane) else ("raw", plane)


def planes_of(data, transform):
    """Split a block's bytes into its planes (pure; `e2` is `exponent_planes`)."""
    n = TRANSFORMS[transform]
    if n == 1:
        return [bytes(data)]
    return [bytes(data[i::n]) for i in range(n - 1, -1, -1)]


def join_planes(planes, transform, length):
    """The inverse of `planes_of`."""
    n = TRANSFORMS[transform]
    if n == 1:
        return bytes(planes[0])
    out = bytearray(length)
    for k, plane in enumerate(planes):
        out[n - 1 - k :: n] = plane
    return bytes(out)


# v2's `e2` transform of BF16 values, done on each byte plane as one Python int (a lane per
# byte): a few whole-int operations per block, no loop over elements.
_MASKS: dict = {}
_LANES: dict = {}


def _masks(n):
    """Byte masks of n bytes: 0x7F, 0x80, 0xFE, 0x01 in every byte."""
    m = _MASKS.get(n)
    if m is None:
        if len(_MASKS) > 8 or sum(_MASKS) + n > CACHE_BYTES:
            _MASKS.clear()
        m = _MASKS[n] = tuple(int.from_bytes(p * n, "little") for p in (b"\x7f", b"\x80", b"\xfe", b"\x01"))
    return m


def _median_lanes(medians, phase, n, negate):
    """(low 7 bits, top bit) of n bytes, byte i = the median (or 256 - median, `negate`) of the
    channel of value i; value 0 is channel `phase`."""
    key = (medians, phase, n, negate)
    v = _LANES.get(key)
    if v is None:
        if len(_LANES) > 8 or sum(k[2] for k in _LANES) + n > CACHE_BYTES:
            _LANES.clear()
        pat = bytes((256 - m) & 0xFF for m in medians) if negate else medians
        pat = pat[phase:] + pat[:phase]
        x = int.from_bytes((pat * (n // len(pat) + 1))[:n], "little")
        m7f, m80 = _masks(n)[:2]
        v = _LANES[key] = (x & m7f, x & m80)
    return v


def _add_bytes(x, lanes, m7f, m80):
    """Byte-wise (x + y) mod 256 of two n-byte ints, y given as `lanes` = (y & 0x7F.., y & 0x80..)."""
    return ((x & m7f) + lanes[0]) ^ ((x & m80) ^ lanes[1])


def exponent_planes(data, medians, phase):
    """The `e2` planes of BF16 bytes: [exponent minus its channel's median (mod 256), sign in
    bit 7 and the 7 mantissa bits].  `medians` (bytes, one per channel) and `phase` (the channel
    of the first value) give each value's channel."""
    n = len(data) // 2
    m7f, m80, mfe, m01 = _masks(n)
    h = int.from_bytes(data[1::2], "little")  # sign, exponent bits 7-1
    lo = int.from_bytes(data[0::2], "little")  # exponent bit 0, mantissa
    e = ((h << 1) & mfe) | ((lo >> 7) & m01)
    e = _add_bytes(e, _median_lanes(medians, phase, n, True), m7f, m80)
    sm = (h & m80) | (lo & m7f)
    return [e.to_bytes(n, "little"), sm.to_bytes(n, "little")]


def join_exponent_planes(planes, medians, phase, length):
    """The inverse of `exponent_planes`."""
    n = length // 2
    m7f, m80, _mfe, m01 = _masks(n)
    e = _add_bytes(int.from_bytes(planes[0], "little"), _median_lanes(medians, phase, n, False), m7f, m80)
    sm = int.from_bytes(planes[1], "little")
    out = bytearray(length)
    out[1::2] = ((sm & m80) | ((e >> 1) & m7f)).to_bytes(n, "little")
    out[0::2] = (((e & m01) << 7) | (sm & m7f)).to_bytes(n, "little")
    return bytes(out)


def channel_medians(sample, width):
    """The median exponent of each of `width` channels over the whole rows of BF16 `sample`."""
    rows = len(sample) // (2 * width)
    if rows == 0:
        return bytes(width)
    exps = exponent_planes(sample[: rows * 2 * width], bytes(width), 0)[0]
    k = rows // 2
    return bytes([sorted(exps[c::width])[k] for c in range(width)])


def sample_rows(fh, start, width, end, count=MEDIAN_ROWS):
    """`count` whole rows of the tensor [start, end) of `fh`, spread evenly over it (all if fewer)."""
    row = 2 * width
    rows = (end - start) // row
    if rows <= count:
        fh.seek(start)
        return fh.read(rows * row)
    out = []
    for i in range(count):
        fh.seek(start + (i * rows // count) * row)
        out.append(fh.read(row))
    return b"".join(out)


def _pack_medians(medians):
    c = zlib.compressobj(9, zlib.DEFLATED, -15, 9)
    return base64.b64encode(c.compress(medians) + c.flush()).decode("ascii")


def _unpack_medians(entry):
    try:
        width, text = entry
        if type(width) is not int or not 0 < width <= MAX_WIDTH or not isinstance(text, str):
            raise ValueError
        medians = _inflate(base64.b64decode(text.encode("ascii"), validate=True), width)
    except (TypeError, ValueError, PackError, binascii.Error):
        raise PackError("a channel table is malformed") from None
    return medians


def _regions(header_len, tensors, source_bytes, block_bytes, version=VERSION):
    """[(offset, length, transform, coder, channel table or None)] tiling the file: the header,
    then each tensor's bytes in data order (cut into blocks of whole elements), any other bytes
    raw.  A channel table is (tensor start, width, tensor end): v2 BF16 tensors are `e2`, their
    channels the last dimension, their blocks whole rows where a row fits in one."""
    start = 8 + header_len
    out = [(0, start, "raw", _deflate, None)]
    pos = start
    for name, info in sorted(tensors.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        a, b = info["data_offsets"]
        a, b = start + int(a), start + int(b)
        if a != pos or b < a or b > source_bytes:
            raise PackError("tensor %s's offsets do not tile the file" % name)
        dtype, shape = info.get("dtype"), info.get("shape")
        group, coder, table = GROUPS.get(dtype, 1), _huffman, None
        if version >= 2 and group == 1 and dtype in INT_GROUPS:
            group, coder = INT_GROUPS[dtype], _deflate
        transform = {1: "raw", 2: "g2", 4: "g4", 8: "g8"}[group]
        if version >= 2 and dtype == "BF16" and isinstance(shape, list) and shape and type(shape[-1]) is int:
            if 0 < shape[-1] <= MAX_WIDTH and (b - a) % (2 * shape[-1]) == 0:
                transform, table = "e2", (a, shape[-1], b)
        step = max(group, block_bytes - block_bytes % group)
        if table is not None and 2 * table[1] <= block_bytes:
            step = block_bytes - block_bytes % (2 * table[1])  # whole rows: every block starts at channel 0
        if (b - a) % group:
            transform, step, coder, table = "raw", block_bytes, _deflate, None
        if transform == "raw":
            coder = _deflate
        for off in range(a, b, step):
            out.append((off, min(step, b - off), transform, coder, table))
        pos = b
    if pos != source_bytes:
        raise PackError("the file is %d bytes, its header ends the data at %d" % (source_bytes, pos))
    return out


def read_source_header(fh, size):
    """(header length, {name: entry}) of a safetensors file open at offset 0."""
    head = fh.read(8)
    if len(head) < 8:
        raise PackError("shorter than 8 bytes")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER or 8 + n > size:
        raise PackError("header length %d is implausible for %d bytes" % (n, size))
    try:
        header = json.loads(fh.read(n))
    except (ValueError, RecursionError):
        raise PackError("the header is not JSON") from None
    if not isinstance(header, dict):
        raise PackError("the header is not a JSON object")
    header.pop("__metadata__", None)
    for name, e in header.items():
        if not (isinstance(e, dict) and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2):
            raise PackError("tensor %s has no data_offsets" % name)
        if not all(type(x) is int and x >= 0 for x in e["data_offsets"]):
            raise PackError("tensor %s's data_offsets are not whole numbers" % name)
    return n, header


def pack_file(src, dst, block_bytes=BLOCK_BYTES, fsync=True, version=VERSION):
    """Pack the safetensors file `src` into `dst` (written in place: the caller names a temp file).

    One pass over the source: its sha256 is computed while it is read (v2 also reads 32 rows
    of each BF16 tensor once more, for its channel medians).  `version` 1 writes the v1 form.
    Returns {source_bytes, source_sha256, packed_bytes, packed_sha256}.  PackError when `src` is
    not a safetensors file whose offsets tile it."""
    if version not in READS:
        raise PackError("cannot write %s version %r" % (FORMAT, version))
    block_bytes = max(16, min(int(block_bytes), MAX_BLOCK))
    src_sha, out_sha = hashlib.sha256(), hashlib.sha256()
    blocks, tables, table_ids = [], [], {}
    with open(src, "rb") as fin:
        size = os.fstat(fin.fileno()).st_size
        header_len, tensors = read_source_header(fin, size)
        fin.seek(0)
        regions = _regions(header_len, tensors, size, block_bytes, version)
        with open(dst, "wb") as fout:

            def put(data):
                out_sha.update(data)
                fout.write(data)

            put(MAGIC)
            for off, length, transform, coder, table in regions:
                extra = []
                if table is not None:
                    if table not in table_ids:  # a tensor's first block: its channel medians
                        start, width, end = table
                        medians = channel_medians(sample_rows(fin, start, width, end), width)
                        fin.seek(off)
                        table_ids[table] = (len(tables), medians)
                        tables.append([width, _pack_medians(medians)])
                    tid, medians = table_ids[table]
                    phase = (off - table[0]) // 2 % table[1]
                    extra = [tid, phase]
                data = fin.read(length)
                if len(data) != length:
                    raise PackError("the source changed size while it was read")
                src_sha.update(data)
                if transform == "e2":
                    planes = exponent_planes(data, medians, phase)
                else:
                    planes = planes_of(data, transform)
                stored = [_store_plane(p, coder) for p in planes]
                for _codec, body in stored:
                    put(body)
                blocks.append([off, length, transform, [[c, len(b)] for c, b in stored], zlib.crc32(data)] + extra)
            if fin.read(1):
                raise PackError("the source grew while it was read")
            index = {
                "format": FORMAT,
                "version": version,
                "source_bytes": size,
                "source_sha256": src_sha.hexdigest(),
                "blocks": blocks,
            }
            if version >= 2:
                index["channels"] = tables
            raw = json.dumps(index, separators=(",", ":")).encode("utf-8")
            put(raw)
            put(struct.pack("<Q", len(raw)))
            put(TRAILER)
            fout.flush()
            if fsync:
                os.fsync(fout.fileno())
            packed = fout.tell()
    return {
        "source_bytes": size,
        "source_sha256": index["source_sha256"],
        "packed_bytes": packed,
        "packed_sha256": out_sha.hexdigest(),
        "version": version,
    }


# --------------------------------------------------------------------------- decoding


def _check_index(index, file_size, index_len):
    """The index must say this format and a version read here and describe a file of exactly
    this size.  Returns the blocks as (offset, length, transform, planes, crc, stored at, e2)
    with e2 = (medians, phase) for an `e2` block, else None."""
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise PackError("not a %s index" % FORMAT)
    version = index.get("version")
    if version not in READS or type(version) is not int:
        raise PackError("%s version %r; this reader knows %s" % (FORMAT, version, ", ".join(map(str, READS))))
    total = index.get("source_bytes")
    blocks = index.get("blocks")
    if type(total) is not int or total < 0 or not isinstance(blocks, list):
        raise PackError("index without source_bytes or blocks")
    channels = index.get("channels", []) if version >= 2 else []
    if not isinstance(channels, list):
        raise PackError("index with malformed channels")
    tables = [_unpack_medians(t) for t in channels]
    pos, stored_at, out = 0, len(MAGIC), []
    for b in blocks:
        try:
            off, length, transform, planes, crc = b[:5]
            n = TRANSFORMS[transform]
            extra = b[5:]
        except (TypeError, ValueError, KeyError):
            raise PackError("a block entry is malformed") from None
        if version == 1 and transform not in V1_TRANSFORMS:
            raise PackError("a version-1 file with a %s block" % transform)
        e2 = None
        if transform == "e2":
            if not (len(extra) == 2 and all(type(x) is int for x in extra) and 0 <= extra[0] < len(tables)):
                raise PackError("an e2 block without its channel table")
            if not 0 <= extra[1] < len(tables[extra[0]]):
                raise PackError("an e2 block's phase is past its channel table")
            e2 = (tables[extra[0]], extra[1])
        elif extra:
            raise PackError("a block entry is malformed")
        if off != pos or type(length) is not int or not 0 < length <= MAX_BLOCK or length % n:
            raise PackError("blocks do not tile the source at %r" % (off,))
        if type(crc) is not int:
            raise PackError("a block entry is malformed")
        if not isinstance(planes, list) or len(planes) != n:
            raise PackError("a %s block needs %d planes" % (transform, n))
        for p in planes:
            if not (isinstance(p, list) and len(p) == 2 and p[0] in ("raw", "deflate") and type(p[1]) is int):
                raise PackError("a plane entry is malformed")
            if p[1] < 0 or (p[0] == "raw" and p[1] != length // n):
                raise PackError("a plane's stored length is impossible")
        out.append((off, length, transform, [(c, s) for c, s in planes], crc, stored_at, e2))
        stored_at += sum(s for _c, s in planes)
        pos += length
    if pos != total:
        raise PackError("blocks cover %d bytes, the index says %d" % (pos, total))
    if stored_at + index_len + 16 != file_size:
        raise PackError("the blocks' stored bytes do not fill the file")
    return out


def _inflate(body, want):
    d = zlib.decompressobj(-15)
    try:
        out = d.decompress(body, want)
    except zlib.error as exc:
        raise PackError("a deflate plane does not decode: %s" % exc) from None
    if len(out) != want or d.unconsumed_tail or not d.eof:
        raise PackError("a deflate plane decodes to the wrong length")
    return out


class PackedFile(io.RawIOBase):
    """A packed dump read as the original file: `read`, `seek`, `tell` over the decoded bytes.

    `source` is a path or an open binary file (positioned anywhere; it is owned and closed
    here).  Blocks are decoded on demand (one kept), each checked against its CRC-32."""

    def __init__(self, source):
        super().__init__()
        self._fh = open(source, "rb") if isinstance(source, (str, bytes, os.PathLike)) else source
        try:
            self._open()
        except BaseException:
            self._fh.close()
            raise

    def _open(self):
        fh = self._fh
        size = os.fstat(fh.fileno()).st_size
        if size < len(MAGIC) + 16:
            raise PackError("too short for a packed file")
        fh.seek(0)
        if fh.read(len(MAGIC)) != MAGIC:
            raise PackError("no packed-file magic")
        fh.seek(size - 16)
        tail = fh.read(16)
        (n,) = struct.unpack("<Q", tail[:8])
        if tail[8:] != TRAILER or n > MAX_INDEX or n > size - len(MAGIC) - 16:
            raise PackError("no packed-file trailer")
        fh.seek(size - 16 - n)
        try:
            index = json.loads(fh.read(n).decode("utf-8"))
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise PackError("the index is not JSON") from None
        self.blocks = _check_index(index, size, n)
        self.version = index["version"]
        self._starts = [b[0] for b in self.blocks]
        self.source_bytes = index["source_bytes"]
        self.source_sha256 = str(index.get("source_sha256"))
        self.packed_bytes = size
        self._pos = 0
        self._cache = (None, b"")

    # -- io
    def readable(self):
        return True

    def seekable(self):
        return True

    def fileno(self):
        return self._fh.fileno()

    def close(self):
        if not self.closed:
            self._fh.close()
        super().close()

    def tell(self):
        return self._pos

    def seek(self, pos, whence=0):
        base = {0: 0, 1: self._pos, 2: self.source_bytes}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def block(self, i):
        """The decoded bytes of block `i` (CRC-checked)."""
        if self._cache[0] == i:
            return self._cache[1]
        off, length, transform, planes, crc, stored_at, e2 = self.blocks[i]
        self._fh.seek(stored_at)
        n = TRANSFORMS[transform]
        parts = []
        for codec, stored in planes:
            body = self._fh.read(stored)
            if len(body) != stored:
                raise PackError("the packed file is shorter than its index says")
            parts.append(body if codec == "raw" else _inflate(body, length // n))
        if e2 is not None:
            data = join_exponent_planes(parts, e2[0], e2[1], length)
        else:
            data = join_planes(parts, transform, length)
        if zlib.crc32(data) != crc:
            raise PackError("block at %d: CRC-32 differs (corrupt packed file)" % off)
        self._cache = (i, data)
        return data

    def read(self, size=-1):
        end = self.source_bytes if size is None or size < 0 else min(self.source_bytes, self._pos + size)
        out = []
        while self._pos < end:
            i = bisect.bisect_right(self._starts, self._pos) - 1
            data = self.block(i)
            a = self._pos - self.blocks[i][0]
            piece = data[a : a + (end - self._pos)]
            out.append(piece)
            self._pos += len(piece)
        return b"".join(out)

    def readinto(self, buf):
        data = self.read(len(buf))
        buf[: len(data)] = data
        return len(data)

    def chunks(self):
        """Every decoded block in order (the whole file, streaming)."""
        for i in range(len(self.blocks)):
            yield self.block(i)


def is_packed_file(fh):
    """Does the open binary file start with the packed magic?  (Its position is kept.)"""
    pos = fh.tell()
    try:
        fh.seek(0)
        return fh.read(len(MAGIC)) == MAGIC
    finally:
        fh.seek(pos)


def open_dump(path):
    """A dump file for reading as its original bytes: a `PackedFile` for a packed one, else the file."""
    fh = open(path, "rb")
    try:
        if is_packed_file(fh):
            return PackedFile(fh)
    except BaseException:
        fh.close()
        raise
    return fh


def decoded_sha256(path):
    """(sha256 hex, bytes) of the decoded file, every block CRC-checked."""
    h, n = hashlib.sha256(), 0
    with PackedFile(path) as pf:
        for data in pf.chunks():
            h.update(data)
            n += len(data)
    return h.hexdigest(), n


def unpack_file(src, dst):
    """Write the decoded file (the original safetensors bytes) to `dst`; returns its sha256."""
    h = hashlib.sha256()
    with PackedFile(src) as pf, open(dst, "wb") as out:
        for data in pf.chunks():
            h.update(data)
            out.write(data)
    return h.hexdigest()


def main(argv=None):
    """`packed.py pack SRC DST | unpack SRC DST | info FILE`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) == 3 and args[0] == "pack":
        print(json.dumps(pack_file(args[1], args[2])))
        return 0
    if len(args) == 3 and args[0] == "unpack":
        print(unpack_file(args[1], args[2]))
        return 0
    if len(args) == 2 and args[0] == "info":
        with PackedFile(args[1]) as pf:
            print(
                json.dumps(
                    {
                        "source_bytes": pf.source_bytes,
                        "source_sha256": pf.source_sha256,
                        "packed_bytes": pf.packed_bytes,
                        "blocks": len(pf.blocks),
                    }
                )
            )
        return 0
    sys.stderr.write("usage: packed.py pack SRC DST | unpack SRC DST | info FILE\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())
