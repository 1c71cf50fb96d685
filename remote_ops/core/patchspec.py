"""Patch specs as data: which SGLang file and class a patch targets, found by name.

A spec folder (`templates/patches/<id>/spec.json`, plus every folder under the
directories of `$REMOTE_OPS_PATCH_PATH`, `os.pathsep`-separated) holds one
patch: its blocks (anchored by method + statement, class left open) and a list
of `models`, each naming the file, the class, the `config.json` architectures
it serves and the releases it was validated on (`known_sha256`, release ->
sha256 of the pristine file), and how each SGLang release numbers a drafter's aux
layer ids for it (`eagle3_layer_ids`, the model's own or the folder's: see
`remote_ops.core.layerids`; validated when the folder is read).  A folder may take
its blocks from another with `"extends": "<id>"`, so a new model is a few lines of
JSON and no Python.

Binding a model to the blocks gives an `anchors.PatchSpec` (one file, one
class): what the anchor functions, the host workflow and the image use.
Model names are unique over all folders; a clash is a ConfigError naming both.
Reading the catalog needs nothing of `anchors` (imported only where a spec is
bound or read), so an inventory checks its spec names without the anchor engine.

Spec problems become `ConfigError` (exit 3) naming the file and field.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Protocol

from ..errors import ConfigError, NotFound, Refused
from ..paths import repo_resource
from . import layerids

if TYPE_CHECKING:  # the anchor engine (ast, hashlib) is imported where a spec is bound or read
    from .anchors import PatchSpec

DEFAULT_PATCH = "eagle3-hs-dump"
PATH_ENV = "REMOTE_OPS_PATCH_PATH"


@dataclass(frozen=True)
class Model:
    """One model entry of a spec folder: a file + class the folder's blocks fit."""

    name: str
    patch_id: str
    file: str
    cls: str
    title: str = ""
    architectures: tuple = ()
    known_sha256: dict = field(default_factory=dict)
    source: str = ""  # the spec.json this entry came from
    #: how each SGLang release numbers the drafter's aux layer ids (`layerids.Convention`s)
    layer_ids: tuple[layerids.Convention, ...] = ()

    @property
    def versions(self) -> tuple:
        return tuple(self.known_sha256)


# ------------------------------------------------------------------ finding folders
def search_dirs() -> list[Path]:
    """$REMOTE_OPS_PATCH_PATH directories first, then the bundled templates/patches."""
    extra = [Path(p) for p in os.environ.get(PATH_ENV, "").split(os.pathsep) if p.strip()]
    return extra + [repo_resource("templates", "patches")]


def folders() -> dict[str, Path]:
    """Spec id -> spec.json over every search dir; one id in two places is a ConfigError."""
    found: dict[str, Path] = {}
    for base in search_dirs():
        for path in sorted(base.glob("*/spec.json")) if base.is_dir() else []:
            pid = path.parent.name
            if pid in found:
                raise ConfigError(
                    f"patch spec {pid!r} is defined twice: {found[pid]} and {path}", source=str(path), field="id"
                )
            found[pid] = path
    return found


def spec_dir(patch_id: str = DEFAULT_PATCH) -> Path:
    """Directory of one spec folder (bundled or on $REMOTE_OPS_PATCH_PATH)."""
    path = folders().get(patch_id)
    if path is None:
        raise NotFound(f"patch spec folder {patch_id!r} not found under {_dirs_text()}")
    return path.parent


def _dirs_text() -> str:
    return ", ".join(str(d) for d in search_dirs())


# ------------------------------------------------------------------- reading folders
def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read patch spec: {exc}", source=str(path)) from None
    if not isinstance(data, dict):
        raise ConfigError("a patch spec is a JSON object", source=str(path))
    return data


def folder_doc(patch_id: str, _seen: tuple = ()) -> tuple[dict, Path]:
    """(spec document with `blocks` resolved through `extends`, dir the block files live in)."""
    path = folders().get(patch_id)
    if path is None:
        raise NotFound(f"patch spec folder {patch_id!r} not found under {_dirs_text()}")
    doc = _read_json(path)
    doc.setdefault("id", patch_id)
    base = doc.get("extends")
    if not base:
        return doc, path.parent
    if base in _seen + (patch_id,):
        raise ConfigError(f"`extends` loops through {base!r}", source=str(path), field="extends")
    parent, block_dir = folder_doc(base, _seen + (patch_id,))
    merged = {k: v for k, v in parent.items() if k != "models"}
    merged.update({k: v for k, v in doc.items() if k != "extends"})
    if "blocks" not in doc:
        return {**merged, "id": parent["id"]}, block_dir  # same blocks, same markers
    return merged, path.parent


def _models_of(patch_id: str, path: Path) -> list[Model]:
    doc = _read_json(path)
    out = []
    for i, m in enumerate(doc.get("models") or []):
        where = f"models[{i}]."
        for key in ("name", "file", "class"):
            if not isinstance(m, dict) or not m.get(key):
                raise ConfigError(f"missing key {key!r}", source=str(path), field=where + key)
        layer_ids = _layer_ids(m, doc, str(path), where)
        out.append(
            Model(
                m["name"],
                patch_id,
                m["file"],
                m["class"],
                m.get("title", ""),
                tuple(m.get("architectures", ())),
                dict(m.get("known_sha256", {})),
                str(path),
                layer_ids,
            )
        )
    return out


def _layer_ids(m: dict, doc: dict, source: str, where: str) -> tuple[layerids.Convention, ...]:
    """The model's `eagle3_layer_ids` table, else its folder's, else `plus_one` for every release
    (validated: `layerids.parse_table`)."""
    if "eagle3_layer_ids" in m:
        return layerids.parse_table(m["eagle3_layer_ids"], source, where + "eagle3_layer_ids")
    if "eagle3_layer_ids" in doc:
        return layerids.parse_table(doc["eagle3_layer_ids"], source, "eagle3_layer_ids")
    return (layerids.Convention("0", "plus_one", "no eagle3_layer_ids in the spec: SGLang's historic + 1"),)


def layer_convention(name: str, version: str) -> layerids.Convention | None:
    """How SGLang `version` numbers a drafter's aux layer ids for spec model `name` (None: the
    version names no release)."""
    return layerids.convention_for(model(name).layer_ids, version)


def catalog() -> list[Model]:
    """Every model of every spec folder, bundled last; a name defined twice is a ConfigError."""
    seen: dict[str, Model] = {}
    for pid, path in folders().items():
        for m in _models_of(pid, path):
            if m.name in seen:
                raise ConfigError(
                    f"model spec {m.name!r} is defined twice: {seen[m.name].source} and {m.source}",
                    source=m.source,
                    field="models.name",
                )
            seen[m.name] = m
    return list(seen.values())


def model(name: str) -> Model:
    """The model entry called `name`, or NotFound listing the known names."""
    for m in catalog():
        if m.name == name:
            return m
    raise NotFound(
        f"no patch spec for model {name!r}; known: {', '.join(m.name for m in catalog())} "
        f"(spec folders: {_dirs_text()})"
    )


# ------------------------------------------------------------------------- binding
def bind(m: Model, model_class: str | None = None) -> PatchSpec:
    """The folder's blocks bound to the model's file and class: an `anchors.PatchSpec`."""
    doc, block_dir = folder_doc(m.patch_id)
    data = {
        **{k: v for k, v in doc.items() if k != "models"},
        "name": m.name,
        "class": model_class or m.cls,
        "target": m.file,
        "architectures": list(m.architectures),
        "validated_versions": list(m.versions),
        "known_sha256": m.known_sha256,
    }
    from . import anchors

    try:
        return anchors.spec_from_dict(data, str(block_dir))
    except anchors.SpecError as exc:
        raise ConfigError(str(exc), source=m.source, field=exc.field or None) from None


@lru_cache(maxsize=64)
def _resolve_cached(name: str, model_class: str | None, env: str) -> PatchSpec:
    return bind(model(name), model_class)


def resolve(name: str, model_class: str | None = None) -> PatchSpec:
    """The bound spec of model `name` (cached per $REMOTE_OPS_PATCH_PATH value)."""
    return _resolve_cached(name, model_class, os.environ.get(PATH_ENV, ""))


def load(name_or_path: str | Path) -> PatchSpec:
    """A bound spec by model name, or from a bound spec.json file (what ships to hosts)."""
    path = Path(name_or_path)
    if path.suffix == ".json":
        if not path.is_file():
            raise NotFound(f"patch spec {path} does not exist")
        from . import anchors

        try:
            return anchors.load_spec(str(path))
        except anchors.SpecError as exc:
            raise ConfigError(str(exc), source=str(path), field=exc.field or None) from None
    return resolve(str(name_or_path))


class _SglangSection(Protocol):
    @property
    def patch(self) -> str | None: ...


class NamedHost(Protocol):
    """What `for_host` reads of an inventory host (`core.inventory.HostSpec` is one): a
    protocol, so that this module needs nothing of the inventory's (the inventory imports it)."""

    @property
    def name(self) -> str: ...

    @property
    def source(self) -> str | None: ...

    @property
    def sglang(self) -> _SglangSection: ...


def for_host(host: NamedHost) -> PatchSpec:
    """The bound spec an inventory host names (`sglang.patch`), or ConfigError when it is
    still to be derived on the host (`patching.bind_host` does that)."""
    if not host.sglang.patch:
        raise ConfigError(
            f"host {host.name}: sglang.patch is not set and was not derived from its model's config.json yet",
            source=host.source,
            field="sglang.patch",
        )
    return resolve(host.sglang.patch)


def target_path(checkout: str, spec: PatchSpec) -> str:
    """Absolute path of the spec's target file inside an SGLang checkout."""
    return str(PurePosixPath(checkout) / spec.target)


def package_relative(spec: PatchSpec) -> str:
    """The target inside the installed `sglang` package (srt/models/x.py): images, containers."""
    parts = PurePosixPath(spec.target).parts
    return str(PurePosixPath(*parts[parts.index("sglang") + 1 :])) if "sglang" in parts else spec.target


# ---------------------------------------------------------------------- detection
def for_file(data: bytes | str, model_class: str | None = None) -> PatchSpec:
    """The spec for a local file: its one capture class (or `model_class`), looked up by class.

    Refuses (Refused, exit 9) when the file has no or several capture classes, or
    when no spec covers the class; never picks "the nearest" one."""
    from . import anchors

    try:
        cls = anchors.pick_class(data, model_class)
    except anchors.AnchorRefusal as exc:
        raise Refused(
            exc.message,
            hint="--model-class NAME picks a class" if exc.reason == "ambiguous_class" else None,
            details={"reason": exc.reason, "lines": exc.lines},
        ) from None
    hits = [m for m in catalog() if m.cls == cls]
    if not hits:
        raise Refused(
            f"no patch spec covers class {cls}; specs cover: {', '.join(sorted({m.cls for m in catalog()}))}",
            hint=f"add a model entry to a spec folder on ${PATH_ENV} (see docs/models.md)",
            details={"reason": "no_spec"},
        )
    if len(hits) > 1:
        raise Refused(
            f"class {cls} is covered by several specs: {', '.join(m.name for m in hits)}",
            details={"reason": "ambiguous_spec"},
        )
    return resolve(hits[0].name, model_class)


@dataclass(frozen=True)
class Derivation:
    """How a host's spec was chosen: named in the inventory, or read off config.json."""

    spec: str
    how: str  # "inventory" | "config.json"
    detail: str

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def __str__(self) -> str:
        return f"{self.spec} ({self.detail})"


def for_architectures(archs: list[str], config_path: str = "config.json") -> Derivation:
    """The one model spec serving `architectures[0]` (SGLang picks its class by that name)."""
    if not archs:
        raise Refused(
            f"{config_path} has no `architectures`: cannot tell which model file to patch",
            hint="name the spec in the inventory: sglang.patch",
            details={"reason": "no_architectures"},
        )
    hits = [m for m in catalog() if archs[0] in m.architectures]
    if len(hits) != 1:
        known = ", ".join(f"{a} -> {m.name}" for m in catalog() for a in m.architectures)
        why = "no" if not hits else f"{len(hits)} ({', '.join(m.name for m in hits)})"
        raise Refused(
            f"{config_path} architectures[0] = {archs[0]}: {why} patch spec serves it; known: {known}",
            hint="name the spec in the inventory: sglang.patch",
            details={"reason": "no_spec"},
        )
    return Derivation(hits[0].name, "config.json", f"{config_path} architectures[0] = {archs[0]}")


def parse_config_architectures(text: str, config_path: str) -> list[str]:
    """`architectures` of a model's config.json text (pure); ConfigError when unreadable."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{config_path} is not valid JSON: {exc}", source=config_path) from None
    archs = doc.get("architectures") if isinstance(doc, dict) else None
    return [str(a) for a in archs] if isinstance(archs, list) else []


def bundled_json(spec: PatchSpec) -> str:
    """The bound spec with block text inline: one file to ship beside anchors.py."""
    from . import anchors

    return json.dumps(anchors.spec_to_dict(spec), indent=2) + "\n"


def version_for_sha(spec: PatchSpec, sha256: str) -> str | None:
    """The release whose pristine file has this sha256, if the spec knows it."""
    return next((v for v, s in spec.known_sha256.items() if s == sha256), None)


# ------------------------------------------------------------------------ listing
def table(models: list[Model] | None = None) -> list[list[str]]:
    """Rows of `remote-ops patch specs`: name, models, file, class, architectures, releases."""
    return [
        [m.name, m.title, PurePosixPath(m.file).name, m.cls, ", ".join(m.architectures), ", ".join(m.versions)]
        for m in (models if models is not None else catalog())
    ]


TABLE_HEADERS = ["spec", "models", "file", "class", "config.json architectures", "validated releases"]


def markdown_table(rows: list[list[str]]) -> str:
    """The `patch specs` table as Markdown (docs/models.md is generated from it)."""
    lines = ["| " + " | ".join(TABLE_HEADERS) + " |", "|" + "---|" * len(TABLE_HEADERS)]
    lines += ["| " + " | ".join(f"`{c}`" if i in (0, 2, 3) else c for i, c in enumerate(r)) + " |" for r in rows]
    return "\n".join(lines)
