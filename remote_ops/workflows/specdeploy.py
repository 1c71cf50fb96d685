"""`spec deploy`: serve the target with a trained EAGLE-3 drafter through `deploy` (check -> act -> verify).

The command parses and renders; what the server is started with is decided here and in the
serving modules (`remote_ops.serving.sglang.spec_host`, `remote_ops.serving.vllm.spec_host`):

- `settings`: the inventory's `speculative:` section with the command's overrides (pure;
  UsageError, exit 2, before any host is contacted).  On vLLM the drafter proposes a chain of
  `num_steps` tokens (`num_speculative_tokens`), so `eagle_topk` must be 1.
- `spec_host`: the host spec with the drafter (SGLang: `--speculative-algorithm EAGLE3 ...`
  in `server.extra_args`; vLLM: `--speculative-config '{"method": "eagle3", "model": DRAFT,
  "num_speculative_tokens": K}'`, extraction and its KV connector off), the draft dir mounted
  read-only.  `target_only` (vLLM): the target alone, the baseline `spec bench` compares with.
- `check_drafter`: the drafter's config.json on the host against the dumps' capture contract
  under the serving engine's own numbering (`workflows.audit.drafter_guard`: SGLang's per
  release from the patch spec, vLLM's `core.layerids.VLLM_LAYER_IDS`); exit 9 when it does not fit.
- `check_flags` (SGLang): each flag passed exists in the host's SGLang release, read from its
  checkout's `server_args.py` (`serving.sglang.flag_problems`); exit 9 otherwise.
- `deploy`: `workflows.deploy.deploy` of that spec: the restart happens only when the run
  settings differ (a re-run is a no-op), `--dry-run` and `--diff` as deploy's.  A plain
  `deploy` afterwards restores the inventory's server (SGLang's, or vLLM's extraction server).
"""

from __future__ import annotations

from typing import Any

from ..core import shell
from ..core.inventory import HostSpec
from ..errors import NotFound, Refused, UsageError
from ..remote import Remote

#: Bytes of the host's `server_args.py` read at most (SGLang 0.5.9's is ~230 kB).
SERVER_ARGS_CAP = 4 * 1024 * 1024


def settings(
    spec: HostSpec,
    draft: str | None,
    num_steps: int | None,
    eagle_topk: int | None,
    num_draft_tokens: int | None,
    target_only: bool = False,
) -> dict[str, Any]:
    """The inventory's `speculative:` section with the command's overrides (pure; UsageError when
    no draft dir is known, the combination is one SGLang would rewrite, or vLLM is asked for a
    draft tree).  `target_only` (vLLM only): no drafter, `draft` None."""
    from ..core.inventory import check_speculative

    vllm = spec.serving.engine == "vllm"
    if target_only and not vllm:
        raise UsageError(f"{spec.name}: --target-only is for a vLLM host (SGLang's baseline is `deploy`)")
    inv = spec.speculative
    steps = inv.num_steps if num_steps is None else num_steps
    topk = inv.eagle_topk if eagle_topk is None else eagle_topk
    if vllm and num_draft_tokens is None:
        tokens = steps + 1  # vLLM drafts a chain: K tokens, verified with the bonus one
    else:
        tokens = inv.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
    out: dict[str, Any] = {
        "draft": None if target_only else (draft or inv.draft_model_path),
        "num_steps": steps,
        "eagle_topk": topk,
        "num_draft_tokens": tokens,
    }
    if target_only:
        return out
    if not out["draft"]:
        raise UsageError(
            f"{spec.name}: no drafter: pass --draft DIR or set speculative.draft_model_path "
            f"in the inventory ({spec.source or 'inventory'})"
        )
    if vllm and topk != 1:
        raise UsageError(
            f"{spec.name}: vLLM's EAGLE-3 drafts a chain of num_speculative_tokens (--num-steps): "
            f"eagle_topk must be 1, not {topk}"
        )
    try:
        check_speculative(steps, topk, tokens)
    except ValueError as exc:
        raise UsageError(f"{spec.name}: speculative settings: {exc}") from None
    return out


def drafter_of_run(remote: Remote, spec: HostSpec) -> str:
    """The drafter dir `train export` wrote for the host's newest training run (run.json's run
    id): `--to hf` for a vLLM host, `--to sglang` for SGLang.  NotFound (exit 13) when no run is
    recorded; a run never exported is found missing by the drafter check that follows."""
    from ..core.specforge_run import exported_drafter_dir
    from . import train

    st = train.status(remote, spec)
    if not st.run_id:
        raise NotFound(f"{spec.name}: no training run on the host: `train start`, then `train export`", host=spec.name)
    return exported_drafter_dir(
        train.paths_for(spec).output, st.run_id, "hf" if spec.serving.engine == "vllm" else "sglang"
    )


def spec_host(spec: HostSpec, s: dict[str, Any]) -> HostSpec:
    """The host spec the server is restarted with (pure): the serving engine's own flags."""
    if spec.serving.engine == "vllm":
        from ..serving import vllm

        return vllm.spec_host(spec, s["draft"], s["num_steps"])
    from ..serving import sglang

    return sglang.spec_host(spec, s["draft"], s["num_steps"], s["eagle_topk"], s["num_draft_tokens"])


def describe(spec: HostSpec, s: dict[str, Any]) -> str:
    """One line naming what the server will serve."""
    if spec.serving.engine == "vllm":
        if s["draft"] is None:
            return "vLLM: the target alone (no drafter, extraction off): the baseline of spec bench"
        return f"vLLM eagle3 draft {s['draft']}, num_speculative_tokens {s['num_steps']} (extraction off)"
    return (
        f"EAGLE3 draft {s['draft']}, steps {s['num_steps']}, topk {s['eagle_topk']}, "
        f"draft tokens {s['num_draft_tokens']}"
    )


def check_drafter(remote: Remote, spec: HostSpec, draft: str) -> dict[str, Any]:
    """The drafter's config.json on the host against the dumps (or the inventory's layers) under
    the serving engine's own numbering; ContractMismatch (exit 9) when it does not fit."""
    from . import audit

    return audit.drafter_guard(remote, spec, draft)


def server_args_text(remote: Remote, spec: HostSpec) -> str | None:
    """The host's SGLang checkout's `server_args.py` (at most `SERVER_ARGS_CAP` bytes; None when
    the checkout has no such regular file)."""
    from ..serving import sglang

    path = spec.sglang.checkout.rstrip("/") + "/" + sglang.SERVER_ARGS_FILE
    cmd = (
        f"test -f {shell.quote(path)} && ! test -L {shell.quote(path)} && head -c {SERVER_ARGS_CAP} {shell.quote(path)}"
    )
    result = remote.run(cmd, check=False)
    return result.stdout if result.exit_status == 0 and result.stdout else None


def check_flags(remote: Remote, spec: HostSpec) -> dict[str, Any]:
    """SGLang: the `--speculative-*` flags of `spec` against the argparse definitions of the
    host's release (its checkout's `server_args.py`, the file the image is built from): Refused
    (exit 9) naming each flag it lacks; {"checked": False, "why"} when the checkout has no such
    file to read.  vLLM: nothing to check here (its JSON goes to vLLM's own config class)."""
    from ..serving import sglang

    if spec.serving.engine != "sglang":
        return {"checked": False, "why": "vLLM takes one --speculative-config JSON"}
    args = sglang.spec_args_of(list(spec.server.extra_args))
    text = server_args_text(remote, spec)
    path = f"{spec.sglang.checkout.rstrip('/')}/{sglang.SERVER_ARGS_FILE}"
    if text is None:
        return {"checked": False, "why": f"no {path} on the host"}
    try:
        flags = sglang.argparse_flags(text)
    except SyntaxError as exc:
        return {"checked": False, "why": f"{path} does not parse: {exc.msg}"}
    problems = sglang.flag_problems(args, flags)
    if problems:
        raise Refused(
            f"SGLang {spec.sglang.version} ({path}) would refuse the speculative flags: " + "; ".join(problems),
            host=spec.name,
            hint="serve the drafter with a release that has these flags, or pass them in server.extra_args",
            details={"reason": "unknown_flags", "problems": problems},
        )
    return {"checked": True, "flags": args, "source": path}


def deploy(remote: Remote, spec: HostSpec, **kwargs: Any) -> Any:
    """`workflows.deploy.deploy` of the spec host (`spec_host`): why "spec deploy" unless given."""
    from . import deploy as deploy_mod

    kwargs.setdefault("why", "spec deploy")
    return deploy_mod.deploy(remote, spec, **kwargs)
