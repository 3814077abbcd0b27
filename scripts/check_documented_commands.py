#!/usr/bin/env python3
"""Run the command lines the READMEs document, in a fresh venv on a fresh copy
of this checkout, so that a documented command cannot rot unnoticed.

Every shell line of a fenced ``bash``/``sh`` block, and every indented code
line that starts with a command (``pip``, ``kvconn``, ``python3``...), of
the files in DOCUMENTS is run in order from the copy's root, with the fresh
venv first on PATH. A line is run as written unless a rule below says why
not; the rules that change a line only make it shorter (a long bench gets
small sizes, a plugin's conformance run one quick check: the full runs are
the test suite's), never make it pass. A line no rule knows is run as
written, so a new documented command is checked by default.

Every line of a fenced ``bash``/``sh`` block of SHELL_DOCUMENTS (the docs)
runs too, the same way (a line ending in ``\\`` continues on the next; ``cd
DIR && COMMAND`` runs as one). A block that cannot run here says why on the
line just above its fence, ``<!-- not run: REASON -->`` (a model it serves,
root it needs, minutes it takes); the listing shows each one. A fence of the
docs with no language whose first line is a command is refused: label it
``bash`` (run) or ``text`` (output), so that no command escapes the check
by its label.

Then every fenced ``python`` block of SNIPPET_DOCUMENTS (README.md and the
docs) runs as a script of its own, top to bottom, with the venv's python
from the copy's root, after the command lines (which install kvconn).
It must exit 0 and print no traceback. A block that cannot run here says
why on the line just above its fence, ``<!-- not run: REASON -->`` (a GPU
it needs, an API summary with ``...`` in it); the listing shows each one.
A block (``python`` or ``bash``) that needs an extra of a distribution of
this checkout says so the same way, ``<!-- needs: ./kvconn_core[trace] -->``:
the check pip-installs that (as the document tells its reader to) before
the block runs.

Usage: python3 scripts/check_documented_commands.py [--keep DIR] [--list]
Exit 1 if any line failed; prints each line's time and the total.
Stdlib only: it runs before (and without) any venv.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = (
    "README.md",
    "kvconn_core/README.md",
    "kvconn_nixl/README.md",
    "kvconn_mooncake/README.md",
    "examples/kvconn-tcpdemo/README.md",
)
#: The documents whose ``python`` blocks run (each file once).
SNIPPET_DOCUMENTS = tuple(
    dict.fromkeys(
        [
            *DOCUMENTS,
            *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")),
            "kvconn_vllm/README.md",
            "kvconn_sglang/README.md",
        ]
    )
)
#: The documents whose fenced shell blocks run, every line (they show commands in fences only).
SHELL_DOCUMENTS = tuple(sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")))
SHELL_FENCES = ("bash", "sh", "shell")
_NOT_RUN = re.compile(r"^<!--\s*not run:\s*(.+?)\s*-->$")
_NEEDS = re.compile(r"^<!--\s*needs:\s*(\./[\w./-]+\[[\w,]+\])\s*-->$")
#: A snippet runs endpoints on loopback: seconds (of an idle machine: see :func:`limit`).
PER_SNIPPET_TIMEOUT_S = 120

#: Commands every newcomer runs, checked even if no README spells them out.
ALWAYS = ("kvconn backends", "kvconn conformance loopback -q")

COMMAND_WORDS = (
    "pip ",
    "pip3 ",
    "python3 ",
    "python ",
    "kvconn",
    ".venv/",
    "sudo ",
    "apt-get ",
    "bash ",
    "pytest",
)

#: The abort bench at the sizes tests/bench uses: seconds, not a minute.
SHORT_BENCH = (
    "--requests 24 --pages 8 --page-bytes 16384 --chunk-pages 2 --stream-requests 8 "
    "--concurrency 4 --overhead-chunks 500 --legacy-timeout 0.5 --drain-s 3 --no-progress"
)
SHORT_TRANSPORT_BENCH = "--repeat 1 --shape 65536x4 --bytes-per-run 4MiB --room-bytes 1MiB --no-progress"
#: The scale benchmarks of docs/performance.md at their smallest size: seconds.
SHORT_MODULES = {"kvconn.bench.tombstones": "--rooms 1000", "kvconn.bench.fleet": "--scales 0.1"}
#: One quick check of the suite: proves the plugin loads and the suite runs.
QUICK_CONFORMANCE = "-q -k test_integrity_large_pages"
PER_COMMAND_TIMEOUT_S = 300
#: A limit stretches at most this many times (as kvconn.testing.waiting's do).
MAX_SLOWNESS = 20.0


def limit(seconds: float) -> float:
    """``seconds`` of an idle machine in wall seconds now: times the runnable
    tasks per core (the larger of the 1- and 5-minute load averages), 1 to
    MAX_SLOWNESS; kvconn.testing.waiting.slowness, which this stdlib-only
    script cannot import (the docs' pip lines took 5-8x their usual time at
    load 20-37)."""
    try:
        one, five, _ = os.getloadavg()
        cores = len(os.sched_getaffinity(0))
    except (OSError, AttributeError):
        return seconds
    return seconds * min(MAX_SLOWNESS, max(1.0, max(one, five) / cores))


@dataclass(frozen=True)
class Line:
    source: str  # file:line
    text: str
    not_run: str | None = None  # the reason its document gives above its block, or None: it runs
    needs: str | None = None  # an extra of this checkout's to install first (./dist[extra])


@dataclass(frozen=True)
class Plan:
    line: Line
    run: str | None  # None: skipped
    why: str  # why it is skipped or changed ("" if run as written)


@dataclass(frozen=True)
class Snippet:
    source: str  # file:line of the opening fence
    code: str
    not_run: str | None  # the reason its document gives, or None: it runs
    needs: str | None = None  # an extra of this checkout's to install first (./dist[extra])


def documented_snippets() -> Iterator[Snippet]:
    for name in SNIPPET_DOCUMENTS:
        path = ROOT / name
        if not path.exists():
            raise SystemExit(f"{name}: listed in SNIPPET_DOCUMENTS but missing")
        lines = path.read_text().splitlines()
        number = 0
        while number < len(lines):
            fence = lines[number].strip()
            if not fence.startswith("```"):
                number += 1
                continue
            end = number + 1
            while end < len(lines) and lines[end].strip() != "```":
                end += 1
            if fence[3:].strip() == "python":
                above = _NOT_RUN.match(lines[number - 1].strip()) if number else None
                needs = _NEEDS.match(lines[number - 1].strip()) if number else None
                yield Snippet(
                    f"{name}:{number + 1}",
                    "\n".join(lines[number + 1 : end]) + "\n",
                    above.group(1) if above else None,
                    needs.group(1) if needs else None,
                )
            number = end + 1


def run_snippet(
    snippet: Snippet, python: str, cwd: Path, env: dict[str, str] | None = None
) -> tuple[int, str]:
    """Run one snippet as a script: its exit code, and its output when it
    failed or printed a traceback (a thread's, or one at exit, that leaves
    the exit code 0)."""
    try:
        proc = subprocess.run(
            [python, "-c", snippet.code],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=limit(PER_SNIPPET_TIMEOUT_S),
        )
    except subprocess.TimeoutExpired as exc:
        return 124, f"timed out after {exc.timeout:.0f} s"
    output = proc.stdout + proc.stderr
    if proc.returncode == 0 and "Traceback" in output:
        return 1, output
    return proc.returncode, output


def documented_lines() -> Iterator[Line]:
    for name in dict.fromkeys([*DOCUMENTS, *SHELL_DOCUMENTS]):
        path = ROOT / name
        if not path.exists():
            raise SystemExit(f"{name}: listed in DOCUMENTS but missing")
        yield from shell_lines(name, path.read_text(), every_line=name in SHELL_DOCUMENTS)


def _markers(above: str) -> tuple[str | None, str | None]:
    """(not run: REASON, needs: EXTRA) of the line above a fence."""
    not_run, needs = _NOT_RUN.match(above.strip()), _NEEDS.match(above.strip())
    return (not_run.group(1) if not_run else None, needs.group(1) if needs else None)


def shell_lines(name: str, text: str, every_line: bool) -> Iterator[Line]:
    """The command lines of one document. ``every_line``: every line of its
    shell fences (the docs); else only lines of its shell fences and of its
    indented code that start with a command word (the READMEs, whose
    indented text also holds output and code)."""
    lines = text.splitlines()
    fence: str | None = None
    not_run = needs = None
    pending, start = "", 0
    for number, raw in enumerate(lines, 1):
        stripped = raw.strip()
        if stripped.startswith("```"):
            if fence is None:
                fence = stripped[3:].strip() or "text"
                not_run, needs = _markers(lines[number - 2] if number > 1 else "")
            else:
                fence = None
            continue
        if fence is not None:
            candidate = stripped if fence in SHELL_FENCES else ""
        elif every_line:
            candidate = ""
        else:
            candidate = raw[4:].strip() if raw.startswith("    ") else ""
        if pending:
            candidate = f"{pending} {candidate}"
        else:
            start = number
        if candidate.endswith("\\"):
            pending = candidate[:-1].strip()
            continue
        pending = ""
        wanted = candidate and not candidate.startswith("#")
        if not wanted or not ((every_line and fence) or candidate.startswith(COMMAND_WORDS)):
            continue
        command = re.sub(r"\s+#.*$", "", candidate)  # a trailing comment
        cd = ""  # `cd DIR && COMMAND`: the command runs in DIR
        for part in (p.strip() for p in command.split("&&")):
            if part.startswith("cd "):
                cd += f"{part} && "
                continue
            yield Line(f"{name}:{start}", cd + part, not_run, needs)


def unlabeled_command_blocks(name: str, text: str) -> Iterator[str]:
    """``file:line`` of each fence with no language whose first line starts
    with a command word: a command the check would not see."""
    lines = text.splitlines()
    number = 0
    while number < len(lines):
        fence = lines[number].strip()
        if not fence.startswith("```"):
            number += 1
            continue
        end = number + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        body = [line.strip() for line in lines[number + 1 : end] if line.strip()]
        if fence == "```" and body and body[0].startswith(COMMAND_WORDS):
            yield f"{name}:{number + 1}"
        number = end + 1


def plan(line: Line, venv: Path, fault_phase_ran: bool = False) -> Plan:
    """What to run for ``line``. ``fault_phase_ran``: an earlier line ran the
    abort bench's fault phase (the same on every run), so this one's bench
    need not."""
    if line.not_run is not None:
        return Plan(line, None, f"not run: {line.not_run}")
    text = line.text
    words = shlex.split(text)
    if words[0] in ("sudo", "apt-get"):
        return Plan(line, None, "system package: scripts/test.sh installs what the tests need")
    if text.startswith("bash scripts/test.sh"):
        return Plan(line, None, "this check runs inside it")
    if words[:2] == ["pip", "uninstall"]:
        return Plan(line, None, "switches an existing environment between wheels")
    if any(w.startswith("mooncake-transfer-engine==") for w in words):
        return Plan(line, None, "the CUDA engine: replaces the CPU wheel the other lines installed")
    if words[:3] == ["python3", "-m", "venv"]:
        return Plan(line, None, f"the venv is made fresh by this check ({venv.name})")
    text = text.replace(".venv/", f"{venv}/")
    words = shlex.split(text)
    command = Path(words[0]).name
    if command == "kvconn" and words[1:2] == ["bench"]:
        return _short_bench(line, words, fault_phase_ran)
    if command == "kvconn" and words[1:2] == ["conformance"] and words[2:3] != ["loopback"]:
        return Plan(line, f"{text} {QUICK_CONFORMANCE}", "one check (the suite runs in tests/)")
    if command.startswith("python") and words[1:2] == ["-m"] and words[2:3][0] in SHORT_MODULES:
        return Plan(line, f"{text} {SHORT_MODULES[words[2]]}", "its smallest size (the full run is a minute)")
    if command == "pytest":
        return Plan(line, f"{text} -q --collect-only", "collected only (run by the test suite)")
    return Plan(line, text, "")


def _short_bench(line: Line, words: list[str], fault_phase_ran: bool) -> Plan:
    """A bench at short sizes. Its own options that the short sizes set
    anyway go (argparse keeps the last: the run is the same), so a line that
    differs only in them is the run above; a curve keeps two points; the
    fault phase runs once."""
    short = shlex.split(SHORT_TRANSPORT_BENCH if "--transport" in words else SHORT_BENCH)
    why = ["short sizes (the full run is minutes)"]
    kept: list[str] = []
    options = words[2:]
    i = 0
    while i < len(options):
        word = options[i]
        takes_value = i + 1 < len(options) and not options[i + 1].startswith("-")
        value = [options[i + 1]] if takes_value else []
        if word in short:
            pass  # set again below
        elif word == "--curve-points" and value and value[0].count(",") > 1:
            kept += [word, ",".join(value[0].split(",")[:2])]
            why.append("its first two points")
        else:
            kept += [word, *value]
        i += 1 + len(value)
    runs_faults = not {"--transport", "--curve", "--faults"} & set(options)
    if runs_faults and fault_phase_ran:
        kept += ["--faults", "off"]
        why.append("no fault phase (run above)")
    return Plan(line, shlex.join([*words[:2], *kept, *short]), ", ".join(why))


def runs_fault_phase(run: str | None) -> bool:
    """Whether this run is an abort bench with its fault phase."""
    if run is None:
        return False
    words = shlex.split(run)
    return "bench" in words[1:2] and not {"--transport", "--curve", "--faults"} & set(words)


def copy_checkout(dest: Path) -> None:
    """What a fresh clone has: the tracked files and the new ones not ignored."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for name in filter(None, (f.decode() for f in files)):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", type=Path, help="work in DIR and keep it (default: a temporary folder)")
    parser.add_argument("--list", action="store_true", help="only print what would run")
    args = parser.parse_args()
    # Named before it exists: the plans print the venv's path.
    work = args.keep or Path(tempfile.gettempdir()) / f"kvconn-doc-commands-{os.getpid()}"
    checkout, venv = work / "checkout", work / "venv"
    unlabeled = [
        where
        for name in SHELL_DOCUMENTS
        for where in unlabeled_command_blocks(name, (ROOT / name).read_text())
    ]
    if unlabeled:
        for where in unlabeled:
            print(f"{where}: a fence with no language shows a command: label it bash (run) or text (output)")
        return 1
    lines = list(documented_lines())
    lines += [Line("(always)", text) for text in ALWAYS]
    plans = []
    seen: set[str] = set()
    fault_phase_ran = False
    for line in lines:
        p = plan(line, venv, fault_phase_ran)
        fault_phase_ran = fault_phase_ran or runs_fault_phase(p.run)
        if p.run is not None and p.run in seen:  # the same line in two READMEs: its result cannot differ
            p = Plan(line, None, "run above")
        elif p.run is not None:
            seen.add(p.run)
        plans.append(p)
    for p in plans:
        what = p.run if p.run is not None else "skipped"
        print(f"{p.line.source:<40} {p.line.text}\n{'':<40} -> {what}{f'  ({p.why})' if p.why else ''}")
    snippets = list(documented_snippets())
    for snippet in snippets:
        what = "python snippet" if snippet.not_run is None else f"python snippet: not run ({snippet.not_run})"
        print(f"{snippet.source:<40} {what}")
    if args.list:
        return 0
    started = time.monotonic()
    if args.keep is None and work.exists():  # a crashed run's, with this pid: not fresh
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    try:
        if checkout.exists():
            shutil.rmtree(checkout)
        checkout.mkdir()
        copy_checkout(checkout)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        env = dict(os.environ, PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
        env.pop("PYTHONPATH", None)  # only what the venv installed
        env["VIRTUAL_ENV"] = str(venv)
        installed: set[str] = set()

        def install(needs: str | None) -> None:
            if needs is not None and needs not in installed:
                subprocess.run(
                    [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-e", needs],
                    cwd=checkout,
                    env=env,
                    check=True,
                    timeout=limit(PER_COMMAND_TIMEOUT_S),
                )
                installed.add(needs)

        failed = []
        docs_s = 0.0  # the docs' shell lines, apart
        for p in plans:
            if p.run is None:
                continue
            t0 = time.monotonic()
            install(p.line.needs)
            try:
                proc = subprocess.run(
                    p.run,
                    shell=True,
                    cwd=checkout,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=limit(PER_COMMAND_TIMEOUT_S),
                )
                code, output = proc.returncode, proc.stdout + proc.stderr
            except subprocess.TimeoutExpired as exc:
                code, output = 124, f"timed out after {exc.timeout:.0f} s"
            took = time.monotonic() - t0
            if p.line.source.split(":")[0] not in DOCUMENTS:
                docs_s += took
            print(f"[{'ok' if code == 0 else 'FAILED'} {took:6.1f} s] {p.run}", flush=True)
            if code != 0:
                failed.append(p)
                print(f"  from {p.line.source}, exit {code}:\n" + _indent(output[-4000:]), flush=True)
        failed_snippets = []
        for snippet in snippets:
            if snippet.not_run is not None:
                continue
            t0 = time.monotonic()
            install(snippet.needs)
            code, output = run_snippet(snippet, str(venv / "bin" / "python"), checkout, env)
            print(
                f"[{'ok' if code == 0 else 'FAILED'} {time.monotonic() - t0:6.1f} s] snippet {snippet.source}"
            )
            if code != 0:
                failed_snippets.append(snippet)
                print(f"  exit {code}:\n" + _indent(output[-4000:]), flush=True)
        print(
            f"documented commands: {len(plans)} lines, {len(failed)} failed; python snippets: "
            f"{len(snippets)}, {len(failed_snippets)} failed; {time.monotonic() - started:.0f} s "
            f"({docs_s:.0f} s of it the docs' shell lines)"
        )
        return 1 if failed or failed_snippets else 0
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


if __name__ == "__main__":
    sys.exit(main())
