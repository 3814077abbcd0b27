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


DOC = """
Text.

```bash
promtool check rules rules.yml   # a comment
cd monitoring && promtool test rules t.yml
# a comment line
kvconn bench --requests 10 \\
    --json out.json
```

<!-- not run: starts a server on a model (MODEL), minutes -->
```bash
python -m server --model MODEL &
```

<!-- needs: ./kvconn_core[trace] -->
```bash
kvconn bench --trace t.jsonl
```

```text
kvconn.room {...}
```
"""


def test_every_line_of_a_docs_shell_block_runs_unless_its_block_says_why() -> None:
    m = script()
    lines = list(m.shell_lines("docs/x.md", DOC, every_line=True))
    assert [(line.text, line.not_run, line.needs) for line in lines] == [
        ("promtool check rules rules.yml", None, None),  # no command word needed in the docs
        ("cd monitoring && promtool test rules t.yml", None, None),  # runs in DIR, as one
        ("kvconn bench --requests 10 --json out.json", None, None),  # continued
        ("python -m server --model MODEL &", "starts a server on a model (MODEL), minutes", None),
        ("kvconn bench --trace t.jsonl", None, "./kvconn_core[trace]"),
    ]
    assert (lines[2].source, lines[3].source) == ("docs/x.md:8", "docs/x.md:14")
    venv = Path("/v")
    assert m.plan(lines[3], venv).run is None and "MODEL" in m.plan(lines[3], venv).why
    # a README keeps only lines that start with a command word
    readme = [line.text for line in m.shell_lines("README.md", DOC, every_line=False)]
    assert "promtool check rules rules.yml" not in readme and "kvconn bench --trace t.jsonl" in readme


def test_the_docs_shell_blocks_are_checked() -> None:
    """The operator guide's promtool lines run; every docs line that does not
    run says why."""
    m = script()
    docs = [line for line in m.documented_lines() if line.source.startswith("docs/")]
    runs = {line.text for line in docs if line.not_run is None}
    assert "promtool check rules monitoring/prometheus/kvconn-rules.yml" in runs
    assert "cd monitoring/prometheus && promtool test rules kvconn-rules.test.yml" in runs
    assert any(text.startswith("kvconn bench --faults off --modes kvconn") for text in runs)
    assert all(line.not_run is None or len(line.not_run) > 20 for line in docs)


def test_a_docs_fence_with_no_language_cannot_hide_a_command() -> None:
    m = script()
    hidden = "Run it:\n\n```\nkvconn bench --requests 5\n```\n\n```text\nkvconn.room {}\n```\n"
    assert list(m.unlabeled_command_blocks("docs/y.md", hidden)) == ["docs/y.md:3"]
    root = SCRIPT.parents[1]
    found = [
        w for name in m.SHELL_DOCUMENTS for w in m.unlabeled_command_blocks(name, (root / name).read_text())
    ]
    assert found == []


def test_a_bench_line_is_only_shortened() -> None:
    """Options the short sizes set anyway go (the same run: argparse keeps
    the last), a curve keeps two points, the fault phase runs once."""
    m = script()
    venv = Path("/v")

    def run(text: str, fault_phase_ran: bool = False) -> str:
        p = m.plan(m.Line("docs/x.md:1", text), venv, fault_phase_ran)
        assert p.run is not None
        return str(p.run)

    assert run("kvconn bench --requests 10000") == run("kvconn bench")
    assert run("kvconn bench --json o.json", fault_phase_ran=True).startswith(
        "kvconn bench --json o.json --faults off "
    )
    assert "--faults off" not in run("kvconn bench --json o.json")
    assert "--curve-points 8,64 " in run("kvconn bench --curve rooms --curve-points 8,64,256,512")
    assert "--faults off" not in run("kvconn bench --curve rooms", fault_phase_ran=True)
    assert run("python -m kvconn.bench.fleet") == "python -m kvconn.bench.fleet --scales 0.1"
