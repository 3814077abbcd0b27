"""Fixtures of the operator-artefact tests."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
from ops_support import EndpointChild


@pytest.fixture
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (Debian/Ubuntu: apt-get install prometheus)")
    return path


@pytest.fixture
def endpoint_child() -> Iterator[EndpointChild]:
    child = EndpointChild(pages=3)
    yield child
    child.close()
