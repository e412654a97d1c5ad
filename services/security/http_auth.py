"""API keys on the OpenAI-compatible HTTP front: an ASGI middleware that answers a
request without a valid `Authorization: Bearer <key>` with 401 in OpenAI's error shape
(what the `openai` client raises as `AuthenticationError`), and records which client the
key names for the endpoints (`authenticated_client()`, and `request.state.client`).

`/health` stays open (probes carry no key); `/metrics` and the API need a key.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from services.errors import PdserveError, http_status
from services.security.apikeys import CURRENT_CLIENT, ApiKeys, bearer_from_headers

OPEN_PATHS = ("/health",)
ErrorBody = Callable[[PdserveError], tuple[int, dict[str, Any]]]


def openai_shape(error: PdserveError) -> tuple[int, dict[str, Any]]:
    """(status, body) as OpenAI's API answers a bad key."""
    status, message = http_status(error)
    return status, {"error": {"message": message, "type": "AuthenticationError",
                              "param": None, "code": status}}


class ApiKeyMiddleware:
    """ASGI middleware: only requests with a known API key reach `app`, but `open_paths`.
    `error_body` shapes the refusal (default: OpenAI's error object)."""

    def __init__(self, app: ASGIApp, keys: ApiKeys, open_paths: Iterable[str] = OPEN_PATHS,
                 error_body: ErrorBody = openai_shape) -> None:
        self.app = app
        self.keys = keys
        self.open_paths = frozenset(open_paths)
        self.error_body = error_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in self.open_paths:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            client = self.keys.authenticate(bearer_from_headers(headers))
        except PdserveError as e:
            await self._refuse(e, send)
            return
        CURRENT_CLIENT.set(client)  # this request's task (and the tasks it starts)
        state = {**scope.get("state", {}), "client": client}
        await self.app({**scope, "state": state}, receive, send)

    async def _refuse(self, error: PdserveError, send: Send) -> None:
        status, body = self.error_body(error)
        payload = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            (b"www-authenticate", b'Bearer realm="pdserve"')]})
        await send({"type": "http.response.body", "body": payload})
