"""scripts/check_documented_commands.py finds the READMEs' command lines and
changes none of them except to make it shorter."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

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
