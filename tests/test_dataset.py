"""`dataset prepare`: loss masks from a REAL tokenizer (trained here with `tokenizers`, loaded
through transformers' AutoTokenizer with a chat template), checked token by token."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from remote_ops.onhost import dataset as ds

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Kimi-style: no {% generation %} markers, role tags as special tokens, no newline after the end marker.
KIMI_LIKE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}<|im_system|>system<|im_middle|>"
    "{% elif m['role'] == 'user' %}<|im_user|>user<|im_middle|>"
    "{% else %}<|im_assistant|>assistant<|im_middle|>{% endif %}{{ m['content'] }}<|im_end|>"
    "{% endfor %}{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)
# Not prefix-stable: the last message is rendered differently from earlier ones.
UNSTABLE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>"
    "{% if loop.last %}[end]{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<s>", "<|im_start|>", "<|im_end|>", "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>"]
CORPUS = [
    "You are a helpful assistant.",
    "What is the capital of France?",
    "Paris is the capital.",
    "Tell me a joke about cats.",
    "Why did the cat sit on the computer? To keep an eye on the mouse!",
    "Thanks! And one more, please.",
    "Sure: a dog walks into a bar.",
    "system user assistant",
] * 20


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A byte-level BPE tokenizer trained here, saved as a transformers tokenizer dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>", additional_special_tokens=SPECIALS[1:]
    )
    fast.chat_template = CHATML
    out = tmp_path_factory.mktemp("tok")
    fast.save_pretrained(out)
    return out


def load(tokenizer_dir, template=None):
    tok = ds.load_tokenizer(str(tokenizer_dir))
    if template:
        tok.chat_template = template
    return tok


def expected_mask(tokens: list[str], openers: set[str], role_end: str, end: str) -> list[int]:
    """Independent oracle on the token sequence: a header is an opener token, the role's tokens, then
    `role_end`; after an `assistant` header every token is 1 through the next `end` marker."""
    mask, i = [0] * len(tokens), 0
    while i < len(tokens):
        if tokens[i] not in openers:
            i += 1
            continue
        j = tokens.index(role_end, i + 1)
        role, i = "".join(tokens[i + 1 : j]), j + 1
        while role == "assistant" and i < len(tokens):
            mask[i] = 1
            i += 1
            if tokens[i - 1] == end:
                break
    return mask


CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital."},
    {"role": "user", "content": "Tell me a joke about cats."},
    {"role": "assistant", "content": "Why did the cat sit on the computer? To keep an eye on the mouse!"},
]


def test_multi_turn_with_system_prompt_masks_exactly_the_assistant_tokens(tokenizer_dir):
    tok = load(tokenizer_dir)
    ids, mask, stable = ds.tokenize_sample(tok, CONVERSATION)
    tokens = tok.convert_ids_to_tokens(ids)
    assert stable and mask == expected_mask(tokens, {"<|im_start|>"}, "Ċ", "<|im_end|>")
    masked = tok.decode([i for i, m in zip(ids, mask) if m])
    assert masked == (
        "Paris is the capital.<|im_end|>Why did the cat sit on the computer? To keep an eye on the mouse!<|im_end|>"
    )
    assert tokens.count("<|im_end|>") == 5 and sum(1 for t, m in zip(tokens, mask) if m and t == "<|im_end|>") == 2
    assert ids == tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"]


def test_kimi_like_template_without_generation_markers(tokenizer_dir):
    tok = load(tokenizer_dir, KIMI_LIKE)
    ids, mask, stable = ds.tokenize_sample(tok, CONVERSATION)
    tokens = tok.convert_ids_to_tokens(ids)
    assert stable and mask == expected_mask(
        tokens, {"<|im_system|>", "<|im_user|>", "<|im_assistant|>"}, "<|im_middle|>", "<|im_end|>"
    )
    assert sum(mask) > 10 and tokens[mask.index(1)] != "<|im_middle|>"


def test_template_that_is_not_prefix_stable_falls_back_to_the_reply_text(tokenizer_dir):
    tok = load(tokenizer_dir, UNSTABLE)
    ids, mask, stable = ds.tokenize_sample(tok, CONVERSATION[1:3])
    assert not stable
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "Paris is the capital."


def test_sharegpt_and_openai_records_give_the_same_sample(tokenizer_dir):
    tok = load(tokenizer_dir)
    share = {
        "id": "s1",
        "conversations": [
            {"from": "system", "value": CONVERSATION[0]["content"]},
            {"from": "human", "value": CONVERSATION[1]["content"]},
            {"from": "gpt", "value": CONVERSATION[2]["content"]},
        ],
    }
    openai = {"id": "s1", "messages": CONVERSATION[:3]}
    a, _ = ds.prepare_lines(tok, [json.dumps(share)])
    b, _ = ds.prepare_lines(tok, [json.dumps(openai)])
    assert list(a) == list(b)


def test_truncate_keeps_the_head_and_drop_skips_and_both_are_counted(tokenizer_dir):
    tok = load(tokenizer_dir)
    full, full_mask, _ = ds.tokenize_sample(tok, CONVERSATION)
    cut = full_mask.index(1) + 3  # three tokens into the first reply
    lines = [
        json.dumps({"id": "long", "messages": CONVERSATION}),
        json.dumps({"id": "short", "messages": CONVERSATION[1:3]}),
        json.dumps({"id": "no-reply-left", "messages": CONVERSATION[:3]}),
        "{not json",
        json.dumps({"id": "x", "messages": CONVERSATION[:2]}),
    ]
    recs, report = ds.prepare_lines(tok, lines, max_length=cut, overflow="truncate")
    out = {r["id"]: r for r in recs}
    assert out["long"]["input_ids"] == full[:cut] and out["long"]["loss_mask"] == full_mask[:cut]
    assert sum(out["long"]["loss_mask"]) == 3
    assert report.truncated >= 1 and len(report.bad_records) == 2 and "no assistant turn" in report.bad_records[1]
    recs, report = ds.prepare_lines(tok, lines[:2], max_length=cut, overflow="drop")
    assert [r["id"] for r in recs] == ["short"] and report.dropped_too_long == 1 and report.truncated == 0


def test_a_sample_cut_before_its_first_reply_is_dropped(tokenizer_dir):
    tok = load(tokenizer_dir)
    _, mask, _ = ds.tokenize_sample(tok, CONVERSATION)
    recs, report = ds.prepare_lines(tok, [json.dumps({"messages": CONVERSATION})], max_length=mask.index(1))
    assert list(recs) == [] and report.dropped_no_assistant == 1 and report.written == 0


def test_cli_prepare_writes_jsonl_and_reports(tokenizer_dir, tmp_path):
    src, dest = tmp_path / "chat.jsonl", tmp_path / "prepared.jsonl"
    src.write_text(
        "".join(json.dumps({"id": f"c{i}", "messages": CONVERSATION[: 3 + 2 * (i % 2)]}) + "\n" for i in range(4))
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "remote_ops",
            "dataset",
            "prepare",
            str(src),
            "-o",
            str(dest),
            "--tokenizer",
            str(tokenizer_dir),
            "--max-length",
            "4096",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    rows = [json.loads(l) for l in dest.read_text().splitlines()]
    assert report["written"] == 4 and [r["id"] for r in rows] == ["c0", "c1", "c2", "c3"]
    assert all(len(r["input_ids"]) == len(r["loss_mask"]) for r in rows)
    assert report["assistant_tokens"] == sum(sum(r["loss_mask"]) for r in rows)


def test_standalone_script_is_what_runs_on_the_host(tokenizer_dir, tmp_path):
    """The module runs as `python3 - prepare ...` with itself on stdin (how --on-host ships it)."""
    src, dest = tmp_path / "chat.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"messages": CONVERSATION[1:3]}) + "\n")
    proc = subprocess.run(
        [sys.executable, "-", "prepare", "--tokenizer", str(tokenizer_dir), "--input", str(src), "--output", str(dest)],
        input=Path(ds.__file__).read_bytes(),
        capture_output=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["written"] == 1 and json.loads(dest.read_text())["id"] == "1"


def test_on_host_command_runs_the_script_in_a_throwaway_container_of_the_served_image():
    from remote_ops.core.inventory import HostSpec
    from remote_ops.workflows.dataset import on_host_command

    spec = HostSpec(name="gpu-node", container={"name": "sglang-eagle3"})
    cmd = on_host_command(
        spec,
        "/data/logs/dataset",
        "/models/Kimi K2.5",
        "/data/logs/dataset/source.jsonl",
        "/data/logs/dataset/prepared.jsonl",
        4096,
        "drop",
        False,
    )
    assert cmd.startswith("docker run --rm -i --pull=never --network none --entrypoint python3 ")
    assert (
        "'/models/Kimi K2.5:/models/Kimi K2.5:ro'" in cmd
        and "docker inspect -f '{{.Config.Image}}' sglang-eagle3)" in cmd
    )
    assert cmd.endswith(
        "- prepare --tokenizer '/models/Kimi K2.5' --input /data/logs/dataset/source.jsonl "
        "--output /data/logs/dataset/prepared.jsonl --overflow drop --max-length 4096"
    )
