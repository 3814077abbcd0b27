"""Real SGLang servers for the tests: the recipe of docs/sglang.md, read from
the doc itself, and the processes it starts.

The doc's CPU recipe block (the fenced ``bash`` block right after the line
``<!-- recipe: tests/sglang/test_sglang_servers.py -->``) is parsed here:
its ``export`` line and ``NAME="..."`` assignments, the line that makes
the model, its ``python -m`` commands (prefill, decode, SGLang's router)
and its ``curl`` request. The
test runs exactly those command lines, with the doc's model placeholder and
ports replaced by a model made at test time and free ports, and with the
test's own short deadlines added to the environment. A change to the doc
is a change to what the test runs; a doc block the parser no longer
understands fails the test.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "sglang.md"
MARKER = "<!-- recipe: tests/sglang/test_sglang_servers.py -->"
#: What the doc writes where a model folder goes.
MODEL_PLACEHOLDER = "MODEL"
#: The script the doc's recipe makes its model with (from the repository's root).
MODEL_SCRIPT = "tests/sglang/tiny_model.py"


class RecipeError(AssertionError):
    """The doc's recipe block is not what the test can run."""


@attrs.frozen(slots=True)
class Recipe:
    """The doc's recipe: environment, one argv per process, the client's request."""

    env: Mapping[str, str]
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    router: tuple[str, ...]
    #: The doc's ``curl`` line: the URL it posts to and its JSON body.
    client_url: str
    client_body: Mapping[str, Any]
    #: The doc's line that makes the model (``python tests/sglang/tiny_model.py MODEL``).
    model: tuple[str, ...] = ()

    def ports(self) -> list[int]:
        """Every port the doc names (HTTP, bootstrap, the router's metrics)."""
        found: list[int] = []
        for argv in (self.prefill, self.decode, self.router):
            for a, b in itertools.pairwise(argv):
                if a in ("--port", "--disaggregation-bootstrap-port", "--prometheus-port"):
                    found.append(int(b))
        return sorted(set(found))

    def plain(self) -> tuple[str, ...]:
        """One SGLang server without disaggregation: the prefill's command
        less its ``--disaggregation-*`` options (the tokens' reference)."""
        argv: list[str] = []
        skip = False
        for arg in self.prefill:
            if skip:
                skip = False
                continue
            if arg.startswith("--disaggregation-"):
                skip = "=" not in arg
                continue
            argv.append(arg)
        return tuple(argv)

    def bound(self, model: Path, ports: Mapping[int, int]) -> Recipe:
        """The recipe with ``model`` for the placeholder and each doc port
        mapped to a port of the test's."""

        def one(arg: str) -> str:
            if arg == MODEL_PLACEHOLDER:
                return str(model)
            for doc_port, port in ports.items():
                arg = re.sub(rf"(?<![0-9]){doc_port}(?![0-9])", str(port), arg)
            return arg

        def argv(items: Sequence[str]) -> tuple[str, ...]:
            return tuple(one(a) for a in items)

        return Recipe(
            env=dict(self.env),
            prefill=argv(self.prefill),
            decode=argv(self.decode),
            router=argv(self.router),
            client_url=one(self.client_url),
            client_body=self.client_body,
            model=argv(self.model),
        )


#: What the CPU recipe has that a GPU host must not: SGLang's CPU engine, no
#: early send of a cached prefix (it records a CUDA event), the CPU
#: stand-ins, float32 and the CPU retraction backup.
CPU_ONLY_ENV = ("SGLANG_USE_CPU_ENGINE", "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX", "PYTHONPATH")
CPU_ONLY_OPTIONS = {"--device": "cpu", "--disaggregation-decode-retraction-backup": "cpu_tensor"}


def on_gpus(recipe: Recipe, prefill_gpu: int, decode_gpu: int) -> Recipe:
    """The doc's recipe for a GPU host (scripts/gpu/sglang_pd.sh): the CPU
    settings above dropped, bfloat16 (GPU attention kernels do not take
    float32), each server on its GPU with a share of its memory."""

    def gpu(argv: Sequence[str], gpu_id: int) -> tuple[str, ...]:
        out: list[str] = []
        items = list(argv)
        i = 0
        while i < len(items):
            if items[i] in CPU_ONLY_OPTIONS:
                i += 2
                continue
            out.append("bfloat16" if items[i - 1 : i] == ["--dtype"] else items[i])
            i += 1
        return (*out, "--base-gpu-id", str(gpu_id), "--mem-fraction-static", "0.25")

    return attrs.evolve(
        recipe,
        env={k: v for k, v in recipe.env.items() if k not in CPU_ONLY_ENV},
        prefill=gpu(recipe.prefill, prefill_gpu),
        decode=gpu(recipe.decode, decode_gpu),
    )


def _block(text: str) -> list[str]:
    lines = text.splitlines()
    try:
        start = lines.index(MARKER)
    except ValueError:
        raise RecipeError(f"{DOC.name}: no line {MARKER!r}") from None
    # Other HTML comments may stand between the marker and the block (the
    # documented-commands check's "not run" line must be right above it).
    while lines[start + 1].startswith("<!--"):
        start += 1
    if lines[start + 1].strip() != "```bash":
        raise RecipeError(f"{DOC.name}: the line after the marker must open a bash block")
    end = lines.index("```", start + 2)
    joined: list[str] = []
    for line in lines[start + 2 : end]:
        if joined and joined[-1].endswith("\\"):
            joined[-1] = joined[-1][:-1].rstrip() + " " + line.strip()
        else:
            joined.append(line.strip())
    return [line for line in joined if line and not line.startswith("#")]


def _expand(text: str, variables: Mapping[str, str]) -> str:
    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in variables:
            raise RecipeError(f"{DOC.name}: ${name} is not set in the recipe block")
        return variables[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, text)


def read_recipe(doc: Path = DOC) -> Recipe:
    """Parse the recipe block of docs/sglang.md (see the module's docstring)."""
    variables = {"PWD": str(ROOT)}
    env: dict[str, str] = {}
    commands: dict[str, tuple[str, ...]] = {}
    client: tuple[str, dict[str, Any]] | None = None
    model: tuple[str, ...] = ()
    for line in _block(doc.read_text()):
        words = shlex.split(_expand(line, variables))
        if words and words[-1] == "&":
            words = words[:-1]
        if words[0] == "export":
            for item in words[1:]:
                name, _, val = item.partition("=")
                env[name] = variables[name] = val
        elif len(words) == 1 and re.fullmatch(r"\w+=.*", words[0]):
            name, _, val = words[0].partition("=")
            variables[name] = val
        elif words[:3] == ["python", "-m", "sglang.launch_server"]:
            mode = words[words.index("--disaggregation-mode") + 1]
            commands[mode] = (sys.executable, *words[1:])
        elif words[:3] == ["python", "-m", "sglang_router.launch_router"]:
            commands["router"] = (sys.executable, *words[1:])
        elif words[:2] == ["python", MODEL_SCRIPT]:
            model = (sys.executable, str(ROOT / MODEL_SCRIPT), *words[2:])
        elif words[0] == "curl":
            url = next(w for w in words if w.startswith("http://"))
            body = json.loads(words[words.index("-d") + 1])
            client = (url, body)
        else:
            raise RecipeError(f"{DOC.name}: the recipe line {line!r} is not one the test knows")
    missing = {"prefill", "decode", "router"} - commands.keys()
    if missing or client is None or not model:
        raise RecipeError(
            f"{DOC.name}: the recipe lacks {sorted(missing) or ('its curl request' if model else 'its model line')}"
        )
    return Recipe(
        env=env,
        prefill=commands["prefill"],
        decode=commands["decode"],
        router=commands["router"],
        client_url=client[0],
        client_body=client[1],
        model=model,
    )


def option(argv: Sequence[str], name: str) -> str:
    """The value after ``name`` in ``argv``."""
    return argv[list(argv).index(name) + 1]


class Process:
    """One command of the recipe, in a process group of its own (stopped by
    that group, which only this test started), its output in ``log``."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], log: Path, url: str) -> None:
        self.argv = tuple(argv)
        self.url = url
        self.log = log
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, env=dict(env), start_new_session=True
            )
        self.pid = self.proc.pid

    def wait_up(self, deadline: float, path: str = "/health") -> float:
        """Until ``path`` answers 200; the seconds it took."""
        t0 = time.monotonic()
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.argv[2]} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + path, timeout=5) as response:
                    if response.status == 200:
                        return time.monotonic() - t0
            except (OSError, urllib.error.HTTPError):
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.url} not up by its deadline:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def children(self) -> list[Any]:
        import psutil

        try:
            return list(psutil.Process(self.pid).children(recursive=True))
        except psutil.NoSuchProcess:
            return []

    def scheduler(self) -> Any:
        """SGLang's scheduler process (TP rank 0): where kvconn's rank lives."""
        found = [p for p in self.children() if "scheduler" in " ".join(_names(p))]
        if len(found) != 1:
            raise AssertionError(f"expected one scheduler process under {self.pid}, found {found}")
        return found[0]

    def alive(self) -> list[int]:
        """Pids of this process and its children still running."""
        import psutil

        pids = [self.pid, *(p.pid for p in self.children())]
        return [p for p in pids if psutil.pid_exists(p) and _not_zombie(p)]

    def post(self, path: str, body: Mapping[str, Any], timeout_s: float = 120) -> Any:
        request = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            raw = response.read()
        return json.loads(raw) if raw else None

    def samples(self, name: str, **labels: str) -> list[float]:
        """Every sample ``name`` on this server's ``/metrics`` whose labels include ``labels``."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as response:
            text = response.read().decode()
        return [
            float(s.value)
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == name and labels.items() <= s.labels.items()
        ]

    def metric(self, name: str, **labels: str) -> float:
        """The sum of those samples (0 when there is none)."""
        return sum(self.samples(name, **labels))

    def stop(self) -> None:
        """SIGKILL to the group this test started, then reap, and remove the
        /dev/shm files the killed group could not."""
        import contextlib

        from kvconn.testing import shm

        held = shm.held_by_group(self.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGCONT)
            os.killpg(self.pid, signal.SIGKILL)
        self.proc.wait(60)
        shm.remove_unheld(held)


def _names(process: Any) -> list[str]:
    try:
        return [process.name(), *process.cmdline()]
    except Exception:
        return []


def _not_zombie(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
