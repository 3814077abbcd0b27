"""Score per module of a mutmut 3 run: ``python scripts/mutation_score.py build/mutation/mutants``.

Reads mutmut's per-file results (``<file>.meta``) and prints, per mutated
module, mutants total / killed / survived / other, then every survivor's name
(``mutmut show NAME`` in build/mutation/ prints its diff)."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from mutmut.stats import status_by_exit_code


def main(mutants: Path) -> int:
    survivors: list[str] = []
    rows = []
    for meta in sorted(mutants.rglob("*.py.meta")):
        # mutants not run (outside the names the run was given) are not counted
        codes = {k: c for k, c in json.loads(meta.read_text())["exit_code_by_key"].items() if c is not None}
        if not codes:
            continue
        counts = Counter(status_by_exit_code[c] for c in codes.values())
        module = str(meta.relative_to(mutants)).removesuffix(".meta")
        killed = counts["killed"] + counts["timeout"]
        rows.append(
            (module, len(codes), killed, counts["survived"], len(codes) - killed - counts["survived"])
        )
        survivors += sorted(
            k for k, c in codes.items() if status_by_exit_code[c] not in ("killed", "timeout")
        )
    print(f"{'module':45} {'total':>6} {'killed':>7} {'survived':>9} {'other':>6} {'score':>7}")
    for module, total, killed, survived, other in rows:
        print(f"{module:45} {total:6} {killed:7} {survived:9} {other:6} {100 * killed / total:6.1f}%")
    if survivors:
        print("not killed:")
        for name in survivors:
            print(f"  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "mutants")))
