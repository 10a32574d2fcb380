"""A tiny JSON-over-HTTP client on the standard library, shared by agents and the CLI.

Every request carries the cluster token as `Authorization: Bearer`. Raises `ControllerUnreachable` when
nothing answers and `ApiError` (with the HTTP status and the server's detail) for an error response; a
request validation error's list (FastAPI's 422) becomes one line of `field: message` parts, not a raw dump.
Stdlib only: agents import it and must start fast.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request


class ControllerUnreachable(ConnectionError):
    pass


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
        raw = err.read().decode(errors="replace")
        try:
            detail = json.loads(raw).get("detail", raw)
        except (json.JSONDecodeError, AttributeError):
            detail = raw
        raise ApiError(err.code, readable_detail(detail)) from None
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise ControllerUnreachable(f"{method} {url}: {reason}") from None
    return json.loads(payload) if payload else {}
