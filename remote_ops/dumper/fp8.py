"""FP8 storage of hidden states: e4m3 values with one float32 scale per row and layer segment.

A row is one token's state; a row of `aux_hidden_states` holds `segments` layers side by side
(`[n, 3H]`: 3 segments of H), and each segment gets its own scale, since the residual stream's
magnitude grows with depth.  `scale = amax / 448` (448: e4m3's largest finite value), so every value
maps into e4m3's range; an all-zero segment (and one whose amax is NaN) gets scale 1.  Encoding is
`x / scale` in float32, clamped to +-448, rounded to e4m3; decoding is `q * scale`, in float32, then
the caller's dtype (bf16 for SpecForge).

Pure torch, no state: `encode_rows` runs wherever the tensor is (the dumper calls `encode_step` on
the GPU, on the forward stream, so the copy to the host moves one byte a value instead of two);
`decode_rows` on the reader's CPU.  Every encoder here is `encode_into` segment by segment, so the
dumper's files, `encode_rows` and `roundtrip` give the same bytes for the same states.  The float32
quotient is made `ENCODE_CHUNK_VALUES` values at a time: at 8k tokens of H = 7168 a whole segment
at once would be a 235 MB temporary on the GPU, a chunk is 64 MB at most.
This is lossy: e4m3 keeps 3 mantissa bits (a relative error up to 2**-4 per value), against bf16's 7.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import torch

E4M3_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
STORAGE = "fp8_e4m3_rowscale"  # the `storage` metadata value of a file written this way
ENCODE_CHUNK_VALUES = 1 << 24  # float32 values of one encoding temporary (64 MB)


def encode_into(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """One segment: `x [n, W]` (any float dtype, any row stride) -> `q [n, W]` float8_e4m3fn and
    `scale [n]` float32, written in place (views of larger tensors are fine)."""
    n, width = x.shape
    step = max(1, ENCODE_CHUNK_VALUES // max(1, width))
    for first in range(0, n, step):
        rows = x[first : first + step]
        amax = rows.abs().amax(dim=-1).float()
        s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        scale[first : first + step].copy_(s)
        q[first : first + step].copy_(torch.div(rows, s.unsqueeze(-1)).clamp_(-E4M3_MAX, E4M3_MAX))


def encode_rows(x: torch.Tensor, segments: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """`x [n, segments*H]` -> (`q [n, segments*H]` float8_e4m3fn, `scale [n, segments]` float32)."""
    n, width = x.shape
    if width % segments:
        raise ValueError(f"width {width} is not a multiple of {segments} segments")
    h = width // segments
    q = torch.empty(n, width, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(n, segments, dtype=torch.float32, device=x.device)
    for k in range(segments):
        encode_into(x[:, k * h : (k + 1) * h], q[:, k * h : (k + 1) * h], scale[:, k])
    return q, scale


def encode_step(
    hidden: torch.Tensor, aux: Sequence[torch.Tensor], rows: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The dumper's cast of one step's first `rows` rows, on the tensors' device and current stream:
    (`hidden [rows, H]`, `aux [rows, 3H]` (the aux tensors side by side, ascending layer order),
    `scale [rows, 1 + len(aux)]` float32: column 0 the final state's, then one per aux layer).
    One allocation holds both value tensors, each contiguous (one DMA copy each)."""
    h = hidden.shape[1]
    values = torch.empty(rows * h * (1 + len(aux)), dtype=FP8_DTYPE, device=hidden.device)
    q_hidden = values[: rows * h].view(rows, h)
    q_aux = values[rows * h :].view(rows, len(aux) * h)
    scale = torch.empty(rows, 1 + len(aux), dtype=torch.float32, device=hidden.device)
    encode_into(hidden[:rows], q_hidden, scale[:, 0])
    for k, t in enumerate(aux):
        encode_into(t[:rows], q_aux[:, k * h : (k + 1) * h], scale[:, k + 1])
    return q_hidden, q_aux, scale


def decode_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(`q [n, segments*H]`, `scale [n, segments]`) -> `[n, segments*H]` in `dtype`."""
    n, width = q.shape
    segments = scale.shape[-1]
    seg = q.view(FP8_DTYPE).reshape(n, segments, width // segments).float() * scale.float().unsqueeze(-1)
    return seg.reshape(n, width).to(dtype)


def roundtrip(x: torch.Tensor, segments: int = 1) -> torch.Tensor:
    """What a reader gets back from `x` stored as FP8 (for measuring what FP8 costs a drafter)."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    q, scale = encode_rows(flat, segments)
    return decode_rows(q, scale, x.dtype).reshape(shape)
