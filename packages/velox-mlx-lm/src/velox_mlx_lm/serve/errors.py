"""The exception a ``velox-serve`` route raises to refuse a request before answering it."""

from __future__ import annotations


class BadRequest(Exception):  # not a ValueError: mlx-lm's handler turns those into 400s
    """A request to refuse with ``status``; each route renders it in its own error style
    (OpenAI's ``{"error": {...}}`` or Anthropic's ``{"type": "error", ...}``).

    ``kind``: Anthropic's error type; ``headers``: extra response headers (``Retry-After``).
    """

    def __init__(
        self,
        message: str,
        status: int = 400,
        code: str | None = None,
        *,
        kind: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.kind = kind or ANTHROPIC_KINDS.get(status, "invalid_request_error")
        self.headers = dict(headers or {})


# Anthropic's error type for each status (https://docs.anthropic.com/en/api/errors).
ANTHROPIC_KINDS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    500: "api_error",
    503: "overloaded_error",
}
