"""The docs a user reads stand alone: every relative link resolves inside the
repository, and none points at design notes the repository does not ship."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted(
    [
        *ROOT.glob("docs/*.md"),
        ROOT / "README.md",
        *ROOT.glob("kvconn_*/README.md"),
        ROOT / "examples/kvconn-tcpdemo/README.md",
    ]
)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
#: Notes kvconn was designed from; not in the repository.
OUTSIDE = ("../shared", "PROTOCOL.md", "TRANSPORTS.md", "ENGINES.md")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_stands_alone(doc: Path) -> None:
    text = doc.read_text()
    assert not [name for name in OUTSIDE if name in text]
    for target in LINK.findall(text):
        if "://" in target or target.startswith("mailto:"):
            continue
        resolved = (doc.parent / target).resolve()
        assert resolved.is_relative_to(ROOT) and resolved.exists(), f"{doc.name}: broken link {target}"


def test_the_protocol_page_covers_what_a_plugin_author_needs() -> None:
    text = " ".join((ROOT / "docs/protocol.md").read_text().split())
    for term in ("Invariant D", "invariant F", "ABORT_ACK", "tombstone", "generation", "quarantine", "fence"):
        assert term.lower() in text.lower(), term
    assert "nothing able to write outlives the rank process" in text


# -- what the docs say matches the code (issue 43) ----------------------------------


def test_every_config_field_is_documented_for_engines() -> None:
    import attrs

    from kvconn.config import Config

    text = (ROOT / "docs/engine-integration.md").read_text()
    missing = [f.name for f in attrs.fields(Config) if f"`{f.name}`" not in text]
    assert not missing, f"docs/engine-integration.md does not document Config's {missing}"


def test_every_release_field_is_documented_for_engines() -> None:
    import attrs

    from kvconn.runtime.decode import Release

    text = (ROOT / "docs/engine-integration.md").read_text()
    assert not [f.name for f in attrs.fields(Release) if f"| `{f.name}` |" not in text]


def test_the_readmes_architecture_table_names_each_class_where_it_is() -> None:
    """Each ```file.py`: ... `Class```` of the runtime row: the class is defined in that file."""
    row = next(
        line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| runtime |")
    )
    runtime = ROOT / "kvconn_core/src/kvconn/runtime"
    named = 0
    for part in row.split("|")[3].split(";"):
        module = re.match(r"\s*`(\w+\.py)`:", part)
        if module is None:
            continue
        source = (runtime / module.group(1)).read_text()
        for name in re.findall(r"`([A-Z]\w+)`", part):
            assert re.search(rf"^class {name}\b", source, re.M), (
                f"README: {name} is not in runtime/{module.group(1)}"
            )
            named += 1
    assert named >= 5


def test_the_plugin_guide_says_the_core_calls_the_owner_fence() -> None:
    from kvconn.config import Config

    text = " ".join((ROOT / "docs/writing-a-transport-plugin.md").read_text().split())
    assert "does not yet call" not in text
    for field in ("owner_fence_after_s", "owner_fence_min_interval_s"):
        assert f"Config.{field}" in text and hasattr(Config(), field)


def test_no_doc_runs_kvconn_through_sudo() -> None:
    """``sudo`` resets PATH (a venv's kvconn is not found) and the machines run as root."""
    for doc in DOCS:
        assert "sudo kvconn" not in " ".join(doc.read_text().split()), doc.name
