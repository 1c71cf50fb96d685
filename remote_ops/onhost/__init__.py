"""Programs that run ON THE HOST (or in its container) with plain `python3`.

Each file is standalone (stdlib only, `dataset.py` also `transformers`; no
`remote_ops` import) and is shipped as source: the workflows read it with
`source(name)` and send it on stdin or upload it.  Nothing here is imported
by the rest of remote-ops except to read or test it.  The dump codecs the readers
share (`remote_ops/dumper/packed.py`, `remote_ops/dumper/fp8read.py`) travel in
front of them on stdin (`with_codec`); run from a checkout, a reader loads them
from there.
"""

from __future__ import annotations

from pathlib import Path


def source(name: str) -> bytes:
    """The bytes of the on-host program `name` (e.g. "extract_onhost.py"), as shipped."""
    return (Path(__file__).resolve().parent / name).read_bytes()


#: The module name the packed-dump codec (`remote_ops/dumper/packed.py`) has in a bundled program.
CODEC_MODULE = "rops_packed"
#: The module name the FP8-storage decoder (`remote_ops/dumper/fp8read.py`) has in a bundled program.
FP8_MODULE = "rops_fp8"
#: What `with_codec` installs before the program: (module name, file in remote_ops/dumper/).
CODECS = ((CODEC_MODULE, "packed.py"), (FP8_MODULE, "fp8read.py"))


def with_codec(program: bytes, filename: str) -> bytes:
    """`program` (an on-host script shipped on stdin) with the dump codecs before it: the packed-dump
    codec as the module `rops_packed` and the FP8-storage decoder as `rops_fp8`, then the program
    runs as `__main__` under its own file name (so tracebacks name it).  All stay standalone stdlib
    sources."""
    dumper = Path(__file__).resolve().parent.parent / "dumper"
    loader = ["import sys as _s, types as _t\n"]
    for module, name in CODECS:
        code = (dumper / name).read_text()
        loader += [
            f"_m = _t.ModuleType({module!r})\n",
            f"_s.modules[{module!r}] = _m\n",
            f"exec(compile({code!r}, {name!r}, 'exec'), _m.__dict__)\n",
        ]
    loader += ["del _s, _t, _m\n", f"exec(compile({program.decode()!r}, {filename!r}, 'exec'))\n"]
    return "".join(loader).encode()


def bundled(name: str) -> bytes:
    """The on-host program `name` with the dump codecs (`with_codec`), as shipped on stdin."""
    return with_codec(source(name), name)
