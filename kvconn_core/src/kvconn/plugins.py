"""Finding transport backends through the ``kvconn.backends`` entry points.

Every installed backend is listed, loaded or not: one that fails to import
(a missing native library, say) is reported with its error and never stops
the others. ``KVCONN_BACKENDS`` (comma-separated names) restricts which may
load at all.
"""

from __future__ import annotations

import os
from importlib.metadata import EntryPoint, entry_points

import attrs

from kvconn.transport import Backend, Capabilities

GROUP = "kvconn.backends"
ALLOW_ENV = "KVCONN_BACKENDS"


class BackendError(LookupError):
    pass


@attrs.frozen
class BackendInfo:
    name: str
    distribution: str
    version: str
    backend: Backend | None
    error: str | None

    @property
    def capabilities(self) -> Capabilities | None:
        return self.backend.capabilities if self.backend is not None else None


def _allowed() -> frozenset[str] | None:
    raw = os.environ.get(ALLOW_ENV, "").strip()
    return frozenset(n.strip() for n in raw.split(",") if n.strip()) if raw else None


def _load(ep: EntryPoint) -> BackendInfo:
    dist = ep.dist
    name, version = (dist.metadata["Name"], dist.version) if dist is not None else ("?", "?")
    try:
        obj = ep.load()
        for attr in ("name", "capabilities", "open_region", "open_writer"):
            if not hasattr(obj, attr):
                raise TypeError(f"{ep.value} has no {attr!r}: not a kvconn Backend")
        if obj.name != ep.name:
            raise TypeError(f"entry point {ep.name!r} yields a backend named {obj.name!r}")
        if not isinstance(obj.capabilities, Capabilities):
            raise TypeError(f"{ep.value}.capabilities is not a kvconn.transport.Capabilities")
    except Exception as exc:
        return BackendInfo(ep.name, name, version, None, f"{type(exc).__name__}: {exc}")
    return BackendInfo(ep.name, name, version, obj, None)


def unknown_allowed() -> list[str]:
    """The names in ``KVCONN_BACKENDS`` that no installed backend has (a
    typo there would otherwise hide every backend without a word)."""
    allowed = _allowed()
    if allowed is None:
        return []
    installed = {ep.name for ep in entry_points(group=GROUP)}
    return sorted(allowed - installed)


def installed_names() -> list[str]:
    """Every installed backend's name, whatever ``KVCONN_BACKENDS`` admits."""
    return sorted({ep.name for ep in entry_points(group=GROUP)})


def discover() -> list[BackendInfo]:
    """Every backend the allow-list admits, sorted by name."""
    allowed = _allowed()
    eps = [ep for ep in entry_points(group=GROUP) if allowed is None or ep.name in allowed]
    return sorted((_load(ep) for ep in eps), key=lambda info: info.name)


def get_backend(name: str) -> Backend:
    """The backend called ``name``, or a :class:`BackendError` saying why not."""
    allowed = _allowed()
    if allowed is not None and name not in allowed:
        raise BackendError(f"backend {name!r} is not in {ALLOW_ENV}={os.environ[ALLOW_ENV]!r}")
    matches = [ep for ep in entry_points(group=GROUP) if ep.name == name]
    if not matches:
        known = ", ".join(sorted({ep.name for ep in entry_points(group=GROUP)})) or "none"
        raise BackendError(f"no kvconn backend {name!r} is installed (installed: {known})")
    if len(matches) > 1:
        dists = ", ".join(sorted(str(ep.dist.metadata["Name"]) for ep in matches if ep.dist))
        raise BackendError(f"backend {name!r} is declared by several distributions: {dists}")
    info = _load(matches[0])
    if info.backend is None:
        raise BackendError(
            f"backend {name!r} from {info.distribution} {info.version} failed to load: {info.error}"
        )
    return info.backend
