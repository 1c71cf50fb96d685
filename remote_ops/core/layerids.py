"""EAGLE-3 aux layer ids: how each SGLang release maps a drafter's ids to captured layers (pure).

A drafter's config carries `eagle_config.eagle_aux_hidden_state_layer_ids` (SGLang's
`ModelRunner` reads that key, nested, and nothing else; absent, it passes None).  At
start the target's `set_eagle3_layers_to_capture(ids)` turns those ids into
`layers_to_capture`, the layers whose *entering* residual stream is captured, and
how it does that is a property of the release and the model file:

- `plus_one`: every id + 1 (the ids name layer outputs; SGLang captures at the top of
  the next layer).  Every model file of every release up to 0.5.12, and Llama/Qwen
  after it.
- `plus_one_if_first_is_1`: + 1 only when the first id is 1, the ids as given
  otherwise (sgl-project/sglang PR #25454: DeepSeek-V2/V3/Kimi from 0.5.13 on).

None (no ids) gives SGLang's default `[2, L//2, L-3]` in every release.  The table
per model lives in the patch spec data (`templates/patches/<id>/spec.json`,
`eagle3_layer_ids`), read and validated by `remote_ops.core.patchspec`.

A drafter is served right when the layers the serving release captures for its ids
are the layers its training data (the dumps' `layers_to_capture`) held:
`layer_problems` says what differs, in words.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

RULES = {
    "plus_one": "every id + 1",
    "plus_one_if_first_is_1": "+ 1 only when the first id is 1, else the ids as given",
}
#: Where SGLang's ModelRunner reads a drafter's ids (`eagle_config` is a dict in its config.json).
DRAFT_KEY = "eagle_config.eagle_aux_hidden_state_layer_ids"
_VERSION = re.compile(r"^v?(\d+(?:\.\d+)*)")


@dataclass(frozen=True)
class Convention:
    """From release `since` on (until the next entry), `set_eagle3_layers_to_capture` applies `rule`."""

    since: str
    rule: str
    source: str

    @property
    def words(self) -> str:
        return f"{self.rule} ({RULES[self.rule]})"


def version_key(version: str) -> tuple[int, ...] | None:
    """'0.5.12.post1' -> (0, 5, 12); 'v0.5.9-cu129' -> (0, 5, 9); None when it names no release.
    Pre- and post-releases count as their release."""
    m = _VERSION.match(str(version).strip())
    return tuple(int(p) for p in m.group(1).split(".")) if m else None


def parse_table(raw: Any, source: str, field: str) -> tuple[Convention, ...]:
    """A spec's `eagle3_layer_ids` list -> Conventions; ConfigError naming `source` and `field`.

    Each entry: `since` (a release; the first one "0"), `rule` (one of RULES) and `source`
    (where the rule was read: a PR, a wheel); releases ascend strictly."""
    if not isinstance(raw, list) or not raw:
        raise ConfigError("a non-empty list of {since, rule, source}", source=source, field=field)
    out: list[Convention] = []
    last: tuple[int, ...] | None = None
    for i, entry in enumerate(raw):
        where = f"{field}[{i}]"
        if not isinstance(entry, dict) or set(entry) != {"since", "rule", "source"}:
            raise ConfigError("want exactly the keys since, rule, source", source=source, field=where)
        since, rule, said = entry["since"], entry["rule"], entry["source"]
        key = version_key(since) if isinstance(since, str) else None
        if key is None:
            raise ConfigError(f"since {since!r} is not a release like 0.5.13", source=source, field=where + ".since")
        if i == 0 and any(key):
            raise ConfigError("the first entry starts at release 0", source=source, field=where + ".since")
        if last is not None and key <= last:
            raise ConfigError(f"since {since} does not come after the entry before", source=source, field=where)
        if rule not in RULES:
            raise ConfigError(f"rule {rule!r}: want one of {', '.join(RULES)}", source=source, field=where + ".rule")
        if not isinstance(said, str) or not said.strip():
            raise ConfigError("say where the rule was read (a PR, a wheel)", source=source, field=where + ".source")
        out.append(Convention(since, rule, said))
        last = key
    return tuple(out)


def convention_for(table: Sequence[Convention], version: str) -> Convention | None:
    """The entry in force for `version` (None when the version names no release)."""
    key = version_key(version)
    if key is None:
        return None
    found = None
    for c in table:
        since = version_key(c.since)
        if since is not None and since <= key:
            found = c
    return found


def default_layers(num_layers: int) -> list[int]:
    """SGLang's default `[2, L//2, L-3]` (what None gives)."""
    return [2, num_layers // 2, num_layers - 3]


def served_layers(rule: str, ids: Sequence[int] | None, num_layers: int | None) -> list[int] | None:
    """The `layers_to_capture` a release with `rule` sets for a drafter's `ids` (None: the
    default, which needs `num_layers`; None back when it is unknown)."""
    if ids is None:
        return default_layers(num_layers) if num_layers else None
    if rule == "plus_one" or (rule == "plus_one_if_first_is_1" and ids and ids[0] == 1):
        return [int(i) + 1 for i in ids]
    return [int(i) for i in ids]


def ids_for(rule: str, layers: Sequence[int]) -> list[int] | None:
    """The drafter ids that make a release with `rule` capture `layers` (None: no ids can)."""
    plus = [int(i) - 1 for i in layers]
    if rule == "plus_one":
        return plus
    if plus and plus[0] == 1:  # plus_one_if_first_is_1: [1, ...] is read as outputs
        return plus
    return list(layers) if layers and layers[0] != 1 else None


@dataclass(frozen=True)
class DraftConfig:
    """What a drafter's config.json says about the contract: its ids as SGLang reads them
    (None: absent, SGLang takes the default), its target hidden size, and what is wrong."""

    ids: list[int] | None
    hidden_size: int | None
    notes: tuple[str, ...] = ()


def read_draft_config(doc: Any) -> DraftConfig:
    """The contract fields of a drafter's config.json document (pure).

    The ids are `eagle_config.eagle_aux_hidden_state_layer_ids` (SGLang reads only that);
    a top-level key of the same name is named in `notes`, since SGLang ignores it.  The
    hidden size compared with the dumps is `target_hidden_size` when set, else `hidden_size`."""
    if not isinstance(doc, dict):
        return DraftConfig(None, None, ("the draft config is not a JSON object",))
    notes: list[str] = []
    eagle = doc.get("eagle_config")
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    if ids is None and "eagle_aux_hidden_state_layer_ids" in doc:
        notes.append(
            "eagle_aux_hidden_state_layer_ids is at the top level, where SGLang does not read it "
            f"(it reads {DRAFT_KEY}): the server would capture its default layers"
        )
    if ids is not None and (not isinstance(ids, list) or not all(type(i) is int for i in ids)):
        notes.append(f"{DRAFT_KEY} is not a list of integers: {ids!r}")
        ids = None
    if isinstance(eagle, dict) and eagle.get("use_aux_hidden_state") is False:
        notes.append("eagle_config.use_aux_hidden_state is false: the drafter takes no aux states")
    size = doc.get("target_hidden_size") or doc.get("hidden_size")
    return DraftConfig(ids, size if type(size) is int else None, tuple(notes))


def layer_problems(
    dump_layers: Sequence[int],
    dump_eagle_ids: Sequence[int] | None,
    convention: Convention | None,
    serving_version: str,
    num_layers: int | None,
    draft: DraftConfig | None = None,
) -> tuple[list[str], list[str]]:
    """(failures, notes) of the layer-id contract, in words (pure).

    - the dumps' own record: `eagle_aux_hidden_state_layer_ids` = layers_to_capture - 1;
    - with a drafter: the layers SGLang `serving_version` captures for its ids must be the
      dumps' layers; its config's own notes are failures too;
    - without one: which ids a drafter served by that release must carry; a note when they
      differ from the ids the dumps record, a failure when no ids can give those layers."""
    fails: list[str] = []
    notes: list[str] = []
    layers = [int(i) for i in dump_layers]
    if dump_eagle_ids is not None and list(dump_eagle_ids) != [i - 1 for i in layers]:
        fails.append(
            f"the dumps record eagle_aux_hidden_state_layer_ids {list(dump_eagle_ids)}, "
            f"not layers_to_capture {layers} - 1"
        )
    if convention is None:
        fails.append(f"SGLang {serving_version!r}: no numbering convention is known for this release")
        return fails, notes
    rule = f"SGLang {serving_version} ({convention.words})"
    if draft is not None:
        fails += list(draft.notes)
        served = served_layers(convention.rule, draft.ids, num_layers)
        if served != layers:
            want = ids_for(convention.rule, layers)
            fails.append(
                f"the drafter's {DRAFT_KEY} {draft.ids} would make {rule} capture layers {served}; "
                f"the dumps hold layers {layers}"
                + (f" (a drafter served there needs {want})" if want is not None else "")
            )
        return fails, notes
    want = ids_for(convention.rule, layers)
    if want is None:
        fails.append(f"no drafter ids make {rule} capture the dumps' layers {layers}")
    elif dump_eagle_ids is not None and want != list(dump_eagle_ids):
        notes.append(
            f"a drafter served by {rule} needs {DRAFT_KEY} = {want}, not the {list(dump_eagle_ids)} the dumps record"
        )
    return fails, notes
