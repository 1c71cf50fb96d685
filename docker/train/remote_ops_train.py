"""The training image's entrypoint (remote-ops, docker/train/): `specforge train|export`, plus two things SpecForge 0.2.0 needs.

    remote_ops_train.py train --config RUN_YAML
    remote_ops_train.py export --to hf|sglang --checkpoint CKPT --draft-config CFG --output-dir OUT
        --embedding-source TARGET [--drop-vocab-mapping-if-full]

1. SpecForge's TargetHead reads the target's `lm_head` through exactly one `*.index.json` in the
   target dir.  A model saved as one `model.safetensors` has none: then a view of the dir is made
   under /tmp (a symlink to each file, plus a `model.safetensors.index.json` mapping every tensor
   to its file, read from the safetensors headers) and SpecForge is pointed at it
   (`model.target_model_path=VIEW`, `--embedding-source VIEW`).  A dir with an index is used as is.
2. `export --drop-vocab-mapping-if-full`: when the draft vocabulary is the target's, SpecForge's
   export still writes `d2t`/`t2d`, which vLLM's llama_eagle3 `load_weights` refuses ("no module
   or parameter named 'draft_id_to_target_id'"); they are then removed from `model.safetensors`
   (they map every id to itself: nothing is lost).  A smaller draft vocabulary keeps them.

Everything else is SpecForge's own CLI (`specforge.cli.main`), unchanged.
"""

import glob
import json
import os
import struct
import sys

VIEW = "/tmp/remote-ops-target"


def safetensors_keys(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100 << 20:
            raise SystemExit(f"remote-ops: {path}: safetensors header of {n} bytes")
        return [k for k in json.loads(f.read(n)) if k != "__metadata__"]


def target_dir(model):
    """`model` when it has one `*.index.json`, else a view of it with one (made under /tmp)."""
    if len(glob.glob(os.path.join(model, "*.index.json"))) == 1:
        return model
    files = sorted(glob.glob(os.path.join(model, "*.safetensors")))
    if not files:
        raise SystemExit(f"remote-ops: {model} has no *.index.json and no *.safetensors")
    os.makedirs(VIEW, exist_ok=True)
    for name in os.listdir(model):
        link = os.path.join(VIEW, name)
        if not os.path.lexists(link):
            os.symlink(os.path.join(model, name), link)
    weight_map = {k: os.path.basename(f) for f in files for k in safetensors_keys(f)}
    with open(os.path.join(VIEW, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"made_by": "remote-ops (no index in the model dir)"}, "weight_map": weight_map}, fh)
    print(f"remote-ops: {model} has no *.index.json: SpecForge reads the view {VIEW}", file=sys.stderr)
    return VIEW


def _value(argv, flag):
    return argv[argv.index(flag) + 1] if flag in argv else None


def _set(argv, flag, value):
    argv[argv.index(flag) + 1] = value


def drop_full_vocab_mapping(out_dir):
    """Remove d2t/t2d from the export when the draft vocabulary equals the target's."""
    cfg = json.load(open(os.path.join(out_dir, "config.json")))
    if cfg.get("draft_vocab_size") not in (None, cfg.get("vocab_size")):
        return False
    from safetensors.torch import load_file, save_file

    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    if not {"d2t", "t2d"} & set(tensors):
        return False
    for k in ("d2t", "t2d"):
        tensors.pop(k, None)
    save_file(tensors, path + ".tmp", metadata={"format": "pt"})
    os.replace(path + ".tmp", path)
    print("remote-ops: draft vocabulary = target vocabulary: d2t/t2d removed (vLLM refuses them)", file=sys.stderr)
    return True


def main(argv):
    from specforge.cli import main as specforge_main

    argv = list(argv)
    if argv[:1] == ["train"]:
        import yaml

        cfg = yaml.safe_load(open(_value(argv, "--config")))
        view = target_dir(cfg["model"]["target_model_path"])
        if view != cfg["model"]["target_model_path"]:
            argv.append(f"model.target_model_path={view}")
        return specforge_main(argv)
    if argv[:1] == ["export"]:
        drop = "--drop-vocab-mapping-if-full" in argv
        argv = [a for a in argv if a != "--drop-vocab-mapping-if-full"]
        source = _value(argv, "--embedding-source")
        if source and os.path.isdir(source):
            _set(argv, "--embedding-source", target_dir(source))
        rc = specforge_main(argv)
        if not rc and drop and _value(argv, "--to") == "hf":
            drop_full_vocab_mapping(_value(argv, "--output-dir"))
        return rc
    return specforge_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]) or 0)
