"""The REST client the CLI uses.

One method per endpoint of ``/api/v1``; answers are the decoded JSON objects. Every failure
is an ``ApiError`` whose message is ready to show a person: the server's ``detail`` (for a
422, one ``field: message`` line per error), or what to check when Shoal cannot be reached.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self
from urllib.parse import quote

import httpx

from shoal.service.code_archive import ArchiveError, pack_directory
from shoal.service.settings import Settings

DEFAULT_URL = "http://127.0.0.1:8000"
API_PREFIX = "/api/v1"
CLIENT_CONFIG = "client.json"
Json = dict[str, Any]


class ApiError(Exception):
    """A request Shoal refused or never answered (``status`` is None then)."""

    def __init__(self, status: int | None, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class ClientConfig:
    url: str
    token: str | None


def resolve_config(url: str | None, token: str | None, settings: Settings) -> ClientConfig:
    """Options and ``SHOAL_URL``/``SHOAL_TOKEN`` first, then what `shoal up` wrote."""
    if url is None:
        config_path = settings.home / CLIENT_CONFIG
        try:
            stored = json.loads(config_path.read_text())
        except FileNotFoundError:
            stored = {}
        except (OSError, ValueError) as exc:
            raise ApiError(
                None, f"cannot read {config_path} ({exc}); delete it or set SHOAL_URL"
            ) from None
        url = stored.get("url") if isinstance(stored, dict) else None
    if token is None and settings.admin_token_path.is_file():
        token = settings.admin_token_path.read_text().strip() or None
    return ClientConfig(url=str(url or DEFAULT_URL).rstrip("/"), token=token)


def write_config(home: Path, url: str) -> Path:
    """Remember where `shoal up` serves, for the CLI's next commands."""
    path = home / CLIENT_CONFIG
    home.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"url": url}) + "\n")
    return path


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict) or "detail" not in body:
        text = response.text.strip()[:300] or response.reason_phrase
        return f"HTTP {response.status_code} from {response.request.url}: {text}"
    detail = body["detail"]
    message = detail if isinstance(detail, str) else json.dumps(detail)
    errors = body.get("errors")
    if response.status_code == 422 and isinstance(errors, list) and errors:
        lines = []
        for error in errors:
            if not isinstance(error, dict):
                lines.append(str(error))
            elif error.get("field"):
                lines.append(f"{error['field']}: {error.get('message', 'invalid')}")
            else:
                lines.append(str(error.get("message", "invalid")))
        message = "\n".join(lines)
    if response.status_code == 401:
        message += "; pass --token or set SHOAL_TOKEN (`shoal token create` makes one)"
    return message


def _item(collection: str, item_id: str, action: str = "") -> str:
    """The path of one job, sweep or device (``collection``), or of an action on it."""
    # Quoted whole: an id typed by a person must not reach another route ("x/../devices").
    path = f"/{collection}/{quote(item_id, safe='')}"
    return f"{path}/{action}" if action else path


RETRY_WAITS_S = (0.5, 1.0, 2.0, 4.0)
EXPORT_TIMEOUT_S = 600.0
"""How long an export may take to start and between its chunks (a large model's checkpoint
is read and written out before the first byte)."""
CHUNK_BYTES = 1 << 20
"""Waits before each retry of a repeatable request answered 503."""


def _retry_after(response: httpx.Response, backoff: float) -> float:
    """The server's Retry-After or the back-off, whichever is longer (30 s at most)."""
    try:
        asked = float(response.headers.get("Retry-After", 0))
    except ValueError:
        asked = 0.0
    return min(max(asked, backoff), 30.0)


def _save(response: httpx.Response, dest: Path) -> int:
    """A streamed answer's body into ``dest``, whole or not at all (a temporary sibling
    renamed into place); the bytes written. A refusal is an ``ApiError``."""
    if not response.is_success:
        response.read()
        raise ApiError(response.status_code, _error_message(response))
    part = dest.with_name(f".{dest.name}.part")
    try:
        with part.open("wb") as out:
            for chunk in response.iter_bytes(CHUNK_BYTES):
                out.write(chunk)
        part.replace(dest)
    finally:
        part.unlink(missing_ok=True)
    return dest.stat().st_size


class Closing:
    """What ``with`` closes on the way out."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class ShoalClient(Closing):
    """A connection to one Shoal API; a context manager."""

    def __init__(
        self,
        url: str,
        token: str | None,
        *,
        timeout_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(
            base_url=self.url + API_PREFIX,
            headers=headers,
            timeout=timeout_s,
            # Connection failures happen before a request is sent, so retrying them is safe.
            transport=transport or httpx.HTTPTransport(retries=2),
        )

    def close(self) -> None:
        self._http.close()

    @contextmanager
    def _reaching(self, method: str, path: str) -> Iterator[None]:
        """Transport failures of a request as ``ApiError``s that say what to check."""
        try:
            yield
        except httpx.ConnectError:
            raise ApiError(
                None, f"cannot reach Shoal at {self.url}; is `shoal up` running? (set SHOAL_URL)"
            ) from None
        except httpx.TimeoutException:
            raise ApiError(
                None, f"Shoal at {self.url} did not answer {method} {path} in time; try again"
            ) from None
        except httpx.TransportError as exc:
            raise ApiError(None, f"{method} {self.url}{API_PREFIX}{path} failed: {exc}") from None

    def _request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        body: Any = None,
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Json:
        sent = {"params": params, "json": body, "content": content, "headers": headers}
        with self._reaching(method, path):
            response = self._http.request(method, path, **sent)
            # 503: the server's database was out of reach and nothing was changed. A read,
            # a submission carrying its idempotency key, or an upload (kept by its content)
            # is safe to send again.
            repeatable = (
                method == "GET" or content is not None or "Idempotency-Key" in (headers or {})
            )
            for wait in RETRY_WAITS_S if repeatable else ():
                if response.status_code != 503:
                    break
                time.sleep(_retry_after(response, wait))
                response = self._http.request(method, path, **sent)
        if not response.is_success:
            raise ApiError(response.status_code, _error_message(response))
        try:
            decoded = response.json()
        except ValueError:
            decoded = None
        if not isinstance(decoded, dict):
            raise ApiError(
                response.status_code,
                f"{method} {path} answered with something other than a JSON object;"
                f" is {self.url} a Shoal server?",
            )
        return decoded

    def submit_job(
        self,
        spec: Mapping[str, Any],
        idempotency_key: str | None = None,
        code: Path | None = None,
    ) -> Json:
        """Queue a job; with ``code`` (a folder), upload that first and name it in the spec."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        body = spec if code is None else {**spec, "code": self.upload_code(code)["digest"]}
        return self._request("POST", "/jobs", body=body, headers=headers)

    def upload_code(self, directory: Path) -> Json:
        """Pack ``directory`` (``service.code_archive``) and upload it; the answer has its
        ``digest``. Uploading the same files again is harmless: they are kept once."""
        try:
            data = pack_directory(directory)
        except ArchiveError as exc:
            raise ApiError(None, str(exc)) from None
        headers = {"Content-Type": "application/zip"}
        return self._request("POST", "/code", content=data, headers=headers)

    def list_jobs(self, states: Sequence[str] = (), limit: int = 50, offset: int = 0) -> Json:
        params = {"state": list(states), "limit": limit, "offset": offset}
        return self._request("GET", "/jobs", params=params)

    def get_job(self, job_id: str) -> Json:
        return self._request("GET", _item("jobs", job_id))

    def cancel_job(self, job_id: str) -> Json:
        return self._request("POST", _item("jobs", job_id, "cancel"))

    def restart_job(self, job_id: str) -> Json:
        return self._request("POST", _item("jobs", job_id, "restart"))

    def metrics(self, job_id: str, since_step: int | None = None) -> Json:
        params = {} if since_step is None else {"since_step": since_step}
        return self._request("GET", _item("jobs", job_id, "metrics"), params=params)

    def events(self, job_id: str, since_id: int = 0) -> Json:
        return self._request("GET", _item("jobs", job_id, "events"), params={"since_id": since_id})

    def checkpoints(self, job_id: str) -> Json:
        return self._request("GET", _item("jobs", job_id, "checkpoints"))

    def export_model(self, job_id: str, dest: Path, step: int | None = None) -> int:
        """Write the job's model at its checkpoint of ``step`` (the latest when None) to
        ``dest`` as a safetensors file: whole or not at all (a temporary sibling renamed
        into place). The bytes written."""
        path = _item("jobs", job_id, "model")
        params = {} if step is None else {"step": step}
        waits = iter(RETRY_WAITS_S)
        with self._reaching("GET", path):
            while True:
                # The server reads the checkpoint and writes the file before the first byte.
                with self._http.stream("GET", path, params=params, timeout=EXPORT_TIMEOUT_S) as r:
                    wait = next(waits, None) if r.status_code == 503 else None
                    if wait is None:
                        return _save(r, dest)
                time.sleep(_retry_after(r, wait))

    def devices(self) -> Json:
        return self._request("GET", "/devices")

    def drain_device(self, device_id: str) -> Json:
        return self._request("POST", _item("devices", device_id, "drain"))

    def undrain_device(self, device_id: str) -> Json:
        return self._request("DELETE", _item("devices", device_id, "drain"))

    def submit_sweep(
        self,
        spec: Mapping[str, Any],
        idempotency_key: str | None = None,
        code: Path | None = None,
    ) -> Json:
        """Start a sweep; with ``code`` (a folder), upload that first and name it in the
        base job."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        body = dict(spec)
        if code is not None:
            base = body.get("base")
            if not isinstance(base, Mapping):
                raise ApiError(None, "the sweep spec has no base job to run the code with")
            body["base"] = {**base, "code": self.upload_code(code)["digest"]}
        return self._request("POST", "/sweeps", body=body, headers=headers)

    def list_sweeps(self, limit: int = 50, offset: int = 0) -> Json:
        return self._request("GET", "/sweeps", params={"limit": limit, "offset": offset})

    def get_sweep(self, sweep_id: str) -> Json:
        return self._request("GET", _item("sweeps", sweep_id))

    def cancel_sweep(self, sweep_id: str) -> Json:
        return self._request("POST", _item("sweeps", sweep_id, "cancel"))
