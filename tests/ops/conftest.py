"""Fixtures of the operator-artefact tests."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
from ops_support import EndpointChild


def installed(command: str, what: str) -> str:
    """The path of ``command``, or skip: Debian's ``prometheus`` package brings it."""
    path = shutil.which(command)
    if path is None:
        pytest.skip(f"{what} is not installed (Debian/Ubuntu: apt-get install prometheus)")
    return path


@pytest.fixture
def promtool() -> str:
    return installed("promtool", "promtool")


@pytest.fixture
def prometheus_binary() -> str:
    return installed("prometheus", "the prometheus server")


@pytest.fixture
def endpoint_child() -> Iterator[EndpointChild]:
    child = EndpointChild(pages=3)
    yield child
    child.close()
