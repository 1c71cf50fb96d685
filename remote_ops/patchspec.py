"""Load the patch spec (anchors + blocks as data) from `templates/patches/<id>/spec.json`.

The spec is data so another model file can be targeted later by adding a
directory, not code.  Parsing and validation live in `remote_ops.anchors`
(stdlib-only, so hosts and images can load the same JSON); this module finds
the spec among the repository's resources, maps spec problems to
`ConfigError` (exit 3) naming file and field, and produces the self-contained
JSON (block text inline) that is shipped next to `anchors.py`.
"""
from __future__ import annotations

import json
from pathlib import Path

from . import anchors
from .anchors import PatchSpec
from .errors import ConfigError, NotFound
from .paths import repo_resource

DEFAULT_PATCH = "eagle3-hs-dump"


def spec_dir(patch_id: str = DEFAULT_PATCH) -> Path:
    """Directory of one patch spec under templates/patches/."""
    return repo_resource("templates", "patches", patch_id)


def load(patch_id_or_path: str | Path = DEFAULT_PATCH) -> PatchSpec:
    """The spec by id (templates/patches/<id>/spec.json) or by path to a spec.json."""
    path = Path(patch_id_or_path)
    if not path.suffix:
        path = spec_dir(str(patch_id_or_path)) / "spec.json"
    if not path.is_file():
        raise NotFound(f"patch spec {path} does not exist")
    try:
        return anchors.load_spec(str(path))
    except anchors.SpecError as exc:
        raise ConfigError(str(exc), source=str(path), field=exc.field or None) from None


def bundled_json(spec: PatchSpec) -> str:
    """The spec with block text inline: one file to ship beside anchors.py."""
    return json.dumps(anchors.spec_to_dict(spec), indent=2) + "\n"


def version_for_sha(spec: PatchSpec, sha256: str) -> str | None:
    """The release whose pristine file has this sha256, if the spec knows it."""
    return next((v for v, s in spec.known_sha256.items() if s == sha256), None)
