"""The five distributions are ready to publish (issue 43): each states its
version once (its package's ``__version__``, which its metadata reads), and
carries the metadata an index shows, the same project URLs, and the
license text. Building, ``twine check`` and installing the wheels into a
fresh venv are scripts/check_dists.sh, a stage of scripts/test.sh."""

from __future__ import annotations

import importlib
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
#: folder -> (distribution, package)
DISTRIBUTIONS = {
    "kvconn_core": ("kvconn-core", "kvconn"),
    "kvconn_nixl": ("kvconn-nixl", "kvconn_nixl"),
    "kvconn_mooncake": ("kvconn-mooncake", "kvconn_mooncake"),
    "kvconn_vllm": ("kvconn-vllm", "kvconn_vllm"),
    "kvconn_sglang": ("kvconn-sglang", "kvconn_sglang"),
}


def pyproject(folder: str) -> dict[str, Any]:
    with (ROOT / folder / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


@pytest.mark.parametrize("folder", sorted(DISTRIBUTIONS))
def test_the_version_is_stated_once_and_installed_as_stated(folder: str) -> None:
    dist, package = DISTRIBUTIONS[folder]
    meta = pyproject(folder)
    assert "version" not in meta["project"] and meta["project"]["dynamic"] == ["version"]
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": f"{package}.__version__"}
    module = importlib.import_module(package)
    assert version(dist) == module.__version__, f"reinstall {folder}: its metadata is stale"


@pytest.mark.parametrize("folder", sorted(DISTRIBUTIONS))
def test_the_metadata_an_index_shows(folder: str) -> None:
    project = pyproject(folder)["project"]
    assert project["name"] == DISTRIBUTIONS[folder][0]
    assert project["description"] and project["readme"] == "README.md"
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert (ROOT / folder / "LICENSE").read_bytes() == (ROOT / "LICENSE").read_bytes()
    assert "Typing :: Typed" in project["classifiers"]
    assert project["requires-python"] == ">=3.10"
    assert pyproject(folder)["build-system"]["requires"] == ["setuptools>=77"]  # SPDX license, license-files


def test_every_distribution_names_the_same_project_urls() -> None:
    urls = {folder: pyproject(folder)["project"]["urls"] for folder in DISTRIBUTIONS}
    first = urls["kvconn_core"]
    assert set(first) == {"Homepage", "Documentation", "Source", "Issues"}
    assert all(u == first for u in urls.values()), urls


def test_companions_require_the_core_they_were_built_with() -> None:
    core = importlib.import_module("kvconn").__version__
    for folder in DISTRIBUTIONS:
        if folder == "kvconn_core":
            continue
        needs = [d for d in pyproject(folder)["project"]["dependencies"] if d.startswith("kvconn-core")]
        assert needs == [f"kvconn-core>={core}"], (folder, needs)
