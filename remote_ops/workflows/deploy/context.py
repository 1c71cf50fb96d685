"""deploy's build context: the patch spec, the image tag, the Dockerfile and the files shipped (local).

Pure except for reading this package's own files: what goes into an image is
decided here, and hashed (`context_hash`) so a no-op deploy knows the image
is current from its labels alone, without rendering the template (Jinja2's
import alone is ~40 ms).
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path
from typing import Any

from ... import __version__
from ...core import shell
from ...core.inventory import HostSpec
from ...engine import labels
from ...errors import Refused
from ...paths import package_file, repo_resource
from .. import container

HEALTHCHECK_PATH = "/get_model_info"


def patch_spec_path(host: HostSpec) -> Path:
    """The host's bound patch spec as the one JSON file `anchors.py --spec` reads (in the cache dir)."""
    from ...core import patchspec
    from ...paths import cache_dir

    spec = load_patch(host)
    path = cache_dir() / "patch-specs" / f"{spec.name}-{spec.hash}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(patchspec.bundled_json(spec))
    return path


def load_patch(host: HostSpec):
    """The host's patch spec (anchors.PatchSpec: file + class); its id and hash label the image.
    A host whose inventory names no spec is bound first (`patching.bind_host`)."""
    from ...core import patchspec

    return patchspec.for_host(host)


def image_tag(host: HostSpec, patch) -> str:
    """`image:tag`; the tag defaults to `<sglang version>-<patch hash[:12]>`."""
    return container.deploy_image(host, patch.hash)


def image_ref(host: HostSpec) -> str:
    """The image ref deploy builds for `host` (used by `health` to check the running image)."""
    return image_tag(host, load_patch(host))


def dockerfile_variables(
    host: HostSpec, patch, sha_before: str, sha_after: str, context_hash: str | None
) -> dict[str, Any]:
    """Everything Dockerfile.j2 needs; labels tie the image to the patch and the file shas."""
    image_labels = {
        labels.PATCH_ID: patch.id,
        labels.PATCH_HASH: patch.hash,
        labels.SHA_BEFORE: sha_before,
        labels.SHA_AFTER: sha_after,
        labels.TOOL_VERSION: __version__,
        labels.SGLANG_VERSION: host.sglang.version,
        labels.BASE_IMAGE: host.sglang.base_image,
    }
    if context_hash:
        image_labels[labels.CONTEXT_HASH] = context_hash
    return {
        "host_name": host.name,
        "remote_ops_version": __version__,
        "base_image": host.sglang.base_image,
        "sglang_version": host.sglang.version,
        "image_checkout": host.sglang.image_checkout.rstrip("/"),
        "tool_dir": container.TOOL_DIR,
        "port": host.server.port,
        "target_sha256_after": sha_after,
        "labels": image_labels,
        "healthcheck": {
            "path": HEALTHCHECK_PATH,
            "interval_s": 15,
            "timeout_s": 5,
            "retries": 3,
            "start_period_s": host.container.healthcheck_start_period_s,
        },
    }


def render_dockerfile(host: HostSpec, patch, sha_before: str, sha_after: str) -> str:
    """The Dockerfile as it will be built, with its context-hash label."""
    from ...core import rendering

    return rendering.render(
        rendering.DOCKERFILE,
        dockerfile_variables(host, patch, sha_before, sha_after, context_hash(host, patch, sha_before, sha_after)),
    )


# the dumper's files in the image: its code and its docs
DUMPER_SUFFIXES = (".py", ".md")


def context_files(patch) -> dict[str, bytes]:
    """Build-context files shipped from here (name in context -> bytes); the sglang tree comes from the host."""
    from ...core import anchors

    files = {
        "anchors.py": Path(anchors.__file__).read_bytes(),
        "patch-spec.json": json.dumps(anchors.spec_to_dict(patch), indent=1, sort_keys=True).encode(),
        "verify_patch.py": repo_resource("docker", "verify_patch.py").read_bytes(),
        "entrypoint.sh": repo_resource("docker", "entrypoint.sh").read_bytes(),
    }
    dump_dir = package_file("dumper")
    for path in sorted(dump_dir.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix in DUMPER_SUFFIXES:
            files[f"remote_ops_dump/{path.relative_to(dump_dir).as_posix()}"] = path.read_bytes()
    return files


def context_hash(host: HostSpec, patch, sha_before: str, sha_after: str) -> str:
    """Hash of every build input: the template's text and its variables (without this label),
    the shipped files, the patched file's sha.  Hashing the inputs instead of the rendered
    text keeps Jinja2 out of a no-op deploy (its import alone is ~40 ms)."""
    variables = dockerfile_variables(host, patch, sha_before, sha_after, None)
    h = hashlib.sha256(json.dumps(variables, sort_keys=True).encode())
    h.update(hashlib.sha256((repo_resource("templates", "Dockerfile.j2")).read_bytes()).digest())
    for name, data in sorted(context_files(patch).items()):
        h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()[:24]


def staging_dir(host: HostSpec) -> str:
    """Where the build context is assembled on the host: per container name and checkout,
    so two inventories sharing one machine (test labs) never share a context."""
    key = hashlib.sha256(f"{host.container.name}\0{host.sglang.checkout}".encode()).hexdigest()[:10]
    return f"/var/tmp/remote-ops/build-{host.container.name}-{key}"


def context_tar(files: dict[str, bytes]) -> bytes:
    """An uncompressed tar of the context files (executables get mode 755)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 0
            info.mode = 0o755 if name.endswith((".sh", "verify_patch.py")) else 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def copy_tree_cmd(host: HostSpec, stage: str) -> str:
    """Copy the (patched) checkout's python/sglang into the context, without bytecode."""
    src = host.sglang.checkout.rstrip("/") + "/python/sglang"
    return shell.and_then(
        ["rm", "-rf", f"{stage}/sglang"],
        ["cp", "-a", src, f"{stage}/sglang"],
        f"find {shell.quote(stage + '/sglang')} -name __pycache__ -prune -exec rm -rf {{}} +",
    )


def render_for_host(host: HostSpec, checkout: Path | None = None, on_progress=None) -> str:
    """The Dockerfile for `host`, computed locally from the released SGLang file (no SSH).

    The shas are those of the released target file (the host's patch spec) of the inventory's
    SGLang version and of that file with the patch applied: what deploy builds
    when the host's checkout is the pristine release.  The file is read offline first
    (`wheels.sglang_source`: a local `checkout` of that release, the cached wheel, the index).
    A vLLM host's (`serving.engine: vllm`) is its vLLM image's, which needs no source file.
    """
    from ... import wheels
    from ...core import anchors

    if host.serving.engine == "vllm":
        from ...serving import vllm

        return vllm.render_dockerfile(host)
    patch = load_patch(host)
    text = wheels.sglang_source(host.sglang.version, patch.target, checkout, on_progress).decode("utf-8")
    try:
        new = anchors.plan(text, patch).new_text
    except anchors.AnchorRefusal as exc:
        raise Refused(
            f"render: the patch does not apply to SGLang {host.sglang.version}: {exc}", host=host.name
        ) from None
    before = hashlib.sha256(text.encode()).hexdigest()
    return render_dockerfile(host, patch, before, hashlib.sha256(new.encode()).hexdigest())
