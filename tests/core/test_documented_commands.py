"""scripts/check_documented_commands.py finds the READMEs' command lines and
changes none of them except to make it shorter."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import sys
from pathlib import Path
from types import ModuleType

from kvconn.bench.cli import add_arguments

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_documented_commands.py"


def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_documented_commands", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_readme_commands_are_found() -> None:
    m = script()
    texts = [line.text for line in m.documented_lines()]
    assert ".venv/bin/kvconn bench" in texts  # the README's first command, split at &&
    assert "bash scripts/test.sh" in texts
    assert "kvconn conformance nixl" in texts
    assert "kvconn conformance tcpdemo" in texts


def test_changes_only_shorten_and_unknown_lines_run_as_written(tmp_path: Path) -> None:
    m = script()
    venv = tmp_path / "venv"

    def plan(text: str) -> tuple[str | None, str]:
        p = m.plan(m.Line("x", text), venv)
        return p.run, p.why

    run, _ = plan(".venv/bin/kvconn bench")
    assert run is not None and run.startswith(f"{venv}/bin/kvconn bench --requests ")
    run, _ = plan("kvconn bench --transport --backend nixl,mooncake")
    assert run is not None and run.startswith("kvconn bench --transport --backend nixl,mooncake --repeat 1")
    assert plan("kvconn conformance loopback -q") == ("kvconn conformance loopback -q", "")
    assert plan("kvconn backends") == ("kvconn backends", "")
    assert plan("kvconn something-new --flag") == ("kvconn something-new --flag", "")
    run, why = plan("sudo apt-get install -y libibverbs1")
    assert run is None and "system package" in why


def test_python_snippets_are_found_and_every_skip_says_why() -> None:
    m = script()
    snippets = list(m.documented_snippets())
    by_file = {s.source.split(":")[0] for s in snippets if s.not_run is None}
    # the README's loopback program and the operator guide's exporter run; so does the plugin guide
    assert {"README.md", "docs/operations.md", "docs/writing-a-transport-plugin.md"} <= by_file
    assert all(s.not_run is None or len(s.not_run) > 10 for s in snippets)
    assert any("CUDA" in (s.not_run or "") for s in snippets if s.source.startswith("README.md"))


def test_the_readme_loopback_program_runs_top_to_bottom_without_a_traceback() -> None:
    """Prefill and decode in one process, as the README's program has them:
    it completes one room, aborts another and exits with no traceback (the
    loopback writer attaching to decode's segment in the same process used
    to leave the resource tracker a KeyError at exit)."""
    m = script()
    (program,) = [
        s
        for s in m.documented_snippets()
        if s.source.startswith("README.md") and s.not_run is None and 'get_backend("loopback")' in s.code
    ]
    code, output = m.run_snippet(program, sys.executable, SCRIPT.parents[1], dict(os.environ))
    assert code == 0, output


def test_every_bench_command_the_docs_quote_parses() -> None:
    """``kvconn bench ...`` quoted inline in a doc (`--bytes-per-run 128 MiB`
    was one) takes options the bench accepts, as written."""
    root = SCRIPT.parents[1]
    docs = [
        root / "README.md",
        *sorted((root / "docs").glob("*.md")),
        *sorted(root.glob("kvconn_*/README.md")),
    ]
    quoted = {
        (doc.name, cmd)
        for doc in docs
        for cmd in re.findall(r"`(kvconn bench(?: [^`]*)?)`", doc.read_text())
        if "--help" not in cmd
    }
    assert len(quoted) >= 3, quoted
    for doc, cmd in sorted(quoted):
        parser = argparse.ArgumentParser(prog="kvconn bench", exit_on_error=False)
        add_arguments(parser)
        try:
            parser.parse_args(shlex.split(cmd)[2:])
        except (argparse.ArgumentError, SystemExit) as exc:
            raise AssertionError(f"{doc}: `{cmd}` does not parse: {exc}") from exc
