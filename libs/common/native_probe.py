"""Whether native code is safe to load here, decided once in a child process.

An extension built for an instruction set this CPU lacks does not raise: the
process dies of SIGILL while importing it (a static initializer) or at its
first call, and no ``try`` can catch that. So the first process of an
installation that wants such code runs a short Python snippet that loads and
exercises it in a child interpreter and reads the child's exit status; the
answer is written to a cache file keyed by the snippet, the versions it names
and the CPU's flags, which every later process (every instance, every test
run) reads instead of probing again. Only code whose probe passed may then be
imported in-process.

The snippet prints one JSON object as its last line of output (its report);
exit status 0 means it ran. A child killed by a signal, one that exits non-zero,
or one that runs past the timeout is a failure with the reason in words.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile

from libs.common import cpu_features
from libs.common.models import cache_root

VERSION = 1  # of the cache format; part of every key


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    ok: bool
    reason: str = ""  # why not, in words ("killed by SIGILL (illegal instruction)", the last error line, ...)
    signal: str | None = None  # the signal's name when the child died of one
    report: dict = dataclasses.field(default_factory=dict)  # the snippet's JSON (ok only)
    cached: bool = False  # read from the cache file, not probed by this process

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("cached")
        return d


def cache_dir() -> pathlib.Path:
    return cache_root() / "probes"


def key(name: str, code: str, versions: dict[str, str]) -> str:
    """The cache key: the probe's name and code, the versions it depends on,
    this interpreter and the CPU's flags (a shared home on another CPU differs)."""
    h = hashlib.sha256()
    for part in (str(VERSION), name, code, json.dumps(versions, sort_keys=True), sys.executable,
                 " ".join(sorted(cpu_features.flags())), cpu_features.arch()):
        h.update(part.encode())
        h.update(b"\0")
    return f"{name}-{h.hexdigest()[:20]}"


def probe(name: str, code: str, versions: dict[str, str], timeout_s: float = 300.0,
          env: dict[str, str] | None = None) -> ProbeResult:
    """The cached answer for (name, code, versions, this CPU), or a new probe.
    Processes that start together probe once: the first holds a file lock,
    the others wait for it and read its answer."""
    path = cache_dir() / f"{key(name, code, versions)}.json"
    cached = _read(path)
    if cached is not None:
        return cached
    path.parent.mkdir(parents=True, exist_ok=True)
    with _lock(path):
        cached = _read(path)
        if cached is not None:
            return cached
        result = run_child(code, timeout_s, env)
        if result.reason != "timeout":  # a loaded machine may time out once; ask again next time
            _write(path, {"name": name, "versions": versions, **result.as_dict()})
        return result


def run_child(code: str, timeout_s: float, env: dict[str, str] | None = None) -> ProbeResult:
    """Run ``code`` in a fresh interpreter of this installation (no cache)."""
    child_env = {**os.environ, **(env or {})}
    # The child imports the project's modules as this process does.
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), *sys.path) if p)
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s,
                              env=child_env, check=False)
    except subprocess.TimeoutExpired:
        return ProbeResult(False, "timeout")
    if proc.returncode < 0:
        sig = signal.Signals(-proc.returncode)
        what = {signal.SIGILL: " (illegal instruction: code built for an instruction set this CPU lacks)",
                signal.SIGSEGV: " (segmentation fault)", signal.SIGBUS: " (bus error)"}.get(sig, "")
        return ProbeResult(False, f"killed by {sig.name}{what}", signal=sig.name)
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        return ProbeResult(False, lines[-1] if lines else f"exit status {proc.returncode}")
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
    try:
        report = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        return ProbeResult(False, f"unreadable report: {lines[-1][:200]!r}")
    if not isinstance(report, dict):
        return ProbeResult(False, f"unreadable report: {lines[-1][:200]!r}")
    return ProbeResult(True, report=report)


def _read(path: pathlib.Path) -> ProbeResult | None:
    try:
        d = json.loads(path.read_text())
        return ProbeResult(bool(d["ok"]), str(d.get("reason", "")), d.get("signal"), dict(d.get("report") or {}),
                           cached=True)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write(path: pathlib.Path, data: dict) -> None:
    """Atomically: a reader sees the whole answer or none."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


@contextlib.contextmanager
def _lock(path: pathlib.Path):
    import fcntl

    with open(path.with_suffix(".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
