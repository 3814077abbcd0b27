"""What operators and proxies hand the connector: refused with the reason
when malformed. Pure: runs without vLLM."""

from __future__ import annotations

import pytest

from kvconn_vllm.params import ParamsError, RemotePrefill, room_for, wants_remote_decode
from kvconn_vllm.settings import Settings, SettingsError


def test_defaults() -> None:
    settings = Settings.parse(None)
    assert settings.backend == "loopback"
    assert settings.config.abort_timeout_s == 30.0
    assert settings.config.transfer_timeout_s == 120.0 == Settings().config.transfer_timeout_s
    assert not settings.conformance


def test_options_reach_kvconns_config() -> None:
    settings = Settings.parse(
        {
            "backend": "nixl",
            "backend_options": {"piece_delay_s": 0.1},
            "write_timeout_s": "1",
            "abort_timeout_s": 2,
            "port": 7000,
            "transfer_timeout_s": 9,
            "gil_switch_interval_s": "0.0005",
        }
    )
    assert settings.backend == "nixl"
    assert settings.config.backend_options == {"piece_delay_s": "0.1"}
    assert (settings.config.write_timeout_s, settings.config.abort_timeout_s) == (1.0, 2.0)
    assert settings.config.port == 7000
    assert settings.config.transfer_timeout_s == 9.0
    assert settings.config.gil_switch_interval_s == 0.0005
    assert Settings.parse(None).config.gil_switch_interval_s is None  # the process's own, untouched


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"abort_timout_s": 3},
            r"unknown kv_connector_extra_config key abort_timout_s \(did you mean abort_timeout_s\?\)",
        ),
        ({"backend": ""}, "backend must be a plugin name"),
        ({"backend_options": ["a"]}, "backend_options must be a mapping"),
        ({"write_timeout_s": "soon"}, "write_timeout_s must be a number"),
        ({"write_timeout_s": True}, "write_timeout_s must be a number"),
        ({"write_timeout_s": 40}, "must be shorter than decode's abort_timeout_s"),
        ({"transfer_timeout_s": 0}, "transfer_timeout_s must be > 0"),
        ({"host": "0.0.0.0"}, "bind to an explicit address"),
        ({"gil_switch_interval_s": 0}, "gil_switch_interval_s must be > 0"),
        ({"gil_switch_interval_s": "fast"}, "gil_switch_interval_s must be a number"),
    ],
)
def test_bad_settings_name_the_problem(extra: dict[str, object], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings.parse(extra)


def test_params_round_trip() -> None:
    remote = RemotePrefill(room_for("e", "r"), ("tcp://127.0.0.1:1", "tcp://127.0.0.1:2"), 70)
    assert RemotePrefill.from_params(remote.to_params()) == remote
    assert RemotePrefill.from_params(None) is None
    assert RemotePrefill.from_params({"do_remote_decode": True}) is None
    assert wants_remote_decode({"do_remote_decode": True})
    assert not wants_remote_decode(remote.to_params())


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("kvconn_room", -1, "kvconn_room must be an int"),
        ("kvconn_room", 1 << 63, "kvconn_room must be an int"),
        ("kvconn_room", "7", "kvconn_room must be an int"),
        ("kvconn_prefill", "tcp://127.0.0.1:1", "kvconn_prefill must be a non-empty list"),
        ("kvconn_prefill", [], "kvconn_prefill must be a non-empty list"),
        ("remote_num_tokens", 0, "remote_num_tokens must be a positive int"),
    ],
)
def test_bad_params_name_the_field(field: str, value: object, message: str) -> None:
    params = RemotePrefill(5, ("tcp://127.0.0.1:1",), 10).to_params()
    params[field] = value
    with pytest.raises(ParamsError, match=message):
        RemotePrefill.from_params(params)
