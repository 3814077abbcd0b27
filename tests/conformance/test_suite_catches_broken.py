"""The suite must fail a broken transport, naming the check, and strict mode
must turn undeclared skips into failures."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

KVCONN = str(Path(sys.executable).with_name("kvconn"))

pytest_plugins = ["pytester"]


def conformance(*args: str, timeout: float = 240) -> tuple[int, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [KVCONN, "conformance", "loopback", "-q", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("options", "check", "message"),
    [
        (
            ["-o", "early_done=1", "-o", "piece_delay_s=0.001"],
            "test_done_barrier_means_landed[dram]",
            "the barrier does not mean landed",
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
    ],
    ids=["early_done", "linger_after_fail", "no_fence"],
)
def test_broken_loopback_fails_the_named_check(options: list[str], check: str, message: str) -> None:
    keyword = check.split("[")[0].removeprefix("test_")
    code, out = conformance("-k", keyword, *options)
    assert code != 0, out
    assert f"FAILED   {check}" in out, out
    assert message in out, out


def test_healthy_options_pass_the_same_checks() -> None:
    """The same checks pass when the broken flag is off (fault injection alone is fine)."""
    code, out = conformance("-k", "done_barrier or writer_fence", "-o", "piece_delay_s=0.001")
    assert code == 0, out
    assert "PASSED   test_done_barrier_means_landed[dram]" in out
    assert (
        "SKIPPED  test_done_barrier_means_landed[vram]  ([capability] memory kind 'vram' not declared)" in out
    )


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
    result = pytester.runpytest_subprocess("-k", "undeclared or vram", "--kvconn-strict")
    result.assert_outcomes(failed=1, skipped=1)
    result.stdout.fnmatch_lines(["*strict: undeclared skip of test_undeclared*"])
    lax = pytester.runpytest_subprocess("-k", "undeclared or vram")
    lax.assert_outcomes(skipped=2)
