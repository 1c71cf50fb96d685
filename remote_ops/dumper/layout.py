"""Where a batch's tensors lie inside one host buffer, and how a span is read back (stdlib only).

Shared by the forward process (which copies into the buffer) and the writer
process (which maps the same memory and writes files from it), so neither
side needs the other's objects.  Regions, each `capacity` rows:
hidden [C, H] | aux [C, 3H] (row t = the 3 aux rows of token t) | ids [C] | positions [C] | scales,
ids and positions in 8-byte slots holding the source dtype (int32 or int64);
the writer converts them to int32 while writing.  `scales` is empty except in
FP8 storage (`scaled`): [C, 4] float32 per row, the final state's scale then one
per aux layer (fp8.encode_step), split by the writer into the file's
`hidden_states_scale [n, 1]` and `aux_hidden_states_scale [n, 3]`.
"""

from __future__ import annotations

from array import array
from typing import List, Tuple

ID_SLOT_BYTES = 8
SCALE_ROW_BYTES = 16  # FP8 storage: 4 float32 scales a row (the final state's, then the 3 aux layers')
REGION_HIDDEN, REGION_AUX, REGION_IDS, REGION_POS, REGION_SCALE = range(5)


class Layout:
    """Byte offsets of the regions of a buffer of `capacity` rows (`scaled`: FP8 storage's scales)."""

    def __init__(self, capacity: int, hidden_size: int, esize: int, scaled: bool = False):
        self.capacity, self.hidden_size, self.esize, self.scaled = capacity, hidden_size, esize, scaled
        self.row_bytes = [
            hidden_size * esize,
            3 * hidden_size * esize,
            ID_SLOT_BYTES,
            ID_SLOT_BYTES,
            SCALE_ROW_BYTES if scaled else 0,
        ]
        self.sizes = [capacity * r for r in self.row_bytes]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.nbytes = sum(self.sizes)

    def region(self, index: int, start: int, rows: int, row_bytes: int = 0) -> Tuple[int, int]:
        """(byte offset, byte length) of rows [start, start+rows) of a region."""
        size = row_bytes or self.row_bytes[index]
        return self.offsets[index] + start * size, rows * size


def int32_bytes(raw: memoryview, item_size: int) -> object:
    """int32 little-endian bytes from raw int32/int64 values (values outside int32 raise)."""
    if item_size == 4:
        return raw
    return array("i", raw.cast("q")).tobytes() if item_size == 8 else _bad(item_size)


def _bad(item_size: int):
    raise ValueError("ids/positions of %d bytes per value" % item_size)


def split_scales(raw: memoryview) -> Tuple[bytes, bytes]:
    """[n, 4] float32 scales -> (column 0 as [n, 1], columns 1..3 as [n, 3]); the bits as they are
    (moved as 32-bit integers, never as floats)."""
    words = array("I", bytes(raw))
    if words.itemsize != 4:
        raise ValueError("array('I') is %d bytes here, want 4" % words.itemsize)
    hidden = words[0::4]
    del words[0::4]
    return hidden.tobytes(), words.tobytes()


def span_views(mem: memoryview, layout: Layout, start: int, rows: int, id_size: int, pos_size: int) -> List[object]:
    """(ids int32, positions int32, hidden bytes, aux bytes) of one span, zero-copy for the floats;
    with FP8 storage (`layout.scaled`) then (hidden scales [n, 1], aux scales [n, 3]) as float32 bytes."""
    out = []
    for index, item in ((REGION_IDS, id_size), (REGION_POS, pos_size)):
        begin, size = layout.region(index, start, rows, item)
        out.append(int32_bytes(mem[begin : begin + size], item))
    for index in (REGION_HIDDEN, REGION_AUX):
        begin, size = layout.region(index, start, rows)
        out.append(mem[begin : begin + size])
    if layout.scaled:
        begin, size = layout.region(REGION_SCALE, start, rows)
        out.extend(split_scales(mem[begin : begin + size]))
    return out
