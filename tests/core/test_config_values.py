"""Every Config field can be set from each engine's own configuration:
vLLM's ``kv_connector_extra_config`` (JSON values) and SGLang's
``KVCONN_SGLANG_*`` variables (strings), through one mapping derived from
Config's fields (kvconn.config_values). The fields are read from Config
itself here too, so a field added to Config is checked without this file
changing. Neither adapter module imports its engine: no engine needed."""

from __future__ import annotations

import typing
from typing import Any

import attrs
import pytest

from kvconn.config import Config
from kvconn.config_values import ConfigValueError, check_convertible, config_from, config_keys
from kvconn.options import split_key_values
from kvconn_sglang.settings import NOT_FROM_ENV
from kvconn_sglang.settings import Settings as SglangSettings
from kvconn_sglang.settings import SettingsError as SglangError
from kvconn_vllm.settings import Settings as VllmSettings
from kvconn_vllm.settings import SettingsError as VllmError

HINTS = typing.get_type_hints(Config)


def _other_value(name: str) -> tuple[Any, str]:
    """A valid value of field ``name`` other than its default, and how an
    environment variable writes it."""
    default = getattr(Config(), name)
    hint = HINTS[name]
    args = typing.get_args(hint)
    kind = next(a for a in args if a is not type(None)) if type(None) in args else hint
    if kind is bool:
        return (not default), ("0" if default else "1")
    if kind is int:
        value = 1 if default is None else default + 1
        return value, str(value)
    if kind is float:
        value = 5.0 if default is None else default * 2
        return value, str(value)
    if kind is str:
        return "127.0.0.2", "127.0.0.2"
    if kind is bytes:
        return b"deployment key", "deployment key"
    if typing.get_origin(kind) is not None:  # Mapping[str, str]
        return {"a": "1", "b": "x,y"}, "a=1,b=x,y"
    raise AssertionError(f"no test value for Config.{name}: {hint}")


def test_every_config_field_has_a_converter() -> None:
    check_convertible()
    assert set(config_keys()) == {f.name for f in attrs.fields(Config)}


@pytest.mark.parametrize("name", config_keys())
def test_each_field_is_set_from_vllms_extra_config(name: str) -> None:
    value, _ = _other_value(name)
    json_value = value.decode() if isinstance(value, bytes) else value
    assert getattr(VllmSettings.parse({name: json_value}).config, name) == value


@pytest.mark.parametrize("name", [n for n in config_keys() if n not in NOT_FROM_ENV])
def test_each_field_is_set_from_an_sglang_variable(name: str) -> None:
    value, text = _other_value(name)
    settings = SglangSettings.from_env({f"KVCONN_SGLANG_{name.upper()}": text})
    assert getattr(settings.config, name) == value


def test_the_timers_issue_40_named_reach_both_engines() -> None:
    timers = {
        "peer_timeout_s": 40.0,
        "heartbeat_interval_s": 3.0,
        "abort_timeout_s": 45.0,
        "write_timeout_s": 8.0,
        "transfer_timeout_s": 90.0,
        "bootstrap_timeout_s": 20.0,
        "resend_interval_s": 0.5,
        "owner_fence_after_s": 12.0,
        "owner_fence_min_interval_s": 30.0,
        "room_bootstrap_timeout_s": 15.0,
    }
    vllm = VllmSettings.parse({**timers, "tracing": True}).config
    sglang = SglangSettings.from_env(
        {**{f"KVCONN_SGLANG_{k.upper()}": str(v) for k, v in timers.items()}, "KVCONN_SGLANG_TRACING": "1"}
    ).config
    for config in (vllm, sglang):
        assert {k: getattr(config, k) for k in timers} == timers
        assert config.tracing


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"peer_timout_s": 3},
            r"unknown kv_connector_extra_config key peer_timout_s \(did you mean peer_timeout_s\?\)",
        ),
        ({"tracing": "maybe"}, "tracing must be true or false"),
        ({"peer_timeout_s": 0.5}, r"peer_timeout_s \(0.5 s\) must be longer than heartbeat_interval_s"),
        ({"workers": 1.5}, "workers must be an integer"),
        ({"owner_fence_after_s": "nan"}, "owner_fence_after_s must be a finite number"),
        ({"transfer_timeout_s": None}, "transfer_timeout_s must be > 0"),
        ({"trace_file": ""}, "trace_file must be a file path"),
    ],
)
def test_vllm_refuses_what_it_cannot_use(extra: dict[str, object], message: str) -> None:
    with pytest.raises(VllmError, match=message):
        VllmSettings.parse(extra)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"KVCONN_SGLANG_PEER_TIMOUT_S": "30"},
            r"unknown kvconn_sglang variable KVCONN_SGLANG_PEER_TIMOUT_S|"
            r"KVCONN_SGLANG_PEER_TIMOUT_S\?",
        ),
        ({"KVCONN_SGLANG_PORT": "7000"}, "unknown kvconn_sglang variable KVCONN_SGLANG_PORT"),
        ({"KVCONN_SGLANG_TRACING": "maybe"}, "KVCONN_SGLANG_TRACING must be true or false"),
        ({"KVCONN_SGLANG_HEARTBEAT_INTERVAL_S": "20"}, "must be longer than heartbeat_interval_s"),
    ],
)
def test_sglang_refuses_what_it_cannot_use(env: dict[str, str], message: str) -> None:
    with pytest.raises(SglangError, match=message):
        SglangSettings.from_env(env)


def test_sglang_ignores_its_test_harnesss_variables_and_empty_ones() -> None:
    settings = SglangSettings.from_env(
        {"KVCONN_SGLANG_TEST_DEVICE": "cuda", "KVCONN_SGLANG_PEER_TIMEOUT_S": "", "OTHER": "x"}
    )
    assert settings.config == Config()


def test_config_from_names_the_key_as_written() -> None:
    with pytest.raises(ConfigValueError, match="KVCONN_SGLANG_ABORT_TIMEOUT_S must be a number, got 'soon'"):
        config_from({"abort_timeout_s": "soon"}, lambda key: "KVCONN_SGLANG_" + key.upper())
    assert config_from({"transfer_timeout_s": "none"}).transfer_timeout_s is None
    assert config_from({"auth_key": "k"}).auth_key == b"k"


@pytest.mark.parametrize(
    ("text", "items"),
    [
        ("a=1,b=2", {"a": "1", "b": "2"}),
        # a comma not followed by KEY= stays in the value: several rank:room:index triples
        (
            "freeze_chunks=0:7:0,0:8:1,piece_bytes=4096",
            {"freeze_chunks": "0:7:0,0:8:1", "piece_bytes": "4096"},
        ),
        (" u = x=y ,", {"u": "x=y"}),
        ("", {}),
    ],
)
def test_key_value_text_splits_only_where_a_new_key_starts(text: str, items: dict[str, str]) -> None:
    assert split_key_values(text, "KVCONN_SGLANG_BACKEND_OPTIONS") == items


def test_loopback_takes_several_freeze_chunks_from_sglangs_variable() -> None:
    from kvconn.backends.loopback import LoopbackOptions

    settings = SglangSettings.from_env(
        {"KVCONN_SGLANG_BACKEND_OPTIONS": "freeze_chunks=0:7:0,1:8:2,piece_delay_s=0.1"}
    )
    options = LoopbackOptions.parse(settings.config.backend_options)
    assert options.freeze_chunks == {(0, 7, 0), (1, 8, 2)} and options.piece_delay_s == 0.1


def test_each_engines_readme_documents_every_field() -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    vllm = (root / "kvconn_vllm/README.md").read_text()
    sglang = (root / "kvconn_sglang/README.md").read_text()
    assert [k for k in config_keys() if f"`{k}`" not in vllm] == []
    assert [
        k for k in config_keys() if k not in NOT_FROM_ENV and f"`KVCONN_SGLANG_{k.upper()}`" not in sglang
    ] == []
