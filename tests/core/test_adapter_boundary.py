"""The engine adapters (kvconn_vllm, kvconn_sglang) and the engine's handles
(``Receiver``, ``Sender``) use kvconn only through its public API: no import
from ``kvconn.protocol`` (the core's internals: what the adapters need of it,
``DrainReport``, ``KVPoll``, ``Release``, comes re-exported from
``kvconn.runtime``), no private name of a kvconn module, and no private
attribute of a kvconn object. Checked on their source (ast), so it costs
nothing and needs no engine installed.

A kvconn object is anything the source binds from a kvconn import: a name
imported from ``kvconn.*``, a variable, attribute or parameter annotated
with one, assigned from a call of one or from another kvconn object, a
method's result annotated with one, a loop variable over one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKED = sorted(
    [
        *(ROOT / "kvconn_vllm/src/kvconn_vllm").glob("*.py"),
        *(ROOT / "kvconn_sglang/src/kvconn_sglang").glob("*.py"),
        ROOT / "kvconn_core/src/kvconn/runtime/receiver.py",
        ROOT / "kvconn_core/src/kvconn/runtime/sender.py",
    ]
)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _kvconn_module(module: str) -> bool:
    return module == "kvconn" or module.startswith("kvconn.")


def _imports(tree: ast.Module, own: bool) -> tuple[set[str], list[str]]:
    """(names bound to kvconn things, import problems). ``own``: the module
    checked, when it is kvconn's own (its imports of its own package are
    what it is made of; only ``kvconn.protocol`` stays forbidden to the
    adapters)."""
    names: set[str] = set()
    problems: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if not _kvconn_module(node.module):
                continue
            if not own and (node.module == "kvconn.protocol" or node.module.startswith("kvconn.protocol.")):
                problems.append(f"line {node.lineno}: imports from {node.module}")
            if any(_private(part) for part in node.module.split(".")):
                problems.append(f"line {node.lineno}: imports private module {node.module}")
            for alias in node.names:
                if _private(alias.name):
                    problems.append(f"line {node.lineno}: imports private {node.module}.{alias.name}")
                names.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if not _kvconn_module(alias.name):
                    continue
                if not own and alias.name.startswith("kvconn.protocol"):
                    problems.append(f"line {node.lineno}: imports {alias.name}")
                names.add(alias.asname or alias.name.split(".")[0])
    return names, problems


def _chain(node: ast.expr) -> list[str]:
    """``node`` and every expression it is reached through (``a.b[c].d()``:
    itself, ``a.b[c].d``, ``a.b[c]``, ``a.b``, ``a``), as source text."""
    keys = []
    while True:
        keys.append(ast.unparse(node))
        if isinstance(node, ast.Attribute | ast.Subscript | ast.Call):
            node = node.func if isinstance(node, ast.Call) else node.value
        else:
            return keys


def _mentions(annotation: ast.expr | None, names: set[str]) -> bool:
    if annotation is None:
        return False
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return False
    return any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(annotation))


def _kvconn_objects(tree: ast.Module, names: set[str]) -> set[str]:
    """Source text of every expression the module binds to a kvconn object."""
    typed = set(names)

    def is_typed(value: ast.expr | None) -> bool:
        return value is not None and any(key in typed for key in _chain(value))

    changed = True
    while changed:
        before = len(typed)
        for node in ast.walk(tree):
            if isinstance(node, ast.AnnAssign) and (
                _mentions(node.annotation, names) or is_typed(node.value)
            ):
                typed.add(ast.unparse(node.target))
                if isinstance(node.target, ast.Name):  # a class body's: its instances' too
                    typed.add(f"self.{node.target.id}")
            elif isinstance(node, ast.Assign) and is_typed(node.value):
                for target in node.targets:
                    for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                        typed.add(ast.unparse(t))
            elif isinstance(node, ast.arg) and _mentions(node.annotation, names):
                typed.add(node.arg)
            elif isinstance(node, ast.FunctionDef) and _mentions(node.returns, names):
                typed |= {f"self.{node.name}()", f"{node.name}()"}
            elif isinstance(node, ast.For | ast.comprehension) and is_typed(node.iter):
                typed.add(ast.unparse(node.target))
            elif isinstance(node, ast.withitem) and node.optional_vars and is_typed(node.context_expr):
                typed.add(ast.unparse(node.optional_vars))
        changed = len(typed) != before
    return typed


def boundary_problems(source: str, own: bool = False) -> list[str]:
    """What in ``source`` crosses kvconn's public API (empty: nothing)."""
    tree = ast.parse(source)
    names, problems = _imports(tree, own)
    typed = _kvconn_objects(tree, names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if any(key in typed for key in _chain(node.value)):
                problems.append(f"line {node.lineno}: {ast.unparse(node)}: a private attribute of kvconn")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
            and any(key in typed for key in _chain(node.args[0]))
        ):
            problems.append(f"line {node.lineno}: {ast.unparse(node)}: a private attribute of kvconn")
    return problems


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_adapters_and_handles_use_only_kvconns_public_api(path: Path) -> None:
    own = path.is_relative_to(ROOT / "kvconn_core")
    assert boundary_problems(path.read_text(), own=own) == []


def test_the_adapters_are_all_checked() -> None:
    assert {p.parent.name for p in CHECKED} >= {"kvconn_vllm", "kvconn_sglang", "runtime"}
    assert len([p for p in CHECKED if p.parent.name == "kvconn_vllm"]) >= 10


# The check itself, on code that breaks each rule (and code that does not).
BAD = {
    "a core import": "from kvconn.protocol.drain import DrainReport\n",
    "a core module import": "import kvconn.protocol.ledger as ledger\n",
    "a private name": "from kvconn.runtime.decode import _UNFREED_REGIONS\n",
    "an annotated attribute": (
        "from kvconn.runtime.decode import DecodeEndpoint\n"
        "class A:\n"
        "    def __init__(self) -> None:\n"
        "        self._decode: DecodeEndpoint | None = None\n"
        "    def f(self) -> None:\n"
        "        with self._decode._lock:\n"
        "            pass\n"
    ),
    "an assigned object and what it returns": (
        "from kvconn.runtime.prefill import PrefillRank\n"
        "rank = PrefillRank(None)\n"
        "sender = rank.sender(1)\n"
        "sender._state\n"
    ),
    "a parameter": (
        "from kvconn.runtime.decode import Receiver\n"
        "def f(rx: 'Receiver') -> None:\n"
        "    rx._request.verdict\n"
    ),
    "a method's result": (
        "from kvconn.runtime.prefill import Sender\n"
        "class A:\n"
        "    def _bound(self) -> Sender | None: ...\n"
        "    def f(self) -> None:\n"
        "        self._bound()._rank\n"
    ),
    "a loop variable": (
        "from kvconn.runtime.decode import Receiver\n"
        "class A:\n"
        "    receivers: dict[int, Receiver] = {}\n"
        "    def f(self) -> None:\n"
        "        for rx in self.receivers.values():\n"
        "            rx._endpoint\n"
    ),
    "getattr": "from kvconn.runtime.decode import DecodeEndpoint as D\ngetattr(D, '_state')\n",
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_the_check_finds(name: str) -> None:
    assert boundary_problems(BAD[name])


def test_the_check_leaves_the_adapters_own_privates_and_other_libraries_alone() -> None:
    source = (
        "from kvconn.runtime.decode import DecodeEndpoint, DrainReport\n"
        "import sglang\n"
        "class A:\n"
        "    def __init__(self, queue: object) -> None:\n"
        "        self._decode = DecodeEndpoint(None)\n"
        "        self._queue = queue\n"
        "    def f(self) -> DrainReport:\n"
        "        self._queue._deferred_releases.clear()\n"
        "        return self._decode.drain(1.0)\n"
    )
    assert boundary_problems(source) == []
