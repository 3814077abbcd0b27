"""Transports that ship with kvconn-core (registered through the same entry
point as any third-party plugin)."""
