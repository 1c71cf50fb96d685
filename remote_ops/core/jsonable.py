"""Result objects as plain JSON values (pure): what `--json` prints and what run records hold."""

from __future__ import annotations

from dataclasses import asdict, is_dataclass
from typing import Any


def fields_of(obj: Any, names: str, **values: Any) -> dict[str, Any]:
    """A result object's `to_dict`: the keys `names` (space-separated) in that order, each the
    value given in `values` (computed, renamed, nested) or else `obj`'s attribute of that name;
    keys of `values` that `names` does not list come last."""
    keys = names.split()
    return {k: values[k] if k in values else getattr(obj, k) for k in keys + [k for k in values if k not in keys]}


def to_jsonable(obj: Any) -> Any:
    """Dataclasses, pydantic models, paths and tuples -> plain JSON values."""
    if hasattr(obj, "to_dict"):
        return to_jsonable(obj.to_dict())
    if is_dataclass(obj) and not isinstance(obj, type):
        return to_jsonable(asdict(obj))
    if hasattr(obj, "model_dump"):
        return to_jsonable(obj.model_dump(mode="json"))
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)
