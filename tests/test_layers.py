"""Imports point down: libs/ (generated protobuf included) imports nothing of
the project above it, services/ nothing of the command-line package, and the
code the benchmarks and the simulator share (ferry/measure) neither of them;
no service imports another (they share libs/ and talk over gRPC).
Every import is read from the source (functions' lazy imports too)."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Layer (a path prefix) -> top-level project packages it must not import.
FORBIDDEN = {
    "libs/": ("ferry", "services", "tests"),
    "services/": ("ferry", "tests"),
    "ferry/measure/": ("ferry.bench", "ferry.sim", "tests"),
    "ferry/": ("tests",),
}
# The simulator's live modes drive a real cluster through the benchmark's
# driver (calibration against a live run; the shared CLI options): named here,
# so that a new one is a decision.
SIM_USES_BENCH = {
    "ferry/sim/calibrate.py": {"ferry.bench", "ferry.bench.serving"},
    "ferry/sim/cli.py": {"ferry.bench.compare", "ferry.bench.serving"},
    "ferry/sim/run.py": {"ferry.bench.serving"},
}


def imports_of(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return out


def _sources() -> list[pathlib.Path]:
    return sorted(p for top in ("libs", "services", "ferry") for p in (ROOT / top).rglob("*.py")
                  if ".venv" not in p.parts)


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def upward_imports(rel: str, modules: set[str]) -> list[str]:
    bad = []
    for prefix, banned in FORBIDDEN.items():
        if rel.startswith(prefix):
            bad += [m for m in modules if any(_under(m, b) for b in banned)]
    if rel.startswith("ferry/sim/"):
        allowed = SIM_USES_BENCH.get(rel, set())
        bad += [m for m in modules if _under(m, "ferry.bench") and m not in allowed]
    return sorted(set(bad))


SERVICES = ("frontend", "scheduler", "instance", "meta_store")


def cross_service_imports(rel: str, modules: set[str]) -> list[str]:
    """A service's imports of another service (they meet in libs/ and over gRPC)."""
    parts = rel.split("/")
    if parts[0] != "services" or len(parts) < 3 or parts[1] not in SERVICES:
        return []
    return sorted(m for m in modules for other in SERVICES
                  if other != parts[1] and _under(m, f"services.{other}"))


def _violations(rule, paths=None) -> dict[str, list[str]]:
    """What ``rule(relative path, path)`` finds in each source (all of libs, services, ferry unless ``paths``)."""
    found = {}
    for p in paths if paths is not None else _sources():
        rel = p.relative_to(ROOT).as_posix()
        bad = rule(rel, p)
        if bad:
            found[rel] = bad
    return found


def test_no_service_imports_another():
    found = _violations(lambda rel, p: cross_service_imports(rel, imports_of(p)))
    assert not found, f"a service importing another: {found}"


@pytest.mark.parametrize(("rel", "modules", "bad"), [
    ("services/instance/migration/x.py", {"services.frontend.router", "services.instance.runner"},
     ["services.frontend.router"]),
    ("services/scheduler/x.py", {"services.scheduler.policies", "libs.common.types"}, []),
    ("ferry/inprocess.py", {"services.frontend.router", "services.instance.runner"}, []),
])
def test_the_service_rule_sees_what_it_should(rel, modules, bad):
    assert cross_service_imports(rel, modules) == bad


def private_names_from_other_benches(rel: str, source: str) -> list[str]:
    """A benchmark's imports of another benchmark's private (_-named) helpers
    (what the benches share is public, in ferry/bench/harness.py)."""
    if not rel.startswith("ferry/bench/"):
        return []
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.startswith("ferry.bench."):
            out += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    return sorted(out)


def test_no_bench_imports_another_bench_private_helpers():
    found = _violations(lambda rel, p: private_names_from_other_benches(rel, p.read_text()),
                        sorted((ROOT / "ferry" / "bench").glob("*.py")))
    assert not found, found
    assert private_names_from_other_benches("ferry/bench/x.py", "def f():\n    from ferry.bench.chaos import _leaks, "
                                            "Chaos") == ["ferry.bench.chaos._leaks"]


def test_no_module_imports_a_layer_above_it():
    found = _violations(lambda rel, p: upward_imports(rel, imports_of(p)))
    assert not found, f"upward imports: {found}"


@pytest.mark.parametrize(("rel", "source", "bad"), [
    ("libs/common/x.py", "from ferry.cluster import free_port", ["ferry.cluster"]),
    ("services/instance/x.py", "def f():\n    from ferry.pb import common_pb2", ["ferry.pb"]),
    ("services/instance/x.py", "import ferry", ["ferry"]),
    ("ferry/measure/x.py", "from ferry.bench import serving", ["ferry.bench"]),
    ("ferry/sim/x.py", "from ferry.bench.serving import POLICIES", ["ferry.bench.serving"]),
    ("services/instance/x.py", "from libs.pb import common_pb2\nfrom ferrying import x", []),
])
def test_the_check_sees_an_upward_import(tmp_path, rel, source, bad):
    p = tmp_path / "m.py"
    p.write_text(source)
    assert upward_imports(rel, imports_of(p)) == bad


# One implementation of each control loop and count (issue 52): where each is called from the
# project's own code. A second caller is a decision to name here, not a copy that drifts.
ONE_PLACE = {
    "pair_migrations(": {"services/scheduler/rescheduler.py"},  # the rescheduling loop (live and simulated)
    "add_pending(": {"libs/common/policies/phases.py"},  # count_placed: the one count of a placement
    "backoff * 2": set(),  # no hand-written doubling backoff: libs/common/backoff.Reconnect
    # asyncio.timeout instead: Python 3.11's wait_for returns the awaited result when a cancel comes
    # as it completes, and the cancelled task goes on (a stream outlived its client: event_stream.py)
    "asyncio.wait_for(": set(),
}


def callers(needle: str) -> set[str]:
    out = set()
    for p in _sources():
        rel = p.relative_to(ROOT).as_posix()
        for line in p.read_text().splitlines():
            code = line.split("#", 1)[0]
            if needle in code and not code.lstrip().startswith(("def ", "async def ")):
                out.add(rel)
    return out


@pytest.mark.parametrize("needle", sorted(ONE_PLACE))
def test_each_loop_and_count_has_one_implementation(needle):
    assert callers(needle) <= ONE_PLACE[needle], f"{needle!r} called from {sorted(callers(needle))}"
