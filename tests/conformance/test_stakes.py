"""No conformance check passes with nothing at stake: one that states too
little fails saying what it lacked, one that states nothing fails as a bug
of the suite, and each passed check's summary line says what it had at
stake. The run's guard runs whatever ``-k`` selects."""

from __future__ import annotations

import pytest
from conformance_cli import conformance

pytest_plugins = ["pytester"]

CHECKS = """
import pytest
from kvconn.conformance.stakes import at_stake


@pytest.mark.kvconn_conformance
class TestChecks:
    backend_name = "loopback"

    def test_states_nothing(self):
        pass

    def test_states_enough(self):
        at_stake(3, 2, "3 writes in flight at the fence", "two writes")

    def test_states_too_little(self):
        at_stake(1, 2, "1 write in flight at the fence", "two writes")
"""


def test_a_check_passes_only_with_something_at_stake(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_checks=CHECKS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=2)
    out = result.stdout.str()
    assert "test_states_nothing passed without stating what it put at stake" in out, out
    assert "nothing at stake: 1 write in flight at the fence, and the check needs two writes" in out, out
    assert "PASSED   test_states_enough  (at stake: 3 writes in flight at the fence)" in out, out


def test_the_guard_runs_whatever_k_selects() -> None:
    """A run of checks not marked as releasing pages still ends with the
    run's guard (which says why it has nothing to do here)."""
    code, out = conformance("loopback", "-k", "integrity and one_page", timeout=240)
    assert code == 0, out
    assert "PASSED   test_integrity[one_page]  (at stake: 1 rooms of 1 pages" in out, out
    assert (
        "SKIPPED  test_nothing_landed_late_in_the_whole_run  ([capability] no check of this run released"
        in out
    ), out


def test_a_bare_writers_prefilled_rounds_keep_their_own_patterns() -> None:
    """The writer-fence check prefilled every round's source at once, and
    its later rounds reused the earlier ones' rows: each earlier write then
    carried the last round's pattern, landed bytes still differed from what
    the suite expected, and the stake counted them as in flight (loopback:
    8 of 8 writes, 31.9 MiB, where 4 of 8 and 15.9 MiB were). Prefilling
    overlapping rows is refused, and the check's later rounds fill their own."""
    from kvconn.conformance.writer_fence import MANY_ROUNDS, ROWS
    from kvconn.conformance.writer_proc import _disjoint_sources

    _disjoint_sources([(k, rows) for k, (_peer, rows) in enumerate(MANY_ROUNDS, start=1)])
    with pytest.raises(ValueError, match="rounds 1 and 9 share source rows"):
        _disjoint_sources([*[(k, rows) for k, (_peer, rows) in enumerate(MANY_ROUNDS, start=1)], (9, ROWS)])
