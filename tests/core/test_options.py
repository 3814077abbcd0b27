"""Backend options: typed reads, errors that name the backend and the option,
and typos refused when a region or writer opens."""

from __future__ import annotations

import pytest

from kvconn.backends.loopback import LoopbackOptions, LoopbackWriter
from kvconn.errors import KvconnError
from kvconn.options import BackendOptions, OptionError, parse_key_values
from kvconn.plugins import get_backend

KNOWN = {"piece_bytes", "delay_s", "mode", "hot_poll_s", "strict", "host"}


def opts(**options: str) -> BackendOptions:
    return BackendOptions("demo", options, KNOWN)


def test_defaults_when_absent() -> None:
    o = opts()
    assert o.integer("piece_bytes", 7) == 7
    assert o.number("delay_s", 0.5) == 0.5
    assert o.choice("mode", "fast", {"fast", "slow"}) == "fast"
    assert o.seconds_or_none("hot_poll_s", 0.002) == 0.002
    assert o.seconds_or_none("hot_poll_s", None) is None
    assert o.flag("strict") is False and o.flag("strict", True) is True
    assert o.text("host", "127.0.0.1") == "127.0.0.1"


def test_values_parsed() -> None:
    o = opts(piece_bytes=" 4096 ", delay_s="1e-3", mode="SLOW", hot_poll_s="none", strict="Yes", host=" ::1 ")
    assert o.integer("piece_bytes", 7, low=1) == 4096
    assert o.number("delay_s", 0.5, low=0.0) == 0.001
    assert o.choice("mode", "fast", {"fast", "slow"}) == "slow"
    assert o.seconds_or_none("hot_poll_s", 0.002) is None
    assert opts(hot_poll_s="").seconds_or_none("hot_poll_s", 0.002) is None
    assert opts(hot_poll_s="0.25").seconds_or_none("hot_poll_s", None) == 0.25
    assert o.flag("strict") is True
    assert opts(strict="off").flag("strict", True) is False
    assert opts(strict="").flag("strict", True) is False
    assert o.text("host") == "::1"


@pytest.mark.parametrize(
    ("key", "value", "read", "wanted"),
    [
        ("piece_bytes", "4k", lambda o: o.integer("piece_bytes", 1), "an integer"),
        ("piece_bytes", "0", lambda o: o.integer("piece_bytes", 1, low=1), "at least 1"),
        ("piece_bytes", "2000", lambda o: o.integer("piece_bytes", 1, high=1000), "at most 1000"),
        ("delay_s", "soon", lambda o: o.number("delay_s", 0.0), "a finite number"),
        ("delay_s", "nan", lambda o: o.number("delay_s", 0.0), "a finite number"),
        ("delay_s", "-0.1", lambda o: o.number("delay_s", 0.0, low=0.0), "at least 0.0"),
        ("hot_poll_s", "-1", lambda o: o.seconds_or_none("hot_poll_s", None), "at least 0.0"),
        ("hot_poll_s", "inf", lambda o: o.seconds_or_none("hot_poll_s", None), "a finite number"),
        ("mode", "medium", lambda o: o.choice("mode", "fast", {"fast", "slow"}), "one of fast, slow"),
        ("strict", "ture", lambda o: o.flag("strict"), "a flag"),
    ],
)
def test_bad_values_name_backend_option_and_value(key: str, value: str, read: object, wanted: str) -> None:
    o = opts(**{key: value})
    with pytest.raises(OptionError) as err:
        read(o)  # type: ignore[operator]
    assert str(err.value).startswith(f"demo option {key}={value!r}: expected {wanted}")
    assert isinstance(err.value, ValueError)  # what callers of open_region already catch


def test_unknown_key_is_refused_with_the_nearest_known_one() -> None:
    with pytest.raises(
        OptionError, match=r"unknown demo option 'piece_byte' \(did you mean 'piece_bytes'\?\)"
    ):
        opts(piece_byte="4096")
    with pytest.raises(
        OptionError,
        match=r"unknown demo option 'zzz'; demo options: delay_s, host, hot_poll_s, mode, piece_bytes, strict$",
    ):
        opts(zzz="1")


def test_values_must_be_strings() -> None:
    with pytest.raises(OptionError, match=r"demo option piece_bytes=4096: values are strings"):
        BackendOptions("demo", {"piece_bytes": 4096}, KNOWN)  # type: ignore[dict-item]


def test_loopback_refuses_a_typo_on_both_sides() -> None:
    lb = get_backend("loopback")
    with pytest.raises(OptionError, match="did you mean 'piece_bytes'"):
        lb.open_region(4096, {"piece_byte": "4096"})
    with pytest.raises(OptionError, match="did you mean 'fail_every'"):
        lb.open_writer(4096, {"fail_evry": "2"})


def test_loopback_reads_its_options() -> None:
    lb = get_backend("loopback")
    options = {"piece_bytes": "1024", "fail_chunks": " 3:1, 5:0 ,", "fail_every": "4", "late_delivery_s": "1"}
    assert LoopbackOptions.parse(options) == LoopbackOptions(
        piece_bytes=1024, fail_chunks=frozenset({(3, 1), (5, 0)}), fail_every=4, late_delivery_s=1.0
    )
    w = LoopbackWriter(4096, options)
    try:
        assert w.options == LoopbackOptions.parse(options)
    finally:
        w.close()
    with pytest.raises(OptionError, match=r"fail_chunks: expected room:index pairs, got '3'"):
        lb.open_writer(4096, {"fail_chunks": "3"})
    with pytest.raises(OptionError, match=r"piece_bytes='0': expected at least 1"):
        lb.open_writer(4096, {"piece_bytes": "0"})


@pytest.mark.parametrize("lie", ["early_done", "linger_after_fail", "no_fence", "misplace_buffer"])
def test_loopback_ships_no_broken_option(lie: str) -> None:
    """The broken-on-purpose variants are a test-only transport (liar-loopback):
    no deployment can switch one on by an option."""
    lb = get_backend("loopback")
    with pytest.raises(OptionError, match=f"unknown loopback option '{lie}'"):
        lb.open_writer(4096, {lie: "1"})


# -- KEY=VALUE items: one rule for every command line and variable ----------
def test_key_values_split_at_the_first_equals_and_strip_blanks() -> None:
    got = parse_key_values([" url = http://h/?a=b ", "empty=", "n=1"], "-o")
    assert got == {"url": "http://h/?a=b", "empty": "", "n": "1"}
    assert parse_key_values([], "-o") == {}


@pytest.mark.parametrize("item", ["piece_bytes", "=4096", " =1", ""])
def test_key_values_refuse_an_item_without_a_key(item: str) -> None:
    with pytest.raises(OptionError, match=rf"^--backend-option wants KEY=VALUE, got {item!r}$"):
        parse_key_values(["ok=1", item], "--backend-option")


def test_key_values_refuse_a_key_given_twice_naming_both_values() -> None:
    with pytest.raises(OptionError, match=r"^-o: 'n' given twice \(n='1' and n='2'\)$"):
        parse_key_values(["n=1", "m=0", " n = 2"], "-o")


def test_option_errors_are_kvconn_errors_and_value_errors() -> None:
    with pytest.raises(OptionError) as err:
        parse_key_values(["x"], "-o")
    assert isinstance(err.value, KvconnError) and isinstance(err.value, ValueError)
