"""``kvconn conformance``'s own command line: its documented exit codes
(pytest's never leak through), what ``--help`` opens with, and the names
its checks print under."""

from __future__ import annotations

import subprocess

import pytest
from conformance_cli import KVCONN, conformance

from kvconn.conformance.cli import exit_code


def test_a_k_expression_that_selects_nothing_is_a_usage_error() -> None:
    code, out = conformance("loopback", "-k", "nomatch", timeout=120)
    assert code == 2, out  # pytest's 5 (no tests collected) is not a documented code
    assert "-k 'nomatch' matches none of the suite's checks" in out, out


def test_a_malformed_k_expression_is_a_usage_error() -> None:
    code, out = conformance("loopback", "-k", "(((", timeout=120)
    assert code == 2, out  # pytest's 4 (usage error)
    assert "-k '(((' is not a valid expression" in out, out


@pytest.mark.parametrize(("pytest_code", "ours"), [(0, 0), (1, 1), (2, 130), (3, 3), (4, 2), (5, 2), (7, 3)])
def test_every_pytest_exit_code_maps_to_a_documented_one(
    pytest_code: int, ours: int, capsys: pytest.CaptureFixture[str]
) -> None:
    assert exit_code(pytest_code, None) == ours
    said = capsys.readouterr().err
    assert bool(said) == (pytest_code not in (0, 1)), said  # anything but pass or fail says why


def test_help_opens_with_what_the_suite_is() -> None:
    out = subprocess.run([KVCONN, "conformance", "--help"], capture_output=True, text=True, timeout=60).stdout
    description = out.split("\n\n", 2)[1]  # after the usage lines
    assert description.startswith("The transport conformance suite:"), description
    assert " s " not in description.split("\n\n")[0], description  # no timings up front
    assert "Exit codes: 0 every selected check passed; 1 a check failed; 2 the command" in out, out


def test_checks_print_under_the_backends_name_not_a_temporary_path() -> None:
    done = subprocess.run(
        [KVCONN, "conformance", "loopback", "-k", "integrity and one_page"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "\nloopback::test_integrity[one_page] PASSED" in done.stdout, done.stdout
    assert "kvconn-conformance-" not in done.stdout, done.stdout
