"""vLLM as the serving engine: its own `extract_hidden_states` speculative method, no source patch.

vLLM (>= 0.18, PR #33736) captures the residual stream entering each layer id of the
dummy drafter's `eagle_aux_hidden_state_layer_ids` and hands it to a KV connector that
writes one safetensors file per request (`token_ids` int64 [S], `hidden_states` [S, L, H]).
The project's connector (`remote_ops/dumper/vllm_connector.py`, CPU and CUDA alike) is
loaded through `kv_connector_module_path`; the response's
`kv_transfer_params.hidden_states_path` names the file (docs/vllm.md).

What the server is asked for (pure, from the inventory):

- layer ids: the aux layers (`dump.layers`, default `[2, L//2, L-3]`, the same numbering as
  SGLang's layers_to_capture: the state entering layer i) plus `L`, the final state, so a file
  holds 4 layers; the audit settles whether that final state is pre- or post-norm;
- chunked prefill off (the method needs it) and prefix caching off (a cached prefix would
  not be captured);
- the connector's output dir `<dump.dir>/<vllm.connector_dir>`: the extraction client moves
  each file to `<dump.dir>/rank0/<key>.safetensors` and writes the dump manifest, so status,
  pull, sync, verify, audit and export read vLLM's dumps through the dump contract.

What the server serves is `serves(host)`, the container env `REMOTE_OPS_VLLM_SERVES`
(`SERVE_ENV`; `spec_host` sets it, the inventory never needs to):

- `extract` (absent): the extraction server above;
- `eagle3`: a trained EAGLE-3 drafter, `--speculative-config '{"method": "eagle3", "model":
  DRAFT, "num_speculative_tokens": K}'` in `server.extra_args`, the draft dir mounted
  read-only, extraction and the KV connector off (`spec deploy`);
- `target`: the target alone, neither (`spec deploy --target-only`: spec bench's baseline).

The container of a non-extracting server carries the label `org.remote-ops.vllm.serves`
(`SERVES_LABEL`), which `spec bench` reads; an extraction container has none, so its
run-config is the one it always had.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..core import layerids

if TYPE_CHECKING:
    from ..core.inventory import HostSpec
    from ..engine.spec import RunSpec

NAME = "vllm"
NEEDS_PATCH = False
ENDPOINTS = [["/health"], ["/v1/models"], ["/version"]]
HEALTH_PATH = "/health"
VERSION_PATH = "/version"
EXTRACT_MODE = "completions"
FILE_FORMAT = "vllm-hidden-states/1"
METRICS = {
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "kv_cache_usage": "vllm:kv_cache_usage_perc",
}
#: the connector as the image carries it (python module on PYTHONPATH, and its class)
CONNECTOR_MODULE = "remote_ops_vllm_connector"
CONNECTOR_CLASS = "RemoteOpsHiddenStatesConnector"
TEMPLATE = "Dockerfile.vllm.j2"
TOOL_DIR = "/opt/remote-ops"
#: what `patch`, `verify` and `push` of a SGLang deploy become
NO_PATCH = "vLLM: no source patch (extraction is vLLM's own extract_hidden_states method)"
#: the container env key saying what the server serves (`serves`), and its values
SERVE_ENV = "REMOTE_OPS_VLLM_SERVES"
SERVES = ("extract", "eagle3", "target")
#: the container label of a non-extracting server (`spec bench` reads it)
SERVES_LABEL = "org.remote-ops.vllm.serves"
SPEC_FLAG = "--speculative-config"


def version_of(body: dict[str, Any]) -> str | None:
    """The release `/version` reports (`{"version": "0.32.0"}`)."""
    v = body.get("version")
    return str(v) if v is not None else None


def want_version(host: "HostSpec") -> str:
    return str(host.vllm.version)


def client_args(host: "HostSpec") -> tuple[str, ...]:
    """The extraction client's options: `/v1/completions` with the served model name."""
    return ("--serving", "vllm", "--model", host.model.served_name)


# --------------------------------------------------------------------------- what is captured


def aux_layers(host: "HostSpec") -> list[int]:
    """The three aux layers (`dump.layers`, default `[2, L//2, L-3]`)."""
    return list(host.dump.layers or layerids.default_layers(host.model.num_layers))


def capture_layer_ids(host: "HostSpec") -> list[int]:
    """The ids vLLM is asked to capture: the aux layers, then L (the final state)."""
    return [*aux_layers(host), host.model.num_layers]


def connector_dir(host: "HostSpec") -> str:
    return f"{host.dump.dir.rstrip('/')}/{host.vllm.connector_dir}"


def serves(host: "HostSpec") -> str:
    """What the server serves: `extract` (the default; also for a value not in `SERVES`), `eagle3`
    (a drafter) or `target` (alone)."""
    mode = host.container.env.get(SERVE_ENV, "extract")
    return mode if mode in SERVES else "extract"


def eagle3_config(draft: str, num_speculative_tokens: int) -> dict[str, Any]:
    """vLLM's `--speculative-config` for an EAGLE-3 drafter dir (vllm 0.32.0 `SpeculativeConfig`:
    `method`, `model`, `num_speculative_tokens`; a chain of K draft tokens, top-1)."""
    return {"method": "eagle3", "model": draft, "num_speculative_tokens": int(num_speculative_tokens)}


def without_spec_config(args: list[str]) -> list[str]:
    """`args` without a `--speculative-config` (and its value, or `=value`)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == SPEC_FLAG:
            skip = True
        elif not a.startswith(SPEC_FLAG + "="):
            out.append(a)
    return out


def drafter_of(host: "HostSpec") -> str | None:
    """The drafter dir of an `eagle3` `--speculative-config` in `server.extra_args` (None: none)."""
    args = list(host.server.extra_args)
    for i, a in enumerate(args):
        text = (
            args[i + 1]
            if a == SPEC_FLAG and i + 1 < len(args)
            else a.partition("=")[2]
            if a.startswith(SPEC_FLAG + "=")
            else None
        )
        if text is None:
            continue
        try:
            doc = json.loads(text)
        except ValueError:
            return None
        return str(doc["model"]) if isinstance(doc, dict) and doc.get("model") else None
    return None


def spec_host(host: "HostSpec", draft: str | None, num_speculative_tokens: int) -> "HostSpec":
    """The host spec serving the drafter at `draft` (a dir on the host), or with `draft` None the
    target alone; extraction off either way (pure, idempotent: a re-run gives the same spec)."""
    earlier = drafter_of(host)
    extra = without_spec_config(list(host.server.extra_args))
    volumes = [m for m in host.container.volumes if earlier is None or m != f"{earlier}:{earlier}:ro"]
    if draft is not None:
        extra += [SPEC_FLAG, json.dumps(eagle3_config(draft, num_speculative_tokens), separators=(",", ":"))]
        mount = f"{draft}:{draft}:ro"
        volumes += [mount] if mount not in volumes else []
    env = {**host.container.env, SERVE_ENV: "eagle3" if draft is not None else "target"}
    return host.model_copy(
        update={
            "server": host.server.model_copy(update={"extra_args": extra}),
            "container": host.container.model_copy(update={"volumes": volumes, "env": env}),
        }
    )


def speculative_config(host: "HostSpec") -> dict[str, Any]:
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": capture_layer_ids(host)}},
    }


def kv_transfer_config(host: "HostSpec") -> dict[str, Any]:
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": connector_dir(host)},
    }


def server_args(host: "HostSpec") -> list[str]:
    """vLLM's OpenAI server arguments from the inventory (chunked prefill and prefix caching off;
    extraction on unless `serves(host)` says a drafter or the target alone)."""
    s, m = host.server, host.model
    extract = serves(host) == "extract"
    args = [
        "--model",
        m.path,
        "--served-model-name",
        m.served_name,
        "--tensor-parallel-size",
        str(s.tp),
        "--port",
        str(s.port),
        "--host",
        "0.0.0.0",
        "--no-enable-chunked-prefill",
        "--no-enable-prefix-caching",
    ]
    if extract:
        args += [
            SPEC_FLAG,
            json.dumps(speculative_config(host), separators=(",", ":")),
            "--kv-transfer-config",
            json.dumps(kv_transfer_config(host), separators=(",", ":")),
        ]
    args += ["--trust-remote-code"] if m.trust_remote_code else []
    args += ["--gpu-memory-utilization", str(s.mem_fraction_static)] if s.mem_fraction_static else []
    return args + list(s.extra_args)


def command(host: "HostSpec") -> tuple[str, ...]:
    return (*host.vllm.launcher, *server_args(host))


def connector_env(host: "HostSpec") -> dict[str, str]:
    """The connector's settings from the inventory: `dump.storage` as REMOTE_OPS_DUMP_DTYPE, only when
    not the default (a running container's run config stays what it was)."""
    storage = host.dump.storage
    return {"REMOTE_OPS_DUMP_DTYPE": storage} if storage != "bf16" else {}


def run_spec(host: "HostSpec", image: str, dump_dir_id: str | None = None) -> "RunSpec":
    """The vLLM server container: the host's container settings, vLLM's command line, no
    SGLang dumper variables; labelled with its run-config hash and its dump dir's identity
    (`dump_dir_id`, when known) like SGLang's."""
    from ..engine.labels import RUN_CONFIG
    from ..engine.spec import for_host, inventory_run_config

    base = for_host(host, image, dump_dir_id)
    env = {k: v for k, v in base.env.items() if not k.startswith(("SGLANG_HS_DUMP_", "SGLANG_PORT"))}
    mode = serves(host)
    spec = replace(
        base,
        command=command(host),
        entrypoint=(),
        env={**env, "VLLM_PORT": str(host.server.port), **connector_env(host), **host.container.env},
        labels={
            **{k: v for k, v in base.labels.items() if k != RUN_CONFIG},
            **({SERVES_LABEL: mode} if mode != "extract" else {}),
        },
    )
    return replace(spec, labels={**spec.labels, RUN_CONFIG: inventory_run_config(spec, len(host.vllm.launcher))})


# --------------------------------------------------------------------------- the image


def connector_source() -> bytes | None:
    """The project's connector as shipped (None when this install has none yet)."""
    from ..paths import package_file

    path = package_file("dumper", "vllm_connector.py")
    return path.read_bytes() if path.is_file() else None


def context_files() -> dict[str, bytes]:
    src = connector_source()
    return {"vllm_connector.py": src} if src is not None else {}


def dockerfile_variables(host: "HostSpec", context_hash: str | None) -> dict[str, Any]:
    from .. import __version__
    from ..engine import labels

    image_labels = {
        labels.TOOL_VERSION: __version__,
        labels.BASE_IMAGE: host.vllm.base_image,
        labels.LABEL_PREFIX + "serving": NAME,
        labels.LABEL_PREFIX + "vllm.version": host.vllm.version,
    }
    if context_hash:
        image_labels[labels.CONTEXT_HASH] = context_hash
    return {
        "host_name": host.name,
        "remote_ops_version": __version__,
        "base_image": host.vllm.base_image,
        "vllm_version": host.vllm.version,
        "tool_dir": TOOL_DIR,
        "connector_module": CONNECTOR_MODULE,
        "port": host.server.port,
        "labels": image_labels,
        "healthcheck": {
            "path": HEALTH_PATH,
            "interval_s": 15,
            "timeout_s": 5,
            "retries": 3,
            "start_period_s": host.container.healthcheck_start_period_s,
        },
    }


def context_hash(host: "HostSpec") -> str:
    """Hash of every build input: template text, its variables (without this label), the connector."""
    from ..paths import repo_resource

    h = hashlib.sha256(json.dumps(dockerfile_variables(host, None), sort_keys=True).encode())
    h.update(hashlib.sha256(repo_resource("templates", TEMPLATE).read_bytes()).digest())
    for name, data in sorted(context_files().items()):
        h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()[:24]


def image_ref(host: "HostSpec") -> str:
    """`image:tag`, the tag `vllm-<version>-<context hash[:12]>` unless the inventory names one."""
    return f"{host.container.image}:{host.container.tag or f'vllm-{host.vllm.version}-{context_hash(host)[:12]}'}"


def render_dockerfile(host: "HostSpec") -> str:
    from ..core import rendering

    return rendering.render(TEMPLATE, dockerfile_variables(host, context_hash(host)))


# --------------------------------------------------------------------------- logs


def log_stats(text: str) -> list[dict[str, Any]]:
    """vLLM's periodic throughput lines of a server log (`core.logparse.parse_vllm_stats`)."""
    from ..core.logparse import parse_vllm_stats

    return parse_vllm_stats(text)
