"""CPU core sets for pinning instance processes (``--cpus``).

Several native instances on one machine each run an engine thread that is
busy every step. Unpinned, the kernel may run any thread on any core, so the
work one instance does besides its steps (a migration's copies, a helper
thread zeroing memory, gRPC) can land on the core another instance is
stepping on. Pinned, an instance's extra work waits for its own core, which
delays its own steps instead (docs/results/LOG.md, "Pinning the instances
to cores": on 2 cores that made a migrated request's stall longer).
"""

from __future__ import annotations

import os


def parse_cpus(text: str) -> list[int]:
    """'0', '0-3', '0,2,4-5' -> sorted core ids; ValueError with the reason."""
    cores: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"cpus {text!r}: empty item (expected e.g. '0', '0-3' or '0,2-3')")
        lo, sep, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"cpus {text!r}: {part!r} is not a core id or a range a-b") from None
        if a < 0 or b < a:
            raise ValueError(f"cpus {text!r}: {part!r} is not a range of core ids from low to high")
        cores.update(range(a, b + 1))
    return sorted(cores)


def format_cpus(cores: list[int]) -> str:
    return ",".join(str(c) for c in cores)


def cores_for(index: int, instances: int, available: list[int]) -> list[int]:
    """The cores of instance ``index`` of ``instances``: the available cores
    split into equal consecutive shares (one each at least; with more
    instances than cores, instances share cores round robin; an index past
    ``instances`` shares the cores of ``index % instances``)."""
    if not available:
        raise ValueError("no cores to pin to")
    per = len(available) // max(1, instances)
    if per == 0:
        return [available[index % len(available)]]
    i = index % max(1, instances)
    return available[i * per: (i + 1) * per]


def available_cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def pin(text: str) -> list[int]:
    """Pin the calling thread, and every thread it starts from now on, to the
    cores in ``text``; returns them. Call it first in a process, before any
    other thread exists, to pin the whole process. ValueError for cores this
    process may not use."""
    cores = parse_cpus(text)
    allowed = set(available_cores())
    if not set(cores) <= allowed:
        missing = format_cpus(sorted(set(cores) - allowed))
        raise ValueError(f"cpus {text!r}: core(s) {missing} not available to this process "
                         f"(available: {format_cpus(sorted(allowed))})")
    os.sched_setaffinity(0, cores)
    return cores
