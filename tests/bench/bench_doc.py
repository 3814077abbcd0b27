"""What docs/bench.md must explain: every JSON field and every row the bench
prints (the end-to-end bench tests check the JSON they got)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "bench.md").read_text()
BENCH = ROOT / "kvconn_core" / "src" / "kvconn" / "bench"

#: Objects whose keys are data (proof names, rank ids, the user's options), not fields.
DATA_KEYED = frozenset(
    {
        "releases_by_proof",
        "ack_wait_ms_by_rank",
        "backend_options",
        # --curve fleet: messages by kind
        "per_s",
        "per_rank_per_s",
        "per_decode_per_s",
        "counts",
    }
)


def fields(doc: Any, out: set[str] | None = None) -> set[str]:
    """Every key of a JSON document, at any depth."""
    out = set() if out is None else out
    if isinstance(doc, list):
        for item in doc:
            fields(item, out)
    elif isinstance(doc, dict):
        for key, value in doc.items():
            out.add(key)
            if key in DATA_KEYED and isinstance(value, dict):
                for inner in value.values():
                    fields(inner, out)
            else:
                fields(value, out)
    return out


def undocumented(doc: Any) -> list[str]:
    return sorted(k for k in fields(doc) if f"`{k}`" not in DOC)


def row_labels() -> list[str]:
    """The first column of every table row the bench prints by label."""
    labels = []
    for name in ("report.py", "transport_report.py", "hosts_run.py"):
        text = (BENCH / name).read_text()
        labels += re.findall(r'\b(?:row|prow)\(\s*"([^"]+)"', text)
    return [label.strip() for label in labels]
