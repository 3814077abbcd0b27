"""kvconn transport plugin for the Mooncake Transfer Engine."""

from kvconn_mooncake._channel import Posted
from kvconn_mooncake._engine import MooncakeUnavailable
from kvconn_mooncake._region import MooncakeRegion
from kvconn_mooncake.backend import MooncakeBackend, MooncakeWriter, backend

__all__ = ["MooncakeBackend", "MooncakeRegion", "MooncakeUnavailable", "MooncakeWriter", "Posted", "backend"]
