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


#: The module name the packed-dump codec (`remote_ops/dumper/packed.py`) has in a bundled program.
CODEC_MODULE = "rops_packed"


def with_codec(program: bytes, filename: str) -> bytes:
    """`program` (an on-host script shipped on stdin) with the packed-dump codec before it: the
    codec is installed as the module `rops_packed`, then the program runs as `__main__` under
    its own file name (so tracebacks name it).  Both stay standalone stdlib sources."""
    codec = (Path(__file__).resolve().parent.parent / "dumper" / "packed.py").read_text()
    loader = (
        "import sys as _s, types as _t\n"
        f"_m = _t.ModuleType({CODEC_MODULE!r})\n"
        f"_s.modules[{CODEC_MODULE!r}] = _m\n"
        f"exec(compile({codec!r}, 'packed.py', 'exec'), _m.__dict__)\n"
        "del _s, _t, _m\n"
        f"exec(compile({program.decode()!r}, {filename!r}, 'exec'))\n"
    )
    return loader.encode()


def bundled(name: str) -> bytes:
    """The on-host program `name` with the packed-dump codec (`with_codec`), as shipped on stdin."""
    return with_codec(source(name), name)
