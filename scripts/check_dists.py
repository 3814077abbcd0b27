#!/usr/bin/env python3
"""The checks of scripts/check_dists.sh that read files.

``check_dists.py OUT DIST...``: every DIST (a folder of this checkout) has a
wheel and an sdist in OUT at the version its package states
(``__version__`` in its ``__init__.py``), with the metadata an index shows
(summary, readme, license expression and file, classifiers, project URLs,
Python range), its license text, its ``py.typed``, and no path of this
machine inside.

``check_dists.py --installed DIST...``: run by the fresh venv's python:
each installed distribution's version is its package's ``__version__``,
imported from the venv (not from this checkout), ``kvconn --version``
names them all, and the three transports are found.

Stdlib only (the first form runs before any kvconn is installed).
"""

from __future__ import annotations

import ast
import email
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: folder -> (distribution name, import package)
PACKAGES = {
    "kvconn_core": ("kvconn-core", "kvconn"),
    "kvconn_nixl": ("kvconn-nixl", "kvconn_nixl"),
    "kvconn_mooncake": ("kvconn-mooncake", "kvconn_mooncake"),
    "kvconn_vllm": ("kvconn-vllm", "kvconn_vllm"),
    "kvconn_sglang": ("kvconn-sglang", "kvconn_sglang"),
}
URL_LABELS = {"Homepage", "Documentation", "Source", "Issues"}


def stated_version(folder: str) -> str:
    """``__version__ = "..."`` of the package's ``__init__.py``, read, not imported."""
    package = PACKAGES[folder][1]
    tree = ast.parse((ROOT / folder / "src" / package / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] == ["__version__"]:
            value = node.value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                return value.value
    raise SystemExit(f"{folder}: no literal __version__ in its __init__.py")


def check_built(out: Path, folder: str) -> list[str]:
    name, package = PACKAGES[folder]
    version = stated_version(folder)
    stem = f"{name.replace('-', '_')}-{version}"
    wheel, sdist = out / f"{stem}-py3-none-any.whl", out / f"{stem}.tar.gz"
    problems = [f"{p.name} missing" for p in (wheel, sdist) if not p.exists()]
    if problems:
        return problems
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = email.message_from_bytes(zf.read(f"{stem}.dist-info/METADATA"))
        texts = {
            n: zf.read(n) for n in names if n.endswith((".py", ".txt", ".json", ".md", "METADATA", "RECORD"))
        }
    want = {
        "Name": name,
        "Version": version,
        "License-Expression": "Apache-2.0",
        "License-File": "LICENSE",
        "Description-Content-Type": "text/markdown",
        "Requires-Python": ">=3.10",
    }
    problems += [
        f"{wheel.name}: {k} is {meta.get(k)!r}, not {v!r}" for k, v in want.items() if meta.get(k) != v
    ]
    if not meta.get("Summary"):
        problems.append(f"{wheel.name}: no Summary")
    if len(meta.get_payload() or "") < 200:
        problems.append(f"{wheel.name}: no readme as its description")
    labels = {u.split(",", 1)[0].strip() for u in meta.get_all("Project-URL") or []}
    if labels != URL_LABELS:
        problems.append(f"{wheel.name}: project URLs {sorted(labels)}, not {sorted(URL_LABELS)}")
    classifiers = meta.get_all("Classifier") or []
    for needed in (
        "Typing :: Typed",
        "Operating System :: POSIX :: Linux",
        "Development Status :: 3 - Alpha",
    ):
        if needed not in classifiers:
            problems.append(f"{wheel.name}: no classifier {needed!r}")
    for member in (f"{package}/py.typed", f"{stem}.dist-info/licenses/LICENSE"):
        if member not in names:
            problems.append(f"{wheel.name}: no {member}")
    here = str(ROOT).encode()
    problems += [f"{wheel.name}: {n} names this machine's path {ROOT}" for n, t in texts.items() if here in t]
    with tarfile.open(sdist) as tf:
        members = set(tf.getnames())
    for member in ("LICENSE", "README.md", "pyproject.toml", "PKG-INFO"):
        if f"{stem}/{member}" not in members:
            problems.append(f"{sdist.name}: no {member}")
    return problems


def check_installed(folders: list[str]) -> list[str]:
    import importlib
    from importlib.metadata import entry_points, version

    problems = []
    for folder in folders:
        name, package = PACKAGES[folder]
        module = importlib.import_module(package)
        where = Path(module.__file__ or "").resolve()
        if ROOT in where.parents and "build" not in where.relative_to(ROOT).parts:
            problems.append(f"{package} was imported from the checkout ({where}), not the venv")
        if version(name) != module.__version__:
            problems.append(f"{name}: installed {version(name)}, its package says {module.__version__}")
    said = subprocess.run(
        [str(Path(sys.executable).with_name("kvconn")), "--version"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    print(said, end="")
    for folder in folders:
        name = PACKAGES[folder][0]
        if name != "kvconn-core" and f"{name} {version(name)}" not in said:
            problems.append(f"kvconn --version does not name {name} {version(name)}: {said!r}")
    found = {ep.name for ep in entry_points(group="kvconn.backends")}
    if not {"loopback", "nixl", "mooncake"} <= found:
        problems.append(f"kvconn.backends entry points: {sorted(found)}")
    return problems


def main(argv: list[str]) -> int:
    if argv[:1] == ["--installed"]:
        problems = check_installed(argv[1:])
    else:
        out, folders = Path(argv[0]), argv[1:]
        problems = [p for folder in folders for p in check_built(out, folder)]
    for problem in problems:
        print(f"check_dists: {problem}", file=sys.stderr)
    if not problems:
        print(f"check_dists: {'installed' if argv[:1] == ['--installed'] else 'built'}: ok")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
