"""Skip tests of a transport whose library cannot be imported here.

A plugin distribution installs without its transport library (nixl is
installed apart, Mooncake's engine needs a system library), so whether a
test can run is decided by importing the library, not by finding the
plugin's entry point."""

from __future__ import annotations

import importlib

import attrs
import pytest


@attrs.frozen
class Library:
    plugin: str  #: the plugin's module, imported first (its ``prepare_env()``, if any, is called)
    module: str  #: the library module the plugin needs at run time
    install: str  #: what makes it importable


LIBRARIES = {
    "nixl": Library("kvconn_nixl", "nixl._api", "pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1"),
    "mooncake": Library(
        "kvconn_mooncake",
        "mooncake.engine",
        "apt-get install libibverbs1; pip install ./kvconn_mooncake",
    ),
}


def why_unavailable(backend: str) -> str | None:
    """Why BACKEND's plugin or library cannot be imported (None if both can)."""
    library = LIBRARIES[backend]
    for module in (library.plugin, library.module):
        try:
            imported = importlib.import_module(module)
        except (ImportError, OSError) as exc:  # OSError: a shared library that does not load
            return f"{backend}: cannot import {module} ({type(exc).__name__}: {exc}); {library.install}"
        prepare = getattr(imported, "prepare_env", None) if module == library.plugin else None
        if prepare is not None:  # nixl: UCX settings that must precede its import
            prepare()
    return None


def require_library(backend: str, *, module_level: bool = False) -> None:
    """Skip the calling test (or, with module_level, the whole test module:
    call it before the module imports anything of the library) when
    BACKEND's plugin or library cannot be imported. Not from a conftest.py:
    pytest does not turn a skip there into a skip when its folder is named
    on the command line."""
    reason = why_unavailable(backend)
    if reason is not None:
        pytest.skip(reason, allow_module_level=module_level)
