"""docs/results/README.md's front page (ferry/results.py): every headline's
file exists, its number is there and finite, its command is a real `ferry`
command with options it has, and the page shows what the files give now."""

from __future__ import annotations

import json

import pytest

from ferry import results
from ferry.results import Headline, HeadlineError


def test_the_front_page_is_current_and_every_headline_resolves():
    headlines = results.load()
    assert len(headlines) >= 10
    rows = results.rows(headlines)
    assert all(r[3] != "uncommitted" for r in rows), "commit the result files before generating the page"
    assert results.main(["--check"]) == 0, "docs/results/README.md is stale: run `python -m ferry.results`"
    first_screen = results.PAGE.read_text().splitlines()[:12]
    assert any(line.startswith("| Live migration downtime") for line in first_screen)


def test_paths_pick_keys_indices_and_list_elements_by_field():
    doc = {"points": [{"instances": 16, "ms": {"p50": 0.7}}, {"instances": 1000, "ms": {"p50": 5.0}}],
           "lengths": {"8000": {"downtime_ms": 23.6}}}
    assert results.pick(doc, "points[instances=1000].ms.p50") == 5.0
    assert results.pick(doc, "points[0].ms.p50") == 0.7
    assert results.pick(doc, "lengths.8000.downtime_ms") == 23.6
    for bad in ("points[instances=64].ms.p50", "points[2]", "lengths.4096", "lengths..x"):
        with pytest.raises(HeadlineError):
            results.pick(doc, bad)


def test_a_missing_file_number_or_command_fails(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps({"a": {"b": 1.5}, "s": "text", "nan": float("nan")}))
    ok = Headline("m", "r.json", "a.b", "ms", "ferry bench overhead")
    assert results.rows([ok], tmp_path)[0][1] == "1.5 ms"
    for broken in (Headline("m", "gone.json", "a.b", "ms", "ferry bench overhead"),
                   Headline("m", "r.json", "a.c", "ms", "ferry bench overhead"),
                   Headline("m", "r.json", "s", "ms", "ferry bench overhead"),
                   Headline("m", "r.json", "nan", "ms", "ferry bench overhead"),
                   Headline("m", "r.json", "a.b", "ms", "ferry bench no-such-bench"),
                   Headline("m", "r.json", "a.b", "ms", "ferry bench overhead --no-such-option 3"),
                   Headline("m", "r.json", "a.b", "ms", "python bench.py")):
        with pytest.raises(HeadlineError):
            results.rows([broken], tmp_path)


def test_a_result_names_its_machine_and_its_commit(tmp_path):
    from ferry.machine import write_json

    path = tmp_path / "r.json"
    write_json(str(path), {"x": 1})
    doc = json.loads(path.read_text())
    assert "cores" in results.machine_of(doc) and results.machine_of({}) == "not recorded"
    assert results.recorded(path) == ("uncommitted", "")  # outside the repository's history
    commit, date = results.recorded(results.RESULTS / "chaos.json")
    assert len(commit) >= 7 and date.startswith("20")
