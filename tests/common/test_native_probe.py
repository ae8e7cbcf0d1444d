"""Native code decided in a child process (libs/common/native_probe.py): a
child that dies of SIGILL is a failure in words, never the caller's death;
answers are cached per snippet, versions and CPU flags; processes that
start together probe once."""

from __future__ import annotations

import threading

import pytest

from libs.common import cpu_features, native_probe

SIGILL = "import tests.instance.engine.sigill_kernels"
OK = "import json; print('noise'); print(json.dumps({'answer': 42}))"


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FERRY_CACHE_DIR", str(tmp_path))
    return tmp_path / "probes"


def test_a_child_killed_by_sigill_is_a_failure_with_the_reason():
    r = native_probe.probe("t", SIGILL, {"v": "1"})
    assert not r.ok and r.signal == "SIGILL" and not r.cached
    assert "illegal instruction" in r.reason


def test_the_answer_is_cached_and_read_without_a_child(cache):
    first = native_probe.probe("t", OK, {"v": "1"})
    assert first.ok and first.report == {"answer": 42} and not first.cached
    (path,) = cache.glob("t-*.json")
    again = native_probe.probe("t", OK, {"v": "1"})
    assert again.cached and again.report == first.report
    path.write_text(path.read_text().replace("42", "43"))  # what the cache says is what a later process reads
    assert native_probe.probe("t", OK, {"v": "1"}).report == {"answer": 43}


def test_the_key_changes_with_versions_code_and_cpu_flags(monkeypatch):
    base = native_probe.key("t", OK, {"v": "1"})
    assert native_probe.key("t", OK, {"v": "2"}) != base
    assert native_probe.key("t", OK + " ", {"v": "1"}) != base
    monkeypatch.setenv("FERRY_CPU_FLAGS", "avx2 fma")
    assert native_probe.key("t", OK, {"v": "1"}) != base


def test_errors_and_bad_reports_fail_with_their_last_line():
    r = native_probe.probe("err", "raise RuntimeError('no primitive for this matmul')", {})
    assert not r.ok and r.signal is None and r.reason == "RuntimeError: no primitive for this matmul"
    r = native_probe.probe("bad", "print('not json')", {})
    assert not r.ok and "unreadable report" in r.reason


def test_a_timeout_is_not_cached(cache):
    r = native_probe.probe("slow", "import time; time.sleep(5)", {}, timeout_s=0.5)
    assert not r.ok and r.reason == "timeout"
    assert not list(cache.glob("slow-*.json"))


def test_processes_that_start_together_probe_once(tmp_path):
    marks = tmp_path / "runs"
    code = f"import json; open({str(marks)!r}, 'a').write('x'); print(json.dumps({{}}))"
    results = []
    threads = [threading.Thread(target=lambda: results.append(native_probe.probe("once", code, {})))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert marks.read_text() == "x" and all(r.ok for r in results)
    assert sum(not r.cached for r in results) == 1


@pytest.mark.parametrize("flags, level", [
    ("sse4_2 avx", "none"),
    ("avx avx2 fma f16c", "AVX2"),
    ("avx2 fma avx512f avx512bw avx512vl", "AVX-512"),
    ("avx2 fma avx512f avx512bw avx512vl avx512_bf16", "AVX-512 BF16"),
    ("avx2 fma avx512f avx512bw avx512vl avx512_bf16 amx_tile amx_bf16", "AMX"),
])
def test_cpu_levels(flags, level, monkeypatch):
    monkeypatch.setenv("FERRY_CPU_FLAGS", flags)
    assert cpu_features.level() == level
    assert level in cpu_features.summary()
    assert cpu_features.has_bf16() == ("bf16" in flags)
