"""The Grafana dashboards in deploy/grafana/dashboards are what
ferry/dashboards.py builds with Grafana's Foundation SDK (``ferry dashboards
--check``), read back into the SDK's dashboard model, and every panel reads
the Prometheus data source variable. Whether their queries return data is
tests/deploy/test_prometheus_live.py's."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ferry.dashboards import BOARDS, OUT, dashboards, panel_queries, to_json

pytest.importorskip("grafana_foundation_sdk")


def test_the_committed_dashboards_are_what_the_builder_makes():
    r = CliRunner().invoke(dashboards, ["--check"])
    assert r.exit_code == 0, r.output
    assert sorted(p.stem for p in OUT.glob("*.json")) == sorted(b.uid for b in BOARDS)


def test_a_stale_dashboard_is_caught(tmp_path):
    for b in BOARDS:
        (tmp_path / f"{b.uid}.json").write_text(to_json(b))
    (tmp_path / "ferry-cluster.json").write_text(to_json(BOARDS[0]).replace("Requests by status", "Requests"))
    r = CliRunner().invoke(dashboards, ["--check", "--out", str(tmp_path)])
    assert r.exit_code != 0 and "ferry-cluster.json" in r.output


@pytest.mark.parametrize("board", BOARDS, ids=lambda b: b.uid)
def test_each_dashboard_reads_back_into_the_sdk_model(board):
    from grafana_foundation_sdk.models.dashboard import Dashboard

    doc = json.loads((OUT / f"{board.uid}.json").read_text())
    model = Dashboard.from_json(doc)
    assert model.uid == board.uid and model.title == board.title
    assert len(doc["panels"]) == len(board.panels)
    for p in doc["panels"]:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and all(t["expr"] for t in p["targets"]), p["title"]
    names = [v["name"] for v in doc["templating"]["list"]]
    assert names == (["datasource", "instance_id"] if board.per_instance else ["datasource"])
    if not board.per_instance:
        assert not any("$instance_id" in e for _, e in panel_queries(doc))
