"""monitoring/grafana/kvconn-dashboard.json: a dashboard Grafana can import,
whose every query names only metrics kvconn exports and parses as PromQL."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

from ops_support import DASHBOARD, exported_series, referenced

# Grafana's variables, replaced by what they stand for at query time.
GRAFANA_VARS = {
    "$__rate_interval": "5m",
    "$__interval": "1m",
    "$__range": "1h",
    "$job": ".*",
    "$instance": ".*",
}


def load() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return dashboard


def targets(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expression) of every query."""
    out: list[tuple[str, str]] = []
    for panel in dashboard["panels"]:
        for sub in [panel, *panel.get("panels", [])]:
            out.extend((sub["title"], t["expr"]) for t in sub.get("targets", []))
    return out


def expand(expr: str) -> str:
    for var, value in sorted(GRAFANA_VARS.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(var, value)
    assert "$" not in expr, f"an unknown Grafana variable in {expr!r}"
    return expr


def test_the_dashboard_is_importable_json() -> None:
    d = load()
    assert d["uid"] and d["title"] and isinstance(d["schemaVersion"], int)
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"] for v in d["templating"]["list"]}
    assert {"datasource", "job", "instance"} <= variables
    for panel in d["panels"]:
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, panel["title"]


def test_the_dashboard_shows_what_an_operator_needs() -> None:
    used = set().union(*(referenced(e) for _, e in targets(load())))
    for needed in (
        "kvconn_pages_held",
        "kvconn_pages_quarantined",
        "kvconn_quarantine_oldest_seconds",
        "kvconn_releases_total",
        "kvconn_abort_to_release_seconds_bucket",
        "kvconn_ranks_down_total",
        "kvconn_fences_total",
        "kvconn_dropped_messages_total",
        "kvconn_chunks_total",
        "kvconn_owner_fences_total",
        "kvconn_owner_fence_pages_recovered_total",
    ):
        assert needed in used, f"no panel shows {needed}"


def test_every_query_names_only_exported_metrics() -> None:
    exported = exported_series()
    d = load()
    queries = [(title, e) for title, e in targets(d)]
    queries += [
        ("variable " + v["name"], v["definition"]) for v in d["templating"]["list"] if "definition" in v
    ]
    for title, expr in queries:
        used = referenced(expr)
        assert used, f"{title}: no kvconn metric in {expr!r}"
        assert used <= exported, f"{title}: {used - exported} is not a metric kvconn exports"


def test_promtool_parses_every_query(promtool: str, tmp_path: Path) -> None:
    """promtool has no offline query check, but a recording rule's expression
    is parsed in full: one rule per query (JSON is YAML)."""
    rules = [
        {"record": f"kvconn_dashboard:query_{i}", "expr": expand(e)}
        for i, (_, e) in enumerate(targets(load()))
    ]
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(rf"SUCCESS: {len(rules)} rules found", out.stdout), out.stdout


def test_promtool_rejects_a_broken_query(promtool: str, tmp_path: Path) -> None:
    """The check above can fail: a query with unbalanced parentheses does not pass."""
    path = tmp_path / "bad.yml"
    bad = [{"record": "kvconn_dashboard:bad", "expr": "sum(rate(kvconn_releases_total[5m])"}]
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": bad}]}))
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
