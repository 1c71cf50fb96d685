"""`deploy`: one workflow over one host, split by concern.

    context.py   the build context: patch spec, image tag, Dockerfile, shipped files, context hash
    plan.py      the one batched probe (facts, lock, target sha, engine objects) and the plan (pure)
    workflow.py  the steps and `Deploy`, SGLang's deploy (check -> act -> verify, records, unlock),
                 `build_on_host`, `wait_until_healthy`
    vllm.py      `VllmDeploy`, vLLM's deploy: a peer of `Deploy` (a subclass changing the plan,
                 the context and the start), not something `workflow.py` knows of
    records.py   the local run record and the host's audit line

The host lock is `remote_ops.workflows.hostlock`; the container goes through the engine
seam (`remote_ops.engine`).  Commands import from here.
"""

from __future__ import annotations

from .context import (
    HEALTHCHECK_PATH,
    context_files,
    context_hash,
    context_tar,
    copy_tree_cmd,
    dockerfile_variables,
    image_ref,
    image_tag,
    load_patch,
    patch_spec_path,
    render_dockerfile,
    render_for_host,
    staging_dir,
)
from .plan import (
    Plan,
    Probe,
    lock_info,
    make_plan,
    parse_lock,
    parse_probe,
    preflight_problems,
    probe,
    probes_for,
)
from .records import write_record
from .workflow import (
    BUILD_TIMEOUT_S,
    Deploy,
    DeployResult,
    Events,
    StepResult,
    apply_patch,
    build_image,
    dry_run_diffs,
    push,
    unlock_and_audit_cmd,
    verify_on_host,
    wait_until_healthy,
)

__all__ = [
    "BUILD_TIMEOUT_S",
    "Deploy",
    "DeployResult",
    "Events",
    "HEALTHCHECK_PATH",
    "Plan",
    "Probe",
    "StepResult",
    "apply_patch",
    "build_image",
    "context_files",
    "context_hash",
    "context_tar",
    "copy_tree_cmd",
    "deploy",
    "deploy_class",
    "dockerfile_variables",
    "dry_run_diffs",
    "image_ref",
    "image_tag",
    "load_patch",
    "lock_info",
    "make_plan",
    "parse_lock",
    "parse_probe",
    "patch_spec_path",
    "preflight_problems",
    "probe",
    "probes_for",
    "push",
    "render_dockerfile",
    "render_for_host",
    "staging_dir",
    "unlock_and_audit_cmd",
    "verify_on_host",
    "wait_until_healthy",
    "write_record",
]


def deploy_class(host) -> type[Deploy]:
    """The deploy of the host's serving engine: SGLang's `Deploy` or vLLM's `VllmDeploy`, one
    interface (`cls(remote, host, **options).run()`); imported only when asked for."""
    if host.serving.engine == "vllm":
        from .vllm import VllmDeploy

        return VllmDeploy
    return Deploy


def deploy(remote, host, **kwargs) -> DeployResult:
    """Run a deploy over one connected host with its serving engine's deploy class."""
    return deploy_class(host)(remote, host, **kwargs).run()
