"""The API key on the HTTP API (`--api-key`, as vLLM's): every `/v1/...` request must carry
`Authorization: Bearer <key>`, or it is answered 401 with OpenAI's error body (code
`invalid_api_key`) before anything else reads it. `/health` and `/metrics` stay open (probes
and scrapers). A plain ASGI middleware, so streaming responses and disconnect detection pass
through untouched. The key is compared in constant time (tandem/security.py).
"""
from __future__ import annotations

import logging
from typing import Any

from gateway.http.errors import HttpError
from tandem.security import bearer_token, same_secret

logger = logging.getLogger(__name__)

PROTECTED_PREFIX = "/v1"


class ApiKeyMiddleware:
    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIX):
            authorization = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
            if not same_secret(bearer_token(authorization.decode("latin-1")), self.api_key):
                err = HttpError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                                code="invalid_api_key")
                response = err.response()
                response.headers["www-authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
