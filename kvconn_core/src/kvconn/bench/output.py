"""Where the bench's results go: consoles that do not cut tables in logs,
output files checked before a run of minutes, and the JSON document."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

#: Width of a console that is not a terminal (a file or pipe), where rich
#: would otherwise wrap every table to 80 columns and cut numbers in logs.
#: ``COLUMNS`` set by the user still wins.
PIPE_WIDTH = 200


def console(stderr: bool = False) -> Console:
    """A console on stdout (or stderr); wide when it is not a terminal."""
    out = Console(stderr=stderr)
    if not out.is_terminal and "COLUMNS" not in os.environ:
        out = Console(stderr=stderr, width=PIPE_WIDTH)
    return out


def spinner(err: Console, disable: bool) -> Progress:
    """Progress on ``err`` for steps of unknown length: a spinner, what runs
    now and for how long; gone when done."""
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    return Progress(*columns, console=err, disable=disable, transient=True)


def check_output_paths(*paths: str | None) -> None:
    """Refuse, before a run of minutes, a file the results cannot be written to."""
    for path in paths:
        if not path or path == "-":
            continue
        if os.path.exists(path):
            if os.path.isdir(path) or not os.access(path, os.W_OK):
                raise ValueError(f"cannot write {path}")
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise ValueError(f"cannot write {path}: {folder} is not a writable folder")


def write_json(path: str, doc: Any) -> None:
    """``doc`` as indented JSON to ``path`` ('-': stdout)."""
    text = json.dumps(doc, indent=2)
    if path == "-":
        sys.stdout.write(text + "\n")
    else:
        with open(path, "w") as f:
            f.write(text + "\n")
