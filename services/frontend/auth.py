"""API keys at the public edge (HTTP API and gRPC Generate API): a request
carries ``Authorization: Bearer KEY`` (an HTTP header, or gRPC metadata
``authorization``), checked in constant time against the configured keys.

Two kinds of keys: the keys that may use the API at all (none configured:
anyone may), and the keys whose requests may ask for high priority. A
priority key is also an API key. Nobody else, anonymous clients included,
may raise a request's priority: it would push everyone else's requests back."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from libs.common.errors import PermissionDenied, Unauthenticated
from libs.common.types import Priority


def _bearer(authorization: str | None) -> bytes:
    header = authorization or ""
    token = header[7:].strip() if header.lower().startswith("bearer ") else ""
    # NOTE: as bytes: compare_digest raises TypeError on a non-ASCII str (an
    # HTTP header value may hold any Latin-1 character: a 500 before).
    return token.encode("utf-8", "surrogateescape")


def _one_of(token: bytes, keys: frozenset[str]) -> bool:
    # every key compared (no early exit): the time says nothing of which one matched
    hits = [secrets.compare_digest(token, k.encode("utf-8", "surrogateescape")) for k in keys]
    return bool(token) and any(hits)


@dataclass(frozen=True)
class Keys:
    required: frozenset[str] = frozenset()  # empty: no key needed
    priority: frozenset[str] = frozenset()  # keys that may ask for high priority

    def check(self, authorization: str | None) -> bool:
        """Raise Unauthenticated unless the request may use the API; returns
        whether it may ask for high priority."""
        token = _bearer(authorization)
        privileged = _one_of(token, self.priority)
        if self.required and not privileged and not _one_of(token, self.required):
            raise Unauthenticated("missing or invalid API key (Authorization: Bearer …)")
        return privileged


def check_priority(priority: Priority, privileged: bool) -> None:
    """Raise PermissionDenied for a raised priority without a priority key."""
    if priority > Priority.NORMAL and not privileged:
        raise PermissionDenied(f"priority {priority.name.lower()} needs an API key allowed to ask for it "
                               "(--priority-api-key)", param="priority")


def check_bearer(authorization: str | None, keys: frozenset[str]) -> None:
    """Raise Unauthenticated unless no keys are configured or the header holds one."""
    Keys(keys).check(authorization)
