"""kvconn transport plugin for the Mooncake Transfer Engine."""

from kvconn_mooncake._engine import MooncakeUnavailable
from kvconn_mooncake.backend import MooncakeBackend, MooncakeRegion, MooncakeWriter, Posted, backend

__all__ = ["MooncakeBackend", "MooncakeRegion", "MooncakeUnavailable", "MooncakeWriter", "Posted", "backend"]
