"""The serving engine's HTTP endpoints, asked on the host: the cheap ones, and with `deep` one generation.

Which endpoints, which generation and which version check come from the host's serving
engine (`remote_ops.serving`): SGLang's below; vLLM's are `/health`, `/v1/models`,
`/version` (all cheap), its generation a one-token `/v1/completions`, its checks in the
`vllm` tier.

SGLang 0.5.x's `/health` runs a one-token generation (20 s timeout) and piled-up
probes have crashed servers, so this probe polls only cheap endpoints
(`/model_info`, `/server_info`, `/v1/models`, each with its older `/get_*`
alias), and a generation runs at most once, only with `deep`.  The calls are
made with curl when the host has it (~10 ms), else with python3's urllib
(~50-150 ms of interpreter start); `parse_http` reads either.  `check_http`
gives one check per endpoint plus the served SGLang version.
"""

from __future__ import annotations

import json
from typing import Any

from ..core import shell
from ..core.inventory import HostSpec
from ..engine.types import ContainerInfo
from .base import Check, Output, Probe, last_line

ENDPOINTS = [["/model_info", "/get_model_info"], ["/server_info", "/get_server_info"], ["/v1/models"]]

HTTP_PROBE = r"""
import json, sys, time, urllib.error, urllib.request
base, groups, deep = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "1"
call_s, generate_s = float(sys.argv[4]), float(sys.argv[5])
deep_path, deep_body = sys.argv[6], sys.argv[7].encode()
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
def call(path, data=None, timeout=None):
    timeout = timeout or call_s
    t = time.monotonic()
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with opener.open(req, timeout=timeout) as r:
            return {"path": path, "status": r.status, "ms": round((time.monotonic() - t) * 1000, 1),
                    "body": r.read(65536).decode("utf-8", "replace")}
    except urllib.error.HTTPError as e:
        return {"path": path, "status": e.code, "ms": round((time.monotonic() - t) * 1000, 1), "body": ""}
    except Exception as e:
        return {"path": path, "error": "%s: %s" % (type(e).__name__, e)}
out = {}
for group in groups:
    for path in group:
        out[group[0]] = res = call(path)
        if res.get("status") != 404:
            break
if deep:
    out["/generate"] = call(deep_path, deep_body, timeout=generate_s)
print(json.dumps(out))
"""

GENERATE_BODY = json.dumps({"text": "ping", "sampling_params": {"max_new_tokens": 1, "temperature": 0}})

#: The endpoint calls with curl, one `@@http GROUP PATH CURL_EXIT HTTP_CODE SECONDS` line each,
#: then the body (or curl's error), a group's next alias tried only after a 404.  One process
#: per call: the body and curl's `-w` trailer are read from one capture (stderr merged, so a
#: failure's message is the "body"), the body cut at 64 KiB by printf (bodies over 1 MiB are
#: refused by curl itself).
CURL_PROBE = r"""
call() {
  if [ -n "$4" ]; then
    out=$(curl -sS --noproxy '*' -m "$3" --max-filesize 1048576 -w '\n@@end %{http_code} %{time_total}' -H 'Content-Type: application/json' --data-binary "$4" "$BASE$2" 2>&1)
  else
    out=$(curl -sS --noproxy '*' -m "$3" --max-filesize 1048576 -w '\n@@end %{http_code} %{time_total}' "$BASE$2" 2>&1)
  fi
  rc=$?
  case $out in *'@@end '*) w=${out##*@@end }; out=${out%@@end *}; out=${out%?};; *) w='000 0';; esac
  code=${w%% *}
  echo "@@http $1 $2 $rc $w"
  printf '%.65536s\n' "$out"
}
"""

#: {group: {path, status, ms, body} or {path, error}}: one record per endpoint group.
Results = dict[str, dict[str, Any]]


def http_budget(probe_s: float) -> tuple[float, float]:
    """(seconds per cheap endpoint call, seconds for the --deep generation) within one probe's
    deadline: up to 4 cheap calls run before the generation."""
    call_s = max(0.1, int(min(5.0, probe_s / 5) * 10) / 10)
    return call_s, max(0.1, int((probe_s - 4 * call_s) * 10) / 10)


class HttpEndpoints(Probe[Results | None]):
    """The cheap endpoints (and with `deep` one generation), within `probe_s` seconds in all."""

    name = "http"

    def __init__(self, host: HostSpec, deep: bool = False, probe_s: float = 96.0) -> None:
        self.port, self.deep, self.probe_s = host.server.port, deep, probe_s
        self.endpoints, self.deep_path, self.deep_body = serving_http(host)

    def command(self) -> str:
        base = f"http://127.0.0.1:{self.port}"
        call_s, generate_s = http_budget(self.probe_s)
        py = shell.join(
            [
                "python3",
                "-c",
                HTTP_PROBE,
                base,
                json.dumps(self.endpoints),
                "1" if self.deep else "0",
                str(call_s),
                str(generate_s),
                self.deep_path,
                self.deep_body,
            ]
        )
        calls = []
        for group in self.endpoints:
            tries = [f"call {shell.join([group[0], path, str(call_s)])}" for path in group]
            calls.append('; [ "$code" = 404 ] && '.join(tries))
        if self.deep:
            calls.append(f"call {shell.join(['/generate', self.deep_path, str(generate_s), self.deep_body])}")
        curl = f"BASE={shell.quote(base)}; {CURL_PROBE.strip()}\n" + "\n".join(calls)
        return f"if command -v curl >/dev/null 2>&1; then {curl}\nelse {py}; fi"

    def parse(self, status: int, text: str) -> Results | None:
        """The endpoint records, or None when the probe did not run."""
        return parse_http(text) if status == 0 else None


def parse_http(text: str) -> Results | None:
    """The endpoint results, {group: {path, status, ms, body} or {path, error}}, from either
    probe's output (curl's `@@http` blocks, or python's one JSON line); None if it did not run."""
    if "@@http " not in text:
        try:
            doc = json.loads(text.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            return None
        return doc if isinstance(doc, dict) else None
    out: Results = {}
    for block in text.split("@@http ")[1:]:
        head, _, body = block.partition("\n")
        fields = head.split()
        if len(fields) < 4:
            continue
        group, path, rc = fields[0], fields[1], fields[2]
        if rc != "0":
            out[group] = {"path": path, "error": f"curl exit {rc}: {body.strip()[:300]}"}
            continue
        code, secs = int(fields[3]), float(fields[4]) if len(fields) > 4 else 0.0
        ok = 200 <= code < 400
        body = body[:-1] if body.endswith("\n") else body  # the batch's section text may end without it
        out[group] = {"path": path, "status": code, "ms": round(secs * 1000, 1), "body": body if ok else ""}
    return out


def serving_http(host: HostSpec) -> tuple[list[list[str]], str, str]:
    """(endpoint groups, generation path, its JSON body) of the host's serving engine."""
    from ..serving import serving_for

    s = serving_for(host)
    if s.NAME == "sglang":
        return ENDPOINTS, "/generate", GENERATE_BODY
    body = {"model": host.model.served_name, "prompt": "ping", "max_tokens": 1, "temperature": 0}
    return s.ENDPOINTS, "/v1/completions", json.dumps(body)


def check_http(host: HostSpec, probe: Output, c: ContainerInfo | None) -> list[Check]:
    """One check per cheap endpoint, the served release, and the generation if asked (tier: the
    serving engine's name)."""
    from ..serving import serving_for

    s = serving_for(host)
    status, text = probe
    res = parse_http(text) if status == 0 else None
    if res is None:
        return [Check(s.NAME, "endpoints", "fail", f"HTTP probe did not run: {last_line(probe[1])}")]
    groups = serving_http(host)[0]
    checks = [_endpoint_check(res[g[0]], g[0].strip("/").replace("/", "_"), s.NAME) for g in groups if g[0] in res]
    if s.NAME != "sglang":
        checks.append(_served_version_check(host, s, res.get(s.VERSION_PATH, {})))
        if "/generate" in res:
            checks.append(_endpoint_check(res["/generate"], "generate", tier="generation"))
        return checks
    checks.append(_version_check(host, res.get("/server_info", {})))
    if "/generate" in res:
        checks.append(_endpoint_check(res["/generate"], "generate", tier="generation"))
    return checks


def _endpoint_check(r: dict[str, Any], name: str, tier: str = "sglang") -> Check:
    if "error" in r:
        return Check(tier, name, "fail", f"{r['path']}: {r['error']}")
    ok = 200 <= r.get("status", 0) < 300
    return Check(tier, name, "ok" if ok else "fail", f"{r['path']} -> HTTP {r.get('status')} in {r.get('ms')} ms")


def _version_check(host: HostSpec, r: dict[str, Any]) -> Check:
    try:
        version = json.loads(r.get("body") or "{}").get("version")
    except json.JSONDecodeError:
        version = None
    if version is None:
        return Check("sglang", "version", "fail", "server_info has no version")
    want = host.sglang.version
    return Check(
        "sglang",
        "version",
        "ok" if version == want else "fail",
        f"server reports SGLang {version}" + ("" if version == want else f", patched tree is {want}"),
    )


def _served_version_check(host: HostSpec, s: Any, r: dict[str, Any]) -> Check:
    """The release the serving engine reports against the one the inventory pins."""
    try:
        version = s.version_of(json.loads(r.get("body") or "{}"))
    except (json.JSONDecodeError, AttributeError):
        version = None
    if version is None:
        return Check(s.NAME, "release", "fail", f"{s.VERSION_PATH} has no version")
    want = s.want_version(host)
    return Check(
        s.NAME,
        "release",
        "ok" if version == want else "fail",
        f"server reports {s.NAME} {version}" + ("" if version == want else f", the inventory pins {want}"),
    )
