"""FP8 storage read without torch: e4m3 values and their float32 scales back to the model dtype.

Stdlib only (numpy when the caller passes it), Python 3.8+.  The one decoder of FP8 storage
(FORMAT.md "FP8 storage (version 2)") for the programs that run on the host with plain python3:
`onhost/specforge_export.py` (`dumps export`) and `onhost/audit_onhost.py` (`dumps audit`).  They
get it on stdin beside themselves (`remote_ops.onhost.with_codec`) as the module `rops_fp8`, or,
run from a checkout, load this file.  The torch codec the dumper writes with is `fp8.py`; decoding
here gives the bytes `fp8.decode_rows` gives (tests/test_export_fp8.py holds the two equal).

- `decode_fp8`: e4m3 bytes + one float32 scale per row segment -> `dtype` bytes (`q * scale` in
  float32, then nearest even), numpy or a 256-entry table per segment and `bytes.translate`.
- `half_ulps`: how far e4m3 rounding may have moved each value of a row (half a unit in the last
  place of its code, times its scale): what a reader allows FP8 storage when it judges a state.
- `encode_floats`: Python floats -> BF16 / F16 / F32 bytes (nearest even, NaN kept).
"""

import struct
from array import array

STORAGE_FP8 = "fp8_e4m3_rowscale"  # metadata `storage` of a dump in FP8 storage (fp8.STORAGE)
FP8_DTYPE = "F8_E4M3"  # the safetensors dtype of the values
MODEL_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}  # metadata `dtype` -> what they decode to
DTYPE_SIZE = {"BF16": 2, "F16": 2, "F32": 4}


def e4m3(b):
    """The value of one float8_e4m3fn byte (no infinities; 0x7F / 0xFF are NaN)."""
    sign, exp, man = -1.0 if b & 0x80 else 1.0, (b >> 3) & 0xF, b & 7
    if exp == 15 and man == 7:
        return float("nan")
    return sign * (man / 8.0 * 2.0**-6 if exp == 0 else (1 + man / 8.0) * 2.0 ** (exp - 7))


def _half_ulp(b):
    """Half the spacing of e4m3 codes at byte `b`: 2^-10 among subnormals (step 2^-9), else
    2^(e-11) (3 mantissa bits; the step at exponent e is 2^(e-10))."""
    exp = (b >> 3) & 0xF
    return 2.0**-10 if exp == 0 else 2.0 ** (exp - 11)


E4M3 = [e4m3(b) for b in range(256)]
HALF_ULP = [_half_ulp(b) for b in range(256)]


def model_dtype(meta):
    """The safetensors dtype FP8 values of a file decode to (its metadata `dtype`, the model's), or None."""
    return MODEL_DTYPES.get(meta.get("dtype"))


def is_fp8(header, meta):
    """A dump (or a vLLM file) in FP8 storage: its metadata says so, or its hidden states are e4m3."""
    hs = header.get("hidden_states")
    return meta.get("storage") == STORAGE_FP8 or (isinstance(hs, dict) and hs.get("dtype") == FP8_DTYPE)


def encode_floats(values, dtype):
    """Python floats -> little-endian BF16 (nearest even, NaN kept), F16 or F32 bytes."""
    if dtype == "F16":
        return struct.pack("<%de" % len(values), *values)
    raw = array("f", values)
    if dtype == "F32":
        return raw.tobytes()
    bits = array("I", raw.tobytes())
    out = array("H", bytes(2 * len(bits)))
    for i, b in enumerate(bits):
        out[i] = (
            0x7FC0
            if (b & 0x7F800000) == 0x7F800000 and b & 0x7FFFFF
            else ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
        )
    return out.tobytes()


def decode_fp8(q, scales, segments, width, dtype, np=None):
    """e4m3 bytes of rows of `width` values (`segments` equal parts, each with its own float32 scale in
    `scales`, row-major) -> the rows as `dtype` bytes: `q * scale` in float32 (exact in double, then
    rounded to float32: torch's float32 product), then to `dtype` (nearest even).  numpy when given,
    else per segment a 256-entry table and `bytes.translate` (C speed for the bulk).  Scales that do
    not match the values in number are a ValueError."""
    seg = width // segments
    count = len(q) // seg if seg else 0
    scale = array("f", bytes(scales))
    if len(scale) != count or (seg and len(q) % seg):
        raise ValueError("%d scales for %d segments of FP8 values" % (len(scale), count))
    if np is not None:
        return _decode_numpy(np, q, scale, seg, dtype)
    size = DTYPE_SIZE[dtype]
    out = bytearray(len(q) * size)
    for i in range(count):
        table = encode_floats([v * scale[i] for v in E4M3], dtype)
        part = q[i * seg : (i + 1) * seg]
        base = i * seg * size
        for byte in range(size):
            out[base + byte : base + seg * size : size] = part.translate(table[byte::size])
    return bytes(out)


def _decode_numpy(np, q, scale, seg, dtype):
    values = np.asarray(E4M3, dtype=np.float32)[np.frombuffer(q, np.uint8).reshape(-1, seg)]
    f = values * np.frombuffer(scale.tobytes(), np.float32)[:, None]
    if dtype == "F32":
        return f.astype("<f4").tobytes()
    if dtype == "F16":
        return f.astype("<f2").tobytes()
    bits = f.view(np.uint32).astype(np.uint64)
    out = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    out[np.isnan(f)] = 0x7FC0
    return out.astype("<u2").tobytes()


def half_ulps(q, scale):
    """One segment's e4m3 bytes and its scale -> per value, the most e4m3 rounding can have moved
    it (half a code step, times the scale; a float each).  The stored value is within this of the
    state the server computed (before the model dtype's own rounding of the decoded value)."""
    s = abs(float(scale))
    return [HALF_ULP[b] * s for b in bytes(q)]
