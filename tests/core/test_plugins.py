"""Backend discovery through entry points, and pluggy's hook validation."""

from __future__ import annotations

from importlib.metadata import EntryPoint

import pluggy
import pytest

from kvconn import hookspecs, plugins
from kvconn.backends.loopback import backend as loopback

GOOD = EntryPoint("loopback", "kvconn.backends.loopback:backend", plugins.GROUP)
MISSING = EntryPoint("ghost", "kvconn_ghost_transport:backend", plugins.GROUP)
NOT_A_BACKEND = EntryPoint("odd", "kvconn.config:Config", plugins.GROUP)


@pytest.fixture
def fake_eps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plugins, "entry_points", lambda group: [GOOD, MISSING, NOT_A_BACKEND])
    monkeypatch.delenv(plugins.ALLOW_ENV, raising=False)


def test_a_broken_plugin_is_listed_with_its_error_and_does_not_stop_the_others(fake_eps: None) -> None:
    infos = {i.name: i for i in plugins.discover()}
    assert infos["loopback"].backend is loopback and infos["loopback"].error is None
    assert infos["ghost"].backend is None and "kvconn_ghost_transport" in str(infos["ghost"].error)
    assert infos["odd"].backend is None and "not a kvconn Backend" in str(infos["odd"].error)


def test_get_backend_errors_name_the_plugin(fake_eps: None) -> None:
    assert plugins.get_backend("loopback") is loopback
    with pytest.raises(plugins.BackendError, match=r"'ghost'.*failed to load.*kvconn_ghost_transport"):
        plugins.get_backend("ghost")
    with pytest.raises(
        plugins.BackendError, match=r"no kvconn backend 'nope'.*installed: ghost, loopback, odd"
    ):
        plugins.get_backend("nope")


def test_allow_list_restricts_loading(fake_eps: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plugins.ALLOW_ENV, "loopback")
    assert [i.name for i in plugins.discover()] == ["loopback"]
    with pytest.raises(plugins.BackendError, match="not in KVCONN_BACKENDS"):
        plugins.get_backend("ghost")


def test_the_installed_loopback_is_found_through_its_entry_point() -> None:
    info = next(i for i in plugins.discover() if i.name == "loopback")
    assert info.distribution == "kvconn-core" and info.capabilities is not None
    assert info.capabilities.writer_fence


def test_check_pending_rejects_a_misspelled_hook() -> None:
    class Typo:
        @hookspecs.hookimpl
        def on_done_barier(self) -> None:  # not a kvconn hook
            pass

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(Typo())
    with pytest.raises(pluggy.PluginValidationError, match="on_done_barier"):
        pm.check_pending()


def test_capabilities_follow_the_options_where_a_backend_says_how() -> None:
    from kvconn.transport import Capabilities, capabilities_of

    fenced, plain = Capabilities(writer_fence=True), Capabilities(writer_fence=False)

    class Static:
        name = "static"
        capabilities = fenced

    class ByOptions(Static):
        name = "by-options"

        @staticmethod
        def capabilities_for(options: dict[str, str]) -> Capabilities:
            return plain if options.get("tls") == "cma" else fenced

    class Broken(Static):
        name = "broken"

        @staticmethod
        def capabilities_for(options: dict[str, str]) -> object:
            return "yes"

    assert capabilities_of(Static(), {"tls": "cma"}) is fenced  # type: ignore[arg-type]
    assert capabilities_of(ByOptions(), {"tls": "cma"}) is plain  # type: ignore[arg-type]
    assert capabilities_of(ByOptions(), {}) is fenced  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="capabilities_for returned"):
        capabilities_of(Broken(), {})  # type: ignore[arg-type]
