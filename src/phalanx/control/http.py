"""A tiny JSON-over-HTTP client on the standard library, shared by agents and the CLI.

Every request carries the cluster token as `Authorization: Bearer`. Raises `ControllerUnreachable` when
nothing answers and `ApiError` (with the HTTP status and the server's detail) for an error response; a
request validation error's list (FastAPI's 422) becomes one line of `field: message` parts, not a raw dump.
An agent's heartbeats go through a `KeepAlive` session: one connection reused from heartbeat to heartbeat, as
a thousand agents must not cost the controller a TCP handshake and a new connection each every few seconds.
Stdlib only: agents import it and must start fast.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.parse
import urllib.request


class ControllerUnreachable(ConnectionError):
    def __init__(self, message: str, *, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out  # the controller took the request but did not answer in time (busy, not gone)


class ApiError(RuntimeError):
    def __init__(self, status: int, detail: str):
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status
        self.detail = detail


def readable_detail(detail) -> str:
    """FastAPI's validation errors ([{"loc": ["body", "xid"], "msg": "Value error, ...", ...}]) as one line of
    `field: message` parts joined by '; '; any other detail as text."""
    if not (isinstance(detail, list) and detail and all(isinstance(e, dict) and "msg" in e for e in detail)):
        return str(detail)
    lines = []
    for e in detail:
        loc = [str(p) for p in e.get("loc", []) if p != "body"]
        msg = str(e["msg"]).removeprefix("Value error, ")
        if e.get("type") == "extra_forbidden":
            msg = "unknown field"
        lines.append(f"{'.'.join(loc)}: {msg}" if loc else msg)
    return "; ".join(lines)


def request_json(method: str, url: str, token: str | None, body: dict | None = None, *,
                 timeout: float = 5.0) -> dict | list:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Accept", "application/json")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            payload = resp.read()
    except urllib.error.HTTPError as err:
        raise ApiError(err.code, _detail(err.read())) from None
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise ControllerUnreachable(f"{method} {url}: {reason}", timed_out=isinstance(reason, TimeoutError)) from None
    return json.loads(payload) if payload else {}


def _detail(raw: bytes) -> str:
    """An error response's `detail` (FastAPI's shape), or its text."""
    text = raw.decode(errors="replace")
    try:
        detail = json.loads(text).get("detail", text)
    except (json.JSONDecodeError, AttributeError):
        detail = text
    return readable_detail(detail)


class KeepAlive:
    """`request_json` over one HTTP/1.1 connection kept open between requests (an agent's heartbeats; the
    controller keeps an idle one for `3 × FULL_HEARTBEAT_MAX_S`). A kept connection the controller closed meanwhile
    is found when the request is sent or its answer's first line is read, and the request goes once more on a new
    connection; any other failure is `ControllerUnreachable`, as with `request_json`. One thread's: not shared."""

    def __init__(self):
        self._conn: http.client.HTTPConnection | None = None
        self._at: tuple[str, int] | None = None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn = self._at = None

    def request_json(self, method: str, url: str, token: str | None, body: dict | None = None, *,
                     timeout: float = 5.0) -> dict | list:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or parts.hostname is None:
            return request_json(method, url, token, body, timeout=timeout)
        at = (parts.hostname, parts.port or 80)
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        data = None if body is None else json.dumps(body).encode()
        headers = {"Accept": "application/json", **({"Content-Type": "application/json"} if data is not None else {}),
                   **({"Authorization": f"Bearer {token}"} if token is not None else {})}
        try:
            status, payload = self._exchange(at, method, path, data, headers, timeout)
        except _Stale:  # the controller closed the idle connection meanwhile: once more, on a new one
            status, payload = self._exchange(at, method, path, data, headers, timeout)
        if status >= 400:
            raise ApiError(status, _detail(payload))
        return json.loads(payload) if payload else {}

    def _exchange(self, at: tuple[str, int], method: str, path: str, data: bytes | None, headers: dict,
                  timeout: float) -> tuple[int, bytes]:
        if self._at != at:
            self.close()
        reused = self._conn is not None
        if not reused:
            self._conn, self._at = http.client.HTTPConnection(*at, timeout=timeout), at
        conn = self._conn
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        try:
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            payload = resp.read()
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as err:
            self.close()
            if reused:
                raise _Stale() from None
            raise ControllerUnreachable(f"{method} http://{at[0]}:{at[1]}{path}: {err}") from None
        except (OSError, http.client.HTTPException) as err:
            self.close()
            raise ControllerUnreachable(f"{method} http://{at[0]}:{at[1]}{path}: {err}") from None
        if resp.will_close:
            self.close()
        return resp.status, payload


class _Stale(Exception):
    """A kept connection turned out closed by the controller."""
