"""The pytest plugin behind the conformance suite (entry point ``pytest11``).

Options: ``--kvconn-backend NAME``, ``--kvconn-option KEY=VALUE`` (repeat),
``--kvconn-strict``, ``--kvconn-write-timeout``, ``--kvconn-abort-timeout``,
``--kvconn-watch`` (late-write watch window, s), ``--kvconn-thorough``,
``--kvconn-cross-host`` (decode on one host, writers on two others:
:mod:`kvconn.testing.hosts`; needs root, else every check skips saying so).
Fixture: ``kvconn_settings``. A check the backend's capabilities rule out is
skipped through :func:`require_capability` (a *declared* skip); with
``--kvconn-strict`` every other skip of a conformance check is a failure.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import Any

import pytest

from kvconn.conformance import guard, harness, region_host, stakes
from kvconn.conformance.harness import ABORT_TIMEOUT_S, WRITE_TIMEOUT_S, Settings
from kvconn.options import OptionError, parse_key_values
from kvconn.plugins import BackendError, get_backend
from kvconn.testing import hosts
from kvconn.transport import capabilities_of

DECLARED = "[capability] "
_MARK = "kvconn_conformance"
#: The suite's last check in each class: the run's guard (see guard.py).
FINAL_CHECK = "test_nothing_landed_late_in_the_whole_run"
#: Checks that give pages back to the guard run first: the checks that
#: release nothing then fill the guard's window, instead of the last check
#: waiting it out.
RELEASES = "kvconn_releases"
_results_key = pytest.StashKey[list[tuple[str, str, str, str]]]()
_times_key = pytest.StashKey[dict[str, list[float]]]()
_reports_key = pytest.StashKey[list[pytest.TestReport]]()
_no_hosts_key = pytest.StashKey[str]()
_fabric_key = pytest.StashKey[hosts.Fabric]()


#: Why a check that cuts a link skips without ``--kvconn-cross-host``.
NEEDS_HOSTS = "a partition needs hosts to cut apart (--kvconn-cross-host)"


def require_capability(declared: bool, reason: str) -> None:
    """Skip the running check unless the backend declares what it needs."""
    if not declared:
        pytest.skip(DECLARED + reason)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvconn", "kvconn transport conformance suite")
    group.addoption("--kvconn-backend", default=None, help="backend (kvconn.backends entry point) to check")
    group.addoption(
        "--kvconn-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="backend option (repeatable)",
    )
    group.addoption(
        "--kvconn-strict", action="store_true", help="undeclared skips fail; 10 s watches, a 30 s guard"
    )
    group.addoption(
        "--kvconn-write-timeout",
        type=float,
        default=WRITE_TIMEOUT_S,
        help=f"writer deadline, s ({WRITE_TIMEOUT_S})",
    )
    group.addoption(
        "--kvconn-abort-timeout",
        type=float,
        default=ABORT_TIMEOUT_S,
        help=f"decode deadline, s ({ABORT_TIMEOUT_S})",
    )
    group.addoption(
        "--kvconn-watch",
        type=float,
        default=None,
        help="how long each check watches released pages and fenced regions for a late write, s "
        "(2; 10 with --kvconn-strict or --kvconn-thorough); the last check guards them to the run's end",
    )
    group.addoption(
        "--kvconn-thorough",
        action="store_true",
        help="wider chunks, 10 s watches and a 30 s guard (a longer run)",
    )
    group.addoption(
        "--kvconn-cross-host",
        action="store_true",
        help="decode on one host, writers on two others (network, PID and mount namespaces; needs root)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{_MARK}: a kvconn transport conformance check")
    config.addinivalue_line("markers", f"{RELEASES}: a conformance check whose releases the guard watches")
    config.stash[_results_key] = []
    config.stash[_times_key] = {}
    # What a rank leaves behind (a daemon in a session of its own) is
    # re-parented here, where the suite can see it.
    guard.become_subreaper()
    if config.getoption("--kvconn-cross-host", False):
        _make_hosts(config)


def _make_hosts(config: pytest.Config) -> None:
    """Decode's host is this process: it moves into that host's network now,
    before it starts a thread, so that every endpoint it opens is there."""
    why = hosts.unavailable()
    if why:
        config.stash[_no_hosts_key] = why
        return
    try:
        fabric = hosts.make(("decode", "prefill0", "prefill1"), sealed=True)
    except hosts.HostsUnavailable as exc:
        config.stash[_no_hosts_key] = str(exc)
        return
    config.stash[_fabric_key] = fabric
    fabric["decode"].enter_for_good()
    harness.place_on(fabric)


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> Generator[None, None, None]:
    """The guard's final check runs last in its class whenever any check of
    its class runs (``-k`` or not): whatever a check released or fenced is
    guarded to the end of the run. Checks that release pages run before
    those that do not, which then fill the guard's window."""
    finals = {getattr(item, "cls", None): item for item in items if item.name == FINAL_CHECK}
    _name_checks_of_the_cli(config, items)
    yield
    # A stable sort within each class (classes stay where they are).
    rank = {cls: i for i, cls in enumerate(dict.fromkeys(getattr(item, "cls", None) for item in items))}
    order = sorted(
        (item for item in items if item.name != FINAL_CHECK),
        key=lambda item: (rank[getattr(item, "cls", None)], item.get_closest_marker(RELEASES) is None),
    )
    classes = {getattr(item, "cls", None) for item in order}
    for cls, final in finals.items():
        if cls not in classes:
            continue
        last = max(i for i, item in enumerate(order) if getattr(item, "cls", None) is cls)
        order.insert(last + 1, final)
    items[:] = order


def _name_checks_of_the_cli(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``kvconn conformance``'s checks are named ``BACKEND::CHECK``: their
    file is the suite's own collection module, whose path says nothing."""
    import kvconn.conformance._collect as collect

    backend = config.getoption("--kvconn-backend") or "conformance"
    for item in items:
        if str(item.path) != collect.__file__:
            continue
        name = f"{backend}::{item.name}"
        # pytest keeps the name as ``_id`` (a NodeId, pytest 9) or ``_nodeid`` (before).
        if hasattr(item, "_id"):
            item._id = type(item._id).parse(name)
        else:
            item._nodeid = name  # type: ignore[attr-defined]


def pytest_sessionfinish(session: pytest.Session) -> None:
    guard.GUARD.close()  # what a final check that did not run (-x) still held
    region_host.close_all()


def pytest_unconfigure(config: pytest.Config) -> None:
    fabric = config.stash.get(_fabric_key, None)
    if fabric is not None:
        harness.place_on(None)
        fabric.close()


@pytest.fixture(scope="class")
def kvconn_settings(request: pytest.FixtureRequest) -> Settings:
    """What the suite runs against: the class's ``backend_name`` or the option."""
    config = request.config
    why = config.stash.get(_no_hosts_key, "")
    if why:
        pytest.skip(f"--kvconn-cross-host: {why}")
    name = getattr(request.cls, "backend_name", None) or config.getoption("--kvconn-backend")
    if not name:
        raise pytest.UsageError("kvconn conformance: name a backend (--kvconn-backend or backend_name)")
    options: dict[str, str] = dict(getattr(request.cls, "backend_options", {}) or {})
    try:
        options.update(parse_key_values(config.getoption("--kvconn-option"), "--kvconn-option"))
    except OptionError as exc:
        raise pytest.UsageError(str(exc)) from None
    try:
        capabilities_of(get_backend(name), options)  # refuses bad options before any process starts
    except (BackendError, ValueError) as exc:
        pytest.fail(f"kvconn conformance: {exc}", pytrace=False)
    return Settings(
        backend_name=name,
        options=options,
        write_timeout_s=config.getoption("--kvconn-write-timeout"),
        abort_timeout_s=config.getoption("--kvconn-abort-timeout"),
        strict=bool(config.getoption("--kvconn-strict")),
        thorough=bool(config.getoption("--kvconn-thorough")),
        watch_s=config.getoption("--kvconn-watch"),
    )


def _backend_of(item: pytest.Item) -> str:
    cls = getattr(item, "cls", None)
    return str(getattr(cls, "backend_name", None) or item.config.getoption("--kvconn-backend") or "?")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    if item.get_closest_marker(_MARK) is None:
        return report
    if report.when == "call" and report.passed and not stakes.taken():
        report.outcome = "failed"
        report.longrepr = (
            f"{item.name} passed without stating what it put at stake (stakes.at_stake): a check that can "
            "pass with nothing at stake proves nothing (a bug of the suite)"
        )
    if report.skipped and item.config.getoption("--kvconn-strict"):
        reason = _skip_reason(report)
        if not reason.startswith(DECLARED):
            report.outcome = "failed"
            report.longrepr = f"strict: undeclared skip of {item.name}: {reason}"
    item.stash.setdefault(_reports_key, []).append(report)
    return report


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, Any, Any]:
    if item.get_closest_marker(_MARK) is None:
        return (yield)
    start = time.monotonic()
    guard.GUARD.check = item.name
    stakes.begin()
    item.stash[_reports_key] = []
    result = yield
    reports = item.stash[_reports_key]
    times = item.config.stash[_times_key].setdefault(_backend_of(item), [start, start])
    times[1] = time.monotonic()
    outcome, why = "passed", ""
    for rep in reports:
        if rep.failed:
            outcome = "failed"
            crash = getattr(rep.longrepr, "reprcrash", None)
            why = crash.message if crash is not None else str(rep.longrepr)
            why = why.removeprefix("kvconn.conformance.harness.ConformanceFailure: ").splitlines()[0][:200]
            break
        if rep.skipped:
            outcome, why = "skipped", _skip_reason(rep)
    if outcome == "passed":
        # What it put at stake, and what it measured (``record_property("figures", ...)``).
        figures = [v for rep in reports for k, v in rep.user_properties if k == "figures"]
        said = ["at stake: " + "; ".join(stakes.taken())]
        why = "; ".join(dict.fromkeys(said + [str(v) for v in figures]))  # every phase's report carries them
    item.config.stash[_results_key].append((_backend_of(item), item.name, outcome, why))
    return result


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    results = config.stash.get(_results_key, [])
    if not results:
        return
    tr = terminalreporter
    times = config.stash[_times_key]
    for backend in sorted({r[0] for r in results}):
        tr.section(f"kvconn conformance: {backend}")
        rows = [r for r in results if r[0] == backend]
        for _, name, outcome, why in rows:
            line = f"{outcome.upper():8} {name}"
            tr.write_line(
                line + (f"  ({why})" if why else ""),
                red=outcome == "failed",
                green=outcome == "passed",
                yellow=outcome == "skipped",
            )
        counts = {o: sum(1 for r in rows if r[2] == o) for o in ("passed", "skipped", "failed")}
        start, end = times.get(backend, [0.0, 0.0])
        tr.write_line(
            f"{backend}: {counts['passed']} passed, {counts['skipped']} skipped, {counts['failed']} failed "
            f"in {end - start:.1f} s wall"
        )
