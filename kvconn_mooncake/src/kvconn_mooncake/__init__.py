"""kvconn transport plugin for the Mooncake Transfer Engine."""

from kvconn_mooncake._channel import Posted
from kvconn_mooncake._engine import MooncakeUnavailable
from kvconn_mooncake._region import MooncakeRegion
from kvconn_mooncake.backend import MooncakeBackend, MooncakeWriter, backend

#: This distribution's version: the one source its metadata (pyproject.toml) reads.
__version__ = "0.1.0"

__all__ = ["MooncakeBackend", "MooncakeRegion", "MooncakeUnavailable", "MooncakeWriter", "Posted", "backend"]
