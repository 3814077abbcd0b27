"""The suite must fail a broken transport, naming the check, and strict mode
must turn undeclared skips into failures."""

from __future__ import annotations

import pytest
from conformance_cli import conformance

pytest_plugins = ["pytester"]


@pytest.mark.parametrize(
    ("options", "check", "message"),
    [
        (
            ["-o", "early_done=1", "-o", "piece_delay_s=0.001"],
            "test_done_barrier_means_landed[dram]",
            "but the region does not hold exactly what was posted",
        ),
        (
            ["-o", "fail_every=3", "-o", "linger_after_fail=1"],
            "test_random_aborts_leave_no_late_write",
            "late write after release",
        ),
        (
            ["-o", "no_fence=1", "-o", "piece_delay_s=0.005"],
            "test_writer_fence_stops_frozen_writer",
            "the fence does not stop a resumed writer",
        ),
        (
            ["-o", "misplace_buffer=1"],
            "test_engine_buffers_byte_exact[many_buffers]",
            "hold wrong bytes after LANDED, in buffers [0, 1]",
        ),
    ],
    ids=["early_done", "linger_after_fail", "no_fence", "misplace_buffer"],
)
def test_broken_loopback_fails_the_named_check(
    liar_env: dict[str, str], options: list[str], check: str, message: str
) -> None:
    keyword = check.split("[")[0].removeprefix("test_")
    code, out = conformance("liar-loopback", "-k", keyword, *options, env=liar_env)
    assert code != 0, out
    assert f"FAILED   {check}" in out, out
    assert message in out, out


def test_healthy_options_pass_the_same_checks() -> None:
    """The same checks pass when the broken flag is off (fault injection alone is fine)."""
    code, out = conformance("loopback", "-k", "done_barrier or writer_fence", "-o", "piece_delay_s=0.001")
    assert code == 0, out
    assert "PASSED   test_done_barrier_means_landed[dram]" in out
    assert (
        "SKIPPED  test_done_barrier_means_landed[vram]  ([capability] memory kind 'vram' not declared)" in out
    )


def test_exitfirst_stops_at_the_first_failed_check(liar_env: dict[str, str]) -> None:
    """``-x``, the start-up gate's mode (kvconn-vllm's ``conformance`` option):
    a lying transport is refused by its first failed check, not after the
    whole suite; the same checks without ``-x`` fail more than once."""
    # pieces slow enough that the checks compare before an early LANDED write lands
    lie = ("-o", "early_done=1", "-o", "piece_delay_s=0.01", "-k", "engine_buffers or done_barrier")
    code, out = conformance("liar-loopback", "-x", *lie, env=liar_env)
    assert code != 0 and out.count("\nFAILED   ") == 1, out
    assert "stopping after 1 failures" in out, out
    code, out = conformance("liar-loopback", *lie, env=liar_env)
    assert code != 0 and out.count("\nFAILED   ") > 1, out


STRICT_FILE = """
import pytest
from kvconn.conformance import ConformanceSuite

class TestStrict(ConformanceSuite):
    backend_name = "loopback"

    def test_undeclared(self):
        pytest.skip("no reason a capability gives")
"""


def test_strict_fails_undeclared_skips(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_strict=STRICT_FILE)
    # The run's guard runs too (whatever -k selects), skipped as declared: nothing was released.
    result = pytester.runpytest_subprocess("-k", "undeclared or (landed and vram)", "--kvconn-strict")
    result.assert_outcomes(failed=1, skipped=2)
    result.stdout.fnmatch_lines(["*strict: undeclared skip of test_undeclared*"])
    lax = pytester.runpytest_subprocess("-k", "undeclared or (landed and vram)")
    lax.assert_outcomes(skipped=3)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-o", "fail_evry=3"], "unknown loopback option 'fail_evry' (did you mean 'fail_every'?)"),
        (["-o", "piece_bytes=0"], "loopback option piece_bytes='0': expected at least 1"),
        (["-o", "piece_bytes"], "-o wants KEY=VALUE, got 'piece_bytes'"),
        (["-o", "early_done=1"], "unknown loopback option 'early_done'"),
        (["-o", "piece_bytes=1", "-o", "piece_bytes=2"], "-o: 'piece_bytes' given twice"),
        (
            ["--write-timeout", "3"],
            "--write-timeout / --abort-timeout: write_timeout_s (3.0 s) must be shorter",
        ),
        (["--abort-timeout", "0"], "--write-timeout / --abort-timeout: abort_timeout_s must be > 0"),
        (["--watch", "-1"], "--watch must be >= 0"),
    ],
    ids=[
        "typo",
        "out_of_bounds",
        "no_value",
        "no_lies_on_loopback",
        "given_twice",
        "write_not_shorter",
        "no_deadline",
        "negative_watch",
    ],
)
def test_bad_options_are_refused_once_before_any_check(args: list[str], message: str) -> None:
    code, out = conformance("loopback", *args, timeout=60)
    assert code == 2, out
    line = out.strip()
    assert line.startswith(f"kvconn conformance: {message}") and "\n" not in line, out  # no check ran


FIXTURE_FILE = """
from kvconn.conformance import ConformanceSuite

class TestTypo(ConformanceSuite):
    backend_name = "loopback"
    backend_options = {"piece_byte": "4096"}
"""


def test_the_fixture_fails_a_suite_with_bad_options(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_typo=FIXTURE_FILE)
    result = pytester.runpytest_subprocess("-k", "done_barrier and dram")
    result.assert_outcomes(errors=2)  # the check, and the run's guard after it (it runs whatever -k selects)
    result.stdout.fnmatch_lines(["*kvconn conformance: unknown loopback option 'piece_byte'*"])


def test_the_plugin_reads_kvconn_option_by_the_same_rule(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_dup=STRICT_FILE)
    result = pytester.runpytest_subprocess(
        "-k", "landed and dram", "--kvconn-option", "piece_bytes=1", "--kvconn-option", "piece_bytes=2"
    )
    assert result.ret != 0
    assert "--kvconn-option: 'piece_bytes' given twice (piece_bytes='1' and piece_bytes='2')" in str(
        result.stdout
    ) + str(result.stderr)
