"""Programs that run ON THE HOST (or in its container) with plain `python3`.

Each file is standalone (stdlib only, `dataset.py` also `transformers`; no
`remote_ops` import) and is shipped as source: the workflows read it with
`source(name)` and send it on stdin or upload it.  Nothing here is imported
by the rest of remote-ops except to read or test it.
"""

from __future__ import annotations

from pathlib import Path


def source(name: str) -> bytes:
    """The bytes of the on-host program `name` (e.g. "extract_onhost.py"), as shipped."""
    return (Path(__file__).resolve().parent / name).read_bytes()
