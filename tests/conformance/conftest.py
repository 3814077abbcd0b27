"""The lying transports (``liars/``) the suite's own tests run it against."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "liars"))

from kvconn_liars.registry import liar_path


@pytest.fixture(scope="session")
def liar_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """An environment in which the ``liar-*`` backends are installed."""
    import os

    return dict(os.environ, PYTHONPATH=liar_path(tmp_path_factory.mktemp("liars")), PYTHONUNBUFFERED="1")
