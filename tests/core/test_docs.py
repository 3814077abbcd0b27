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
