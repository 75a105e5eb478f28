"""``velox-serve --api-key``: one shared key, checked on every route but ``/health``.

A request carries the key as ``Authorization: Bearer KEY`` (the ``openai`` client) or
``x-api-key: KEY`` (the ``anthropic`` client). The comparison runs in constant time
(:func:`hmac.compare_digest`) and the key is never logged; a refusal is a 401 whose body has
the route's own error shape (Anthropic's for ``/v1/messages``, OpenAI's elsewhere).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping
from typing import Any

ENV_VAR = "VELOX_API_KEY"
OPEN_PATHS = frozenset({"/health"})
ANTHROPIC_PATHS = frozenset({"/v1/messages"})


def resolve_api_key(flag: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The key to require: ``--api-key`` if given, else ``$VELOX_API_KEY``, else ``None`` (no
    authentication). An empty or blank key is refused rather than silently meaning "none"."""
    env = os.environ if environ is None else environ
    key = flag if flag is not None else env.get(ENV_VAR)
    if key is None:
        return None
    if not isinstance(key, str) or not key.strip():
        source = "--api-key" if flag is not None else ENV_VAR
        raise ValueError(f"{source} must be a non-empty string (leave it unset for no key)")
    return key


def presented_key(headers: Any) -> str | None:
    """The key a request presents: ``x-api-key``, else the token of ``Authorization: Bearer``."""
    key = headers.get("x-api-key")
    if key:
        return str(key).strip()
    auth = headers.get("Authorization") or ""
    scheme, _, token = str(auth).strip().partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return None


def is_authorized(headers: Any, key: str | None) -> bool:
    """Whether a request with ``headers`` may proceed (always, when no key is set)."""
    if key is None:
        return True
    given = presented_key(headers)
    if given is None:
        return False
    return hmac.compare_digest(given.encode("utf-8"), key.encode("utf-8"))


def needs_key(path: str) -> bool:
    """Every route needs the key except the health check (query string ignored)."""
    return path.split("?", 1)[0].rstrip("/") not in OPEN_PATHS


def unauthorized_body(path: str, has_key: bool) -> dict[str, Any]:
    """A 401 body in the route's style; the message never echoes what was sent."""
    message = (
        "invalid API key"
        if has_key
        else "missing API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'"
    )
    if path.split("?", 1)[0].rstrip("/") in ANTHROPIC_PATHS:
        return {"type": "error", "error": {"type": "authentication_error", "message": message}}
    return {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
