"""The ``kvconn`` command as a new user meets it: a documented subcommand never
fails with an argparse error because an optional import went missing, and
everything kvconn-core imports is something its install brings."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "kvconn_core"
SRC = CORE / "src" / "kvconn"

#: Imported only behind a guard that names the extra to install (bench --plot).
#: Modules only an extra installs: module -> (extra, the distribution that brings it).
OPTIONAL = {"matplotlib": ("plot", "matplotlib"), "opentelemetry": ("trace", "opentelemetry_api")}


def run_cli_without(module: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """``kvconn ARGV`` in a fresh interpreter where importing MODULE fails as
    it does when the package is not installed."""
    code = (
        "import sys\n"
        f"sys.modules[{module!r}] = None  # import raises ModuleNotFoundError, as if not installed\n"
        "from kvconn.cli import main\n"
        f"sys.exit(main({list(argv)!r}))\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_conformance_without_pytest_names_the_install_command() -> None:
    proc = run_cli_without("pytest", "conformance", "loopback", "-q")
    assert proc.returncode == 2, proc.stderr
    assert "unrecognized arguments" not in proc.stderr
    assert "kvconn conformance needs the Python package 'pytest'" in proc.stderr
    assert "pip install" in proc.stderr


def test_a_missing_kvconn_module_is_not_mistaken_for_a_dependency() -> None:
    # A broken kvconn install is a bug to see in full, not an install hint.
    proc = run_cli_without("kvconn.conformance.suite", "conformance", "loopback")
    assert proc.returncode != 0
    assert "ModuleNotFoundError" in proc.stderr
    assert "needs the Python package" not in proc.stderr


def test_conformance_arguments_are_registered() -> None:
    from kvconn.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["conformance", "--help"])
    assert exc.value.code == 0


@pytest.mark.parametrize("flag", ["-o", "--option", "--backend-option"])
def test_conformance_takes_backend_options_under_the_names_bench_takes(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each spelling reaches the option check (which refuses an unknown
    option before any process starts), as ``kvconn bench`` accepts all three."""
    from kvconn.cli import main

    assert main(["conformance", "loopback", flag, "no_such_option=1"]) == 2
    err = capsys.readouterr().err
    assert "no_such_option" in err, err
    assert "unrecognized arguments" not in err


def third_party_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.partition(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "kvconn"}


def declared(requirements: list[str]) -> set[str]:
    out = set()
    for req in requirements:
        name = req
        for stop in "<>=!~[; ":
            name = name.partition(stop)[0]
        out.add(name.strip().lower().replace("-", "_"))
    return out


#: Distribution name -> the module it installs, where they differ.
MODULE_OF = {"prometheus_client": "prometheus_client", "pyzmq": "zmq"}


def test_every_module_kvconn_core_imports_is_installed_with_it() -> None:
    """What made ``kvconn conformance`` an argparse error on a plain
    ``pip install ./kvconn_core``: it imports pytest, which was only in an extra."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((CORE / "pyproject.toml").read_text())["project"]
    required = {MODULE_OF.get(d, d) for d in declared(project["dependencies"])}
    extras = project["optional-dependencies"]
    imported: dict[str, list[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        for name in third_party_imports(path):
            imported.setdefault(name, []).append(str(path.relative_to(SRC)))
    missing = {n: where for n, where in imported.items() if n not in required and n not in OPTIONAL}
    assert not missing, f"imported by kvconn-core but not in its dependencies: {missing}"
    for module, (extra, distribution) in OPTIONAL.items():
        assert distribution in declared(extras[extra]), (module, extra)


def kvconn(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvconn.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200", **env},
    )


def test_an_allow_list_naming_no_installed_backend_says_so() -> None:
    proc = kvconn("backends", KVCONN_BACKENDS="bogus")
    assert proc.returncode == 1
    err = " ".join(proc.stderr.split())
    assert "KVCONN_BACKENDS='bogus' names bogus, which no installed backend is" in err, proc.stderr
    assert "installed: " in err and "loopback" in err


def test_backends_lists_and_opens_loopback() -> None:
    proc = kvconn("backends", KVCONN_BACKENDS="loopback")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "each opened here" in proc.stdout and "loopback" in proc.stdout
    assert "does not open here" not in proc.stdout


def test_help_and_version_read_as_text() -> None:
    top = kvconn("--help")
    assert top.returncode == 0 and "The ``kvconn`` command" not in top.stdout
    assert "never hand a page" in " ".join(top.stdout.split())
    version = kvconn("--version")
    assert version.returncode == 0 and version.stdout.startswith("kvconn ")
