"""FP8 storage of hidden states: e4m3 values with one float32 scale per row and layer segment.

A row is one token's state; a row of `aux_hidden_states` holds `segments` layers side by side
(`[n, 3H]`: 3 segments of H), and each segment gets its own scale, since the residual stream's
magnitude grows with depth.  `scale = amax / 448` (448: e4m3's largest finite value), so every value
maps into e4m3's range; an all-zero segment gets scale 1.  Decoding is `q * scale`, in float32, then
the caller's dtype (bf16 for SpecForge).

Pure torch, no state: `encode_rows` runs wherever the tensor is (the dumper calls it on the GPU, so
the copy to the host moves one byte a value instead of two); `decode_rows` on the reader's CPU.
This is lossy: e4m3 keeps 3 mantissa bits (a relative error up to 2**-4 per value), against bf16's 7.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
STORAGE = "fp8_e4m3_rowscale"  # the `storage` metadata value of a file written this way


def encode_rows(x: torch.Tensor, segments: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [n, segments*H]` -> (`q [n, segments*H]` float8_e4m3fn, `scale [n, segments]` float32)."""
    n, width = x.shape
    if width % segments:
        raise ValueError(f"width {width} is not a multiple of {segments} segments")
    seg = x.reshape(n, segments, width // segments).float()
    amax = seg.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (seg / scale.unsqueeze(-1)).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return q.reshape(n, width), scale


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
