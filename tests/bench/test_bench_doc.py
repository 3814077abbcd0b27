"""docs/bench.md is a guide to the bench's output: every row it prints is
explained there (the JSON fields are checked by the end-to-end tests)."""

from __future__ import annotations

import re

from bench_doc import DOC, row_labels


def test_every_row_label_is_explained() -> None:
    labels = row_labels()
    assert len(labels) >= 20  # the parser still finds them
    missing = [label for label in labels if f"`{label}`" not in DOC]
    assert not missing, missing


def test_the_doc_is_a_guide_not_a_history() -> None:
    assert len(DOC.splitlines()) < 500  # a section per option; measured history goes elsewhere
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", DOC), "dated measurements belong in git history"
    assert "--plot" in DOC and "[plot]" in DOC
