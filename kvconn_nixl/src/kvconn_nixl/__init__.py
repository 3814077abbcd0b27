"""NIXL transport plugin for kvconn (entry point ``kvconn.backends: nixl``)."""

from kvconn_nixl._nixl import DEFAULT_ENV, FENCE_PROVEN_TLS, Options, prepare_env
from kvconn_nixl.backend import NixlBackend, NixlRegion, NixlWriter, Posted, backend

#: This distribution's version: the one source its metadata (pyproject.toml) reads.
__version__ = "0.1.0"

__all__ = [
    "DEFAULT_ENV",
    "FENCE_PROVEN_TLS",
    "NixlBackend",
    "NixlRegion",
    "NixlWriter",
    "Options",
    "Posted",
    "backend",
    "prepare_env",
]
