"""docs/operations.md's Python example runs as written, in a process of its own."""

from __future__ import annotations

import re
import subprocess
import sys

from ops_support import ROOT


def test_the_operations_python_example_runs() -> None:
    text = (ROOT / "docs" / "operations.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)
    assert blocks, "docs/operations.md has no python example"
    for code in blocks:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
