"""One loader for JSON configs (a draft config.json, a patch spec, a host's config.json): bounded.

A config is read with a size cap and its nesting depth is checked before `json.loads` sees it:
200,000 nested `[` made `json.loads` raise RecursionError, a traceback (exit 1) where the docs
promise exit 3.  Every problem is one `ConfigError` naming the file (`source`): it cannot be
read, it is larger than the cap, it nests deeper than `MAX_DEPTH`, it is not JSON (pure apart
from `load_json`'s one read).
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from ..errors import ConfigError

#: The largest config file read (bytes): a drafter's or a model's config.json is a few KB.
MAX_BYTES = 4 << 20
#: The deepest nesting of arrays and objects a config may have (real ones: under 10).
MAX_DEPTH = 100

#: The characters that open or close a string or a level, and the string escape.
_SPECIAL = re.compile(r'[\[\]{}"\\]')


def depth(text: str) -> int:
    """The deepest nesting of `[`/`{` in `text`, outside strings (one pass, no recursion; pure).
    Text that is not JSON gets some number; `json.loads` judges it afterwards."""
    level = deepest = 0
    in_string, skip_to = False, -1
    for m in _SPECIAL.finditer(text):
        i = m.start()
        if i < skip_to:  # the character after a backslash in a string
            continue
        c = text[i]
        if in_string:
            if c == "\\":
                skip_to = i + 2
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            level += 1
            deepest = max(deepest, level)
        elif c in "]}":
            level -= 1
    return deepest


def loads_json(text: str, source: str, *, what: str = "config", max_depth: int = MAX_DEPTH) -> Any:
    """`text` parsed as JSON; ConfigError naming `source` when it nests too deep or is not JSON."""
    found = depth(text)
    if found > max_depth:
        raise ConfigError(f"the {what} nests deeper than {max_depth} levels ({found}): not read", source=source)
    try:
        return json.loads(text)
    except RecursionError:  # a depth the scan did not see (it cannot; kept as the last word)
        raise ConfigError(f"the {what} nests too deep to read", source=source) from None
    except ValueError as exc:
        raise ConfigError(f"the {what} is not JSON: {exc}", source=source) from None


def load_json(path: Path | str, *, what: str = "config", cap: int = MAX_BYTES, max_depth: int = MAX_DEPTH) -> Any:
    """The local JSON file `path` (`~` expanded): a regular file (a FIFO or a device is refused
    without blocking), at most `cap` bytes, checked as `loads_json`."""
    p = Path(path).expanduser()
    source = str(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block the open
    except OSError as exc:
        raise ConfigError(f"cannot read the {what}: {exc.strerror or exc}", source=source) from None
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"the {what} is not a regular file: not read", source=source)
        data = fh.read(cap + 1)
    if len(data) > cap:
        raise ConfigError(f"the {what} is larger than {cap} bytes: not read", source=source)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"the {what} is not UTF-8 text: {exc}", source=source) from None
    return loads_json(text, source, what=what, max_depth=max_depth)


def positive_ints(doc: Any, fields: tuple[str, ...], source: str) -> None:
    """Each of `fields` present (not null) in the JSON object `doc` must be a positive integer:
    not a float (7168.0, NaN, 1e999 read as inf), a string ("7168") or a bool (JSON's true is
    not 1 here); ConfigError naming `source` and the field otherwise (pure)."""
    if not isinstance(doc, dict):
        return
    for name in fields:
        value = doc.get(name)
        if value is None:
            continue
        if type(value) is not int or value <= 0:
            raise ConfigError(f"must be a positive integer, not {json.dumps(value)}", source=source, field=name)
