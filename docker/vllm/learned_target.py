"""Make the sandbox vLLM's target: a tiny Llama TRAINED on the Python standard library's sources.

A drafter can only be judged on a target that has learned something: a seeded random network
has nearly uniform logits (std ~0.23), no drafter learns from it, and vLLM's bf16 greedy output
parts from a float32 reference within a few tokens.  This script makes one that has learned:

- **Text**: the `.py` sources of Debian's python3.11 under /usr/lib/python3.11 (packages
  libpython3.11-minimal and libpython3.11-stdlib, on every Debian 12 machine with Python), as
  regular files, sorted by path, leaving out generated tables and data (`encodings/`,
  `pydoc_data/`), the test package, the directories other packages install (`distutils/`,
  `lib2to3/`, `ensurepip/`, `config-3.11-*`, site/dist-packages) and `_sysconfigdata*`.
  Files are split by their index in that sorted list: index % 10 == 3 is `validation` (the
  loss reported below), index % 10 == 7 is `heldout` (never trained on: the drafter's
  held-out prompts come from these files), the rest `train`.  `split.json` in the model dir
  names every file with its size and sha256, and holds `prompts`: 16 snippets of held-out
  files, the prompts of the real-vLLM agreement test.
- **Tokenizer**: a byte-level BPE of `VOCAB` tokens trained with `tokenizers` on the train
  files (`<s>`=0, `</s>`=1, `<unk>`=2); each file is `<s>` + its text + `</s>`.  Its
  `chat_template` concatenates the turns' text (`CHAT_TEMPLATE`).
- **Model**: `LlamaForCausalLM`, 4 layers, hidden 128, 4 heads (2 KV heads), MLP 384,
  untied `lm_head`, ~1.3 M parameters.  The final RMSNorm's weight is a FIXED seeded
  log-normal vector (exp(N(0, `NORM_SIGMA`)), not trained): with the usual init at 1 it stays
  near 1 and the norm hardly changes which token wins (98 % of positions equal in a first
  attempt), while in real models it does (vllm-project/speculators #313).  A capture that
  leaves the final state pre-norm must really teach a drafter something wrong here;
  `training.json` reports the share of positions whose argmax is the same with and without it.
- **Training**: AdamW, `STEPS` steps of `BATCH` windows of `CONTEXT` tokens drawn at seeded
  offsets from the train stream, float32 on the CPU with `THREADS` threads; then cast to bf16
  and written with `save_pretrained` (safetensors, `config.json`, the tokenizer files) plus
  `model.safetensors.index.json` (SpecForge's TargetHead needs exactly one `*.index.json`),
  `split.json`, `training.json` (losses, the norm's effect, wall time) and `SHA256SUMS`.

The files are made ONCE and committed (docker/vllm/learned-target/, 2.9 MB): the sandbox image
copies them once their checksums match (remote_ops/hostlab/vllm.py), CI never trains.  The
committed files were made on one NVIDIA H200 (`--device cuda`, deterministic algorithms, no TF32;
torch 2.11.0+cu130, transformers 5.17.0, tokenizers 0.23.2; `training.json` says so): 3,000 steps
in 98 s; a second run gave bit-identical weights.  On the CPU (`--device cpu`, `THREADS` threads)
the same script trains the same model up to floating-point order; a step of 16 x 512 tokens took
12 s on two cores shared with other work (about 10 hours for 3,000 steps), which is why it ran on
a GPU.  The tokenizer is trained on the CPU either way (the same tokenizer.json here and there).

    python learned_target.py make OUT_DIR [--steps N] [--device cuda] [--stdlib DIR]
    python learned_target.py check DIR    # every file matches SHA256SUMS
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAYON_NUM_THREADS", "2")  # tokenizers' trainer

SEED = 20261204
STDLIB = "/usr/lib/python3.11"
EXCLUDED_DIRS = {
    "encodings",
    "pydoc_data",
    "test",
    "distutils",
    "lib2to3",
    "ensurepip",
    "site-packages",
    "dist-packages",
    "idlelib",
    "turtledemo",
    "__pycache__",
}
VOCAB = 2048
SPECIALS = ["<s>", "</s>", "<unk>"]
LAYERS = 4
HIDDEN = 128
INTERMEDIATE = 384
HEADS = 4
KV_HEADS = 2
NORM_SIGMA = 1.0
CONTEXT = 512
BATCH = 16
STEPS = 3000
WARMUP = 60
LR = 4e-3
MIN_LR = 2e-4
WEIGHT_DECAY = 0.1
THREADS = 2
EVAL_WINDOWS = 48
PROMPTS = 16
SUMS = "SHA256SUMS"
# The turns' text, concatenated: vLLM then serves /v1/chat/completions (`dataset regenerate`).
CHAT_TEMPLATE = "{%- for message in messages -%}{{ message['content'] }}{%- endfor -%}"


# -- the text ------------------------------------------------------------------
def corpus_files(root: str = STDLIB) -> list[Path]:
    """The sorted `.py` regular files of `root` that the corpus uses (module docstring)."""
    base = Path(root)
    out = []
    for p in base.rglob("*.py"):
        rel = p.relative_to(base)
        if p.is_symlink() or not p.is_file():
            continue
        if rel.parts[0] in EXCLUDED_DIRS or rel.parts[0].startswith("config-") or "__pycache__" in rel.parts:
            continue
        if rel.name.startswith("_sysconfigdata"):
            continue
        out.append(p)
    return sorted(out, key=lambda p: p.relative_to(base).as_posix())


def split_of(index: int) -> str:
    return {3: "validation", 7: "heldout"}.get(index % 10, "train")


def read_split(root: str = STDLIB) -> dict[str, list[tuple[str, str]]]:
    """{split: [(relative path, text)]}, every file decoded as UTF-8."""
    base = Path(root)
    parts: dict[str, list[tuple[str, str]]] = {"train": [], "validation": [], "heldout": []}
    for i, p in enumerate(corpus_files(root)):
        parts[split_of(i)].append((p.relative_to(base).as_posix(), p.read_text(encoding="utf-8")))
    return parts


def snippets(files: list[tuple[str, str]], n: int = PROMPTS, chars: int = 320) -> list[dict]:
    """`n` prompts from held-out files: from the first line start past a third of the file, whole
    lines up to about `chars` characters (files too short are passed over)."""
    out = []
    for path, text in files:
        if len(text) < 3 * chars:
            continue
        start = text.find("\n", len(text) // 3) + 1
        end = text.rfind("\n", start, start + chars) + 1
        if end <= start:
            continue
        out.append({"file": path, "offset": start, "text": text[start:end]})
        if len(out) == n:
            break
    return out


# -- the tokenizer -------------------------------------------------------------
def make_tokenizer(texts: list[str], out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(out))
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return fast


def token_stream(tok, files: list[tuple[str, str]]):
    import torch

    ids: list[int] = []
    for _, text in files:
        ids.append(tok.bos_token_id)
        ids.extend(tok(text, add_special_tokens=False)["input_ids"])
        ids.append(tok.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


# -- the model -----------------------------------------------------------------
def make_config(vocab_size: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )


def make_model(vocab_size: int):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(SEED)
    model = LlamaForCausalLM(make_config(vocab_size))
    gen = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        model.model.norm.weight.copy_(torch.exp(NORM_SIGMA * torch.randn(HIDDEN, generator=gen)))
    model.model.norm.weight.requires_grad_(False)
    return model


def eval_windows(stream, n: int = EVAL_WINDOWS):
    """Up to `n` non-overlapping windows of CONTEXT+1 tokens, spread evenly over `stream`."""
    import torch

    count = min(n, (len(stream) - 1) // (CONTEXT + 1))
    step = (len(stream) - CONTEXT - 1) // max(count, 1)
    return torch.stack([stream[i * step : i * step + CONTEXT + 1] for i in range(count)])


def mean_loss(model, windows, batch: int = 8) -> float:
    import torch

    windows = windows.to(next(model.parameters()).device)
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            w = windows[i : i + batch]
            logits = model(w[:, :-1]).logits.float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))
            total += float(loss) * w[:, 1:].numel()
            count += w[:, 1:].numel()
    return total / count


def norm_effect(model, windows, batch: int = 8) -> dict:
    """How much the final RMSNorm decides the token: the share of positions where
    argmax(lm_head(pre-norm state)) equals argmax(lm_head(norm(pre-norm state))), and the mean
    top-1 probability each way."""
    import torch

    windows = windows.to(next(model.parameters()).device)
    same, count, p_post, p_pre = 0, 0, 0.0, 0.0
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            out = model.model(windows[i : i + batch, :-1])
            post = out.last_hidden_state
            pre = _pre_norm(model, windows[i : i + batch, :-1])
            lp, lq = model.lm_head(post).float(), model.lm_head(pre).float()
            same += int((lp.argmax(-1) == lq.argmax(-1)).sum())
            count += lp.shape[0] * lp.shape[1]
            p_post += float(lp.softmax(-1).amax(-1).sum())
            p_pre += float(lq.softmax(-1).amax(-1).sum())
    return {
        "argmax_equal_share": round(same / count, 4),
        "positions": count,
        "mean_top1_prob_post_norm": round(p_post / count, 4),
        "mean_top1_prob_pre_norm": round(p_pre / count, 4),
    }


def _pre_norm(model, ids):
    captured = {}

    def keep(_m, _i, output):
        captured["x"] = output[0] if isinstance(output, tuple) else output

    hook = model.model.layers[-1].register_forward_hook(keep)
    try:
        model.model(ids)
    finally:
        hook.remove()
    return captured["x"]


def lr_at(step: int, steps: int) -> float:
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    t = (step - WARMUP) / max(1, steps - WARMUP)
    return MIN_LR + 0.5 * (LR - MIN_LR) * (1 + math.cos(math.pi * t))


def train(model, stream, val, steps: int, log) -> list[dict]:
    import torch

    device = next(model.parameters()).device

    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}],
        lr=LR,
        betas=(0.9, 0.95),
    )
    rng = random.Random(SEED)
    history = []
    running, t0 = 0.0, time.monotonic()
    for step in range(steps):
        offsets = [rng.randrange(0, len(stream) - CONTEXT - 1) for _ in range(BATCH)]
        w = torch.stack([stream[o : o + CONTEXT + 1] for o in offsets]).to(device)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps)
        model.train()
        logits = model(w[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        running += float(loss.detach())
        if (step + 1) % 100 == 0 or step + 1 == steps:
            model.eval()
            n = 100 if (step + 1) % 100 == 0 else (step + 1) % 100
            entry = {
                "step": step + 1,
                "train_loss": round(running / n, 4),
                "validation_loss": round(mean_loss(model, val), 4),
                "elapsed_s": round(time.monotonic() - t0, 1),
            }
            history.append(entry)
            running = 0.0
            log(json.dumps(entry))
    return history


# -- the files -----------------------------------------------------------------
def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_index(out: Path) -> None:
    """model.safetensors.index.json for the single shard save_pretrained wrote."""
    from safetensors import safe_open

    shard = out / "model.safetensors"
    with safe_open(str(shard), framework="pt") as f:
        names = sorted(f.keys())
    index = {"metadata": {"total_size": shard.stat().st_size}, "weight_map": dict.fromkeys(names, shard.name)}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def write_sums(out: Path) -> None:
    lines = [f"{sha256(p)}  {p.name}\n" for p in sorted(out.iterdir()) if p.is_file() and p.name != SUMS]
    (out / SUMS).write_text("".join(lines))


def check(model_dir: str | Path) -> list[str]:
    """What is wrong with `model_dir` against its SHA256SUMS ([] when every file matches and no
    file is missing or extra)."""
    d = Path(model_dir)
    sums = d / SUMS
    if not sums.is_file():
        return [f"{sums} missing"]
    want = {}
    for line in sums.read_text().splitlines():
        digest, name = line.split(None, 1)
        want[name.lstrip("*")] = digest
    have = {p.name for p in d.iterdir() if p.is_file() and p.name != SUMS}
    problems = [f"{name}: missing" for name in sorted(set(want) - have)]
    problems += [f"{name}: not in {SUMS}" for name in sorted(have - set(want))]
    problems += [f"{name}: sha256 differs" for name in sorted(set(want) & have) if sha256(d / name) != want[name]]
    return problems


def make(out: Path, steps: int, root: str = STDLIB, device: str = "cpu") -> None:
    import tokenizers
    import torch
    import transformers

    torch.set_num_threads(THREADS)
    if device.startswith("cuda"):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    t_start = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t_start:7.1f}s] {msg}", file=sys.stderr, flush=True)

    out.mkdir(parents=True, exist_ok=True)
    parts = read_split(root)
    log(", ".join(f"{k}: {len(v)} files, {sum(len(t.encode()) for _, t in v)} bytes" for k, v in parts.items()))
    tok = make_tokenizer([t for _, t in parts["train"]], out)
    streams = {k: token_stream(tok, v) for k, v in parts.items()}
    log("tokens: " + ", ".join(f"{k} {len(s)}" for k, s in streams.items()))
    model = make_model(len(tok)).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"parameters: {n_params}")
    val, held = eval_windows(streams["validation"]), eval_windows(streams["heldout"])
    model.eval()
    start = {"validation_loss": round(mean_loss(model, val), 4)}
    log(f"before training: {start}")
    t_train = time.monotonic()
    history = train(model, streams["train"], val, steps, log)
    train_s = time.monotonic() - t_train
    model = model.to("cpu", torch.bfloat16).eval()
    model.save_pretrained(str(out), safe_serialization=True)
    write_index(out)
    final = model.float().eval()
    train_eval = eval_windows(streams["train"])
    result = {
        "seed": SEED,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "device": device if device == "cpu" else f"{device} ({torch.cuda.get_device_name(device)})",
        "threads": THREADS,
        "parameters": n_params,
        "steps": steps,
        "batch": BATCH,
        "context": CONTEXT,
        "tokens_seen": steps * BATCH * CONTEXT,
        "train_wall_s": round(train_s, 1),
        "initial": start,
        "history": history,
        "final_bf16": {
            "train_loss": round(mean_loss(final, train_eval), 4),
            "validation_loss": round(mean_loss(final, val), 4),
            "heldout_loss": round(mean_loss(final, held), 4),
        },
        "final_norm": {
            "weight_min": round(float(final.model.norm.weight.min()), 4),
            "weight_max": round(float(final.model.norm.weight.max()), 4),
            "validation": norm_effect(final, val),
        },
    }
    log(json.dumps({k: result[k] for k in ("final_bf16", "final_norm", "train_wall_s")}))
    files = {
        k: [{"file": p, "bytes": len(t.encode()), "sha256": hashlib.sha256(t.encode()).hexdigest()} for p, t in v]
        for k, v in parts.items()
    }
    split = {
        "source": f"{STDLIB}/**/*.py, the files named below (module docstring of docker/vllm/learned_target.py)",
        "rule": "sorted by path; index % 10 == 3: validation, index % 10 == 7: heldout, else train",
        "tokens": {k: len(s) for k, s in streams.items()},
        "files": files,
        "prompts": snippets(parts["heldout"]),
    }
    (out / "split.json").write_text(json.dumps(split, indent=1, sort_keys=True) + "\n")
    (out / "training.json").write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    write_sums(out)
    log(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make", help="train the target and write its model dir")
    mk.add_argument("out", type=Path)
    mk.add_argument("--steps", type=int, default=STEPS)
    mk.add_argument("--stdlib", default=STDLIB)
    mk.add_argument("--device", default="cpu", help="cpu (THREADS threads) or cuda (deterministic algorithms)")
    ck = sub.add_parser("check", help="verify a model dir against its SHA256SUMS")
    ck.add_argument("dir", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "make":
        make(args.out, args.steps, args.stdlib, args.device)
        return 0
    problems = check(args.dir)
    for p in problems:
        print(f"{args.dir}: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
