"""monitoring/prometheus/kvconn-rules.yml: promtool accepts it, its unit tests
pass, every alert has a test and a section in docs/operations.md, and every
metric it uses is one kvconn exports."""

from __future__ import annotations

import re
import subprocess

from ops_support import ROOT, RULE_TESTS, RULES, exported_series, referenced


def alerts() -> list[str]:
    return re.findall(r"^\s*- alert: (\w+)\s*$", RULES.read_text(), re.M)


def test_promtool_checks_the_rules(promtool: str) -> None:
    out = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_promtool_unit_tests_of_the_rules_pass(promtool: str) -> None:
    out = subprocess.run(
        [promtool, "test", "rules", RULE_TESTS.name],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=RULE_TESTS.parent,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_every_alert_has_a_unit_test_and_a_runbook_section() -> None:
    names = alerts()
    assert len(names) >= 7 and len(set(names)) == len(names), names
    tested = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    assert set(names) <= tested, f"alerts without a promtool test: {set(names) - tested}"
    runbook = (ROOT / "docs" / "operations.md").read_text()
    missing = [n for n in names if not re.search(rf"^#+ `?{n}`?\s*$", runbook, re.M)]
    assert not missing, f"alerts without a section in docs/operations.md: {missing}"


def test_the_rules_use_only_metrics_kvconn_exports() -> None:
    used = referenced(RULES.read_text())
    assert used, "no kvconn metric found in the rules"
    assert used <= exported_series(), f"not exported by kvconn: {used - exported_series()}"


def test_every_recording_rule_has_a_unit_test() -> None:
    records = re.findall(r"^\s*- record: (\S+)\s*$", RULES.read_text(), re.M)
    assert len(records) >= 5, records
    tested = set(re.findall(r"^\s*- expr: (kvconn:\S+)\s*$", RULE_TESTS.read_text(), re.M))
    assert set(records) <= tested, f"recording rules without a promtool test: {set(records) - tested}"
