"""The plugin guide's table of checks (docs/writing-a-transport-plugin.md,
section 6) names every check of the suite, each with its parameters, and
nothing the suite does not run: a check added, renamed or removed fails
here until the guide says so."""

from __future__ import annotations

import re
from pathlib import Path

from kvconn.conformance import ConformanceSuite

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "writing-a-transport-plugin.md"


def guide_section() -> str:
    text = GUIDE.read_text()
    return text[text.index("## 6. What the suite checks") : text.index("## 7.")]


def guide_rows() -> dict[str, tuple[str, ...]]:
    """``{check: parameter ids}`` of the table's first column."""
    section = guide_section()
    rows: dict[str, tuple[str, ...]] = {}
    for name, params in re.findall(r"^\| `(test_\w+)(?:\[([^\]]*)\])?` \|", section, re.M):
        assert name not in rows, f"{name} has two rows"
        rows[name] = tuple(params.split("/")) if params else ()
    return rows


def suite_checks() -> dict[str, tuple[str, ...]]:
    """``{check: parameter ids}`` of ConformanceSuite's test methods."""
    checks: dict[str, tuple[str, ...]] = {}
    for name in dir(ConformanceSuite):
        if not name.startswith("test_"):
            continue
        params: tuple[str, ...] = ()
        for mark in getattr(getattr(ConformanceSuite, name), "pytestmark", []):
            if mark.name == "parametrize":
                params += tuple(str(v) for v in mark.args[1])
        checks[name] = params
    return checks


def test_the_guide_lists_every_check_of_the_suite_with_its_parameters() -> None:
    rows, checks = guide_rows(), suite_checks()
    assert len(checks) >= 20  # the suite was read, not an empty class
    missing = sorted(set(checks) - set(rows))
    extra = sorted(set(rows) - set(checks))
    assert not missing and not extra, f"not in the guide: {missing}; not in the suite: {extra}"
    wrong = {name: (rows[name], checks[name]) for name in checks if set(rows[name]) != set(checks[name])}
    assert not wrong, f"parameters (guide, suite): {wrong}"


def test_the_guide_table_is_one_table() -> None:
    """From its header to its last row, no blank line: Markdown would end
    the table there and render the rows after it as text."""
    lines = guide_section().splitlines()
    first = lines.index("| check | property |")
    last = max(i for i, line in enumerate(lines) if line.startswith("| `test_"))
    assert all(line.startswith("|") for line in lines[first : last + 1]), lines[first : last + 1]
