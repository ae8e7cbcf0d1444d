"""API keys at the public edge (HTTP API and gRPC Generate API): a request
carries ``Authorization: Bearer KEY`` (an HTTP header, or gRPC metadata
``authorization``), checked in constant time against the configured keys."""

from __future__ import annotations

import secrets

from libs.common.errors import Unauthenticated


def check_bearer(authorization: str | None, keys: frozenset[str]) -> None:
    """Raise Unauthenticated unless no keys are configured or the header holds one."""
    if not keys:
        return
    header = authorization or ""
    token = header[7:].strip() if header.lower().startswith("bearer ") else ""
    if not any(secrets.compare_digest(token, k) for k in keys):
        raise Unauthenticated("missing or invalid API key (Authorization: Bearer …)")
