"""The copy kernel (`hsk.cu`, checked in as `hsk.ptx`): a copy job in one launch (SGLANG_HS_DUMP_COPY=kernel).

Why: on the H200 VM each driver copy call costs ~6 us of the forward thread,
and a job of 8 gathered steps is 48 of them (~290 us; bench/README.md, cause
14).  With this mode the job is the fence, one cuLaunchKernel of
`hsk_copy_all` on the side stream with the job's copy table as its parameter
(up to 48 copies: 2,312 bytes, under the 4 KB parameter limit), and the
completion post.  The kernel's threads load the GPU tensors and store into
the writer's host buffer, which is page-locked with CU_MEMHOSTREGISTER_DEVICEMAP
so that it has a device address.

The price, measured on the H200 (bench/README.md, cause 15): the copies run on
`blocks` thread blocks (SGLANG_HS_DUMP_KERNEL_BLOCKS, default 8: 8 reach the
~50 GB/s that 16-132 do, the copy engine 55) beside the model's kernels, not on
the copy engines.  Beside memory-bound kernels (a large prefill step) the two
slow each other: an 8,192-token step ran 17-27 % longer beside a 235 MB job
(+2 % beside the copy engine), and the job took twice as long.  capture() got
16-60 us shorter.  So it stays opt-in and is not recommended; bit-exact on the
H200 (12/12 spans).  Where the module cannot be loaded, or a buffer could not
be device-mapped, the ctypes calls are used (`calls`).

SGLANG_HS_DUMP_COPY=staged launches the same kernel with destinations in GPU
memory (a staging buffer laid out for the job's rows, `Stager._queue_staged`),
so its stores stay off PCIe, and one copy-engine DMA then moves the whole job.
"""

from __future__ import annotations

import ctypes
import struct
from pathlib import Path
from typing import Dict, Sequence

PTX = Path(__file__).with_name("hsk.ptx")
SOURCE = PTX.with_suffix(".cu")
KERNEL = b"hsk_copy_all"
MAX_COPIES = 48  # hsk.cu's HSK_MAX_COPIES
TABLE_BYTES = 8 + MAX_COPIES * 6 * 8  # u64 count, then 6 u64 per copy (hsq.c's copy fields)
THREADS = 256


class KernelCopy:
    """The loaded kernel and one reusable parameter table (the driver copies parameters at launch)."""

    def __init__(self, driver, blocks: int):
        self.function = driver.kernel(PTX.read_bytes(), KERNEL)
        self.launch_fn = driver.launch_fn
        self.blocks = max(1, blocks)
        self.table = ctypes.create_string_buffer(TABLE_BYTES)
        self.params = (ctypes.c_void_p * 1)(ctypes.addressof(self.table))
        self.formats: Dict[int, struct.Struct] = {}

    def launch(self, stream: int, values: Sequence[int]) -> int:
        """Queue the copies (`values`: 6 per copy, as `staging._native_copies` gives them, destinations
        as device addresses) on `stream` as one launch; its CUresult."""
        count = len(values) // 6
        if count > MAX_COPIES:
            raise ValueError("%d copies in one kernel job: the table holds %d" % (count, MAX_COPIES))
        fmt = self.formats.get(count)
        if fmt is None:
            fmt = self.formats[count] = struct.Struct("<Q%dQ" % len(values))
        fmt.pack_into(self.table, 0, count, *values)
        return self.launch_fn(self.function, self.blocks, 1, 1, THREADS, 1, 1, 0, stream, self.params, None)
