"""API keys: ``Authorization: Bearer <key>`` compared in constant time; 401 in OpenAI's shape otherwise."""

from __future__ import annotations

import hmac

from starlette.requests import Request

from frontend.errors import AdminDisabledError, AuthenticationError


def require_bearer(request: Request, key: str | None, *, admin: bool = False) -> None:
    """Refuse the request unless it carries ``key``. No key configured: client routes are open, admin ones shut."""
    check_bearer(request.headers.get("authorization"), key, admin=admin)


def check_bearer(header: str | None, key: str | None, *, admin: bool = False) -> None:
    """``require_bearer`` on the request's ``Authorization`` header (``header``; None when it sent none)."""
    if key is None:
        if admin:
            raise AdminDisabledError("the admin API is disabled: start the orchestrator with --admin-key")
        return
    scheme, _, presented = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(presented.strip().encode(), key.encode()):
        kind = "admin key" if admin else "API key"
        raise AuthenticationError(f"missing or incorrect {kind}: send 'Authorization: Bearer <key>'")
