"""Named fault-injection points for tests of failure paths (commit lost,
process killed mid-transfer, …). Off unless configured: ``--failpoints``
or env FERRY_FAILPOINTS, as ``name`` or ``name=value``, comma-separated.
Production code asks ``value(name)``; with nothing configured that is one
dict lookup."""

from __future__ import annotations

import os

_points: dict[str, str] = {}


def configure(spec: str) -> None:
    _points.clear()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, val = item.partition("=")
        _points[name] = val or "1"


def value(name: str) -> str | None:
    return _points.get(name)


def enabled(name: str) -> bool:
    return name in _points


configure(os.environ.get("FERRY_FAILPOINTS", ""))
