"""`DockerEngine`: the `Engine` interface on the Docker SDK's low-level `APIClient`.

The APIClient speaks to the host's Engine API through `DialStdioAdapter`
(engine/dialstdio.py): one exec channel on the existing strict SSH transport,
kept alive across requests.  What this module adds on top of the SDK:

- API version negotiation on first use (the SDK's default, 1.45, is newer
  than e.g. docker 20.10's 1.41; `version="auto"` would dial at construction);
- a deadline on every call: the socket timeout of the channel is the call's
  `timeout` (default: the connection's command timeout);
- typed errors: 404 -> NotFound, other API errors -> CommandFailed (with the
  daemon's message), a timeout -> CommandTimedOut, a dead link -> Unreachable,
  a dial process that could not reach the daemon -> CommandFailed with its
  stderr;
- never a pull: containers are created with `POST /containers/create`, which
  only uses images already present (the SDK's `containers.run` would pull).

One engine per host connection.  Its calls are serialised by a lock: they
share one channel, which carries one request at a time anyway.

The SDK (and requests/urllib3) is imported when an engine is made, not with
this module: the registry (`remote_ops.engine.engine_class`) imports it to
hand out `DockerEngine.cli` to shell-probe paths (health, a no-op deploy),
which must not pay the SDK's ~0.4 s import.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import CommandFailed, CommandTimedOut, NotFound, RemoteOpsError, Unreachable, tail
from . import types
from .cli import DockerCLI
from .spec import RunSpec, create_request
from .types import ContainerInfo, EngineEvent, EngineInfo, EngineVersion, ImageInfo, LogLine

if TYPE_CHECKING:
    import docker

    from .dialstdio import DialStdioAdapter, StreamOpener

T = TypeVar("T")
#: Placeholder API version until the daemon has told us its own (no request at construction).
BOOTSTRAP_API = "1.24"


class DockerEngine:
    """The host's Docker daemon, over `remote`'s SSH connection.

    An engine kind (the inventory's `engine: docker`): `cli` builds its command
    lines and reads their output (pure, usable without an instance: see
    `remote_ops.engine.cli_for`), `dial` is the host command whose stdin/stdout
    reach its Engine API, and an instance is that API over one channel.
    """

    kind = "docker"
    cli: DockerCLI = DockerCLI()
    #: What the engine runs on the host to reach its API: Docker's own SSH-transport helper.
    dial: tuple[str, ...] = ("docker", "system", "dial-stdio")
    #: The dial command as errors name it.
    dial_label = "docker system dial-stdio"
    #: What to check on the host when the dial fails (the error's hint).
    dial_hint = "is the docker daemon running on the host, and `docker` on its PATH?"

    def __init__(self, remote: StreamOpener, *, timeout: float | None = None) -> None:
        from .dialstdio import DialStdioAdapter

        self.host = remote.name
        target = getattr(remote, "target", None)
        self.timeout = timeout or (target.timeouts.command if target is not None else 120.0)
        self.adapter = DialStdioAdapter(remote, self.dial)
        self._api = _api_client(self.adapter, self.timeout)
        self._lock = threading.Lock()
        self._version: EngineVersion | None = None

    # -- plumbing -----------------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[[], T], timeout: float | None) -> T:
        """Run one API exchange under the lock with `timeout` as its socket deadline; map errors."""
        deadline = timeout or self.timeout
        with self._lock:
            self._negotiate(deadline)
            self._api.timeout = deadline
            with self._errors(what, deadline):
                return fn()

    def _negotiate(self, timeout: float) -> None:
        """First use: ask the daemon its API version and speak min(its, the SDK's)."""
        if self._version is not None:
            return
        from docker.constants import DEFAULT_DOCKER_API_VERSION
        from docker.utils import version_lt

        self._api.timeout = timeout
        with self._errors("GET /version", timeout):
            doc = self._api.version(api_version=False)
        server = str(doc.get("ApiVersion") or BOOTSTRAP_API)
        use = server if version_lt(server, DEFAULT_DOCKER_API_VERSION) else DEFAULT_DOCKER_API_VERSION
        self._api._version = use
        self._version = types.parse_version(doc, self.kind, use)

    @contextmanager
    def _errors(self, what: str, timeout: float) -> Iterator[None]:
        import docker.errors
        import requests.exceptions
        import urllib3.exceptions

        try:
            yield
        except RemoteOpsError:
            raise
        except docker.errors.NotFound as exc:
            raise NotFound(f"{_explain(exc)}", host=self.host, details={"request": what}) from None
        except docker.errors.APIError as exc:
            raise CommandFailed(
                f"engine API refused {what}: {_explain(exc)}",
                host=self.host,
                command=f"engine API {what}",
                stderr_tail=_explain(exc),
                details={"status_code": exc.status_code},
            ) from None
        except (requests.exceptions.RequestException, urllib3.exceptions.HTTPError, OSError) as exc:
            raise self._transport_error(what, timeout, exc) from None
        except docker.errors.DockerException as exc:  # the SDK refused the request before sending it
            raise CommandFailed(
                f"engine request {what} is invalid: {exc}",
                host=self.host,
                command=f"engine API {what}",
                stderr_tail=str(exc),
            ) from None

    def _transport_error(self, what: str, timeout: float, exc: Exception) -> RemoteOpsError:
        """A request that got no HTTP answer: timeout, lost connection, or a dial that failed."""
        if _is_timeout(exc):
            return CommandTimedOut(
                f"engine API {what} timed out after {timeout:g}s",
                host=self.host,
                command=f"engine API {what}",
                timeout=timeout,
            )
        sock = self.adapter.last_socket
        if sock is not None and not sock.transport_alive():
            return Unreachable(
                f"connection was lost during engine API {what}", host=self.host, details={"reason": "connection_lost"}
            )
        status, err = self.adapter.dial_diagnostics()
        return CommandFailed(
            f"engine API {what} failed: {self.dial_label} "
            f"{'exited ' + str(status) if status is not None else 'dropped the connection'}",
            host=self.host,
            command=self.dial_label,
            exit_status=status,
            stderr_tail=err or tail(str(exc), 3),
            hint=self.dial_hint,
        )

    # -- version / info -----------------------------------------------------------------------
    def version(self, *, timeout: float | None = None) -> EngineVersion:
        """The daemon's version and API version (asked once per engine; later calls are free)."""
        self._call("GET /version", lambda: None, timeout)
        assert self._version is not None
        return self._version

    def info(self, *, timeout: float | None = None) -> EngineInfo:
        return types.parse_info(self._call("GET /info", self._api.info, timeout))

    # -- inspect ------------------------------------------------------------------------------
    def image(self, ref: str, *, timeout: float | None = None) -> ImageInfo | None:
        """The image `ref` (name:tag or id), or None when the host does not have it."""
        what = f"GET /images/{ref}/json"
        return self._inspect(what, lambda: self._api.inspect_image(ref), types.parse_image, timeout)

    def container(self, name: str, *, timeout: float | None = None) -> ContainerInfo | None:
        """The container `name` (state, health, labels), or None when there is none."""
        what = f"GET /containers/{name}/json"
        return self._inspect(what, lambda: self._api.inspect_container(name), types.parse_container, timeout)

    def _inspect(
        self, what: str, fetch: Callable[[], Any], parse: Callable[[Any], T], timeout: float | None
    ) -> T | None:
        """`parse` of an inspect call's answer, or None when the object is not there (404)."""
        try:
            return parse(self._call(what, fetch, timeout))
        except NotFound:
            return None

    # -- lifecycle ----------------------------------------------------------------------------
    def create(self, spec: RunSpec, *, timeout: float | None = None) -> str:
        """Create (not start) a container from `spec`; NotFound if its image is not on the host."""

        def post() -> str:
            body = create_request(spec, self._api._version)
            return self._api.create_container_from_config(body, name=spec.name)["Id"]

        try:
            return self._call(f"POST /containers/create?name={spec.name}", post, timeout)
        except NotFound as exc:
            raise NotFound(
                f"image {spec.image} is not on the host: {exc.message}",
                host=self.host,
                hint="images are never pulled: build it (remote-ops deploy) or load it first",
                details={"image": spec.image},
            ) from None

    def run(self, spec: RunSpec, *, timeout: float | None = None) -> ContainerInfo:
        """Create and start a container from `spec`; its state after the start."""
        ident = self.create(spec, timeout=timeout)
        self.start(ident, timeout=timeout)
        info = self.container(ident, timeout=timeout)
        if info is None:
            raise NotFound(f"container {spec.name} vanished right after it started", host=self.host)
        return info

    def start(self, name: str, *, timeout: float | None = None) -> None:
        """Start a created or stopped container (a running one stays as it is)."""
        self._call(f"POST /containers/{name}/start", lambda: self._api.start(name), timeout)

    def stop(self, name: str, *, grace_s: int = 30, timeout: float | None = None) -> None:
        """SIGTERM, then SIGKILL after `grace_s`; the deadline allows for the grace period."""
        self._call(
            f"POST /containers/{name}/stop",
            lambda: self._api.stop(name, timeout=grace_s),
            (timeout or self.timeout) + grace_s,
        )

    def restart(self, name: str, *, grace_s: int = 30, timeout: float | None = None) -> None:
        self._call(
            f"POST /containers/{name}/restart",
            lambda: self._api.restart(name, timeout=grace_s),
            (timeout or self.timeout) + grace_s,
        )

    def remove(self, name: str, *, force: bool = True, timeout: float | None = None) -> bool:
        """Remove the container (killed first when `force`); False when it did not exist."""
        try:
            self._call(f"DELETE /containers/{name}", lambda: self._api.remove_container(name, force=force), timeout)
        except NotFound:
            return False
        return True

    # -- logs and events ----------------------------------------------------------------------
    def logs(
        self,
        name: str,
        *,
        since: types.Since | None = None,
        until: types.Since | None = None,
        tail: int | None = None,
        timeout: float | None = None,
    ) -> list[LogLine]:
        """stdout + stderr lines with the daemon's timestamps, from `since` (unix s or datetime)."""
        params: dict[str, Any] = {
            "stdout": 1,
            "stderr": 1,
            "timestamps": 1,
            "tail": "all" if tail is None else str(tail),
        }
        params.update({k: types.api_time(v) for k, v in (("since", since), ("until", until)) if v is not None})

        def get() -> bytes:
            res = self._api._get(self._api._url("/containers/{0}/logs", name), params=params)
            self._api._raise_for_status(res)
            return res.content

        return types.parse_logs(self._call(f"GET /containers/{name}/logs", get, timeout))

    def events(
        self,
        *,
        since: types.Since,
        until: types.Since,
        filters: dict[str, list[str]] | None = None,
        timeout: float | None = None,
    ) -> list[EngineEvent]:
        """Events between `since` and `until` (the daemon's clock; see `info().system_time`).

        The daemon ends the stream at `until`; the deadline is the time left
        until then plus `timeout`, so a stream that never ends is a TIMEOUT.
        """
        import json

        wait = max(0.0, _unix(until) - time.time())
        params = {
            "since": types.api_time(since),
            "until": types.api_time(until),
            "filters": json.dumps(filters) if filters else None,
        }

        def get() -> bytes:
            res = self._api._get(self._api._url("/events"), params=params)
            self._api._raise_for_status(res)
            return res.content

        return types.parse_events(self._call("GET /events", get, (timeout or self.timeout) + wait))

    # -- both objects ---------------------------------------------------------------------------
    def objects(
        self, container: str, image: str, *, timeout: float | None = None
    ) -> tuple[ContainerInfo | None, ImageInfo | None]:
        """Container + image in two requests on the kept-alive channel (the deploy probe's objects)."""
        return self.container(container, timeout=timeout), self.image(image, timeout=timeout)

    def close(self) -> None:
        """Close the channel(s); the SSH connection stays open."""
        self._api.close()
        self.adapter.close()

    def __enter__(self) -> "DockerEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _api_client(adapter: DialStdioAdapter, timeout: float) -> docker.APIClient:
    """An APIClient whose every request goes through `adapter`; no environment proxies or
    ~/.docker/config.json proxies (the laptop's settings must not reach the host's containers)."""
    import docker
    from docker.utils.proxy import ProxyConfig

    api = docker.APIClient(base_url="tcp://localhost:2375", version=BOOTSTRAP_API, timeout=timeout)
    api.trust_env = False
    api._proxy_configs = ProxyConfig()
    api.mount("http://", adapter)
    api.mount("https://", adapter)
    return api


def _explain(exc: docker.errors.APIError) -> str:
    return str(exc.explanation or exc).strip()


def _is_timeout(exc: BaseException) -> bool:
    """requests reports a read timeout mid-body as ConnectionError(ReadTimeoutError): look inside."""
    import requests.exceptions
    import urllib3.exceptions

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, (requests.exceptions.Timeout, urllib3.exceptions.TimeoutError, TimeoutError)):
            return True
        if any(isinstance(a, BaseException) and _is_timeout(a) for a in getattr(seen, "args", ())):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _unix(value: types.Since) -> float:
    return value.timestamp() if hasattr(value, "timestamp") else float(value)
